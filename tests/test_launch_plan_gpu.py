"""Launch plans on CUDA: an eager `fused_experts` call that replays a plan gives the bits of the
full path, for fresh inputs on every call, and never reads memory a plan's tensors gave up."""

import gc
import zlib

import pytest
import torch

from helpers import rel_err
from padded_moe import experts as X
from padded_moe.experts import fused_experts
from padded_moe.layer import dense_weights
from padded_moe.mxfp4 import quantize_mxfp4
from padded_moe.reference.moe import reference_moe

pytestmark = pytest.mark.gpu


def _inputs(M, k, E, K, gen, *, poison_from=None, offset=0):
    """Fresh hidden states (optionally a view at `offset` elements into a bigger buffer), routes
    with invalid ids, and NaN rows from `poison_from` on (past valid_tokens)."""
    base = torch.randn(M * K + offset, device="cuda", generator=gen).bfloat16()
    x = base[offset:].view(M, K)
    if poison_from is not None:
        x[poison_from:].fill_(float("nan"))
    ids = torch.rand(M, E, device="cuda", generator=gen).argsort(dim=1)[:, :k].to(torch.int32)
    ids[0, 0].fill_(-1)  # (a fill, not an indexed store: the loop runs in sync-debug "error" mode)
    ids[M // 2, k - 1].fill_(E + 3)
    tw = torch.rand(M, k, device="cuda", generator=gen)
    return x, tw / tw.sum(-1, keepdim=True), ids


def _full(*args, **kw):
    """The same call without the plan shortcut."""
    return X._fused_experts(*args, kw.get("activation"), kw.get("activation_config"), None, kw.get("layout"),
                            kw.get("w13_bias"), kw.get("w2_bias"), kw.get("valid_tokens"), kw.get("backend", "auto"),
                            None, None)


CASES = {
    "bf16-indexed": dict(E=32, k=6, K=512, N=256, fmt="bf16", activation="silu"),
    "bf16-contiguous": dict(E=16, k=2, K=256, N=512, fmt="bf16", activation="gelu", layout="grouped_contiguous"),
    "bf16-bias-swigluoai": dict(E=16, k=4, K=256, N=128, fmt="bf16", activation="swigluoai", bias=True),
    "mxfp4-prepared": dict(E=16, k=4, K=512, N=256, fmt="mxfp4", activation="swigluoai", bias=True, prepare=True),
    "mxfp4-canonical": dict(E=16, k=4, K=512, N=256, fmt="mxfp4", activation="silu"),
}


@pytest.mark.parametrize("valid", [False, True])
@pytest.mark.parametrize("M", [1, 7, 300])
@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_matches_full_path_bitwise(case, M, valid):
    c = CASES[case]
    E, k, K, N = c["E"], c["k"], c["K"], c["N"]
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{case}-{M}-{valid}".encode()))
    w13 = torch.randn(E, 2 * N, K, device="cuda", generator=gen) * 0.05
    w2 = torch.randn(E, K, N, device="cuda", generator=gen) * 0.05
    if c["fmt"] == "mxfp4":
        w13, w2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
        if c.get("prepare"):
            w13, w2 = w13.prepare_for(), w2.prepare_for()
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    bias = dict(w13_bias=torch.randn(E, 2 * N, device="cuda", generator=gen).bfloat16() * 0.1,
                w2_bias=torch.randn(E, K, device="cuda", generator=gen).bfloat16() * 0.1) if c.get("bias") else {}
    kw = dict(activation=c["activation"], layout=c.get("layout"), **bias)
    X._launch_plans().clear()
    n_valid = max(1, M - 3) if valid else M
    results = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):
            x, tw, ids = _inputs(M, k, E, K, gen, poison_from=n_valid if valid else None)
            if valid:
                kw["valid_tokens"] = torch.full((1,), n_valid, device="cuda", dtype=torch.int32)
            results.append((fused_experts(x, w13, w2, tw, ids, **kw), _full(x, w13, w2, tw, ids, **kw)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for call, (out, want) in enumerate(results):
        assert torch.equal(out[:n_valid], want[:n_valid]), f"call {call}: replay differs from the full path"
        assert not out[:n_valid].isnan().any()
    assert len(X._launch_plans()) == 1, "the repeated signature never got a plan"
    ref = reference_moe(x[:n_valid], dense_weights(w13), dense_weights(w2), tw[:n_valid], ids[:n_valid],
                        activation=c["activation"], w13_bias=bias.get("w13_bias"), w2_bias=bias.get("w2_bias"))
    assert rel_err(out[:n_valid], ref) <= 3e-2


def test_alignment_and_new_weights_take_the_full_path():
    """A misaligned view of the input, and weights at a new address (the old ones freed), each
    get their own plan or the full path — checked against the full path bit for bit."""
    E, k, K, N, M = 16, 4, 256, 128, 5
    gen = torch.Generator(device="cuda").manual_seed(7)
    X._launch_plans().clear()

    def weights():
        return ((torch.randn(E, 2 * N, K, device="cuda", generator=gen) * 0.05).bfloat16(),
                (torch.randn(E, K, N, device="cuda", generator=gen) * 0.05).bfloat16())

    w13, w2 = weights()
    for offset in (0, 0, 0, 0, 2, 2, 2, 2, 0):  # 2 bf16 elements: 4-byte aligned only
        x, tw, ids = _inputs(M, k, E, K, gen, offset=offset)
        assert torch.equal(fused_experts(x, w13, w2, tw, ids, activation="silu"),
                           _full(x, w13, w2, tw, ids, activation="silu"))
    assert len(X._launch_plans()) == 2
    del w13, w2
    gc.collect()
    for _ in range(4):  # new weights, possibly at the freed addresses: a dead plan must not run
        w13, w2 = weights()
        x, tw, ids = _inputs(M, k, E, K, gen)
        assert torch.equal(fused_experts(x, w13, w2, tw, ids, activation="silu"),
                           _full(x, w13, w2, tw, ids, activation="silu"))


def test_workspace_growth_drops_plans_into_the_old_workspace():
    """A bigger call replaces the eager workspace; the small call's plan pointed into the old one
    and must not replay (its weak references died)."""
    E, k, K, N = 16, 4, 256, 128
    gen = torch.Generator(device="cuda").manual_seed(8)
    w13 = (torch.randn(E, 2 * N, K, device="cuda", generator=gen) * 0.05).bfloat16()
    w2 = (torch.randn(E, K, N, device="cuda", generator=gen) * 0.05).bfloat16()
    X._launch_plans().clear()
    X._eager_buffers.clear()
    for M in (2, 2, 2, 2, 900, 2, 2, 2, 2):
        x, tw, ids = _inputs(M, k, E, K, gen)
        out = fused_experts(x, w13, w2, tw, ids, activation="silu")
        torch.cuda.synchronize()
        assert torch.equal(out, _full(x, w13, w2, tw, ids, activation="silu")), f"M={M}"
    assert len(X._launch_plans()) >= 1


def test_no_plan_under_graph_capture_or_with_scratch():
    """Calls inside a CUDA-graph capture never replay an eager plan (they take the capture-safe
    path), and the graph replays with new inputs are right."""
    from padded_moe.layouts import PermuteScratch

    E, k, K, N, M = 16, 4, 256, 128, 8
    gen = torch.Generator(device="cuda").manual_seed(9)
    w13 = (torch.randn(E, 2 * N, K, device="cuda", generator=gen) * 0.05).bfloat16()
    w2 = (torch.randn(E, K, N, device="cuda", generator=gen) * 0.05).bfloat16()
    x, tw, ids = _inputs(M, k, E, K, gen)
    for _ in range(4):
        fused_experts(x, w13, w2, tw, ids, activation="silu")
    assert len(X._launch_plans()) >= 1
    scratch = PermuteScratch(M, k, E, E, "cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_experts(x, w13, w2, tw, ids, activation="silu", scratch=scratch)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused_experts(x, w13, w2, tw, ids, activation="silu")
    for _ in range(3):
        x2, tw2, ids2 = _inputs(M, k, E, K, gen)
        x.copy_(x2), tw.copy_(tw2), ids.copy_(ids2)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _full(x, w13, w2, tw, ids, activation="silu"))


LAYER_CASES = {
    "gpt-oss-like": dict(E=32, k=4, K=256, N=128, router="topk_softmax", activation="swigluoai", has_bias=True,
                         weight_format="mxfp4"),
    "qwen3-like": dict(E=64, k=8, K=256, N=128, router="softmax"),
    "mixtral-like": dict(E=8, k=2, K=512, N=256, router="softmax_renorm"),
    "deepseek-like": dict(E=64, k=6, K=256, N=128, router="biased_sqrtsoftplus", routed_scaling_factor=2.5,
                          num_groups=8, topk_groups=4),
}


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_layer_forward_replays_its_plan_bitwise(case, M, monkeypatch):
    """An eager decode-sized `FusedMoE.forward` (gate kernel, router kernel, experts) becomes one
    launch plan: once planned, a call runs no host code of the step's own (`moe_step` is entered
    while recording, never in a replay), and gives the bits of the full forward on fresh hidden
    states, with and without a count whose padded rows hold NaN; the result equals the float64
    reference on the layer's own routes."""
    from padded_moe import layer as L
    from padded_moe.layer import FusedMoE

    c = dict(LAYER_CASES[case])
    E, k, K, N = c.pop("E"), c.pop("k"), c.pop("K"), c.pop("N")
    layer = FusedMoE(E, k, K, N, device="cuda", dtype=torch.bfloat16, **c)
    layer.randomize(seed=zlib.crc32(case.encode()), std=0.05)
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{case}-{M}".encode()))
    entered = []
    step = L.moe_step
    monkeypatch.setattr(L, "moe_step", lambda *a: entered.append(1) or step(*a))
    full = FusedMoE._forward  # the general path (gate kernel and router, then the experts)
    with torch.no_grad():
        for valid in (None, max(M - 1, 0)):
            count = None if valid is None else torch.tensor([valid], device="cuda", dtype=torch.int32)
            for _ in range(3):  # plain, then two agreeing recordings
                layer(torch.randn(M, K, device="cuda", generator=gen).bfloat16(), valid_tokens=count)
            assert entered, "the forward did not run the step"
            entered.clear()
            for _ in range(3):
                x = torch.randn(M, K, device="cuda", generator=gen).bfloat16()
                if valid is not None:
                    x[valid:] = float("nan")
                out = layer(x) if valid is None else layer(x, valid_tokens=count)
                assert entered == [], "the forward did not replay its plan"
                want = full(layer, x, None, None, count)
                n = M if valid is None else valid
                assert torch.equal(out[:n], want[:n])
            if n:
                tw, ids = layer._gate_routes(x[:n])  # the layer's own routes (the routers have their tests)
                w13, w2 = layer.expert_weights()
                ref = reference_moe(x[:n], dense_weights(w13), dense_weights(w2), tw, ids,
                                    activation=layer.activation.value,
                                    activation_kwargs=dict(limit=layer.activation_config.clamp_limit),
                                    w13_bias=layer.w13_bias, w2_bias=layer.w2_bias)
                assert rel_err(out[:n], ref) <= 2e-2


def test_layer_with_shared_experts_replays_its_routed_part(monkeypatch):
    """Shared experts (the caller's module) run beside the plan: the routed part of a decode-sized
    forward replays its plan, and the sum equals the full forward bit for bit."""
    from padded_moe import layer as L
    from padded_moe.layer import FusedMoE

    K = 256
    shared = torch.nn.Linear(K, K, device="cuda", dtype=torch.bfloat16)
    layer = FusedMoE(64, 6, K, 128, device="cuda", dtype=torch.bfloat16, router="biased_sigmoid",
                     routed_scaling_factor=2.5, shared_experts=shared)
    layer.randomize(seed=3, std=0.05)
    entered = []
    step = L.moe_step
    monkeypatch.setattr(L, "moe_step", lambda *a: entered.append(1) or step(*a))
    gen = torch.Generator(device="cuda").manual_seed(4)
    with torch.no_grad():
        for _ in range(3):
            layer(torch.randn(5, K, device="cuda", generator=gen).bfloat16())
        assert entered
        entered.clear()
        for _ in range(3):
            x = torch.randn(5, K, device="cuda", generator=gen).bfloat16()
            out = layer(x)
            assert entered == [], "the routed part did not replay its plan"
            assert torch.equal(out, layer._forward(x, None, None, None))


def test_layer_plan_follows_new_weights_and_settings():
    """A layer's plan never serves a call whose host code would decide differently: a new gate
    weight, a changed top-k or a larger batch take the full forward (and agree with it)."""
    from padded_moe.layer import FusedMoE

    layer = FusedMoE(32, 4, 256, 128, device="cuda", dtype=torch.bfloat16, router="softmax_renorm")
    layer.randomize(seed=5, std=0.05)
    x = torch.randn(4, 256, device="cuda").bfloat16()
    with torch.no_grad():
        for _ in range(4):
            layer(x)
        layer.gate.weight = torch.nn.Parameter(torch.randn_like(layer.gate.weight) * 0.05)
        assert torch.equal(layer(x), layer._forward(x, None, None, None))
        layer.top_k = 3
        assert torch.equal(layer(x), layer._forward(x, None, None, None))
        assert layer._gate_routes(x)[1].shape == (4, 3)
        big = torch.randn(40, 256, device="cuda").bfloat16()
        assert layer._plan_key(big, None) is None
