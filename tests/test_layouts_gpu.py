"""Spec 02 layouts on CUDA: compiled kernels vs the CPU torch path, no host sync, CUDA-graph replay
after the ids change, and adversarial ids for compute-sanitizer:

    compute-sanitizer --tool memcheck --error-exitcode 1 \
        python -m pytest -x -q tests/test_layouts_gpu.py -m gpu -k sanitizer
"""

import pytest
import torch

from helpers import SENTINEL
from padded_moe.expert_map import ExpertMap
from padded_moe.layouts import GemmLayout, PermuteScratch, build_layout, permute, unpermute

pytestmark = pytest.mark.gpu

LAYOUTS = list(GemmLayout)
FIELDS = ("slot_expert", "activation_counts", "sorted_ids", "block_expert", "num_padded", "offsets",
          "inv", "src", "counts", "overflow")


def meta_equal(a, b):
    for name in FIELDS:
        if hasattr(a, name):
            x, y = getattr(a, name).cpu(), getattr(b, name).cpu()
            assert torch.equal(x, y), f"{a.layout} {name}: {x.tolist()[:16]} vs {y.tolist()[:16]}"


def garbage_ids(M, k, E, gen, dtype=torch.int32):
    ids = torch.randint(0, E, (M, k), generator=gen).to(dtype)
    bad = torch.tensor([-1, E, 2**31 - 1, -(2**31)] + ([2**32 + 1, 2**40] if dtype == torch.int64 else []),
                       dtype=dtype)
    pick = torch.randint(0, bad.numel(), (M, k), generator=gen)
    where = torch.rand(M, k, generator=gen) < 0.1
    return torch.where(where, bad[pick], ids)


def round_on(device, layout, ids, experts, vt, hidden, y, weights, *, scratch=None, **kw):
    vt_t = None if vt is None else torch.tensor([vt], dtype=torch.int32, device=device)
    em = experts.to(device) if isinstance(experts, ExpertMap) else experts
    meta = build_layout(layout, ids.to(device), em, valid_tokens=vt_t, scratch=scratch, **kw)
    p = permute(hidden.to(device), meta)
    out = torch.full(hidden.shape, SENTINEL, dtype=hidden.dtype, device=device)
    unpermute(out, y.to(device), weights.to(device), meta)
    return meta, p, out


@pytest.mark.parametrize("layout", LAYOUTS)
# Up to 128 slots the layout is built in one program (decode); above, by three launches.
@pytest.mark.parametrize("M,k,E,R,K", [(1, 1, 4, 2, 64), (3, 6, 256, 2, 64), (16, 8, 128, 1, 64),
                                       (37, 4, 16, 1, 96), (4096, 8, 128, 1, 256), (5000, 6, 768, 2, 128)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_cuda_matches_cpu_path(layout, M, k, E, R, K, id_dtype):
    gen = torch.Generator().manual_seed(M * 31 + E)
    experts = ExpertMap(E, R - 1, R, "round_robin") if R > 1 else E
    L = experts.num_local if R > 1 else E
    ids = garbage_ids(M, k, E, gen, id_dtype)
    vt = M - M // 5
    hidden = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    hidden[vt:] = float("nan")
    kw = dict(block_m=16, max_tokens_per_expert=max(1, 2 * M * k // L), drop_overflow=True)
    T = kw["max_tokens_per_expert"]
    y = torch.randn(*((L, T, K) if layout == GemmLayout.GROUPED_MASKED else (M * k, K)), generator=gen)
    y = y.to(torch.bfloat16)
    weights = torch.rand(M, k, generator=gen)
    m_cpu, p_cpu, o_cpu = round_on("cpu", layout, ids, experts, vt, hidden, y, weights, **kw)
    m_gpu, p_gpu, o_gpu = round_on("cuda", layout, ids, experts, vt, hidden, y, weights, **kw)
    meta_equal(m_gpu, m_cpu)
    if layout != GemmLayout.INDEXED:
        # Rows the layout owns are identical (the rest of the buffer is unspecified).
        inv = m_cpu.inv.long()
        kept = inv < p_cpu.reshape(-1, K).shape[0]
        kept &= inv < (L * T if layout == GemmLayout.GROUPED_MASKED else int(m_cpu.offsets[-1]))
        rows = inv[kept]
        assert torch.equal(p_gpu.reshape(-1, K).cpu()[rows], p_cpu.reshape(-1, K)[rows])
    assert torch.allclose(o_gpu.cpu().float(), o_cpu.float(), rtol=1e-2, atol=1e-2)
    assert (o_gpu[vt:] == SENTINEL).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_host_sync(layout):
    gen = torch.Generator().manual_seed(7)
    M, k, E, K = 64, 4, 16, 128
    em = ExpertMap(E, 0, 2, device="cuda")
    ids = garbage_ids(M, k, E, gen).cuda()
    vt = torch.tensor([50], dtype=torch.int32, device="cuda")
    hidden = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    scratch = PermuteScratch(M, k, E, em.num_local, "cuda", hidden_size=K, dtype=torch.bfloat16)
    build_layout(layout, ids, em, valid_tokens=vt, scratch=scratch)  # compile + warm caches first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta = build_layout(layout, ids, em, valid_tokens=vt, scratch=scratch)
        p = permute(hidden, meta)
        y = p if layout != GemmLayout.INDEXED else torch.randn(M * k, K, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
        unpermute(out, y, torch.rand(M, k, device="cuda"), meta)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_graph_replay_after_ids_change(layout):
    gen = torch.Generator().manual_seed(11)
    M, k, E, K = 96, 4, 24, 256
    em = ExpertMap(E, 1, 3, device="cuda")
    L = em.num_local
    ids = garbage_ids(M, k, E, gen).cuda()
    vt = torch.tensor([M], dtype=torch.int32, device="cuda")
    hidden = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    weights = torch.rand(M, k, device="cuda")
    T = 64
    y_shape = (L, T, K) if layout == GemmLayout.GROUPED_MASKED else (M * k, K)
    y = torch.randn(*y_shape, device="cuda", dtype=torch.bfloat16)
    out = torch.full((M, K), SENTINEL, device="cuda", dtype=torch.bfloat16)
    scratch = PermuteScratch(M, k, E, L, "cuda", block_m=16, max_tokens_per_expert=T, hidden_size=K,
                             dtype=torch.bfloat16)
    holder = {}

    def step():
        meta = build_layout(layout, ids, em, valid_tokens=vt, scratch=scratch, drop_overflow=True)
        holder["meta"], holder["p"] = meta, permute(hidden, meta)
        unpermute(out, y, weights, meta)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(3):
        ids.copy_(garbage_ids(M, k, E, gen).cuda())
        vt.fill_([M, 40, 0][trial])
        hidden.normal_()
        y.normal_()
        out.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        fresh, p_fresh, o_fresh = round_on("cpu", layout, ids.cpu(), ExpertMap(E, 1, 3), int(vt), hidden.cpu(),
                                           y.cpu(), weights.cpu(), block_m=16, max_tokens_per_expert=T,
                                           drop_overflow=True)
        meta_equal(holder["meta"], fresh)
        n = int(vt)
        assert torch.allclose(out[:n].cpu().float(), o_fresh[:n].float(), rtol=1e-2, atol=1e-2)
        assert (out[n:] == SENTINEL).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_sanitizer_adversarial_ids(layout, id_dtype):
    """Every slot invalid or remote, valid_tokens out of range: nothing may be read or written out of bounds."""
    E, k, K = 8, 4, 64
    big = [2**31 - 1, -(2**31), -1, E, E + 1] + ([2**40, 2**32 + 3, -(2**40)] if id_dtype == torch.int64 else [])
    for M, vt, em in [(1, None, ExpertMap(E, 0, 4, device="cuda")), (7, 0, E), (7, 99, E), (7, -3, E),
                      (300, 150, ExpertMap(E, 3, 4, device="cuda"))]:
        ids = torch.tensor(big, dtype=id_dtype).repeat(M * k)[: M * k].view(M, k).cuda()
        if M == 300:
            ids[::3, 0] = 6  # a few local slots (rank 3 of 4 owns 6, 7)
        vt_t = None if vt is None else torch.tensor([vt], dtype=torch.int32, device="cuda")
        meta = build_layout(layout, ids, em, valid_tokens=vt_t, block_m=64, max_tokens_per_expert=16,
                              drop_overflow=True)
        hidden = torch.full((M, K), float("nan"), device="cuda", dtype=torch.bfloat16)
        hidden[: max(0, min(M, vt if vt is not None else M))] = 1.5
        p = permute(hidden, meta)
        y = p if layout != GemmLayout.INDEXED else torch.full((M * k, K), 2.0, device="cuda", dtype=torch.bfloat16)
        out = torch.full((M, K), SENTINEL, device="cuda", dtype=torch.bfloat16)
        unpermute(out, y, torch.full((M, k), 0.5, device="cuda"), meta)
        torch.cuda.synchronize()
        n = M if vt is None else max(0, min(M, vt))
        assert torch.isfinite(out[:n].float()).all()
        assert (out[n:] == SENTINEL).all()
        if M != 300:
            assert (out[:n] == 0).all()
            L = em.num_local if isinstance(em, ExpertMap) else E
            assert (meta.slot_expert == L).all()
