"""torch.compile of the MoE layer on CUDA: every preset case under fullgraph, mode="reduce-overhead"
(CUDA graphs) and dynamic=True, 50 calls with fresh inputs each compared with eager, no
recompilation across token counts with dynamic=True, and no device-to-host synchronisation in an
eager forward.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from padded_moe import FusedMoE, fused_experts

pytestmark = pytest.mark.gpu

CASES = [("qwen3-30b-a3b", "bf16"), ("dsv4-flash", "bf16"), ("dsv4-flash", "mxfp4"),
         ("mixtral-8x7b", "bf16"), ("gpt-oss-120b", "mxfp4")]
MODES = {"fullgraph": dict(fullgraph=True), "reduce-overhead": dict(fullgraph=True, mode="reduce-overhead"),
         "dynamic": dict(fullgraph=True, dynamic=True)}
TOKENS = (16, 1024)
CALLS = 50


@pytest.fixture(scope="module")
def layers():
    cache = {}

    def get(preset, fmt):
        if (preset, fmt) not in cache:
            cache.clear()  # one full-width layer on the GPU at a time
            torch.cuda.empty_cache()
            layer = FusedMoE.from_preset(preset, weight_format=fmt, device="cuda", dtype=torch.bfloat16)
            layer.randomize(seed=0, std=0.02)
            cache[(preset, fmt)] = layer
        return cache[(preset, fmt)]

    return get


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("preset,fmt,mode", [(p, f, m) for p, f in CASES for m in MODES])
def test_compiled_layer_matches_eager(layers, preset, fmt, mode):
    layer = layers(preset, fmt)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, **MODES[mode])
    gen = torch.Generator(device="cuda").manual_seed(1)
    worst = 0.0
    with torch.no_grad():
        for T in TOKENS:
            for i in range(CALLS):
                x = torch.randn(T, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
                # fp32 logits given explicitly: the compiled and eager gates may round differently,
                # and a flipped top-k tie would change which experts a token uses.
                logits = torch.randn(T, layer.num_experts, device="cuda", generator=gen)
                got = compiled(x, logits).clone()  # clone: a CUDA-graph output is reused by the next replay
                want = layer(x, logits)
                assert torch.isfinite(got).all(), (preset, fmt, mode, T, i)
                worst = max(worst, _rel(got, want))
    torch.cuda.synchronize()
    assert worst < 1e-2, worst
    if mode == "dynamic":
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_fused_experts_dynamic_graph_count():
    """dynamic=True: one graph for every token count from 2 up (Dynamo always specialises a size of
    1, so a one-token call gets a graph of its own)."""
    torch._dynamo.reset()
    counters.clear()
    E, k, K, N = 64, 4, 1024, 512
    gen = torch.Generator(device="cuda").manual_seed(2)
    w13 = torch.randn(E, 2 * N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
    w2 = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05

    def step(x, w, ids):
        return fused_experts(x, w13, w2, w, ids, activation="silu")

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for T in (2, 7, 64, 333, 2048):
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        w, ids = torch.topk(torch.randn(T, E, device="cuda", generator=gen).softmax(-1), k)
        ids = ids.int()
        assert _rel(compiled(x, w, ids), step(x, w, ids)) == 0.0
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("preset,fmt", [("qwen3-30b-a3b", "bf16"), ("dsv4-flash", "mxfp4")])
def test_eager_forward_never_syncs(layers, preset, fmt):
    """No device-to-host synchronisation in an eager forward (router, layout, GEMMs, combine), also
    with a device-side `valid_tokens`."""
    layer = layers(preset, fmt)
    x = torch.randn(16, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    valid = torch.tensor([5], device="cuda", dtype=torch.int32)
    with torch.no_grad():
        layer(x)  # first call compiles kernels and fills caches outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(x)
            layer(x[:3])
            layer(x, valid_tokens=valid)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("preset,fmt", [("gpt-oss-120b", "mxfp4"), ("qwen3-30b-a3b", "bf16"), ("dsv4-flash", "bf16")])
def test_compiled_layer_is_one_op_with_the_eager_bits(layers, preset, fmt, mode, monkeypatch):
    """Without logits given (the layer's own gate, under no_grad), the compiled forward is the op
    `padded_moe::moe_forward` running the eager step (`moe_step` runs inside compiled calls):
    the eager bits at decode sizes (a launch plan inside the graph, or the full path under
    CUDA-graph capture) and past them."""
    from padded_moe import layer as L

    layer = layers(preset, fmt)
    bias = layer.e_score_correction_bias
    saved = None if bias is None else bias.clone()
    if bias is not None:  # a bias that moves the choice (the fixture's is zero)
        bias.normal_(0, 0.1, generator=torch.Generator(device="cuda").manual_seed(3))
    inside, step = [], L.moe_step
    monkeypatch.setattr(L, "moe_step", lambda *a: inside.append(1) or step(*a))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, **MODES[mode])
    gen = torch.Generator(device="cuda").manual_seed(2)
    compiled_steps = 0  # moe_step entered by compiled calls (the traced forward never enters it;
    # a plan's replay and a CUDA-graph replay do not either, so not every call counts)
    try:
        with torch.no_grad():
            for T in (1, 3, 16, 64):
                for _ in range(4):
                    x = torch.randn(T, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
                    before = len(inside)
                    got = compiled(x).clone()  # clone: a CUDA-graph output is reused by the next replay
                    compiled_steps += len(inside) - before
                    assert torch.equal(got, layer(x)), (preset, mode, T)
        assert compiled_steps > 0, "the compiled forward never ran the one-step op"
        if mode == "dynamic":  # one graph from 2 tokens up, one for a single token (Dynamo specialises 1)
            assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    finally:
        if saved is not None:
            bias.copy_(saved)
