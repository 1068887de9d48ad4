"""The transport layer of `padded_moe.ep` (spec 04): selection, the buffer description both
transports allocate from, the planner's numbers against the bytes each allocates, and the
in-process double's exchanges."""

from __future__ import annotations

import pytest
import torch

from padded_moe import planner
from padded_moe.distributed import ExpertParallel
from padded_moe.ep import InProcessWorld, transport_names
from padded_moe.ep.transport import reuse_storage, separate_storage, storage_plan
from padded_moe.ep.wire import EPGeometry, WireFormat, ep_buffer_specs

SHAPES = dict(num_experts=10, top_k=3, hidden_size=32, intermediate_size=16)
E, TOPK, K = SHAPES["num_experts"], SHAPES["top_k"], SHAPES["hidden_size"]


def test_registry_names_the_transports():
    assert set(transport_names()) >= {"nccl", "inprocess"}


def test_default_and_named_transport(one_rank_group):
    assert ExpertParallel(None, E, TOPK, K, 4, dtype=torch.float32).transport_name == "nccl"
    assert ExpertParallel(None, E, TOPK, K, 4, dtype=torch.float32, transport="nccl").transport_name == "nccl"


@pytest.mark.parametrize("bad", ["nope", "NCCL", 3, object()])
def test_bad_transport_is_a_value_error_naming_the_choices(bad):
    with pytest.raises(ValueError, match="transport must be one of") as info:
        ExpertParallel(None, E, TOPK, K, 4, dtype=torch.float32, transport=bad)
    for name in transport_names():
        assert name in str(info.value)


def test_inprocess_by_name_needs_its_world():
    with pytest.raises(ValueError, match="InProcessWorld"):
        ExpertParallel(None, E, TOPK, K, 4, dtype=torch.float32, transport="inprocess")


def test_rank_and_size_come_from_the_transport():
    """No process group: the in-process transport numbers the ranks."""
    world = InProcessWorld(3)
    got = world.run(lambda rank, tr: (ExpertParallel(None, E, TOPK, K, 4, dtype=torch.float32, transport=tr)))
    assert [(ep.ep_rank, ep.rank, ep.ep_size, ep.transport_name) for ep in got] == \
        [(r, r, 3, "inprocess") for r in range(3)]
    assert [ep.expert_map.ep_rank for ep in got] == [0, 1, 2]


def test_keep_own_chunk_argument():
    world = InProcessWorld(1)
    tr = world.transport(0)
    with pytest.raises(ValueError, match="graph_safe"):
        ExpertParallel(None, E, TOPK, K, 4, dtype=torch.float32, transport=tr, graph_safe=False, keep_own_chunk=True)
    with pytest.raises(TypeError, match="keep_own_chunk"):
        ExpertParallel(None, E, TOPK, K, 4, dtype=torch.float32, transport=tr, keep_own_chunk="yes")


# ---------------------------------------------------------------------------------------- buffers
@pytest.mark.parametrize("mode", ["flat", "batched"])
def test_allocated_buffers_follow_the_description(mode):
    """Every buffer has its description's shape and dtype; the combine rows reuse the dispatch
    rows' storage (the collective transports' policy), so the description's bytes of the two add
    up to more than what is allocated."""
    ep = InProcessWorld(1).run(lambda rank, tr: ExpertParallel(None, E, TOPK, K, 6, mode=mode, dtype=torch.float32,
                                                               transport=tr))[0]
    specs = ep.buffer_specs()
    bufs = ep.buffers()
    assert set(bufs) == {s.name for s in specs}
    for s in specs:
        assert tuple(bufs[s.name].shape) == s.shape and bufs[s.name].dtype == s.dtype, s.name
    assert bufs["combine_send"].untyped_storage().data_ptr() == bufs["dispatch_send"].untyped_storage().data_ptr()
    assert bufs["combine_recv"].untyped_storage().data_ptr() == bufs["dispatch_recv"].untyped_storage().data_ptr()
    assert ep.buffer_bytes() == sum(st.nbytes for st in storage_plan("inprocess", specs))
    assert ep.buffer_bytes() < sum(s.nbytes for s in specs)


def test_storage_policies():
    specs = ep_buffer_specs(EPGeometry(2, 4, E, WireFormat(K, TOPK, torch.bfloat16, True)), "flat", 5)
    assert sum(st.nbytes for st in separate_storage(specs)) == sum(s.nbytes for s in specs)
    shared = {st.name: st for st in reuse_storage(specs)}
    assert shared["dispatch_send"].buffers == ("dispatch_send", "combine_send")
    by = {s.name: s for s in specs}
    assert shared["dispatch_send"].nbytes == max(by["dispatch_send"].nbytes, by["combine_send"].nbytes)
    assert all(st.exchanged == (st.name in ("dispatch_send", "dispatch_recv")) for st in shared.values())


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_wire", "fp8_wire"])
@pytest.mark.parametrize("mode", ["flat", "batched"])
def test_planner_equals_bytes_allocated_by_each_transport(one_rank_group, mode, fp8):
    """`plan(..., transport=name)` reports exactly `ExpertParallel.buffer_bytes()` of that transport:
    nccl (gloo, one rank) and inprocess (3 ranks; rank 0 is the busiest under linear placement)."""
    kw = dict(mode=mode, dtype=torch.bfloat16, dispatch_dtype=torch.float8_e4m3fn if fp8 else None)
    T = 6
    ep = ExpertParallel(None, E, TOPK, K, T, **kw)
    pl = planner.plan(SHAPES, 1, T, 1000.0, mode=mode, dtype=torch.bfloat16, dispatch_dtype=kw["dispatch_dtype"],
                      transport="nccl")
    assert pl.transport == "nccl" and pl.bytes_of("ep") == ep.buffer_bytes()
    R = 3
    eps = InProcessWorld(R).run(lambda rank, tr: ExpertParallel(None, E, TOPK, K, T, transport=tr, **kw))
    pl = planner.plan(SHAPES, R, T, 1000.0, mode=mode, dtype=torch.bfloat16, dispatch_dtype=kw["dispatch_dtype"],
                      transport="inprocess")
    assert pl.transport == "inprocess" and pl.bytes_of("ep") == eps[0].buffer_bytes()
    assert all(e.buffer_bytes() <= eps[0].buffer_bytes() for e in eps)


def test_plan_names_the_transport(capsys):
    import argparse
    import json

    parser = argparse.ArgumentParser()
    planner.add_arguments(parser)
    assert planner.run_cli(parser.parse_args(["--preset", "tiny", "--json"])) == 0
    assert json.loads(capsys.readouterr().out)["transport"] == "nccl"
    assert planner.run_cli(parser.parse_args(["--preset", "tiny", "--transport", "inprocess"])) == 0
    assert "inprocess transport" in capsys.readouterr().out
    with pytest.raises(ValueError, match="transport must be one of"):
        planner.plan("tiny", 2, 16, 10.0, transport="nope")


# ---------------------------------------------------------------------------------------- in-process
def test_inprocess_exchanges():
    """Fixed chunks (own chunk skipped or not), exact splits and counts, between 3 threads."""
    R, T = 3, 2

    def fn(rank, tr):
        send = torch.arange(R * T, dtype=torch.float32).view(R * T, 1) + 100 * rank
        recv = torch.full((R * T, 1), -1.0)
        tr.exchange("dispatch", send, recv)
        fixed = recv.clone()
        recv.fill_(-1.0)
        tr.exchange("combine", send, recv, skip_own=True)
        skipped = recv.clone()
        counts = torch.tensor([(rank + d) % 2 + 1 for d in range(R)])
        got = tr.exchange_counts(counts)
        recv.fill_(-1.0)
        sc = counts.tolist()
        tr.exchange("dispatch", send, recv, send_counts=sc, recv_counts=got.tolist())
        return fixed, skipped, got, recv.clone(), sc

    out = InProcessWorld(R).run(fn)
    for r, (fixed, skipped, got, exact, _) in enumerate(out):
        for s in range(R):
            want = torch.arange(r * T, (r + 1) * T, dtype=torch.float32) + 100 * s
            assert torch.equal(fixed[s * T:(s + 1) * T, 0], want)
            assert torch.equal(skipped[s * T:(s + 1) * T, 0], want if s != r else torch.full((T,), -1.0))
        assert got.tolist() == [out[s][4][r] for s in range(R)]
        off = 0
        for s in range(R):
            n, start = out[s][4][r], sum(out[s][4][:r])
            want = torch.arange(start, start + n, dtype=torch.float32) + 100 * s
            assert torch.equal(exact[off:off + n, 0], want)
            off += n
        assert (exact[off:, 0] == -1).all()


def test_inprocess_errors_propagate_without_hanging():
    def fn(rank, tr):
        if rank == 1:
            raise KeyError("rank 1 failed")
        tr.exchange_counts(torch.zeros(2, dtype=torch.int64))

    with pytest.raises(KeyError, match="rank 1 failed"):
        InProcessWorld(2).run(fn, timeout=30)


def test_inprocess_argument_errors():
    with pytest.raises(ValueError, match="size"):
        InProcessWorld(0)
    with pytest.raises(ValueError, match="rank"):
        InProcessWorld(2).transport(2)
    tr = InProcessWorld(1).transport(0)
    with pytest.raises(ValueError, match="stage"):
        tr.exchange("gather", torch.zeros(2, 1), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="send_counts"):
        tr.exchange("dispatch", torch.zeros(2, 1), torch.zeros(2, 1), send_counts=[1])


def test_symm_mem_is_registered_and_refused_off_cuda(one_rank_group):
    """The put transport needs an NCCL group on CUDA: on gloo it is a ValueError that names the
    alternative, and the default stays the collectives."""
    assert "symm_mem" in transport_names()
    with pytest.raises(ValueError, match="transport='nccl'"):
        ExpertParallel(None, E, TOPK, K, 4, dtype=torch.float32, transport="symm_mem")
    assert ExpertParallel(None, E, TOPK, K, 4, dtype=torch.float32).transport_name == "nccl"


@pytest.mark.parametrize("mode", ["flat", "batched"])
def test_planner_sizes_the_put_transport_from_the_description(mode):
    """symm_mem: one symmetric allocation of both directions' receive rows (each on a 256-byte
    boundary) plus 256 bytes of flags, no send rows; every other buffer as described. Counted here
    from the description's shapes. (The GPU test checks it against the bytes really allocated.)"""
    R, T = 2, 6
    geo = EPGeometry(R, T, E, WireFormat(K, TOPK, torch.bfloat16, False))
    specs = ep_buffer_specs(geo, mode, E // R)
    by = {s.name: s for s in specs}
    up = lambda n: -(-n // 256) * 256  # noqa: E731
    want = up(R * T * geo.wire.row_bytes) + up(R * T * K * 2) + 256
    want += sum(s.nbytes for s in specs if s.name not in ("dispatch_send", "dispatch_recv", "combine_send",
                                                          "combine_recv"))
    assert by["dispatch_recv"].nbytes == R * T * geo.wire.row_bytes
    pl = planner.plan(SHAPES, R, T, 1000.0, mode=mode, dtype=torch.bfloat16, transport="symm_mem")
    assert pl.transport == "symm_mem" and pl.bytes_of("ep") == want
    # The in-process double allocates by the same layout: what it holds is what was planned.
    eps = InProcessWorld(R, put=True).run(
        lambda rank, tr: ExpertParallel(None, E, TOPK, K, T, mode=mode, dtype=torch.bfloat16, transport=tr))
    assert [ep.transport_name for ep in eps] == ["inprocess_put"] * R
    assert max(ep.buffer_bytes() for ep in eps) == want
