"""`ExpertParallel` end to end on R in-process ranks (spec 04): the orchestrator's real code path.

Each rank is a thread running its own `ExpertParallel` over an `InProcessTransport`; the local
"experts" multiply expert e's rows by scale[e] (rows past counts / valid_tokens are NaN and must
never be read), and every persistent buffer starts poisoned. Both modes, graph-safe (own chunk
kept home or not) and exact splits, fp8 wire, idle ranks, garbage and repeated ids, on the torch
path and on the Triton kernels (interpreted on CPU; compiled on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from helpers import fp8_dequant_reference, fp8_reference, rel_err
from test_ep_kernels import geometry, owner_table, random_ids

from padded_moe import distributed as D
from padded_moe.ep import InProcessWorld, tiles
from padded_moe.expert_map import ExpertMap

# Every buffer poisoned before the first call: nothing may depend on its initial contents.
POISON = {"dispatch_send": 0xFF, "dispatch_recv": 0xFF, "token_rows": -2, "chunk_counts": -4, "route_counts": -9,
          "rb_x": float("nan"), "rb_topk_ids": 5, "rb_topk_weights": float("nan"), "rb_counts": 99,
          "slot_rows": 3, "slot_weights": float("nan")}


@pytest.fixture
def triton_on(monkeypatch):
    """Run the stage functions' Triton implementations (interpreted on CPU)."""
    from padded_moe._platform import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("Triton kernels were compiled for a GPU; the interpreter is not in use")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def round_trip(geo, owner, placement, mode, graph_safe, hiddens, ids, weights, scale, keep_own=None, put=False,
               calls=1):
    """R ranks of `ExpertParallel` (one thread each, `InProcessTransport`): dispatch, experts
    (expert e multiplies its rows by scale[e]; rows past counts / valid NaN), combine. `keep_own`
    (default: graph_safe) keeps each rank's own chunk out of the exchange. Returns each rank's
    output; runs on the inputs' device. `put`: the put transport's in-process double (its kernels
    write into the other ranks' tensors); `calls` > 1 repeats the round trip (the last output)."""
    R, T, E, K, k = geo.ep_size, geo.max_tokens, geo.num_experts, geo.wire.hidden_size, geo.wire.top_k
    dtype, rows, dev = geo.wire.dtype, geo.rows, hiddens[0].device
    keep_own = (graph_safe and not put) if keep_own is None else keep_own
    if not torch.equal(owner, D.ExpertParallel._owner_table(E, R, placement)):
        raise ValueError("owner must be the placement's owner table")
    scale = scale.to(dev)

    def rank_fn(rank, transport):
        ep = D.ExpertParallel(None, E, k, K, T, mode=mode, placement=placement, dtype=dtype, graph_safe=graph_safe,
                              dispatch_dtype=torch.float8_e4m3fn if geo.wire.fp8 else None, device=dev,
                              transport=transport, keep_own_chunk=keep_own)
        for name, t in ep.buffers().items():
            if name in POISON:
                t.fill_(POISON[name])
        # Every rank poisoned before any rank dispatches: a put transport's first call writes into
        # the other ranks' receive rows, which a later poisoning would overwrite.
        transport.world._sync()
        for _ in range(calls):
            out = one_call(ep, rank)
        if ep._keeps_own_chunk != keep_own:
            raise AssertionError(f"rank {rank}: own chunk kept {ep._keeps_own_chunk}, asked {keep_own}")
        return out

    def one_call(ep, rank):
        rb, handle = ep.dispatch(hiddens[rank], ids[rank], weights[rank])
        if mode == "flat":
            v = int(rb.valid_tokens)
            y = torch.full((rows, K), float("nan"), dtype=dtype, device=dev)
            g = rb.topk_ids[:v].long()
            keep = g >= 0
            f = torch.where(keep, rb.topk_weights[:v].double() * scale[g.clamp(min=0)],
                            torch.zeros((), dtype=torch.float64, device=dev))
            y[:v] = (rb.x[:v].double() * f.sum(1, keepdim=True)).to(dtype)
        else:
            sc = scale[ep.expert_map.local_experts.to(dev)]
            y = torch.full_like(rb.x, float("nan"))
            for e in range(ep.num_local):
                c = int(rb.counts[e])
                y[e, :c] = (rb.x[e, :c].double() * float(sc[e])).to(dtype)
        return ep.combine(y, handle)

    return InProcessWorld(R, dev, put=put).run(rank_fn)


def check_round_trip(outs, hiddens, ids, weights, scale, wire):
    """Each rank's output against the float64 reference of `round_trip`'s experts (expert e scales
    its rows by scale[e]; fp8 wire: the inputs rounded as the wire rounds them)."""
    E = scale.shape[0]
    for s, (out, h) in enumerate(zip(outs, hiddens)):
        m, K = h.shape
        x = h.float()
        if wire == "fp8":
            q, sc = fp8_reference(x)
            x = fp8_dequant_reference(q, sc, torch.float32)
        g = ids[s]
        ok = (g >= 0) & (g < E)
        f = torch.where(ok, weights[s].double() * scale[g.clamp(0, E - 1)], torch.zeros((), dtype=torch.float64))
        ref = x.double() * f.sum(1, keepdim=True)
        assert out.shape == (m, K)
        if m:
            # rel_err: a rank whose ids are all invalid has a zero reference (its output must be 0).
            err = rel_err(out, ref)
            tol = 1e-6 if h.dtype == torch.float32 else 2e-2
            assert err <= tol, (s, err)


@pytest.mark.parametrize("mode", ["flat", "batched"])
@pytest.mark.parametrize("graph_safe,keep_own", [(True, True), (True, False), (False, False)],
                         ids=["graph_safe_own_kept", "graph_safe", "exact"])
@pytest.mark.parametrize("wire,ms,routing", [("f32", (5, 0, 7), "random"), ("bf16", (6, 6, 6), "last_rank"),
                                             ("fp8", (4, 6, 2), "duplicate"), ("bf16", (0, 0, 0), "random")],
                         ids=str)
def test_round_trip_matches_reference(cpu_path, gen, mode, graph_safe, keep_own, wire, ms, routing):
    R, T, E, k = 3, 7, 10, 3
    K = 256 if wire == "fp8" else 40
    dtype = torch.bfloat16 if wire in ("bf16", "fp8") else torch.float32
    placement = "round_robin" if routing == "duplicate" else "linear"
    geo = geometry(R, T, E, K, k, dtype, wire == "fp8")
    owner = owner_table(E, R, placement)
    only = ExpertMap(E, R - 1, R, placement).local_experts if routing == "last_rank" else None
    hiddens = [torch.randn(m, K, generator=gen).to(dtype) for m in ms]
    ids = [random_ids(gen, m, E, k, dup=routing == "duplicate", only=only) for m in ms]
    weights = [torch.rand(m, k, generator=gen) + 0.1 for m in ms]
    scale = torch.rand(E, generator=gen, dtype=torch.float64) + 0.5
    outs = round_trip(geo, owner, placement, mode, graph_safe, hiddens, ids, weights, scale, keep_own)
    check_round_trip(outs, hiddens, ids, weights, scale, wire)


@pytest.mark.parametrize("mode", ["flat", "batched"])
@pytest.mark.parametrize("wire,ms", [("f32", (5, 0, 7)), ("fp8", (4, 6, 2)), ("bf16", (0, 0, 0))], ids=str)
@pytest.mark.parametrize("calls", [1, 3])
def test_put_transport_round_trip_matches_reference(triton_on, gen, mode, wire, ms, calls):
    """The put transport's kernels (pack and combine writing into the other ranks' rows through
    the destination tables, the epoch handshake) on 3 in-process ranks, the first call on poisoned
    buffers and the third on the same buffers: each equals the float64 reference, an idle rank and
    all-idle included."""
    R, T, E, k = 3, 7, 10, 3
    K = 256 if wire == "fp8" else 40
    dtype = torch.bfloat16 if wire in ("bf16", "fp8") else torch.float32
    geo = geometry(R, T, E, K, k, dtype, wire == "fp8")
    owner = owner_table(E, R)
    hiddens = [torch.randn(m, K, generator=gen).to(dtype) for m in ms]
    ids = [random_ids(gen, m, E, k, dup=True) for m in ms]
    weights = [torch.rand(m, k, generator=gen) + 0.1 for m in ms]
    scale = torch.rand(E, generator=gen, dtype=torch.float64) + 0.5
    outs = round_trip(geo, owner, "linear", mode, True, hiddens, ids, weights, scale, put=True, calls=calls)
    check_round_trip(outs, hiddens, ids, weights, scale, wire)


def test_put_transport_needs_the_kernels(gen, monkeypatch):
    """On the torch path (no Triton kernels) a put transport is refused with NotImplementedError,
    never run through code that would ignore its destinations."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    R, T, E, k, K = 2, 4, 6, 2, 16
    geo = geometry(R, T, E, K, k)
    ms = (3, 2)
    with pytest.raises(NotImplementedError, match="Triton path"):
        round_trip(geo, owner_table(E, R), "linear", "flat", True, [torch.randn(m, K, generator=gen) for m in ms],
                   [random_ids(gen, m, E, k) for m in ms], [torch.rand(m, k, generator=gen) for m in ms],
                   torch.ones(E, dtype=torch.float64), put=True)


@pytest.mark.parametrize("mode", ["flat", "batched"])
def test_round_trip_with_capped_grids(triton_on, gen, monkeypatch, mode):
    """The kernels that overlap the all_to_all (local_batched / local_flat, the own chunk's
    combine) run on a grid capped below the machine and loop over the row blocks: with 2
    programs for 3-4 blocks the round trip still equals the reference."""
    monkeypatch.setattr(tiles, "_capped_grid", lambda device, rows, k_programs=1: min(rows, 2))
    R, T, E, k, K = 2, 40, 12, 3, 32
    geo = geometry(R, T, E, K, k)
    owner = owner_table(E, R)
    ms = (40, 33)
    hiddens = [torch.randn(m, K, generator=gen) for m in ms]
    ids = [random_ids(gen, m, E, k, dup=True) for m in ms]
    weights = [torch.rand(m, k, generator=gen) + 0.1 for m in ms]
    scale = torch.rand(E, generator=gen, dtype=torch.float64) + 0.5
    outs = round_trip(geo, owner, "linear", mode, True, hiddens, ids, weights, scale)
    for s, m in enumerate(ms):
        g = ids[s]
        ok = (g >= 0) & (g < E)
        f = torch.where(ok, weights[s].double() * scale[g.clamp(0, E - 1)], torch.zeros((), dtype=torch.float64))
        ref = hiddens[s].double() * f.sum(1, keepdim=True)
        assert torch.allclose(outs[s].double(), ref, rtol=1e-5, atol=1e-5), s




# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["flat", "batched"])
@pytest.mark.parametrize("graph_safe", [True, False], ids=["graph_safe", "exact"])
@pytest.mark.parametrize("wire,K", [("f32", 4096), ("bf16", 4096), ("fp8", 4096), ("fp8", 200),
                                    ("bf16", 200)])
def test_round_trip_cuda_equals_torch_path(monkeypatch, mode, graph_safe, wire, K):
    """dsv4-like routing (E=256, k=6) on one GPU through the compiled kernels equals the CPU torch
    path (to float32 / one bf16 rounding: the GPU may fuse multiply-adds)."""
    R, T, E, k = 2, 40, 256, 6
    dtype = torch.float32 if wire == "f32" else torch.bfloat16
    geo = geometry(R, T, E, K, k, dtype, wire == "fp8")
    gen = torch.Generator().manual_seed(K + T)
    owner = owner_table(E, R)
    ms = (T, 17)
    hiddens = [torch.randn(m, K, generator=gen).to(dtype) for m in ms]
    ids = [random_ids(gen, m, E, k, garbage=0.05, dup=(i == 1)) for i, m in enumerate(ms)]
    weights = [torch.rand(m, k, generator=gen) + 0.1 for m in ms]
    scale = torch.rand(E, generator=gen, dtype=torch.float64) + 0.5
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cpu = round_trip(geo, owner, "linear", mode, graph_safe, hiddens, ids, weights, scale)
    cuda = lambda ts: [t.cuda() for t in ts]  # noqa: E731
    gpu = round_trip(geo, owner, "linear", mode, graph_safe, cuda(hiddens), cuda(ids), cuda(weights), scale)
    for a, b in zip(cpu, gpu):
        b = b.cpu()
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol), (a - b).abs().max()


