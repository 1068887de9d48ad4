"""The decode path on CUDA: model shapes against the float64 oracle, graph replays with new routes,
no host synchronisation, torch.compile, and a small case for compute-sanitizer (`-k sanitizer`)."""

import pytest
import torch

from helpers import rel_err
from padded_moe import decode as dec
from padded_moe.activation import ApplyMoEActivationConfig, MoEActivation
from padded_moe.kernels import native as native_kernels
from padded_moe.expert_map import ExpertMap
from padded_moe.experts import fused_experts
from padded_moe.layer import FusedMoE, dense_weights
from padded_moe.mxfp4 import quantize_mxfp4
from padded_moe.presets import get_preset
from padded_moe.reference.moe import reference_moe

pytestmark = pytest.mark.gpu
BF16_TOL = 1e-2
PRESETS = ["qwen3-30b-a3b", "dsv4-flash", "mixtral-8x7b", "gpt-oss-120b"]


@pytest.fixture(autouse=True)
def decode_on(monkeypatch):
    monkeypatch.delenv(dec.DECODE_ENV, raising=False)
    monkeypatch.delenv("PADDED_MOE_GEMM_LAYOUT", raising=False)


@pytest.fixture(scope="module")
def layers():
    made = {}

    def get(name):
        if name not in made:
            made.clear()
            torch.cuda.empty_cache()
            layer = FusedMoE.from_preset(name, weight_format="bf16", device="cuda", dtype=torch.bfloat16)
            layer.randomize(seed=3, std=0.02)
            if layer.w13_bias is not None:
                layer.w13_bias.normal_(0, 0.1)
                layer.w2_bias.normal_(0, 0.1)
            made[name] = layer
        return made[name]

    yield get
    made.clear()


def oracle(layer, x, tw, ids, valid: int):
    """`reference_moe` on the experts the routes hit (a whole model's experts in float64 on the host
    would be tens of GB): the hit experts become local experts 0.. through an expert map."""
    E = layer.num_experts
    ok = (ids >= 0) & (ids < E)
    ok[valid:] = False
    used = torch.unique(ids[ok].long())
    emap = torch.full((E,), -1, dtype=torch.long, device=ids.device)
    emap[used] = torch.arange(used.numel(), device=ids.device)
    sub = lambda t: None if t is None else t[used]  # noqa: E731
    return reference_moe(x, layer.w13[used], layer.w2[used], tw, ids, activation=layer.activation.value,
                         activation_kwargs=dict(limit=layer.activation_config.clamp_limit), expert_map=emap,
                         num_experts=E, w13_bias=sub(layer.w13_bias), w2_bias=sub(layer.w2_bias),
                         valid_tokens=valid)


def routes(T, k, E, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(T, k, device="cuda", generator=g)
    return w / w.sum(-1, keepdim=True), ids


def call(layer, x, tw, ids, valid=None):
    return fused_experts(x, layer.w13, layer.w2, tw, ids, activation=layer.activation,
                         activation_config=layer.activation_config, w13_bias=layer.w13_bias,
                         w2_bias=layer.w2_bias, valid_tokens=valid)


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("preset", PRESETS)
def test_model_shapes_match_reference(layers, decode_calls, monkeypatch, preset, T):
    if not dec.fits_decode(T + 1, (T + 1) * get_preset(preset).top_k):
        pytest.skip(f"{(T + 1) * get_preset(preset).top_k} slots: past the decode path")
    layer = layers(preset)
    k, E = layer.top_k, layer.num_experts
    x = torch.randn(T + 1, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    x[T] = float("nan")  # the token past valid_tokens: never read
    tw, ids = routes(T + 1, k, E, seed=T)
    ids[T] = torch.tensor([-1, E + 3] + [0] * (k - 2), device="cuda")[:k]
    if k > 2:
        ids[0, 1] = -1  # a padding slot
        ids[0, 2] = E  # one past the end
    if T > 1:
        ids[1, 0] = ids[0, 0]  # an expert shared by two tokens: computed once, for both
    vt = torch.tensor([T], device="cuda", dtype=torch.int32)
    out = call(layer, x, tw, ids, vt)
    torch.cuda.synchronize()
    assert decode_calls == [T + 1]
    ref = oracle(layer, x, tw, ids, T)
    assert rel_err(out[:T], ref[:T]) <= BF16_TOL
    monkeypatch.setenv(dec.DECODE_ENV, "off")
    layout_path = call(layer, x, tw, ids, vt)
    assert rel_err(out[:T], layout_path[:T].float()) <= BF16_TOL


@pytest.mark.parametrize("read", dec.W13_READS)
@pytest.mark.parametrize("preset", PRESETS)
def test_both_w13_reads_on_model_shapes(layers, decode_calls, monkeypatch, preset, read):
    """GEMM1's two weight reads (`decode.W13_READ`: TMA tiles on wgmma's M side, per-thread
    copies) at one token of each model, a slot dropped, against the oracle; the read asked for is
    the one launched."""
    monkeypatch.setattr(dec, "W13_READ", read)
    taken, real = [], dec._w13_descriptor
    monkeypatch.setattr(dec, "_w13_descriptor", lambda *a: taken.append(real(*a)) or taken[-1])
    layer = layers(preset)
    tw, ids = routes(1, layer.top_k, layer.num_experts, seed=30)
    ids[0, -1] = -1
    x = torch.randn(1, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    out = call(layer, x, tw, ids)
    torch.cuda.synchronize()
    assert decode_calls == [1] and (taken[0] is not None) == (read == "tma")
    assert rel_err(out, oracle(layer, x, tw, ids, 1)) <= BF16_TOL


def test_graph_replays_with_new_routes(layers, decode_calls):
    layer = layers("qwen3-30b-a3b")
    k, E = layer.top_k, layer.num_experts
    x = torch.randn(2, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    tw, ids = routes(2, k, E, seed=10)
    call(layer, x, tw, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(layer, x, tw, ids)
    for seed in range(11, 16):
        new_w, new_ids = routes(2, k, E, seed)
        new_ids[0, seed % k] = -1
        x.copy_(torch.randn_like(x))
        tw.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, oracle(layer, x, tw, ids, 2)) <= BF16_TOL
    assert len(decode_calls) == 2


def test_never_syncs(layers, decode_calls):
    layer = layers("dsv4-flash")
    x = torch.randn(1, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    tw, ids = routes(1, layer.top_k, layer.num_experts, seed=20)
    call(layer, x, tw, ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(layer, x, tw, ids)
        call(layer, x, tw, ids)  # the launch plan's replay
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(decode_calls) >= 2


def test_compiled_call_takes_the_decode_path(layers, decode_calls):
    layer = layers("gpt-oss-120b")
    x = torch.randn(2, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    tw, ids = routes(2, layer.top_k, layer.num_experts, seed=30)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, tw, ids: call(layer, x, tw, ids), fullgraph=True)
    out = compiled(x, tw, ids)
    torch.cuda.synchronize()
    assert decode_calls, "the compiled op did not take the decode path"
    assert rel_err(out, oracle(layer, x, tw, ids, 2)) <= BF16_TOL
    torch._dynamo.reset()


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4", "mxfp4-words", "mxfp4-prepared-read", "mxfp4-prepared-dot",
                                 "mxfp4-prepared-native"])
@pytest.mark.parametrize("mapped", [False, True], ids=["plain", "expert-map"])
def test_sanitizer_small(decode_calls, monkeypatch, mapped, fmt):
    """Small enough for compute-sanitizer: garbage ids (int64 past int32), a repeated expert, an
    expert map, valid_tokens with NaN rows past it, biases, a K and N that no tile divides (MXFP4:
    multiples of 32 only, and 2 tokens; with the prepared words read, K and N not multiples of the
    prepared form's 64-column blocks; "dot": GEMM1 as an MMA, `MX_W13`; "native": GEMM2 as the
    native CUDA kernel, `MX_W2`, the others its Triton kernel)."""
    monkeypatch.setattr(dec, "MX_STEP", {"mxfp4-words": "words", "mxfp4-prepared-read": "prepared",
                                         "mxfp4-prepared-dot": "prepared",
                                         "mxfp4-prepared-native": "prepared"}.get(fmt, "bytes"))
    monkeypatch.setattr(dec, "MX_W13", "dot" if fmt == "mxfp4-prepared-dot" else "gemv")
    monkeypatch.setattr(dec, "MX_W2", "cuda" if fmt == "mxfp4-prepared-native" else "triton")
    T, k, E, K, N = (4, 4, 12, 200, 72) if fmt == "bf16" else (2, 4, 12, 224, 96)
    emap = ExpertMap(E, ep_rank=1, ep_size=2, device="cuda") if mapped else None
    L = emap.num_local if mapped else E
    g = torch.Generator(device="cuda").manual_seed(40)
    w13 = torch.randn(L, 2 * N, K, device="cuda", generator=g) * 0.1
    w2 = torch.randn(L, K, N, device="cuda", generator=g) * 0.1
    if fmt in ("mxfp4", "mxfp4-words"):
        w13, w2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    elif fmt.startswith("mxfp4-prepared"):
        w13, w2 = quantize_mxfp4(w13).prepare_for(), quantize_mxfp4(w2).prepare_for()
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    b13 = torch.randn(L, 2 * N, device="cuda", generator=g).bfloat16()
    b2 = torch.randn(L, K, device="cuda", generator=g).bfloat16()
    x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
    x[T - 1] = float("nan")
    tw, ids = routes(T, k, E, seed=41)
    ids = ids.long()
    ids[0] = torch.tensor([5, 5, -1, 2**40], device="cuda")
    ids[T - 1] = torch.tensor([-(2**35), E, 1, 2], device="cuda")
    vt = torch.tensor([T - 1], device="cuda", dtype=torch.int32)
    out = fused_experts(x, w13, w2, tw, ids, activation="swigluoai", expert_map=emap, valid_tokens=vt,
                        w13_bias=b13, w2_bias=b2)
    torch.cuda.synchronize()
    assert decode_calls == [T]
    ref = reference_moe(x, dense_weights(w13), dense_weights(w2), tw, ids, activation="swigluoai",
                        expert_map=None if emap is None else emap.map,
                        num_experts=E, w13_bias=b13, w2_bias=b2, valid_tokens=T - 1)
    assert rel_err(out[:T - 1], ref[:T - 1]) <= BF16_TOL


def _mx_case(shape: str, E: int, seed: int):
    """Prepared MXFP4 experts at a model's widths (E experts) with its activation and biases:
    (top_k, K, w13, w2, b13, b2, activation, the generator, for more inputs)."""
    k, K, N, act, bias = (4, 2880, 2880, "swigluoai", True) if shape == "gpt-oss" else (6, 4096, 2048, "silu", False)
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = quantize_mxfp4(torch.randn(E, 2 * N, K, device="cuda", generator=g) * 0.02).prepare_for()
    w2 = quantize_mxfp4(torch.randn(E, K, N, device="cuda", generator=g) * 0.02).prepare_for()
    b13 = torch.randn(E, 2 * N, device="cuda", generator=g).bfloat16() * 0.1 if bias else None
    b2 = torch.randn(E, K, device="cuda", generator=g).bfloat16() * 0.1 if bias else None
    return k, K, w13, w2, b13, b2, act, g


def _mx_oracle(x, w13, w2, tw, ids, act, b13, b2, E: int, valid: int):
    """`reference_moe` on the MXFP4 experts the first `valid` tokens hit (as `oracle`)."""
    ok = (ids[:valid] >= 0) & (ids[:valid] < E)
    used = torch.unique(ids[:valid][ok].long())
    emap = torch.full((E,), -1, dtype=torch.long, device="cuda")
    emap[used] = torch.arange(used.numel(), device="cuda")
    sub = lambda t: None if t is None else t[used]  # noqa: E731
    return reference_moe(x, dense_weights(w13)[used], dense_weights(w2)[used], tw, ids, activation=act,
                         expert_map=emap, num_experts=E, w13_bias=sub(b13), w2_bias=sub(b2), valid_tokens=valid)


@pytest.mark.parametrize("step", ["bytes", "words", "prepared", "prepared-dot", "prepared-gemv", "prepared-auto-triton"])
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("shape", ["gpt-oss", "dsv4"])
def test_mxfp4_model_widths(decode_calls, monkeypatch, shape, T, step):
    """Prepared MXFP4 experts at the models' widths (fewer experts, for the oracle), every way the
    decode kernels read them (`MX_STEP`; the word routes upcast with inline PTX; GEMM1 on prepared
    words as `MX_W13` chooses, or as an MMA / a GEMV; GEMM2 as `MX_W2` chooses, or the Triton
    kernel); against the float64 oracle and the layout path (prepared kernel)."""
    step, w13, w2 = (step.split("-") + ["", ""])[:3]
    monkeypatch.setattr(dec, "MX_STEP", step)
    monkeypatch.setattr(dec, "MX_W13", w13 or "auto")
    monkeypatch.setattr(dec, "MX_W2", w2 or "auto")
    E = 32
    k, K, w13, w2, b13, b2, act, g = _mx_case(shape, E, seed=50 + T)
    x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
    tw, ids = routes(T, k, E, seed=60 + T)
    ids[0, 1] = -1
    out = fused_experts(x, w13, w2, tw, ids, activation=act, w13_bias=b13, w2_bias=b2)
    torch.cuda.synchronize()
    assert decode_calls == [T]
    assert rel_err(out, _mx_oracle(x, w13, w2, tw, ids, act, b13, b2, E, T)) <= BF16_TOL
    # The same experts holding only their prepared form: the same bits on the prepared words; the
    # canonical-byte routes refuse them (they have nothing to read).
    once13, once2 = w13.prepare_for(keep_canonical=False), w2.prepare_for(keep_canonical=False)
    if step == "prepared":
        assert torch.equal(fused_experts(x, once13, once2, tw, ids, activation=act, w13_bias=b13, w2_bias=b2), out)
    else:
        with pytest.raises(ValueError, match="MX_STEP=.* does not hold"):
            fused_experts(x, once13, once2, tw, ids, activation=act, w13_bias=b13, w2_bias=b2)
    monkeypatch.setenv(dec.DECODE_ENV, "off")
    layout_path = fused_experts(x, w13, w2, tw, ids, activation=act, w13_bias=b13, w2_bias=b2)
    assert rel_err(out, layout_path.float()) <= BF16_TOL


@pytest.mark.parametrize("mx_w2", ["auto", "cuda"])
def test_compiled_mxfp4_call_takes_the_decode_path(decode_calls, monkeypatch, mx_w2):
    """A compiled call on prepared MXFP4 experts (GPT-OSS widths, fewer experts) takes the decode
    path and gives the eager call's result bit for bit (the same kernels on the same inputs), with
    GEMM2 as `MX_W2` chooses (GPT-OSS: the Triton kernel) and as the native kernel."""
    monkeypatch.setattr(dec, "MX_W2", mx_w2)
    E = 16
    k, K, w13, w2, b13, b2, _, g = _mx_case("gpt-oss", E, seed=70)
    x = torch.randn(2, K, device="cuda", generator=g).bfloat16()
    tw, ids = routes(2, k, E, seed=71)

    def step(x, tw, ids):
        return fused_experts(x, w13, w2, tw, ids, activation="swigluoai", w13_bias=b13, w2_bias=b2)

    eager = step(x, tw, ids)
    assert decode_calls == [2]
    decode_calls.clear()
    torch._dynamo.reset()
    out = torch.compile(step, fullgraph=True)(x, tw, ids)
    torch.cuda.synchronize()
    torch._dynamo.reset()
    assert decode_calls and set(decode_calls) == {2}, "the compiled op did not take the decode path"
    assert torch.equal(out, eager)


@pytest.mark.parametrize("config", [None, 0, 1, 2, 3, 4, 5], ids=lambda c: f"config{c}")
@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("shape", ["gpt-oss", "dsv4"])
def test_native_w2_against_reference_and_triton(monkeypatch, shape, T, config):
    """The native GEMM2 (`MX_W2 = "cuda"`), each configuration that fits the shape's top_k, at the
    models' widths: NaN rows past valid_tokens, a dropped slot, an id past the end and an expert
    shared by two tokens, int64 ids and valid_tokens; against the float64 oracle and the Triton
    GEMM2. Called directly on a NaN-poisoned scratch and output: rows past valid_tokens keep it."""
    E = 32
    k, K, w13, w2, b13, b2, act, _ = _mx_case(shape, E, seed=80 + T)
    if not dec.fits_decode(T, T * k):
        pytest.skip(f"{T * k} slots: past the decode path")
    if config is not None and k * native_kernels.w2_split(config) > 16:
        with pytest.raises(ValueError, match="top_k"):
            monkeypatch.setattr(dec, "MX_W2", "cuda")
            monkeypatch.setattr(dec, "NATIVE_W2_CONFIG", config)
            fused_experts(torch.randn(T, K, device="cuda").bfloat16(), w13, w2, *routes(T, k, E, seed=1),
                          activation=act, w13_bias=b13, w2_bias=b2)
        return
    g = torch.Generator(device="cuda").manual_seed(90 + T)
    valid = max(1, T - 1)  # the last token of 2 or 4 is past valid_tokens
    x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
    x[valid:] = float("nan")
    tw, ids = routes(T, k, E, seed=91 + T)
    ids = ids.long()
    ids[0, 1] = -1
    ids[0, 2] = E
    if valid > 1:
        ids[1, 0] = ids[0, 0]
    vt = torch.tensor([valid], device="cuda", dtype=torch.int64)
    launched = []
    real_entry = native_kernels.entry
    monkeypatch.setattr(native_kernels, "entry", lambda name: launched.append(name) or real_entry(name))

    def run(mx_w2, cfg=None):
        """Called directly, on a NaN-poisoned activation scratch and output."""
        monkeypatch.setattr(dec, "MX_W2", mx_w2)
        monkeypatch.setattr(dec, "NATIVE_W2_CONFIG", cfg)
        h = torch.full((T * k, w2.shape[2]), float("nan"), device="cuda", dtype=torch.bfloat16)
        out = torch.full((T, K), float("nan"), device="cuda", dtype=torch.bfloat16)
        return dec.decode_experts(x, w13, w2, tw, ids, MoEActivation(act), ApplyMoEActivationConfig(), E, None, b13,
                                  b2, vt, h, out)

    native = run("cuda", config)
    torch.cuda.synchronize()
    assert launched == ["pmoe_mx_w2_combine"], "the native GEMM2 did not run"
    assert torch.isnan(native[valid:]).all(), "a row past valid_tokens was written"
    assert torch.isfinite(native[:valid]).all()
    triton_w2 = run("triton")
    torch.cuda.synchronize()
    assert launched == ["pmoe_mx_w2_combine"], "MX_W2='triton' ran the native kernel"
    ref = _mx_oracle(x, w13, w2, tw, ids, act, b13, b2, E, valid)
    assert rel_err(native[:valid], ref[:valid]) <= BF16_TOL
    assert rel_err(native[:valid], triton_w2[:valid].float()) <= BF16_TOL


def test_native_w2_plans_graphs_and_no_sync(decode_calls, monkeypatch):
    """The native GEMM2 under the eager launch plan (calls after the plan is built, with new
    routes, equal a plan-less call bit for bit), inside a CUDA graph replayed with new routes (equal
    to eager calls bit for bit), and without a device-to-host synchronisation."""
    from padded_moe import experts as ex

    monkeypatch.setattr(dec, "MX_W2", "cuda")
    E = 32
    k, K, w13, w2, b13, b2, act, _ = _mx_case("gpt-oss", E, seed=100)
    x = torch.randn(2, K, device="cuda").bfloat16()
    tw, ids = routes(2, k, E, seed=101)

    def step():
        return fused_experts(x, w13, w2, tw, ids, activation=act, w13_bias=b13, w2_bias=b2)

    plans = ex._launch_plans()
    plans.enabled = False
    try:
        fresh = []
        for seed in range(102, 106):
            new_w, new_ids = routes(2, k, E, seed)
            tw.copy_(new_w)
            ids.copy_(new_ids)
            fresh.append(step().clone())
    finally:
        plans.enabled = True
    plans.clear()
    step(), step(), step()  # plain, recorded, recorded again: the plan is built
    torch.cuda.synchronize()
    assert len(plans) == 1, "the native launch made the call unplannable"
    new_routes = [routes(2, k, E, seed) for seed in range(102, 106)]
    got = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for new_w, new_ids in new_routes:
            tw.copy_(new_w)
            ids.copy_(new_ids)
            got.append(step().clone())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip(got, fresh))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed, want in zip(range(102, 106), fresh):
        new_w, new_ids = routes(2, k, E, seed)
        tw.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
