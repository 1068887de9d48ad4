"""The native grouped GEMM (backend "cuda", `padded_moe.kernels.native.grouped`) on an sm_90 GPU.

References are float64 per expert over the rows the layout must compute (`test_gemm_gpu.check`),
inputs hold NaN in every row the layout must not compute, and outputs are poisoned: rows past a
count must stay as they were. Shapes: the models' (DeepSeek-V4, GPT-OSS with its bias, a prefill
case of ~1000 rows per expert, i.e. several 256-row passes of one CTA) and odd ones (K and N not
multiples of the kernel's tiles, empty experts, counts on either side of each 64-row step). MXFP4
weights in their prepared form run the RS kernel (`grouped.launch_rs`), the others the
producer-upcast kernel.
"""

from __future__ import annotations

import pytest
import torch
from helpers import SENTINEL
from test_gemm_gpu import SHAPES, check, inputs_for, out_for, real_shape_case, weight_cache

from padded_moe import fused_experts
from padded_moe.activation import ApplyMoEActivationConfig, apply_moe_activation
from padded_moe.gemm import expert_gemm
from padded_moe.kernels import native
from padded_moe.layouts import GemmLayout, build_layout

pytestmark = pytest.mark.gpu

DEV = "cuda"
GROUPED = [GemmLayout.GROUPED_CONTIGUOUS, GemmLayout.GROUPED_MASKED]


@pytest.fixture(scope="module", autouse=True)
def needs_native():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    why = native.unsupported_device(torch.device(DEV)) or native.GROUPED.failure()
    if why is not None:
        pytest.skip(f"the native grouped GEMM cannot run here: {why}")


@pytest.fixture(scope="module")
def weights():
    return weight_cache()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
@pytest.mark.parametrize("wdtype", ["bf16", "mxfp4", "mxfp4_hopper"])  # mxfp4_hopper: the RS kernel
@pytest.mark.parametrize("stage", ["w13", "w2"])
@pytest.mark.parametrize("layout", GROUPED, ids=lambda l: l.value)
def test_real_shapes(shape, wdtype, stage, layout, weights):
    w, meta, a, bias, out = real_shape_case(shape, stage, layout, weights, wdtype)
    expert_gemm(a, w, meta, stage=stage, bias=bias, out=out, backend="cuda")
    torch.cuda.synchronize()
    check(a, w, meta, stage, out, bias)


def _counts_case(counts, K, N, layout, bias_dtype, seed):
    """A layout whose expert e receives exactly counts[e] slots (top-1 routing of shuffled tokens)."""
    L = len(counts)
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)]).to(DEV)
    ids = ids[torch.randperm(ids.numel(), generator=g, device=DEV)].view(-1, 1)
    meta = build_layout(layout, ids, L)
    w = (torch.randn(L, N, K, generator=g, device=DEV) / K ** 0.5).bfloat16()
    a = inputs_for(layout, meta, "w13", K, ids.shape[0], 1, seed)
    bias = None if bias_dtype is None else torch.randn(L, N, generator=g, device=DEV).to(bias_dtype)
    return w, meta, a, bias, out_for(layout, meta, a, N)


# Counts around every 64-row step of a chunk and past one chunk (128 or 256 rows), and empty experts.
ODD_COUNTS = [0, 1, 63, 64, 65, 127, 128, 130, 191, 192, 193, 255, 256, 257, 0, 520]
# The RS kernel's chunks also hold 320 rows (`grouped.RS_WIDE`): counts around that and its fifth box,
# and a partial box of each count of 16-row pieces (`grouped.RS_TAIL_PIECES`: 90 two, 100 three).
RS_COUNTS = ODD_COUNTS + [319, 320, 321, 385, 90, 100]
CONFIG_IDS = ["persistent", "one_cta_per_tile", "persistent_64_rows", "persistent_256_rows_two_consumers"]


@pytest.mark.parametrize("config", [0, 3], ids=lambda c: CONFIG_IDS[c])
@pytest.mark.parametrize("K,N", [(64, 128), (200, 200), (4096, 136), (72, 2056)])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", GROUPED, ids=lambda l: l.value)
def test_odd_counts_and_shapes(K, N, bias_dtype, layout, config, monkeypatch):
    """Through `expert_gemm`, in the 128-row and the 256-row tiles (the choice by shape forced)."""
    from padded_moe.kernels.native import grouped

    monkeypatch.setattr(grouped, "default_config", lambda *_: config)
    w, meta, a, bias, out = _counts_case(ODD_COUNTS, K, N, layout, bias_dtype, K + N)
    expert_gemm(a, w, meta, bias=bias, out=out, backend="cuda")
    torch.cuda.synchronize()
    check(a, w, meta, "w13", out, bias)


@pytest.mark.parametrize("wdtype", ["bf16", "mxfp4"])
@pytest.mark.parametrize("layout", GROUPED, ids=lambda l: l.value)
def test_tiny_shapes(wdtype, layout):
    """TMA boxes larger than the tensors they read (K 32 < 64, a handful of rows and slabs of a few
    rows < 64, 16 output columns < 128): the out-of-range parts read as zero."""
    from padded_moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    w, meta, a, bias, out = _counts_case([3, 0, 1], 32, 16, layout, torch.float32, 4)
    q = quantize_mxfp4(w.float()) if wdtype == "mxfp4" else w
    expert_gemm(a, q, meta, bias=bias, out=out, backend="cuda")
    torch.cuda.synchronize()
    check(a, dequantize_mxfp4(q) if wdtype == "mxfp4" else w, meta, "w13", out, bias)


@pytest.mark.parametrize("K,N", [(96, 200), (2880, 136)])
@pytest.mark.parametrize("layout", GROUPED, ids=lambda l: l.value)
def test_odd_counts_mxfp4(K, N, layout):
    """MXFP4 weights: a k tile with one scale group (K % 64 == 32), N past the last column tile."""
    from padded_moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    w, meta, a, bias, out = _counts_case(ODD_COUNTS, K, N, layout, torch.bfloat16, K + N + 1)
    q = quantize_mxfp4(w.float())
    expert_gemm(a, q, meta, bias=bias, out=out, backend="cuda")
    torch.cuda.synchronize()
    check(a, dequantize_mxfp4(q), meta, "w13", out, bias)


@pytest.mark.parametrize("walk", ["static", "dynamic"])
@pytest.mark.parametrize("config", range(len(CONFIG_IDS)), ids=CONFIG_IDS)
@pytest.mark.parametrize("epilogue", [None, "silu", "swigluoai"], ids=str)
@pytest.mark.parametrize("layout", GROUPED, ids=lambda l: l.value)
def test_every_config(config, epilogue, layout, walk):
    """Each configuration, plain and with either gated epilogue, against float64 (and, gated, the
    two steps of the same configuration); the persistent ones in both tile walks."""
    from padded_moe.activation import ActivationEpilogue
    from padded_moe.kernels.native import grouped

    assert len(grouped.CONFIGS) == len(CONFIG_IDS)
    if walk == "dynamic" and not grouped.CONFIGS[config][1]:
        pytest.skip("one CTA per tile: no walk")
    w, meta, a, bias, out = _counts_case(ODD_COUNTS, 512, 392, layout, torch.float32, 5)
    where = dict(offsets=meta.offsets) if layout == GemmLayout.GROUPED_CONTIGUOUS else dict(counts=meta.counts)
    where["dynamic"] = walk == "dynamic"
    grouped.launch(a, w, out, bias=bias, config=config, **where)
    torch.cuda.synchronize()
    check(a, w, meta, "w13", out, bias)
    if epilogue is not None:
        act = torch.full(out.shape[:-1] + (196,), SENTINEL, dtype=torch.bfloat16, device=DEV)
        grouped.launch(a, w, act, bias=bias, config=config, epilogue=ActivationEpilogue.of(epilogue), **where)
        ref = torch.full_like(act, SENTINEL)
        apply_moe_activation(epilogue, ref, out, valid_token_counts=meta.activation_counts)
        torch.cuda.synchronize()
        written = (ref != SENTINEL).any(-1)
        assert ((act == SENTINEL).all(-1) == ~written).all()
        diff = (act[written].double() - ref[written].double()).abs()
        assert (diff / ref[written].double().abs().clamp(min=1e-2)).max().item() <= 2 ** -7


@pytest.mark.parametrize("wdtype", ["bf16", "mxfp4_hopper"])  # mxfp4_hopper: the RS kernel
def test_graph_replay_reads_new_rows_and_counts(wdtype):
    """A captured call replays on new data in the same buffers, new counts included."""
    from padded_moe.mxfp4 import quantize_mxfp4

    L, K, N, M = 16, 512, 384, 300
    g = torch.Generator(device=DEV).manual_seed(3)
    ids = torch.randint(0, L, (M, 2), generator=g, device=DEV, dtype=torch.int32)
    meta = build_layout(GemmLayout.GROUPED_MASKED, ids, L)
    w = (torch.randn(L, N, K, generator=g, device=DEV) / K ** 0.5).bfloat16()
    if wdtype == "mxfp4_hopper":
        w = quantize_mxfp4(w.float()).prepare_for()
    a = inputs_for(GemmLayout.GROUPED_MASKED, meta, "w13", K, M, 2, 1)
    out = out_for(GemmLayout.GROUPED_MASKED, meta, a, N)
    expert_gemm(a, w, meta, out=out, backend="cuda")  # builds and loads the library outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expert_gemm(a, w, meta, out=out, backend="cuda")
    new_counts = torch.randint(0, meta.max_tokens_per_expert + 1, (L,), generator=g, device=DEV, dtype=torch.int32)
    meta.counts.copy_(new_counts)
    a.copy_(inputs_for(GemmLayout.GROUPED_MASKED, meta, "w13", K, M, 2, 9))
    out.fill_(SENTINEL)
    graph.replay()
    torch.cuda.synchronize()
    check(a, w, meta, "w13", out)


def test_fused_experts_mxfp4_gpt_oss():
    """GPT-OSS's MXFP4 experts (swigluoai interleaved in the epilogue, biases) through the whole
    pipeline, cuda vs triton."""
    from padded_moe.mxfp4 import quantize_mxfp4

    g = torch.Generator(device=DEV).manual_seed(12)
    E, K, N, M, k = 32, 2880, 2880, 256, 4
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    w13 = quantize_mxfp4(torch.randn(E, 2 * N, K, generator=g, device=DEV) / K ** 0.5)
    w2 = quantize_mxfp4(torch.randn(E, K, N, generator=g, device=DEV) / N ** 0.5)
    b13 = torch.randn(E, 2 * N, generator=g, device=DEV).bfloat16() * 0.1
    b2 = torch.randn(E, K, generator=g, device=DEV).bfloat16() * 0.1
    tw, ids = torch.topk(torch.randn(M, E, generator=g, device=DEV).softmax(-1), k, dim=-1)
    outs = {b: fused_experts(x, w13, w2, tw, ids.int(), activation="swigluoai", w13_bias=b13, w2_bias=b2,
                             layout="grouped_contiguous", backend=b) for b in ("cuda", "triton")}
    torch.cuda.synchronize()
    ref = outs["triton"].double()
    err = ((outs["cuda"].double() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(outs["cuda"]).all() and err < 1e-2, f"relative difference {err:.3g}"


@pytest.mark.parametrize("preset", ["dsv4-flash", "qwen3-30b-a3b"])
def test_fused_experts_on_the_cuda_backend(preset):
    """The whole pipeline with both GEMMs on the native kernel equals the Triton backend's within
    bf16 rounding (different summation orders; each side is checked against float64 above)."""
    from padded_moe.presets import get_preset

    p = get_preset(preset)
    g = torch.Generator(device=DEV).manual_seed(11)
    M, E = 512, p.num_experts
    x = torch.randn(M, p.hidden_size, generator=g, device=DEV).bfloat16()
    w13 = (torch.randn(E, p.w13_rows, p.hidden_size, generator=g, device=DEV) / p.hidden_size ** 0.5).bfloat16()
    w2 = (torch.randn(E, p.hidden_size, p.intermediate_size, generator=g, device=DEV)
          / p.intermediate_size ** 0.5).bfloat16()
    logits = torch.randn(M, E, generator=g, device=DEV)
    tw, ids = torch.topk(logits.softmax(-1), p.top_k, dim=-1)
    ids = ids.int()
    ids[::5, 0] = -1  # dropped slots
    cfg = ApplyMoEActivationConfig(**p.activation_config)
    outs = {}
    for backend in ("cuda", "triton"):
        outs[backend] = fused_experts(x, w13, w2, tw, ids, activation=p.activation, activation_config=cfg,
                                      layout="grouped_contiguous", backend=backend)
    torch.cuda.synchronize()
    ref = outs["triton"].double()
    err = ((outs["cuda"].double() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(outs["cuda"]).all() and err < 1e-2, f"relative difference {err:.3g}"


@pytest.mark.parametrize("preset,tokens", [("dsv4-flash", 256), ("qwen3-30b-a3b", 256)])
def test_auto_takes_the_native_kernel_where_listed(preset, tokens, monkeypatch):
    """`fused_experts` with its layout and backend left to it: DeepSeek-V4's expert shape at 96 rows
    per expert (in its `AUTO_NATIVE_ROWS` band) runs both GEMMs on the native kernel, Qwen3-MoE's
    (not listed) none; both equal the Triton path within bf16 rounding, with dropped slots."""
    from padded_moe import backends
    from padded_moe.activation import MoEActivation
    from padded_moe.kernels.native import grouped
    from padded_moe.layouts import LAYOUT_ENV
    from padded_moe.presets import get_preset

    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    monkeypatch.delenv(backends.BACKEND_ENV, raising=False)
    p = get_preset(preset)
    g = torch.Generator(device=DEV).manual_seed(13)
    E = 16 if preset == "dsv4-flash" else 32  # 96 and 64 rows per expert
    x = torch.randn(tokens, p.hidden_size, generator=g, device=DEV).bfloat16()
    w13 = (torch.randn(E, p.w13_rows, p.hidden_size, generator=g, device=DEV) / p.hidden_size ** 0.5).bfloat16()
    w2 = (torch.randn(E, p.hidden_size, p.intermediate_size, generator=g, device=DEV)
          / p.intermediate_size ** 0.5).bfloat16()
    tw, ids = torch.topk(torch.randn(tokens, E, generator=g, device=DEV).softmax(-1), p.top_k, dim=-1)
    ids = ids.int()
    ids[::7, 1] = -1  # dropped slots
    cfg = ApplyMoEActivationConfig(**p.activation_config)
    launches = []
    real_launch = grouped.launch
    monkeypatch.setattr(grouped, "launch", lambda *a, **kw: launches.append(1) or real_launch(*a, **kw))
    out = fused_experts(x, w13, w2, tw, ids, activation=p.activation, activation_config=cfg)
    ref = fused_experts(x, w13, w2, tw, ids, activation=p.activation, activation_config=cfg, backend="triton")
    torch.cuda.synchronize()
    listed = preset == "dsv4-flash"
    assert backends.auto_native(x.device, w13, w2, MoEActivation(p.activation), ids.numel(), E) == listed
    assert len(launches) == (2 if listed else 0)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert torch.isfinite(out).all() and err < 1e-2, f"relative difference {err:.3g}"


# Every activation the epilogue computes, with the settings that change its formula, and two that
# it leaves to the activation op (`expert_gemm` then runs the two steps on this backend).
EPILOGUES = [("silu", None), ("silu", ApplyMoEActivationConfig(clamp_limit=10.0)),
             ("silu", ApplyMoEActivationConfig(alpha=1.702, beta=1.0)), ("swigluoai", None),
             ("swigluoai_uninterleave", None), ("gelu", None), ("relu2_no_mul", None)]


@pytest.mark.parametrize("activation,config", EPILOGUES, ids=lambda v: str(v))
@pytest.mark.parametrize("layout", GROUPED, ids=lambda l: l.value)
def test_activation_epilogue_equals_two_steps(activation, config, layout):
    """GEMM1 with the activation in its epilogue equals GEMM1 into a bf16 buffer (same kernel) and
    then the activation op, on the valid rows; rows past the counts stay poisoned."""
    from padded_moe.activation import MoEActivation

    gated = MoEActivation(activation).is_gated
    w, meta, a, bias, h = _counts_case(ODD_COUNTS[:10], 256, 392, layout, torch.float32, 21)
    w = w * 4  # pre-activation values of a few units: every branch of the formulas is taken
    expert_gemm(a, w, meta, bias=bias, out=h, backend="cuda")
    width = 392 // 2 if gated else 392
    ref = torch.full(h.shape[:-1] + (width,), SENTINEL, dtype=torch.bfloat16, device=DEV)
    apply_moe_activation(activation, ref, h, activation_config=config, valid_token_counts=meta.activation_counts)
    out = torch.full_like(ref, SENTINEL)
    expert_gemm(a, w, meta, bias=bias, out=out, backend="cuda", activation=activation, activation_config=config)
    torch.cuda.synchronize()
    flat_ref, flat_out = ref.reshape(-1, width), out.reshape(-1, width)
    written = (flat_ref != SENTINEL).any(-1)
    assert ((flat_out == SENTINEL).all(-1) == ~written).all(), "the epilogue wrote other rows than the op"
    diff = (flat_out[written].double() - flat_ref[written].double()).abs()
    scale = flat_ref[written].double().abs().clamp(min=1e-2)
    assert torch.isfinite(flat_out[written]).all()
    assert (diff / scale).max().item() <= 2 ** -7, "more than one bf16 rounding apart"


def test_sanitizer_small():
    """A small call of each layout, bf16 and MXFP4, for `compute-sanitizer --tool memcheck`
    (gpu_check.sh)."""
    from padded_moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    from padded_moe.kernels.native import grouped

    for layout in GROUPED:
        w, meta, a, bias, out = _counts_case([5, 0, 70, 257], 128, 264, layout, torch.float32, 2)
        expert_gemm(a, w, meta, bias=bias, out=out, backend="cuda")
        torch.cuda.synchronize()
        check(a, w, meta, "w13", out, bias)
        out.fill_(SENTINEL)  # the 256-row tiles of two consumers
        where = dict(offsets=meta.offsets) if layout == GemmLayout.GROUPED_CONTIGUOUS else dict(counts=meta.counts)
        grouped.launch(a, w, out, bias=bias, config=3, **where)
        torch.cuda.synchronize()
        check(a, w, meta, "w13", out, bias)
        for config in (0, 3):  # the tiles handed out by the counter
            out.fill_(SENTINEL)
            grouped.launch(a, w, out, bias=bias, config=config, dynamic=True, **where)
            torch.cuda.synchronize()
            check(a, w, meta, "w13", out, bias)
        q = quantize_mxfp4(w.float())
        out.fill_(SENTINEL)
        expert_gemm(a, q, meta, bias=bias, out=out, backend="cuda")
        torch.cuda.synchronize()
        check(a, dequantize_mxfp4(q), meta, "w13", out, bias)


# ---- the RS kernel (prepared MXFP4 weights) ----

def _rs_case(counts, K, N, layout, bias_dtype, seed, keep_canonical=True):
    from padded_moe.mxfp4 import quantize_mxfp4

    w, meta, a, bias, out = _counts_case(counts, K, N, layout, bias_dtype, seed)
    q = quantize_mxfp4(w.float()).prepare_for(keep_canonical=keep_canonical)
    return q, meta, a, bias, out


def _where(layout, meta):
    return dict(offsets=meta.offsets) if layout == GemmLayout.GROUPED_CONTIGUOUS else dict(counts=meta.counts)


@pytest.mark.parametrize("wide", [False, True], ids=["chunks256", "chunks320"])
@pytest.mark.parametrize("K,N", [(64, 136), (96, 264), (2880, 2056), (4096, 8)])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", GROUPED, ids=lambda l: l.value)
def test_rs_odd_counts_and_shapes(K, N, bias_dtype, layout, wide, monkeypatch):
    """Counts on either side of each 64-row box and of the 256- and 320-row chunks (0 to 520), K
    past a multiple of 64 (the weight's padded k tile reads zero rows), N past the last 128-row
    weight tile, against float64; rows past each count keep their poison."""
    from padded_moe.kernels.native import grouped

    monkeypatch.setattr(grouped, "RS_WIDE", wide)
    q, meta, a, bias, out = _rs_case(RS_COUNTS, K, N, layout, bias_dtype, K + N)
    assert grouped.takes_rs(q)
    grouped.launch(a, q, out, bias=bias, **_where(layout, meta))
    torch.cuda.synchronize()
    check(a, q, meta, "w13", out, bias)


@pytest.mark.parametrize("layout", GROUPED, ids=lambda l: l.value)
def test_rs_stages_and_chunks_agree_bit_for_bit(layout, monkeypatch):
    """Three and four pipeline stages, chunks of 256 or 320 rows, a partial box in 16-row pieces or
    whole (`RS_TAIL_PIECES`), tiles walked statically or from the counter (`RS_DYNAMIC`): each
    output element sums the same k16 MMAs in the same order, so the same bits."""
    from padded_moe.kernels.native import grouped

    q, meta, a, bias, out = _rs_case([300, 7, 0, 64, 129, 320, 590, 90, 100], 640, 392, layout, torch.float32, 21,
                                     keep_canonical=False)
    outs = []
    for stages, wide, pieces, dynamic in ((3, False, True, False), (4, False, True, False), (3, True, True, False),
                                          (4, False, False, False), (3, True, False, False), (4, False, True, True),
                                          (3, True, True, True)):
        monkeypatch.setattr(grouped, "RS_TAIL_PIECES", pieces)
        monkeypatch.setattr(grouped, "RS_DYNAMIC", dynamic)
        out.fill_(SENTINEL)
        grouped.launch_rs(a, q, out, bias=bias, stages=stages, wide=wide, **_where(layout, meta))
        outs.append(out.clone())
    torch.cuda.synchronize()
    for other in outs[1:]:
        assert torch.equal(outs[0].view(torch.int16), other.view(torch.int16))
    check(a, q, meta, "w13", outs[1], bias)


def test_auto_takes_the_rs_kernel_for_prepared_mxfp4(monkeypatch):
    """GPT-OSS's prepared MXFP4 experts (swigluoai, biases, dropped slots) with the layout and
    backend left to `fused_experts`, their shape listed in `AUTO_RS_ROWS` from 128 rows per expert
    (the table's own entries are measured choices; this tests the mechanism): at 128 rows both
    GEMMs run the RS kernel and the result equals the Triton path's within bf16 rounding; at 64,
    below the band, none does."""
    from padded_moe import backends
    from padded_moe.kernels.native import grouped
    from padded_moe.layouts import LAYOUT_ENV
    from padded_moe.mxfp4 import quantize_mxfp4

    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    monkeypatch.delenv(backends.BACKEND_ENV, raising=False)
    monkeypatch.setattr(backends, "AUTO_RS_ROWS", {(2880, 2880): (128, 1024)})
    g = torch.Generator(device=DEV).manual_seed(14)
    E, K, N, k = 16, 2880, 2880, 4
    w13 = quantize_mxfp4(torch.randn(E, 2 * N, K, generator=g, device=DEV) / K ** 0.5).prepare_for(keep_canonical=False)
    w2 = quantize_mxfp4(torch.randn(E, K, N, generator=g, device=DEV) / N ** 0.5).prepare_for(keep_canonical=False)
    b13 = torch.randn(E, 2 * N, generator=g, device=DEV).bfloat16() * 0.1
    b2 = torch.randn(E, K, generator=g, device=DEV).bfloat16() * 0.1
    launches = []
    real = grouped.launch_rs
    monkeypatch.setattr(grouped, "launch_rs", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    for rows in (128, 64):
        M = rows * E // k
        x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
        tw, ids = torch.topk(torch.randn(M, E, generator=g, device=DEV).softmax(-1), k, dim=-1)
        ids = ids.int()
        ids[::7, 1] = -1
        launches.clear()
        out = fused_experts(x, w13, w2, tw, ids, activation="swigluoai", w13_bias=b13, w2_bias=b2)
        ref = fused_experts(x, w13, w2, tw, ids, activation="swigluoai", w13_bias=b13, w2_bias=b2, backend="triton")
        torch.cuda.synchronize()
        assert len(launches) == (2 if rows == 128 else 0)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert torch.isfinite(out).all() and err < 1e-2, f"relative difference {err:.3g}"


@pytest.mark.parametrize("wide", [False, True], ids=["chunks256", "chunks320"])
@pytest.mark.parametrize("config", [None, ApplyMoEActivationConfig(clamp_limit=3.0)], ids=["default", "limit3"])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
@pytest.mark.parametrize("layout", GROUPED, ids=lambda l: l.value)
def test_rs_gated_epilogue_equals_two_steps(layout, activation, bias_dtype, config, wide, monkeypatch):
    """The silu family in the RS kernel's epilogue, swigluoai with interleaved gate / up rows and silu
    with gate / up halves, against the RS kernel's plain GEMM1 (itself against float64) followed by the
    activation op: the same rows written, within one bf16 rounding; N past a 64-column tile (and for
    the halves, the up half starting mid-tile); chunks of 256 and of 320 rows."""
    from padded_moe.activation import ActivationEpilogue
    from padded_moe.kernels.native import grouped

    monkeypatch.setattr(grouped, "RS_WIDE", wide)
    q, meta, a, bias, out = _rs_case(RS_COUNTS, 2880, 272, layout, bias_dtype, 31)
    where = _where(layout, meta)
    grouped.launch_rs(a, q, out, bias=bias, **where)
    act = torch.full(out.shape[:-1] + (136,), SENTINEL, dtype=torch.bfloat16, device=DEV)
    grouped.launch_rs(a, q, act, bias=bias, epilogue=ActivationEpilogue.of(activation, config), **where)
    ref = torch.full_like(act, SENTINEL)
    apply_moe_activation(activation, ref, out, activation_config=config, valid_token_counts=meta.activation_counts)
    torch.cuda.synchronize()
    check(a, q, meta, "w13", out, bias)
    written = (ref != SENTINEL).any(-1)
    assert ((act == SENTINEL).all(-1) == ~written).all()
    diff = (act[written].double() - ref[written].double()).abs()
    assert torch.isfinite(act[written]).all()
    assert (diff / ref[written].double().abs().clamp(min=1e-2)).max().item() <= 2 ** -7


def _gpt_oss_experts(seed, M, E=16, K=2880, N=2880, k=4, mx=True):
    """Prepared MXFP4 experts (`mx`; else bf16) of GPT-OSS's shape with biases, M token rows and their
    top-k routing with dropped slots: (x, w13, w2, b13, b2, topk weights, topk ids)."""
    from padded_moe.mxfp4 import quantize_mxfp4

    def weight(*shape):
        w = torch.randn(*shape, generator=g, device=DEV) / shape[-1] ** 0.5
        return quantize_mxfp4(w).prepare_for(keep_canonical=False) if mx else w.bfloat16()

    g = torch.Generator(device=DEV).manual_seed(seed)
    w13, w2 = weight(E, 2 * N, K), weight(E, K, N)
    b13 = torch.randn(E, 2 * N, generator=g, device=DEV).bfloat16() * 0.1
    b2 = torch.randn(E, K, generator=g, device=DEV).bfloat16() * 0.1
    x = torch.randn(M, K, generator=g, device=DEV).bfloat16()
    tw, ids = torch.topk(torch.randn(M, E, generator=g, device=DEV).softmax(-1), k, dim=-1)
    ids = ids.int()
    ids[::7, 1] = -1
    return x, w13, w2, b13, b2, tw, ids


@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
def test_fused_experts_rs_epilogue(activation, monkeypatch):
    """Prepared MXFP4 experts of GPT-OSS's shape (biases, dropped slots), swigluoai (interleaved) or
    silu (halves), on backend "cuda" with the RS kernel's epilogue enabled and asked for: equal to the
    Triton path within bf16 rounding."""
    from padded_moe.gemm import FUSE_ENV
    from padded_moe.kernels.native import grouped

    monkeypatch.setattr(grouped, "RS_EPILOGUE", True)
    monkeypatch.setattr(grouped, "RS_EPILOGUE_SPLIT", True)
    monkeypatch.setenv(FUSE_ENV, "1")
    x, w13, w2, b13, b2, tw, ids = _gpt_oss_experts(15, 512)
    launches = []
    real = grouped.launch_rs
    monkeypatch.setattr(grouped, "launch_rs", lambda *a, **kw: launches.append(kw.get("epilogue")) or real(*a, **kw))
    out = fused_experts(x, w13, w2, tw, ids, activation=activation, w13_bias=b13, w2_bias=b2,
                        layout="grouped_contiguous", backend="cuda")
    ref = fused_experts(x, w13, w2, tw, ids, activation=activation, w13_bias=b13, w2_bias=b2, backend="triton")
    torch.cuda.synchronize()
    assert len(launches) == 2 and launches[0] is not None and launches[1] is None
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert torch.isfinite(out).all() and err < 1e-2, f"relative difference {err:.3g}"


def test_rs_sanitizer_small(monkeypatch):
    """A small RS call of each layout (chunks of 1-5 boxes, a second chunk, an empty expert, K past a
    multiple of 64, N past a weight tile), plain and with the gated epilogue, 256- and 320-row chunks,
    partial boxes in pieces and whole, the static and the dynamic walk, for
    `compute-sanitizer --tool memcheck`."""
    from padded_moe.activation import ActivationEpilogue
    from padded_moe.kernels.native import grouped

    counts = [5, 0, 70, 257, 130, 200, 321]
    for layout in GROUPED:
        q, meta, a, bias, out = _rs_case(counts, 160, 264, layout, torch.float32, 3)
        for stages, wide, pieces, dynamic in ((3, False, True, False), (4, False, False, False),
                                              (3, True, True, True), (3, True, False, False)):
            monkeypatch.setattr(grouped, "RS_TAIL_PIECES", pieces)
            monkeypatch.setattr(grouped, "RS_DYNAMIC", dynamic)
            out.fill_(SENTINEL)
            grouped.launch_rs(a, q, out, bias=bias, stages=stages, wide=wide, **_where(layout, meta))
            torch.cuda.synchronize()
            check(a, q, meta, "w13", out, bias)
        monkeypatch.setattr(grouped, "RS_TAIL_PIECES", True)
        q, meta, a, bias, out = _rs_case(counts, 160, 272, layout, torch.float32, 4)
        for wide, activation in ((False, "swigluoai"), (True, "swigluoai"), (False, "silu"), (True, "silu")):
            monkeypatch.setattr(grouped, "RS_DYNAMIC", wide)  # the wide chunks walked from the counter
            act = torch.full(out.shape[:-1] + (136,), SENTINEL, dtype=torch.bfloat16, device=DEV)
            grouped.launch_rs(a, q, act, bias=bias, epilogue=ActivationEpilogue.of(activation), wide=wide,
                              **_where(layout, meta))
            torch.cuda.synchronize()
            assert torch.isfinite(act[(act != SENTINEL).any(-1)]).all()


# ---- the RS kernel gathering GEMM1's rows from the tokens (`launch_rs`'s gather_src) ----

def _gather_case(K, N, seed, *, tokens=300, k=3, L=9, valid=None, row_pad=0, mx=True):
    """Token rows `x` (NaN in the tokens at/after `valid`; rows `row_pad` elements apart) routed top-k
    over L experts, skewed so that experts hold 0 to several hundred slots, with dropped (-1) and
    out-of-range ids; the GROUPED_CONTIGUOUS layout, its permuted rows, prepared MXFP4 weights
    (`mx`; else bf16) and a float32 bias."""
    from padded_moe.mxfp4 import quantize_mxfp4

    g = torch.Generator(device=DEV).manual_seed(seed)
    weights = torch.tensor([8.0, 0.0, 1.0, 3.0, 0.3, 2.0, 5.0, 1.5, 0.05][:L], device=DEV)
    ids = torch.multinomial(weights.expand(tokens, L), k, generator=g).int()
    ids[::11, 0] = -1
    ids[5::13, k - 1] = L + 2  # out of range: dropped by the layout's guard
    x_rows = torch.randn(tokens, K + row_pad, generator=g, device=DEV).bfloat16()
    x = x_rows[:, :K]
    vt = None
    if valid is not None:
        x[valid:] = float("nan")
        vt = torch.tensor([valid], dtype=torch.int32, device=DEV)
    meta = build_layout(GemmLayout.GROUPED_CONTIGUOUS, ids, L, valid_tokens=vt)
    from padded_moe.layouts import permute

    w = torch.randn(L, N, K, generator=g, device=DEV) / K ** 0.5
    q = quantize_mxfp4(w).prepare_for(keep_canonical=True) if mx else w.bfloat16()
    bias = torch.randn(L, N, generator=g, device=DEV)
    return x, permute(x, meta), meta, q, bias


def _permuted_and_gathered(launch, x, xp, meta, w, width, **kw):
    """`launch(a, w, out, ...)` on the permuted rows `xp`, then gathering them from the tokens `x`:
    the two outputs, each poisoned before its launch."""
    outs = []
    for a, gather in ((xp, {}), (x, dict(gather_src=meta.src, top_k=meta.top_k))):
        out = torch.full((meta.num_slots, width), SENTINEL, dtype=torch.bfloat16, device=DEV)
        launch(a, w, out, offsets=meta.offsets, **gather, **kw)
        outs.append(out)
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("K,N,valid,row_pad", [(2880, 272, None, 0), (224, 144, 250, 64), (64, 16, None, 8)])
def test_rs_gather_equals_permuted_rows(K, N, valid, row_pad, monkeypatch):
    """GEMM1 reading each row from its token (cp.async by the producer warpgroup into the swizzled
    boxes) against the same kernel on the permuted copy: the same bits in every row, plain and with
    both gated epilogues, for every chunk kind, stage count, piece mode and walk; the permuted result
    itself against float64. Tokens past `valid_tokens` hold NaN (never read), K past a multiple of
    64 reads zeros, token rows with a row stride wider than K."""
    from padded_moe.activation import ActivationEpilogue
    from padded_moe.kernels.native import grouped

    x, xp, meta, q, bias = _gather_case(K, N, K + N, valid=valid, row_pad=row_pad)
    for stages, wide, pieces, dynamic in ((4, False, True, True), (3, False, True, False), (3, True, True, True),
                                          (4, False, False, False), (3, True, False, False)):
        monkeypatch.setattr(grouped, "RS_TAIL_PIECES", pieces)
        monkeypatch.setattr(grouped, "RS_DYNAMIC", dynamic)
        for epilogue, width in ((None, N), (ActivationEpilogue.of("swigluoai"), N // 2),
                                (ActivationEpilogue.of("silu"), N // 2)):
            outs = _permuted_and_gathered(grouped.launch_rs, x, xp, meta, q, width, bias=bias, epilogue=epilogue,
                                          stages=stages, wide=wide)
            assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), \
                (stages, wide, pieces, dynamic, epilogue)
            if epilogue is None and stages == 4 and pieces:
                check(xp, q, meta, "w13", outs[1], bias)


@pytest.mark.parametrize("K,N,valid,row_pad", [(4096, 272, None, 0), (200, 144, 250, 64)])
def test_gather_bf16_equals_permuted_rows(K, N, valid, row_pad):
    """bf16 weights: every configuration and walk reading each row from its token against the same
    configuration on the permuted copy, plain and with both gated epilogues: the same bits; the
    permuted result itself against float64."""
    from padded_moe.activation import ActivationEpilogue
    from padded_moe.kernels.native import grouped

    x, xp, meta, w, bias = _gather_case(K, N, K + N, valid=valid, row_pad=row_pad, mx=False)
    for config in range(len(grouped.CONFIGS)):
        for dynamic in ((False, True) if grouped.CONFIGS[config][1] else (False,)):
            for epilogue, width in ((None, N), (ActivationEpilogue.of("swigluoai"), N // 2),
                                    (ActivationEpilogue.of("silu"), N // 2)):
                outs = _permuted_and_gathered(grouped.launch, x, xp, meta, w, width, bias=bias, epilogue=epilogue,
                                              config=config, dynamic=dynamic)
                assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), (config, dynamic, epilogue)
                if epilogue is None and not dynamic:
                    check(xp, w, meta, "w13", outs[1], bias)


@pytest.mark.parametrize("mx", [True, False], ids=["rs", "bf16"])
def test_fused_experts_gathers_gemm1_rows(mx, monkeypatch):
    """`fused_experts` on backend "cuda" with experts of GPT-OSS's shape (prepared MXFP4: the RS
    kernel, or bf16; swigluoai, biases, dropped slots): with `RS_GATHER` / `GATHER_BF16` GEMM1 reads
    the token rows (no `permute` call) and the result has the same bits as with the permuted copy."""
    from padded_moe import experts
    from padded_moe.kernels.native import grouped

    x, w13, w2, b13, b2, tw, ids = _gpt_oss_experts(16, 1024, mx=mx)
    permutes = []
    real = experts.permute
    monkeypatch.setattr(experts, "permute", lambda *a, **kw: permutes.append(1) or real(*a, **kw))
    outs = []
    for gather in (False, True):
        monkeypatch.setattr(grouped, "RS_GATHER" if mx else "GATHER_BF16", gather)
        permutes.clear()
        with experts.eager_cache_off():  # no launch plan: the second call must not replay the first's launches
            outs.append(fused_experts(x, w13, w2, tw, ids, activation="swigluoai", w13_bias=b13, w2_bias=b2,
                                      layout="grouped_contiguous", backend="cuda"))
        assert len(permutes) == (0 if gather else 1)
    torch.cuda.synchronize()
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_sanitizer_gathered(monkeypatch):
    """Small gathering calls, RS (every chunk kind, both walks) and bf16 (every configuration and
    walk), plain and gated, NaN tokens past valid_tokens, padded token rows, for
    `compute-sanitizer --tool memcheck`."""
    from padded_moe.activation import ActivationEpilogue
    from padded_moe.kernels.native import grouped

    x, xp, meta, w, bias = _gather_case(160, 272, 6, tokens=200, valid=180, row_pad=8, mx=False)
    for config in range(len(grouped.CONFIGS)):
        for dynamic in ((False, True) if grouped.CONFIGS[config][1] else (False,)):
            for epilogue, width in ((None, 272), (ActivationEpilogue.of("swigluoai"), 136)):
                out = torch.full((meta.num_slots, width), SENTINEL, dtype=torch.bfloat16, device=DEV)
                grouped.launch(x, w, out, offsets=meta.offsets, bias=bias, epilogue=epilogue, config=config,
                               dynamic=dynamic, gather_src=meta.src, top_k=meta.top_k)
                torch.cuda.synchronize()
                assert torch.isfinite(out[(out != SENTINEL).any(-1)]).all()

    x, xp, meta, q, bias = _gather_case(160, 272, 5, tokens=200, valid=180, row_pad=8)
    for stages, wide, dynamic in ((3, False, False), (4, False, True), (3, True, True)):
        monkeypatch.setattr(grouped, "RS_DYNAMIC", dynamic)
        for epilogue, width in ((None, 272), (ActivationEpilogue.of("swigluoai"), 136),
                                (ActivationEpilogue.of("silu"), 136)):
            out = torch.full((meta.num_slots, width), SENTINEL, dtype=torch.bfloat16, device=DEV)
            grouped.launch_rs(x, q, out, offsets=meta.offsets, bias=bias, epilogue=epilogue, stages=stages,
                              wide=wide, gather_src=meta.src, top_k=meta.top_k)
            torch.cuda.synchronize()
            assert torch.isfinite(out[(out != SENTINEL).any(-1)]).all()
