"""Spec 03: fused_experts / batched_experts / FusedMoE against the float64 loop-over-experts oracle."""

import pytest
import torch

from helpers import SENTINEL, rel_err
from padded_moe.activation import ApplyMoEActivationConfig
from padded_moe.expert_map import ExpertMap
from padded_moe.experts import batched_experts, fused_experts
from padded_moe.layer import FusedMoE, dense_weights
from padded_moe.layouts import PermuteScratch
from padded_moe.mxfp4 import quantize_mxfp4
from padded_moe.reference.moe import activation_f64, reference_moe

K, N = 64, 32
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
LAYOUTS = ["indexed", "grouped_contiguous"]


def weights(num_local, gen, dtype, gated=True, std=0.1):
    w13 = (torch.randn(num_local, (2 if gated else 1) * N, K, generator=gen) * std).to(dtype)
    w2 = (torch.randn(num_local, K, N, generator=gen) * std).to(dtype)
    return w13, w2


def routed(M, k, E, gen):
    """Random distinct ids per token plus softmax-ish weights."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    w = torch.rand(M, k, generator=gen)
    return w / w.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_experts_matches_reference(cpu_path, layout, dtype, gen):
    M, k, E = 19, 3, 6
    x = torch.randn(M, K, generator=gen).to(dtype)
    w13, w2 = weights(E, gen, dtype)
    tw, ids = routed(M, k, E, gen)
    ids[2, 1] = -1  # padding slot
    ids[5, 0] = E  # out of range
    ids[7] = torch.tensor([-1, 2**31 - 1, -(2**31)], dtype=torch.int32)  # a token with nothing kept
    out = fused_experts(x, w13, w2, tw, ids, activation="silu", layout=layout)
    ref = reference_moe(x, w13, w2, tw, ids, activation="silu")
    assert rel_err(out, ref) <= TOL[dtype]
    assert (out[7] == 0).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_map_and_valid_tokens(cpu_path, layout, gen):
    """The flat receive buffer of EP: global ids, -1 for other ranks, garbage past valid_tokens."""
    M, k, E = 24, 4, 8
    emap = ExpertMap(E, ep_rank=1, ep_size=2)
    L = emap.num_local
    x = torch.randn(M, K, generator=gen)
    w13, w2 = weights(L, gen, torch.float32)
    tw, ids = routed(M, k, E, gen)
    valid = 15
    ids[valid:] = torch.randint(-3, E + 3, (M - valid, k), generator=gen, dtype=torch.int32)
    x[valid:] = float("nan")
    out = torch.full((M, K), SENTINEL)
    out = fused_experts(x, w13, w2, tw, ids, activation="silu", expert_map=emap, layout=layout,
                        valid_tokens=torch.tensor([valid], dtype=torch.int32))
    ref = reference_moe(x, w13, w2, tw, ids, activation="silu", expert_map=emap.map, num_experts=E,
                        valid_tokens=valid)
    assert rel_err(out[:valid], ref[:valid]) <= TOL[torch.float32]


def test_expected_m_sizes_the_contiguous_tiles_not_the_rows(cpu_path, gen, monkeypatch):
    """A flat receive buffer with room for far more tokens than it holds: `expected_m` reaches the
    GEMMs as the expected rows per expert (at most the buffer's mean), every valid row is still
    computed, and the outputs equal the call without the hint."""
    from padded_moe import experts as ex

    M, k, E, valid = 40, 4, 8, 6
    emap = ExpertMap(E, ep_rank=0, ep_size=2)
    x = torch.randn(M, K, generator=gen)
    w13, w2 = weights(emap.num_local, gen, torch.float32)
    tw, ids = routed(M, k, E, gen)
    ids[valid:] = -1
    x[valid:] = float("nan")
    vt = torch.tensor([valid], dtype=torch.int32)
    seen, gemm = [], ex.expert_gemm
    monkeypatch.setattr(ex, "expert_gemm", lambda a, w, meta, **kw: (seen.append(meta.rows_per_expert()),
                                                                      gemm(a, w, meta, **kw))[1])
    outs = [fused_experts(x, w13, w2, tw, ids, activation="silu", expert_map=emap, valid_tokens=vt,
                          expected_m=m)[:valid] for m in (None, 3, 1000)]
    assert seen == [40.0, 40.0, 3.0, 3.0, 40.0, 40.0]  # M*k / L = 40: the hint is capped there
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
    ref = reference_moe(x, w13, w2, tw, ids, activation="silu", expert_map=emap.map, num_experts=E, valid_tokens=valid)
    assert rel_err(outs[0], ref[:valid]) <= TOL[torch.float32]


def test_expected_m_is_checked(gen):
    """`expected_m`: an int >= 0, on the grouped layouts; INDEXED (the default without an expert
    map) refuses it by name, and so does build_layout."""
    from padded_moe.layouts import GemmLayout, build_layout

    x = torch.randn(4, K, generator=gen)
    w13, w2 = weights(4, gen, torch.float32)
    tw, ids = routed(4, 2, 4, gen)
    for bad, err in ((2.5, TypeError), (False, TypeError), (-3, ValueError)):
        with pytest.raises(err, match="expected_m"):
            fused_experts(x, w13, w2, tw, ids, activation="silu", layout="grouped_contiguous", expected_m=bad)
    with pytest.raises(ValueError, match="grouped_contiguous"):
        fused_experts(x, w13, w2, tw, ids, activation="silu", expected_m=2)
    with pytest.raises(ValueError, match="INDEXED"):
        build_layout(GemmLayout.INDEXED, ids, 4, expected_m=2)
    assert build_layout(GemmLayout.GROUPED_CONTIGUOUS, ids, 4, expected_m=1).rows_per_expert() == 1.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_map_from_a_vllm_table(cpu_path, layout, gen):
    """A placement neither linear nor round-robin (a load-balanced vLLM table): local expert l holds
    the weights of the global expert whose table entry is l."""
    M, k, E = 21, 3, 8
    table = torch.tensor([2, -1, -1, 0, 3, -1, 1, -1], dtype=torch.int32)
    emap = ExpertMap.from_table(table)
    x = torch.randn(M, K, generator=gen)
    w13, w2 = weights(emap.num_local, gen, torch.float32)
    tw, ids = routed(M, k, E, gen)
    ids[4, 0] = E + 5
    out = fused_experts(x, w13, w2, tw, ids, activation="silu", expert_map=emap, layout=layout)
    # The float64 loop reads the table itself (not the ExpertMap built from it).
    ref = reference_moe(x, w13, w2, tw, ids, activation="silu", expert_map=table, num_experts=E)
    assert rel_err(out, ref) <= TOL[torch.float32]
    # Non-vacuous: the same weights read through a linear map of the same size give another answer.
    other = fused_experts(x, w13, w2, tw, ids, activation="silu", expert_map=ExpertMap(E, 0, 2), layout=layout)
    assert rel_err(other, ref) > 0.1


@pytest.mark.parametrize("prepared", [False, True], ids=["canonical", "prepared"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_swigluoai_with_biases_and_mxfp4(cpu_path, layout, prepared, gen):
    """Interleaved swigluoai w13 [E, 2N, K] and w2 [E, K, N=32] (one padded 64-block when prepared)."""
    M, k, E = 13, 2, 4
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    w13f, w2f = weights(E, gen, torch.float32)
    q13, q2 = quantize_mxfp4(w13f), quantize_mxfp4(w2f)
    if prepared:
        q13, q2 = q13.prepare_for(), q2.prepare_for()
    b13 = (torch.randn(E, 2 * N, generator=gen) * 0.1).to(torch.bfloat16)
    b2 = (torch.randn(E, K, generator=gen) * 0.1).to(torch.bfloat16)
    tw, ids = routed(M, k, E, gen)
    out = fused_experts(x, q13, q2, tw, ids, activation="swigluoai", layout=layout, w13_bias=b13, w2_bias=b2)
    ref = reference_moe(x, dense_weights(q13), dense_weights(q2), tw, ids, activation="swigluoai",
                        w13_bias=b13, w2_bias=b2)
    assert rel_err(out, ref) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prepared_only_mxfp4_weights_give_the_same_outputs(cpu_path, layout, gen):
    """Weights that hold only their prepared form (`prepare_for(keep_canonical=False)`) give the
    bits of the same weights holding both forms: the Triton path reads the prepared form either
    way, the torch path rebuilds the canonical bytes. Also batched_experts (GROUPED_MASKED)."""
    M, k, E, n = 13, 2, 4, 64  # K and the inner width multiples of 64 (no prepared padding)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    q13 = quantize_mxfp4(torch.randn(E, 2 * n, K, generator=gen) * 0.1).prepare_for()
    q2 = quantize_mxfp4(torch.randn(E, K, n, generator=gen) * 0.1).prepare_for()
    p13, p2 = q13.prepare_for(keep_canonical=False), q2.prepare_for(keep_canonical=False)
    tw, ids = routed(M, k, E, gen)
    ids[3, 0] = -1
    x[11:] = float("nan")
    valid = torch.tensor([11], dtype=torch.int32)
    want = fused_experts(x, q13, q2, tw, ids, activation="silu", layout=layout, valid_tokens=valid)
    got = fused_experts(x, p13, p2, tw, ids, activation="silu", layout=layout, valid_tokens=valid)
    assert torch.equal(got[:11], want[:11])
    ref = reference_moe(x[:11], dense_weights(q13), dense_weights(q2), tw[:11], ids[:11], activation="silu")
    assert rel_err(got[:11], ref) <= TOL[torch.bfloat16]
    xb = torch.randn(E, 8, K, generator=gen).to(torch.bfloat16)
    counts = torch.tensor([8, 0, 3, 5], dtype=torch.int32)
    want = batched_experts(xb, counts, q13, q2, activation="silu")
    got = batched_experts(xb, counts, p13, p2, activation="silu")
    for e, c in enumerate(counts.tolist()):
        assert torch.equal(got[e, :c], want[e, :c])


def test_mxfp4_layer_holds_its_experts_once(cpu_path, gen):
    """An MXFP4 layer whose widths are multiples of 64 empties its canonical parameters after
    `prepare()` (the prepared form alone holds the experts), and behaves as one that keeps them:
    the same forward, the same `state_dict()` (the canonical bytes, rebuilt), loads, re-draws and
    `.to()`; `keep_canonical=True` keeps them filled."""
    E, n = 8, 64
    once = FusedMoE(E, 2, K, n, weight_format="mxfp4", dtype=torch.bfloat16)
    kept = FusedMoE(E, 2, K, n, weight_format="mxfp4", dtype=torch.bfloat16, keep_canonical=True)
    for layer in (once, kept):
        layer.randomize(seed=5)
    assert all(getattr(once, p).numel() == 0 for p, _ in once._mxfp4_param_shapes())
    assert all(getattr(kept, p).numel() > 0 for p, _ in kept._mxfp4_param_shapes())
    assert all(not w.holds_canonical for w in once.expert_weights())
    x = torch.randn(7, K, generator=gen).to(torch.bfloat16)
    assert torch.equal(once(x), kept(x))
    state, want = once.state_dict(), kept.state_dict()
    assert state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    # A load into an emptied layer (new weights), then back; reset_parameters and load_experts too.
    other = FusedMoE(E, 2, K, n, weight_format="mxfp4", dtype=torch.bfloat16)
    other.randomize(seed=6)
    once.load_state_dict(other.state_dict())
    assert torch.equal(once(x), other(x)) and once.w13_blocks.numel() == 0
    once.load_state_dict(want)
    assert torch.equal(once(x), kept(x))
    once.reset_parameters(seed=2)
    kept.reset_parameters(seed=2)
    assert torch.equal(once(x), kept(x)) and once.w2_scales.numel() == 0
    w13 = quantize_mxfp4(torch.randn(E, 2 * n, K, generator=gen) * 0.1)
    w2 = quantize_mxfp4(torch.randn(E, K, n, generator=gen) * 0.1)
    once.load_experts(w13.prepare_for(keep_canonical=False), w2)  # a prepared-only checkpoint too
    kept.load_experts(w13, w2)
    assert torch.equal(once(x), kept(x))
    moved = once.to("cpu", torch.float32)  # floats convert; the prepared integers travel as they are
    assert moved.w13_blocks.numel() == 0 and not moved.expert_weights()[0].holds_canonical
    kept.to(torch.float32)
    xf = x.float()
    assert torch.equal(moved(xf), kept(xf))
    # Widths the prepared form pads keep the canonical parameters (and say so).
    padded = FusedMoE(E, 2, K, 32, weight_format="mxfp4", dtype=torch.bfloat16)
    assert padded.keep_canonical and padded.w2_blocks.numel() > 0
    with pytest.raises(TypeError, match="keep_canonical must be a bool"):
        FusedMoE(E, 2, K, n, weight_format="mxfp4", keep_canonical="no")


@pytest.mark.parametrize("keep", [False, True])
def test_mxfp4_layer_keeps_its_experts_through_partial_and_refused_loads(cpu_path, keep, gen):
    """What a load does not write keeps its value, as a plain parameter's does, also where the
    prepared form alone held the experts: a partial `load_state_dict(strict=False)`, a strict one
    refused for a size mismatch, and a `load_experts` refused for a NaN in its sixth expert (named)."""
    from torch.func import functional_call

    E, n = 8, 64
    layer = FusedMoE(E, 2, K, n, weight_format="mxfp4", dtype=torch.float32, keep_canonical=keep)
    layer.randomize(seed=1)
    x = torch.randn(6, K, generator=gen)
    want = layer(x)
    res = layer.load_state_dict({"gate.weight": layer.gate.weight.detach().clone()}, strict=False)
    assert "w13_blocks" in res.missing_keys
    assert torch.equal(layer(x), want)
    small = FusedMoE(4, 2, K, n, weight_format="mxfp4", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="size mismatch"):
        layer.load_state_dict(small.state_dict())
    assert torch.equal(layer(x), want)
    w13, w2 = torch.randn(E, 2 * n, K, generator=gen), torch.randn(E, K, n, generator=gen)
    w13[5, 3, 7] = float("nan")
    with pytest.raises(ValueError, match=r"^w13 must be finite to quantize to MXFP4 \(expert 5 holds NaN"):
        layer.load_experts(w13, w2)
    with pytest.raises(TypeError, match="^w2 must have dtype in"):
        layer.load_experts(w13.nan_to_num(), w2.to(torch.int32))
    assert torch.equal(layer(x), want) and (layer.w13_blocks.numel() == 0) == (not keep)
    # Another layer's parameters for one call (torch.func): its experts, not the held prepared form
    # (read as canonical bytes, another kernel: equal up to float32 summation order).
    other = FusedMoE(E, 2, K, n, weight_format="mxfp4", dtype=torch.float32)
    other.randomize(seed=2)
    torch.testing.assert_close(functional_call(layer, other.state_dict(), (x,)), other(x), rtol=1e-5, atol=1e-6)
    assert torch.equal(layer(x), want)
    with pytest.raises(TypeError, match="expert weights are bytes"):
        layer.type(torch.float64)


def test_mxfp4_layer_redraw_does_not_rebuild_the_canonical_bytes(cpu_path, monkeypatch):
    """`randomize`, `reset_parameters` and float `load_experts` write every expert, so an emptied layer
    does not rebuild its old canonical bytes first (on a model-sized layer that transient is the whole
    layer's size)."""
    import padded_moe.mxfp4 as mx

    layer = FusedMoE(8, 2, K, 64, weight_format="mxfp4", dtype=torch.float32)
    assert layer.w13_blocks.numel() == 0

    def refuse(h):
        raise AssertionError("the canonical bytes were rebuilt")

    monkeypatch.setattr(mx, "unprepare_hopper", refuse)
    layer.randomize(seed=3)
    layer.reset_parameters(seed=4)
    gen = torch.Generator().manual_seed(0)
    layer.load_experts(torch.randn(8, 128, K, generator=gen), torch.randn(8, K, 64, generator=gen))
    assert layer.w13_blocks.numel() == 0


@pytest.mark.parametrize("act, cfg", [
    ("situ", ApplyMoEActivationConfig(situ_beta=4.0, situ_linear_beta=25.0)),
    ("silu", ApplyMoEActivationConfig(clamp_limit=0.05)),
    ("gelu_no_mul", None),
])
def test_activation_config_reaches_the_kernel(cpu_path, act, cfg, gen):
    M, k, E = 11, 2, 4
    gated = not act.endswith("_no_mul")
    x = torch.randn(M, K, generator=gen)
    w13, w2 = weights(E, gen, torch.float32, gated=gated, std=0.5)
    tw, ids = routed(M, k, E, gen)
    out = fused_experts(x, w13, w2, tw, ids, activation=act, activation_config=cfg)
    c = cfg or ApplyMoEActivationConfig()
    kw = dict(limit=c.clamp_limit, situ_beta=c.situ_beta, situ_lambda=c.situ_linear_beta)
    ref = reference_moe(x, w13, w2, tw, ids, activation=act, activation_kwargs=kw)
    assert rel_err(out, ref) <= TOL[torch.float32]


def test_scratch_reuses_every_buffer(cpu_path, gen):
    """Steady state allocates nothing: the same output storage comes back call after call."""
    M, k, E = 16, 2, 4
    w13, w2 = weights(E, gen, torch.float32)
    scratch = PermuteScratch(max_tokens=M, k=k, num_experts=E, num_local=E, device="cpu")
    pointers = set()
    for _ in range(3):
        x = torch.randn(M, K, generator=gen)
        tw, ids = routed(M, k, E, gen)
        out = fused_experts(x, w13, w2, tw, ids, activation="silu", layout="grouped_contiguous", scratch=scratch)
        ref = reference_moe(x, w13, w2, tw, ids, activation="silu")
        assert rel_err(out, ref) <= TOL[torch.float32]
        pointers.add(out.data_ptr())
    assert len(pointers) == 1


def test_batched_experts_rows_past_counts_untouched(cpu_path, gen):
    L, T = 4, 9
    counts = [0, 1, 9, 4]
    x = torch.randn(L, T, K, generator=gen)
    for e, c in enumerate(counts):
        x[e, c:] = float("nan")
    w13, w2 = weights(L, gen, torch.float32)
    out = torch.full((L, T, K), SENTINEL)
    batched_experts(x, torch.tensor(counts, dtype=torch.int32), w13, w2, activation="silu", out=out)
    for e, c in enumerate(counts):
        if c:
            h = x[e, :c].double() @ w13[e].double().T
            ref = activation_f64("silu", h) @ w2[e].double().T
            assert rel_err(out[e, :c], ref) <= TOL[torch.float32]
        assert (out[e, c:] == SENTINEL).all()


@pytest.mark.parametrize("wide", [2**31, 2**32 + 1, 2**40, 2**63 - 1])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_wide_int64_valid_tokens_mean_every_token(cpu_path, layout, wide, gen):
    """An int64 `valid_tokens` past int32 counts as M (every token), never wrapped into range by a
    narrowing before the clamp: every output row computed, equal to the call without it."""
    M, k, E = 6, 2, 4
    x = torch.randn(M, K, generator=gen)
    w13, w2 = weights(E, gen, torch.float32)
    tw, ids = routed(M, k, E, gen)
    out = fused_experts(x, w13, w2, tw, ids, activation="silu", layout=layout,
                        valid_tokens=torch.tensor([wide], dtype=torch.int64))
    assert rel_err(out, reference_moe(x, w13, w2, tw, ids, activation="silu")) <= TOL[torch.float32]


def test_batched_experts_expected_m_sizes_the_tiles_not_the_rows(cpu_path, gen, monkeypatch):
    """`expected_m` reaches the GEMMs as the slabs' expected rows (capped at T), and every count is
    still computed: the same outputs with any hint."""
    from padded_moe import experts as ex

    L, T = 3, 6
    counts = torch.tensor([6, 0, 2], dtype=torch.int32)
    x = torch.randn(L, T, K, generator=gen)
    x[2, 2:] = float("nan")
    w13, w2 = weights(L, gen, torch.float32)
    seen, gemm = [], ex.expert_gemm
    monkeypatch.setattr(ex, "expert_gemm", lambda a, w, meta, **kw: (seen.append(meta.rows_per_expert()),
                                                                      gemm(a, w, meta, **kw))[1])
    outs = [batched_experts(x, counts, w13, w2, activation="silu", out=torch.full((L, T, K), SENTINEL),
                            expected_m=m) for m in (None, 0, 1, 100)]
    assert seen == [6.0, 6.0, 0.0, 0.0, 1.0, 1.0, 6.0, 6.0]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0, atol=0)
    assert (outs[0][1] == SENTINEL).all() and (outs[0][2, 2:] == SENTINEL).all()


def test_batched_experts_expected_m_is_checked():
    x, counts = torch.randn(2, 3, K), torch.tensor([1, 2])
    w13, w2 = torch.randn(2, 2 * N, K), torch.randn(2, K, N)
    for bad, err in ((1.5, TypeError), (True, TypeError), (-1, ValueError)):
        with pytest.raises(err, match="expected_m"):
            batched_experts(x, counts, w13, w2, activation="silu", expected_m=bad)


def test_typed_errors():
    x = torch.randn(4, K)
    w13, w2 = torch.randn(2, 2 * N, K), torch.randn(2, K, N)
    ids = torch.zeros(4, 2, dtype=torch.int32)
    tw = torch.rand(4, 2)
    with pytest.raises(NotImplementedError, match="relu2_no_mul"):
        fused_experts(x, w13, w2, tw, ids, activation="relu2")
    with pytest.raises(ValueError, match="w2 must have shape"):
        fused_experts(x, w13, torch.randn(2, K, N + 1), tw, ids, activation="silu")
    with pytest.raises(TypeError, match="topk_ids"):
        fused_experts(x, w13, w2, tw, ids.float(), activation="silu")
    with pytest.raises(ValueError, match="topk_weights"):
        fused_experts(x, w13, w2, tw[:, :1], ids, activation="silu")
    with pytest.raises(ValueError, match="grouped_masked"):
        fused_experts(x, w13, w2, tw, ids, activation="silu", layout="grouped_masked")
    with pytest.raises(ValueError, match="counts"):
        batched_experts(torch.randn(2, 3, K), torch.tensor([1, 2, 3]), w13, w2, activation="silu")


# ----- the layer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("router", ["softmax", "softmax_renorm", "topk_softmax", "biased_sigmoid",
                                    "biased_sqrtsoftplus"])
def test_layer_matches_reference(cpu_path, router, gen):
    scale = 1.5 if router.startswith("biased_") else 1.0  # only the biased routers take a factor
    layer = FusedMoE(8, 2, K, N, router=router, routed_scaling_factor=scale, dtype=torch.float32)
    layer.randomize(int(torch.randint(0, 2**31, (1,), generator=gen)), std=0.1)
    x = torch.randn(3, 5, K, generator=gen)
    out = layer(x)
    assert out.shape == x.shape
    tw, ids = layer.route(layer.gate(x.reshape(-1, K)))
    ref = reference_moe(x.reshape(-1, K), layer.w13, layer.w2, tw, ids, activation="silu")
    assert rel_err(out.reshape(-1, K), ref) <= TOL[torch.float32]


@pytest.mark.parametrize("router", ["biased_sigmoid", "biased_sqrtsoftplus"])
def test_layer_with_expert_groups(cpu_path, router, gen):
    """DeepSeek-V3's group-limited selection in the layer: every chosen expert lies in one of the
    token's `topk_groups` best groups (by the sum of their two best biased scores), and the output
    equals the reference on the routing `biased_grouped_topk` gives."""
    from padded_moe import routing

    E, groups, kept = 16, 4, 2
    layer = FusedMoE(E, 3, K, N, router=router, num_groups=groups, topk_groups=kept, dtype=torch.float32)
    layer.randomize(int(torch.randint(0, 2**31, (1,), generator=gen)), std=0.1)
    layer.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.1)
    x = torch.randn(7, K, generator=gen)
    logits = layer.gate(x)
    tw, ids = layer.route(logits)
    scoring = "sigmoid" if router == "biased_sigmoid" else "sqrtsoftplus"
    want = routing.biased_grouped_topk(logits, layer.e_score_correction_bias, 3, num_groups=groups,
                                       topk_groups=kept, scoring=scoring)
    assert torch.equal(ids, want[1]) and torch.equal(tw, want[0])
    # Independent of the library's mask: the best groups by hand, per token.
    choice = routing._scores(logits.float(), scoring) + layer.e_score_correction_bias
    group_score = choice.view(7, groups, E // groups).topk(2, dim=-1).values.sum(-1)
    best = group_score.topk(kept, dim=-1).indices
    for t in range(7):
        assert set((ids[t] // (E // groups)).tolist()) <= set(best[t].tolist())
    ref = reference_moe(x, layer.w13, layer.w2, tw, ids, activation="silu")
    assert rel_err(layer(x), ref) <= TOL[torch.float32]
    flat = FusedMoE(E, 3, K, N, router=router, dtype=torch.float32)
    assert (flat.num_groups, flat.topk_groups) == (1, 1)


def test_layer_shared_experts_and_mxfp4(cpu_path, gen):
    shared = torch.nn.Linear(K, K, bias=False)
    layer = FusedMoE(8, 2, K, N, weight_format="mxfp4", shared_experts=shared, dtype=torch.float32)
    layer.randomize(int(torch.randint(0, 2**31, (1,), generator=gen)), std=0.1)
    x = torch.randn(6, K, generator=gen)
    tw, ids = layer.route(layer.gate(x))
    w13, w2 = layer.expert_weights()
    ref = reference_moe(x, dense_weights(w13), dense_weights(w2), tw, ids, activation="silu") + shared(x).double()
    assert rel_err(layer(x), ref) <= TOL[torch.float32]


@pytest.mark.parametrize("count", [0, 4, 9, 12, -3])
@pytest.mark.parametrize("count_dtype", [torch.int32, torch.int64], ids=str)
def test_layer_valid_tokens_computes_only_the_real_rows(cpu_path, count, count_dtype, gen, monkeypatch):
    """forward(valid_tokens=) on a padded batch (padded rows NaN, through the router too) equals the
    reference on the real rows, and the count reaches fused_experts (which never computes past it)."""
    import padded_moe.layer as layer_module

    M = 9
    layer = FusedMoE(8, 2, K, N, dtype=torch.float32)
    layer.randomize(int(torch.randint(0, 2**31, (1,), generator=gen)), std=0.1)
    real = min(max(count, 0), M)
    x = torch.randn(M, K, generator=gen)
    x[real:] = float("nan")
    seen, fused = [], layer_module.fused_experts

    def spy(*args, **kwargs):
        seen.append(kwargs.get("valid_tokens"))
        return fused(*args, **kwargs)

    monkeypatch.setattr(layer_module, "fused_experts", spy)
    out = layer(x, valid_tokens=torch.tensor([count], dtype=count_dtype))
    assert out.shape == x.shape
    assert len(seen) == 1 and seen[0] is not None and int(seen[0]) == count
    if real:
        tw, ids = layer.route(layer.gate(x[:real]))
        ref = reference_moe(x[:real], layer.w13, layer.w2, tw, ids, activation="silu")
        assert rel_err(out[:real], ref) <= TOL[torch.float32]


def test_mxfp4_layer_holds_mxfp4_parameters_only():
    """An MXFP4 layer's expert weights are its uint8 parameters (canonical MXFP4) and their
    prepared arrangement; no float copy. Its initial and random weights are the bf16 layer's, quantized."""
    mx = FusedMoE(8, 2, K, N, weight_format="mxfp4", dtype=torch.bfloat16)
    ref = FusedMoE(8, 2, K, N, dtype=torch.bfloat16)
    names = {n for n, _ in mx.named_parameters()}
    assert {"w13_blocks", "w13_scales", "w2_blocks", "w2_scales"} <= names and not {"w13", "w2"} & names
    assert all(p.dtype == torch.uint8 for n, p in mx.named_parameters() if n.startswith(("w13", "w2")))
    for seed_fn in (lambda m: m.reset_parameters(seed=3), lambda m: m.randomize(seed=4)):
        seed_fn(mx)
        seed_fn(ref)
        for got, w in zip(mx.expert_weights(), (ref.w13, ref.w2)):
            want = quantize_mxfp4(w)
            assert torch.equal(got.blocks, want.blocks) and torch.equal(got.scales, want.scales)
            assert got.hopper is not None


def test_mxfp4_layer_loads_checkpoint_bytes_and_float_weights(cpu_path, gen):
    """`load_experts` keeps an `Mxfp4Tensor`'s bytes as they are and quantizes float weights per
    expert; the forward reads them (against the float64 reference of the dequantized weights)."""
    E = 8
    w13 = torch.randn(E, 2 * N, K, generator=gen) * 0.1
    w2 = torch.randn(E, K, N, generator=gen) * 0.1
    q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    layer = FusedMoE(E, 2, K, N, weight_format="mxfp4", dtype=torch.float32)
    layer.load_experts(q13, q2)
    assert torch.equal(layer.w13_blocks, q13.blocks) and torch.equal(layer.w2_scales, q2.scales)
    x = torch.randn(6, K, generator=gen)
    tw, ids = layer.route(layer.gate(x))
    ref = reference_moe(x, dense_weights(q13), dense_weights(q2), tw, ids, activation="silu")
    assert rel_err(layer(x), ref) <= TOL[torch.float32]
    other = FusedMoE(E, 2, K, N, weight_format="mxfp4", dtype=torch.float32)
    other.load_experts(w13, w2)
    for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"):
        assert torch.equal(getattr(other, name), getattr(layer, name)), name


def test_mxfp4_weights_need_an_mxfp4_layer_and_whole_scale_groups():
    q = quantize_mxfp4(torch.randn(8, 2 * N, K))
    with pytest.raises(TypeError, match="w13 is an Mxfp4Tensor.*weight_format='mxfp4'"):
        FusedMoE(8, 2, K, N, dtype=torch.float32).load_experts(q, torch.zeros(8, K, N))
    with pytest.raises(ValueError, match="hidden_size to be a multiple of 32"):
        FusedMoE(8, 2, 48, 32, weight_format="mxfp4")
    with pytest.raises(ValueError, match="intermediate_size to be a multiple of 32"):
        FusedMoE(8, 2, 64, 40, weight_format="mxfp4")


def test_layer_rejects_bad_configuration():
    with pytest.raises(ValueError, match="weight_format"):
        FusedMoE(8, 2, K, N, weight_format="int4")
    with pytest.raises(ValueError, match="router"):
        FusedMoE(8, 2, K, N, router="random")
    with pytest.raises(ValueError, match="top_k"):
        FusedMoE(8, 9, K, N)
    with pytest.raises(NotImplementedError):
        FusedMoE(8, 2, K, N, activation="relu2")
