"""torch.compile of the expert pipeline (CPU): fullgraph tracing, dynamic token counts, no recompiles.

The GPU side (inductor, CUDA graphs through mode="reduce-overhead", the model presets) is in
test_compile_gpu.py. Here the compiled graph holds the custom ops `padded_moe::fused_experts` /
`padded_moe::batched_experts`, whose implementation runs the torch path or the interpreted
kernels, so these tests check what the compiler sees: the fake shapes, the op schema, and that
nothing in the wrappers breaks the graph or needs a value from the device.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from padded_moe import FusedMoE, batched_experts, fused_experts
from padded_moe.expert_map import ExpertMap
from padded_moe.layer import ep_step
from padded_moe.mxfp4 import Mxfp4Tensor, quantize_mxfp4


def _routes(gen, M, E, k):
    logits = torch.randn(M, E, generator=gen)
    w, ids = torch.topk(logits.softmax(-1), k)
    ids = ids.to(torch.int32)
    ids[0, 0] = -1          # dropped slot
    ids[-1, -1] = E + 3     # garbage id
    return w, ids


def _weights(gen, E, N, K, mxfp4=False):
    w13 = torch.randn(E, 2 * N, K, generator=gen) * 0.1
    w2 = torch.randn(E, K, N, generator=gen) * 0.1
    if mxfp4 == "prepared":
        # Canonical bytes NaN-scaled garbage: a result can only come from the prepared form, so the
        # compiled call shows that the Hopper arrangement travels through the custom op.
        def prepared_only(w):
            q = quantize_mxfp4(w).prepare_for()
            return Mxfp4Tensor(torch.full_like(q.blocks, 0x77), torch.full_like(q.scales, 255), q.hopper)

        return prepared_only(w13), prepared_only(w2)
    if mxfp4 == "once":  # the prepared form alone (no canonical bytes held)
        return (quantize_mxfp4(w13).prepare_for(keep_canonical=False),
                quantize_mxfp4(w2).prepare_for(keep_canonical=False))
    if mxfp4:
        return quantize_mxfp4(w13), quantize_mxfp4(w2)
    return w13, w2


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mxfp4,expected_m", [(False, None), (True, None), ("prepared", None), ("once", None),
                                               ("prepared", 1)])
def test_fused_experts_fullgraph_matches_eager(gen, mxfp4, expected_m):
    E, k, K, N = 8, 2, 64, 64 if mxfp4 == "once" else 32
    w13, w2 = _weights(gen, E, N, K, mxfp4)
    b13, b2 = torch.randn(E, 2 * N, generator=gen), torch.randn(E, K, generator=gen)
    layout = None if expected_m is None else "grouped_contiguous"

    def step(x, w, ids):
        return fused_experts(x, w13, w2, w, ids, activation="swigluoai", w13_bias=b13, w2_bias=b2, layout=layout,
                             expected_m=expected_m)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for M in (5, 9):
        x = torch.randn(M, K, generator=gen)
        w, ids = _routes(gen, M, E, k)
        got = compiled(x, w, ids)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, step(x, w, ids), rtol=0, atol=0)


def test_compiled_call_applies_the_activation_in_gemm1(gen, monkeypatch):
    """Inside the compiled graph the custom op's pipeline takes GEMM1's activation epilogue, as the
    eager call does (interpreted Triton here), and agrees with the two steps to the last bit
    of the float32 sums (tests/test_gemm_epilogue.py says why not bitwise under the interpreter)."""
    from padded_moe import experts as ex
    from padded_moe._platform import kernels_interpreted
    from padded_moe.gemm import FUSE_ENV

    if not kernels_interpreted():
        pytest.skip("the interpreted kernels are not in use")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    real = ex.apply_moe_activation
    monkeypatch.setattr(ex, "apply_moe_activation", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    E, k, K, N, M = 8, 2, 64, 32, 7
    w13, w2 = _weights(gen, E, N, K)

    def step(x, w, ids):
        return fused_experts(x, w13, w2, w, ids, activation="silu")

    x = torch.randn(M, K, generator=gen)
    w, ids = _routes(gen, M, E, k)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x, w, ids)
    assert not calls, "the compiled call ran the activation as its own op"
    monkeypatch.setenv(FUSE_ENV, "0")
    plain = step(x, w, ids)
    assert calls
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)


def test_fused_experts_dynamic_no_recompile(gen):
    """One graph serves every token count (dynamic=True), valid_tokens and an expert map included."""
    E, k, K, N = 8, 2, 64, 32
    w13, w2 = _weights(gen, 4, N, K)
    emap = ExpertMap(E, ep_rank=1, ep_size=2)

    def step(x, w, ids, vt):
        return fused_experts(x, w13, w2, w, ids, activation="silu", expert_map=emap, valid_tokens=vt)

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for M in (3, 6, 11, 17):
        x = torch.randn(M, K, generator=gen)
        x[M - 1] = float("nan")  # the row past valid_tokens is padding: never read
        w, ids = _routes(gen, M, E, k)
        vt = torch.tensor([M - 1], dtype=torch.int32)
        got, want = compiled(x, w, ids, vt), step(x, w, ids, vt)
        torch.testing.assert_close(got[: M - 1], want[: M - 1], rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_fused_experts_dynamic_prepared_mxfp4_weights_keep_their_sizes(gen):
    """Prepared MXFP4 weights held in a closure (not module parameters): `prepare_for()` fixes
    their sizes, so a first token count equal to one of them still gives one graph."""
    L, k, K, N = 4, 2, 64, 32
    w13 = quantize_mxfp4(torch.randn(L, 2 * N, K, generator=gen)).prepare_for()
    w2 = quantize_mxfp4(torch.randn(L, K, N, generator=gen)).prepare_for()
    sizes = {d for h in (w13.hopper, w2.hopper) for t in (h.blocks, h.scales) for d in t.shape}
    first = max(sizes - {L, K, N, 2 * N})  # a size of the prepared form alone

    def step(x, w, ids):
        return fused_experts(x, w13, w2, w, ids, activation="silu")

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for M in (first, 5, 7):
        x = torch.randn(M, K, generator=gen)
        w, ids = _routes(gen, M, L, k)
        torch.testing.assert_close(compiled(x, w, ids), step(x, w, ids), rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("expected_m", [None, 2])
def test_batched_experts_fullgraph(gen, expected_m):
    L, T, K, N = 3, 5, 64, 32
    w13, w2 = _weights(gen, L, N, K)
    x = torch.randn(L, T, K, generator=gen)
    counts = torch.tensor([2, 0, 5], dtype=torch.int64)
    x[0, 2:] = float("nan")
    x[1] = float("nan")
    poison = torch.full((L, T, K), 7.0)

    def step(x, counts, out):
        return batched_experts(x, counts, w13, w2, activation="silu", out=out, expected_m=expected_m)

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(x, counts, poison.clone())
    want = step(x, counts, poison.clone())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.all(got[0, 2:] == 7.0) and torch.all(got[1] == 7.0)  # rows past the counts untouched


@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4", "mxfp4-once"])
def test_layer_compiles_with_inductor(weight_format):
    """The whole layer (gate, router, experts op) under inductor, fullgraph, dynamic token counts;
    "mxfp4-once": widths of 64, so the layer holds its experts in the prepared form alone."""
    if weight_format == "mxfp4-once":
        layer = FusedMoE(8, 2, 64, 64, router="softmax", weight_format="mxfp4", dtype=torch.float32)
        assert not layer.keep_canonical
    else:
        layer = FusedMoE.from_preset("tiny", weight_format=weight_format, dtype=torch.float32)
    layer.randomize(seed=3)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for M in (4, 7):
            x = torch.randn(M, layer.hidden_size, generator=gen)
            torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_layer_compiles_with_grad_enabled():
    """Outside `torch.no_grad()` (the gate's weight requires grad, so the router weights do), the
    compiled layer's forward equals eager: the ops are inference-only, with no backward to trace."""
    layer = FusedMoE.from_preset("tiny", dtype=torch.float32)
    layer.randomize(seed=4)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(6, layer.hidden_size, generator=torch.Generator().manual_seed(6))
    got = compiled(x)
    assert got.requires_grad  # through the gate
    torch.testing.assert_close(got, layer(x), rtol=0, atol=0)


def test_layer_never_quantizes_inside_the_graph():
    """An MXFP4 layer holds only MXFP4 parameters (no float expert weights); their prepared
    arrangement is built eagerly (randomize / load / state dict), so a compiled forward only reads
    it, and a state-dict load replaces it."""
    layer = FusedMoE.from_preset("tiny", weight_format="mxfp4", dtype=torch.float32)
    layer.randomize(seed=1)
    first = layer.expert_weights()[0]
    before = first.dequantize(torch.float32)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    assert {"w13_blocks", "w13_scales", "w2_blocks", "w2_scales"} <= set(state) and "w13" not in state
    assert all(state[k].dtype == torch.uint8 for k in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"))
    state["w13_scales"].add_(1)  # every w13 weight doubled
    layer.load_state_dict(state)
    second = layer.expert_weights()[0]
    assert second is not first and second.hopper is not None
    torch.testing.assert_close(second.dequantize(torch.float32), 2 * before, rtol=0, atol=0)


def test_mxfp4_layer_dynamic_first_token_count_equal_to_a_prepared_dim_does_not_recompile():
    """The prepared MXFP4 arrangement sits beside the parameters (not a parameter itself): its
    sizes are fixed, so a first token count equal to one of them (duck sizing would tie the two
    symbols) still gives one graph for every later token count."""
    layer = FusedMoE(4, 2, 64, 32, router="softmax", weight_format="mxfp4", dtype=torch.float32)
    h = layer._mxfp4["w13"].hopper
    first = max(d for d in (*h.blocks.shape, *h.scales.shape) if d not in (64, 32, 4))  # not a layer width
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for M in (first, 5, 7):
            x, logits = torch.randn(M, 64, generator=gen), torch.randn(M, 4, generator=gen)
            torch.testing.assert_close(compiled(x, logits), layer(x, logits), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_mxfp4_layer_compiled_straight_after_construction_reads_the_prepared_form():
    """Construction prepares the MXFP4 experts (`reset_parameters` ends with `prepare()`), so a
    layer compiled before any eager forward passes the prepared arrangement to its op, never the
    canonical bytes (which would run the slower `tl.dot_scaled` GEMM on Hopper for good): the
    one-step op of a forward with the layer's own gate, the experts op of one given logits."""
    layer = FusedMoE(8, 2, 64, 64, router="softmax", weight_format="mxfp4", dtype=torch.float32)
    assert layer._mxfp4 and layer.w13_blocks.numel() == 0
    seen = []

    def backend(gm, example_inputs):  # the traced graph's padded_moe ops and their arguments
        seen.extend((str(n.target), n.args) for n in gm.graph.nodes if "padded_moe" in str(n.target))
        return gm.forward

    gen = torch.Generator().manual_seed(2)
    x, logits = torch.randn(5, 64, generator=gen), torch.randn(5, 8, generator=gen)
    with torch.no_grad():
        got = torch.compile(layer, fullgraph=True, backend=backend)(x)
        torch.testing.assert_close(got, layer(x), rtol=0, atol=0)
        (op, args), = seen
        assert "moe_forward" in op and all(a is not None for a in (args[7], args[8], args[11], args[12])), seen
        seen.clear()
        got = torch.compile(layer, fullgraph=True, backend=backend)(x, logits)
        torch.testing.assert_close(got, layer(x, logits), rtol=1e-5, atol=1e-6)
    ops = [(op, args) for op, args in seen if "fused_experts" in op]
    assert len(ops) == 1 and all(a is not None for a in ops[0][1][20:24]), seen  # prepared blocks / scales


def _graph_ops(seen: list):
    def backend(gm, example_inputs):
        seen.extend(str(n.target).removesuffix(".default") for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    return backend


@pytest.mark.parametrize("router", ["softmax_renorm", "topk_softmax", "biased_sigmoid"])
def test_layer_compiles_as_one_op_that_runs_the_eager_forward(router):
    """Without gradients, `torch.compile` sees a layer's forward as one op (`padded_moe::moe_forward`:
    no gate GEMM, router or experts op of its own in the graph), for every token count in one
    dynamic graph, with the eager forward's bits; given logits, the traced forward as before."""
    layer = FusedMoE(16, 4, 64, 32, router=router, dtype=torch.float32, has_bias=router == "topk_softmax")
    layer.randomize(seed=7)
    if layer.e_score_correction_bias is not None:
        layer.e_score_correction_bias.normal_(generator=torch.Generator().manual_seed(9))
    seen = []
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=_graph_ops(seen))
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for M in (3, 16, 40):
            x = torch.randn(M, 64, generator=gen)
            torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)
        assert [t for t in seen if "padded_moe" in t] == ["padded_moe.moe_forward"], seen
        seen.clear()
        logits = torch.randn(40, 16, generator=gen)
        torch.testing.assert_close(compiled(x, logits), layer(x, logits), rtol=0, atol=0)
    assert "padded_moe.moe_forward" not in seen and "padded_moe.fused_experts" in seen, seen


def test_one_step_op_leaves_the_graph_to_the_compiler_where_it_does_not_apply():
    """A callable router, a gate with a hook, or a gradient to record: the compiler traces the
    forward (gate, router op, experts op), and the result equals eager. Shared experts (the
    caller's module) are traced beside the one-step op."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 64, generator=gen)

    def ops_of(layer, grad=False):
        seen = []
        with torch.set_grad_enabled(grad):
            got = torch.compile(layer, fullgraph=True, backend=_graph_ops(seen))(x)
            torch.testing.assert_close(got, layer(x), rtol=1e-6, atol=1e-6)
        torch._dynamo.reset()
        return [t for t in seen if "padded_moe" in t]

    plain = FusedMoE(8, 2, 64, 32, dtype=torch.float32)
    assert ops_of(plain) == ["padded_moe.moe_forward"]
    shared = FusedMoE(8, 2, 64, 32, dtype=torch.float32, shared_experts=torch.nn.Linear(64, 64))
    assert ops_of(shared) == ["padded_moe.moe_forward"]
    def router(logits, token_ids):
        weights, ids = torch.topk(logits.softmax(-1), 2)
        return weights, ids.to(torch.int32)

    routed = FusedMoE(8, 2, 64, 32, dtype=torch.float32, router=router)
    assert "padded_moe.moe_forward" not in ops_of(routed)
    hooked = FusedMoE(8, 2, 64, 32, dtype=torch.float32)
    hooked.gate.register_forward_hook(lambda m, args, out: out * 2)
    assert "padded_moe.moe_forward" not in ops_of(hooked)
    assert "padded_moe.moe_forward" not in ops_of(FusedMoE(8, 2, 64, 32, dtype=torch.float32), grad=True)


def test_layers_share_one_compiled_graph():
    """The op takes the layer's tensors and settings, never an id of the layer: one compiled
    function called with several layers (a model compiled block by block) makes one graph, each
    layer computing with its own weights."""
    layers = [FusedMoE.from_preset("tiny", dtype=torch.float32) for _ in range(4)]
    for i, layer in enumerate(layers):
        layer.randomize(seed=20 + i)

    def step(layer, x):
        return layer(x)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        outs = []
        for layer in layers:
            x = torch.randn(5, layer.hidden_size, generator=gen)
            outs.append(compiled(layer, x))
            torch.testing.assert_close(outs[-1], layer(x), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


# ---------------------------------------------------------------------------- expert parallelism
def _ep_layer(mode, T=8):
    from padded_moe.distributed import ExpertParallel

    E, k, K, N = 8, 2, 32, 16
    ep = ExpertParallel(None, E, k, K, T, mode=mode, dtype=torch.float32)
    layer = FusedMoE(E, k, K, N, dtype=torch.float32, expert_parallel=ep)
    layer.randomize(seed=11)
    return layer


def _by_hand(layer):
    """dispatch → local experts → combine as an engine composing its own layer would write it:
    `ExpertParallel.dispatch` / `combine` called inside the compiled function (the layer's own
    sequence, `padded_moe.layer.ep_step`, not its `ep_experts` op)."""

    def step(x):
        weights, ids = layer.route(layer.gate(x))
        w13, w2 = layer.expert_weights()
        return ep_step(layer.expert_parallel, x, weights, ids, w13, w2, layer.w13_bias, layer.w2_bias,
                       layer.activation, layer.activation_config, layer.layout, layer.backend)

    return step


@pytest.mark.parametrize("by_hand", [False, True], ids=["layer", "by-hand"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("mode", ["flat", "batched"])
def test_layer_with_expert_parallelism_compiles(one_rank_group, mode, backend, by_hand):
    """FusedMoE with an ExpertParallel under fullgraph and dynamic token counts: dispatch → local
    experts → combine is one custom op (`padded_moe::ep_experts`), or, written by hand, one op for
    each of dispatch and combine (`ep_dispatch`, `ep_combine`); the compiler never traces the
    exchange's buffers; one graph for every count, results equal to eager."""
    layer = _ep_layer(mode)
    compiled = torch.compile(_by_hand(layer) if by_hand else layer, fullgraph=True, dynamic=True, backend=backend)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for M in (3, 8, 5):
            x = torch.randn(M, layer.hidden_size, generator=gen)
            torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("mode", [None, "flat", "batched"], ids=["single", "ep-flat", "ep-batched"])
def test_layer_with_valid_tokens_compiles(one_rank_group, mode):
    """forward(valid_tokens=) under inductor, fullgraph, dynamic token counts and a device-side count
    (with expert parallelism the padded rows' ids are masked inside the graph): one graph; the real
    rows equal eager."""
    if mode is None:
        layer = FusedMoE.from_preset("tiny", dtype=torch.float32)
        layer.randomize(seed=3)
    else:
        layer = _ep_layer(mode)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for M, v in ((6, 4), (8, 8), (5, 0)):
            x = torch.randn(M, layer.hidden_size, generator=gen)
            x[v:] = float("nan")
            vt = torch.tensor([v], dtype=torch.int32)
            torch.testing.assert_close(compiled(x, valid_tokens=vt)[:v], layer(x, valid_tokens=vt)[:v],
                                       rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_layers_sharing_an_expert_parallel_share_one_graph(one_rank_group):
    """The expert-parallel op names the `ExpertParallel` (shared by a model's layers), not the layer,
    and takes each layer's weights as arguments: one compiled function called with three layers
    makes one graph, each layer computing with its own weights."""
    from padded_moe.distributed import ExpertParallel

    E, k, K, N = 8, 2, 32, 16
    ep = ExpertParallel(None, E, k, K, 8, dtype=torch.float32)
    layers = [FusedMoE(E, k, K, N, dtype=torch.float32, expert_parallel=ep) for _ in range(3)]
    for i, layer in enumerate(layers):
        layer.randomize(seed=30 + i)

    def step(layer, x):
        return layer(x)

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        outs = []
        for layer in layers:
            x = torch.randn(5, K, generator=gen)
            outs.append(compiled(layer, x))
            torch.testing.assert_close(outs[-1], layer(x), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(outs[0], outs[1])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _ep_compile_worker(rank, world, payload):
    import traceback

    try:
        layer = _ep_layer(payload["mode"], T=6)
        compiled = torch.compile(_by_hand(layer) if payload["by_hand"] else layer, fullgraph=True,
                                 backend="aot_eager")
        gen = torch.Generator().manual_seed(40 + rank)
        errs = []
        with torch.no_grad():
            for m in ((6, 0), (2, 5))[rank]:  # an idle rank, then uneven counts
                x = torch.randn(m, layer.hidden_size, generator=gen)
                got, want = compiled(x), layer(x)  # collective: an idle rank calls too
                assert got.shape == (m, layer.hidden_size)
                errs.append(float((got - want).abs().max()) if m else 0.0)
        return dict(errs=errs)
    except Exception:
        return dict(error=traceback.format_exc())


@pytest.mark.parametrize("by_hand", [False, True], ids=["layer", "by-hand"])
@pytest.mark.parametrize("mode", ["flat", "batched"])
def test_layer_with_expert_parallelism_compiles_on_two_ranks(mode, by_hand):
    """The compiled layer (or its dispatch / combine by hand) on 2 gloo ranks, idle rank and uneven
    counts included, equals eager."""
    from _spawn import spawn_group

    for rank, r in enumerate(spawn_group(2, _ep_compile_worker, dict(mode=mode, by_hand=by_hand))):
        assert "error" not in r, f"rank {rank}:\n{r.get('error')}"
        assert max(r["errs"]) <= 1e-5, (rank, r["errs"])


def test_combine_without_its_dispatch_is_refused(one_rank_group):
    """The ops pair up through the ExpertParallel: a combine op with no dispatch op before it fails."""
    ep = _ep_layer("flat", T=4).expert_parallel
    with pytest.raises(RuntimeError, match="every combine needs the dispatch before it"):
        torch.ops.padded_moe.ep_combine(torch.zeros(ep.ep_size * 4, ep.hidden_size), 2, ep.op_id)


def test_moe_forward_op_passes_opcheck():
    """torch.library.opcheck of `padded_moe::moe_forward` (schema, fake implementation against the
    real op) on a layer's own arguments, bf16-format and MXFP4 weights with biases."""
    gen = torch.Generator().manual_seed(12)
    for fmt in ("bf16", "mxfp4"):
        layer = FusedMoE(8, 2, 64, 64, router="biased_sigmoid", routed_scaling_factor=2.0, weight_format=fmt,
                         has_bias=True, dtype=torch.float32)
        layer.randomize(seed=2)
        x = torch.randn(5, 64, generator=gen)
        for valid in (None, torch.tensor([3], dtype=torch.int32)):
            torch.library.opcheck(torch.ops.padded_moe.moe_forward.default, layer._one_step_args(x, valid),
                                  test_utils=("test_schema", "test_faketensor"))


def test_ep_experts_op_passes_opcheck(one_rank_group):
    """torch.library.opcheck of `padded_moe::ep_experts` (schema, fake implementation) on an
    expert-parallel layer's arguments."""
    layer = _ep_layer("flat", T=4)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(3, layer.hidden_size, generator=gen)
    with torch.no_grad():
        w, ids = layer.route(layer.gate(x))
    torch.library.opcheck(torch.ops.padded_moe.ep_experts.default, layer._ep_op_args(x, w, ids),
                          test_utils=("test_schema", "test_faketensor"))


def test_compiled_layer_with_no_activation_config():
    """`activation_config = None` set on a layer (accepted eagerly) compiles too: the op gets the
    defaults."""
    layer = FusedMoE.from_preset("tiny", dtype=torch.float32)
    layer.randomize(seed=5)
    layer.activation_config = None
    x = torch.randn(4, layer.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), layer(x),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["flat", "batched"])
def test_dispatch_and_combine_ops_pass_opcheck(one_rank_group, mode):
    """torch.library.opcheck: schema, fake implementation (shapes, dtypes) against the real op."""
    ep = _ep_layer(mode, T=4).expert_parallel
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, ep.hidden_size, generator=gen)
    w, ids = _routes(gen, 3, ep.num_experts, ep.top_k)
    # Not opcheck's value comparisons across calls: the receive rows past the counts are
    # unspecified (stale or never written), so two calls need not agree there.
    torch.library.opcheck(torch.ops.padded_moe.ep_dispatch.default,
                          (x, ids, w, ep.op_id, mode == "flat", ep.geometry.rows, ep.num_local),
                          test_utils=("test_schema", "test_faketensor"))
    rb, handle = ep.dispatch(x, ids, w)
    y = torch.randn(rb.x.shape, generator=gen)
    ep._op_handle = handle  # what the dispatch op leaves for the combine op (one real call below)
    torch.library.opcheck(torch.ops.padded_moe.ep_combine.default, (y, 3, ep.op_id), test_utils=("test_faketensor",))


@pytest.mark.parametrize("act, field, values", [("silu", "clamp_limit", (3.0, 5.0)),
                                                ("swigluoai", "clamp_limit", (7.0, 9.0)),
                                                ("situ", "situ_beta", (4.0, 2.0))])
def test_activation_configs_differing_per_layer_compile_fullgraph(gen, act, field, values):
    """One compiled function applied to layers whose activation configs differ: the recompile for
    the second value holds it as a symbolic float, which the op takes as given and resolves when it
    runs (the checks of `_resolve` are not traced); each result equals the eager call's."""
    from padded_moe.activation import ApplyMoEActivationConfig, apply_moe_activation

    class Act(torch.nn.Module):
        def __init__(self, value):
            super().__init__()
            self.cfg = ApplyMoEActivationConfig(**{field: value})

        def forward(self, x):
            out = torch.zeros(x.shape[0], x.shape[1] // 2)
            return apply_moe_activation(act, out, x, activation_config=self.cfg)

    step = torch.compile(lambda mod, x: mod(x), fullgraph=True, backend="aot_eager")
    x = torch.randn(6, 16, generator=gen)
    for value in values:
        mod = Act(value)
        assert torch.equal(step(mod, x), mod(x))
    mod = Act(values[0])  # dynamic=True: the module's floats symbolic from the first trace
    dyn = torch.compile(lambda x: mod(x), fullgraph=True, dynamic=True, backend="aot_eager")
    assert torch.equal(dyn(x), mod(x))
