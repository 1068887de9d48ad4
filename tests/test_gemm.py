"""expert_gemm (spec 03) on every layout, backend and weight dtype, against float64 loops.

Metadata comes from `local_meta` below, written straight from the field meanings in
docs/architecture.md (independent of `padded_moe.layouts.build_layout`, which one test also uses).
Inputs: padded/unused rows are NaN (a load would leak), outputs are pre-filled with SENTINEL and
rows outside the layout's valid set must keep it.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from helpers import REL_TOL, SENTINEL, extreme_mxfp4_weight, rel_err

from padded_moe.gemm import expert_gemm
from padded_moe.layouts import (
    GemmLayout,
    GroupedContiguousMeta,
    GroupedMaskedMeta,
    IndexedMeta,
)
from padded_moe.mxfp4 import Mxfp4Tensor, dequantize_mxfp4, prepare_hopper, quantize_mxfp4

try:  # import the kernels now, while conftest's TRITON_INTERPRET=1 is in force (see conftest)
    import padded_moe.kernels.gemm  # noqa: F401
except ImportError:
    pass

BM = 16  # the interpreter's kernel block (kernels.gemm.INTERPRET_CONFIG.BM)


# ---------------------------------------------------------------------------------------------
# metadata built from the documented field meanings
# ---------------------------------------------------------------------------------------------


def local_meta(layout: GemmLayout, topk_ids: torch.Tensor, L: int, *, block_m: int = BM,
               t_max: int | None = None):
    M, k = topk_ids.shape
    mk = M * k
    flat = topk_ids.reshape(-1).long()
    slot_expert = torch.where((flat >= 0) & (flat < L), flat, torch.full_like(flat, L)).to(torch.int32)
    counts = torch.bincount(slot_expert.long(), minlength=L + 1)[:L]
    base = dict(num_tokens=M, top_k=k, num_local=L, slot_expert=slot_expert)
    if layout == GemmLayout.INDEXED:
        cap = mk + L * (block_m - 1)
        cap = (cap + block_m - 1) // block_m * block_m
        sorted_ids = torch.full((cap,), mk, dtype=torch.int32)
        block_expert = torch.full((max(cap // block_m, 0),), -1, dtype=torch.int32)
        pos = 0
        for e in range(L):
            slots = (slot_expert == e).nonzero().squeeze(1)
            n = slots.numel()
            padded = (n + block_m - 1) // block_m * block_m
            sorted_ids[pos:pos + n] = slots.to(torch.int32)
            block_expert[pos // block_m:(pos + padded) // block_m] = e
            pos += padded
        return IndexedMeta(**base, activation_counts=torch.tensor([mk], dtype=torch.int32),
                           sorted_ids=sorted_ids, block_expert=block_expert,
                           num_padded=torch.tensor([pos], dtype=torch.int32), block_m=block_m)
    if layout == GemmLayout.GROUPED_CONTIGUOUS:
        offsets = torch.zeros(L + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(counts, 0)
        order = torch.argsort(slot_expert.long(), stable=True)
        src = torch.full((mk,), mk, dtype=torch.int32)
        n_kept = int(offsets[L])
        src[:n_kept] = order[:n_kept].to(torch.int32)
        inv = torch.full((mk,), mk, dtype=torch.int32)
        inv[order[:n_kept]] = torch.arange(n_kept, dtype=torch.int32)
        return GroupedContiguousMeta(**base, activation_counts=offsets[L:], offsets=offsets, inv=inv, src=src)
    T = t_max if t_max is not None else M
    clipped = counts.clamp(max=T).to(torch.int32)
    inv = torch.full((mk,), L * T, dtype=torch.int32)
    return GroupedMaskedMeta(**base, activation_counts=clipped, counts=clipped, inv=inv,
                             overflow=torch.zeros(1, dtype=torch.int32), max_tokens_per_expert=T)


def masked_meta(counts: list[int], t_max: int) -> GroupedMaskedMeta:
    """GROUPED_MASKED metadata straight from counts (the batched receive-buffer case)."""
    L = len(counts)
    c = torch.tensor(counts, dtype=torch.int32)
    return GroupedMaskedMeta(num_tokens=L * t_max, top_k=1, num_local=L,
                             slot_expert=torch.zeros(L * t_max, dtype=torch.int32),
                             activation_counts=c, counts=c, inv=torch.zeros(L * t_max, dtype=torch.int32),
                             overflow=torch.zeros(1, dtype=torch.int32), max_tokens_per_expert=t_max)


def ids_with_counts(counts: list[int], k: int, gen, extra_invalid: int = 0) -> torch.Tensor:
    """topk_ids [M, k] whose local experts get exactly `counts`, distinct per token, with some
    invalid ids (-1, L, huge) mixed in as dropped slots."""
    L = len(counts)
    slots = [e for e, c in enumerate(counts) for _ in range(c)]
    bad = [-1, L, 2**31 - 1][: max(extra_invalid, 0)] * ((extra_invalid + 2) // 3)
    slots += bad[:extra_invalid]
    M = max(math.ceil(len(slots) / k), max(counts + [0]), 1)
    # Fill column by column so no token gets one expert twice (counts[e] <= M).
    grid = torch.full((M * k,), -1, dtype=torch.int64)
    order = sorted(range(len(slots)), key=lambda i: (slots[i] < 0 or slots[i] >= L, slots[i]))
    for pos, i in enumerate(order):
        grid[(pos % M) * k + pos // M] = slots[i]
    ids = grid.view(M, k)
    perm = torch.randperm(M, generator=gen)
    return ids[perm].to(torch.int32)


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------


def make_weight(L, n_out, K, wdtype, gen):
    w = torch.randn(L, n_out, K, generator=gen, dtype=torch.float64) / math.sqrt(K)
    if wdtype == "mxfp4":
        q = quantize_mxfp4(w)
        return q, dequantize_mxfp4(q, torch.float64)
    wt = w.to(wdtype)
    return wt, wt.double()


def act_dtype(wdtype):
    return torch.bfloat16 if wdtype == "mxfp4" else wdtype


def ref_rows(a64, w64, bias64, meta, stage):
    """{out_row: float64 vector} for every row the layout must write."""
    rows = {}
    L = meta.num_local
    if isinstance(meta, IndexedMeta):
        mk = meta.num_tokens * meta.top_k
        for b, e in enumerate(meta.block_expert.tolist()):
            if e < 0 or b * meta.block_m >= int(meta.num_padded):
                continue
            for s in meta.sorted_ids[b * meta.block_m:(b + 1) * meta.block_m].tolist():
                if s < mk:
                    src = s // meta.top_k if stage == "w13" else s
                    rows[s] = (e, a64[src])
    elif isinstance(meta, GroupedContiguousMeta):
        off = meta.offsets.tolist()
        for e in range(L):
            for r in range(off[e], off[e + 1]):
                rows[r] = (e, a64[r])
    else:
        T = meta.max_tokens_per_expert
        for e in range(L):
            for t in range(int(meta.counts[e])):
                rows[e * T + t] = (e, a64[e, t])
    out = {}
    for r, (e, x) in rows.items():
        y = w64[e] @ x
        if bias64 is not None:
            y = y + bias64[e]
        out[r] = y
    return out


def nan_unused_rows(a, meta, stage):
    """Set every row of `a` the layout must not read to NaN."""
    a = a.clone()
    if isinstance(meta, IndexedMeta):
        used = torch.zeros(a.shape[0], dtype=torch.bool)
        mk = meta.num_tokens * meta.top_k
        ids = meta.sorted_ids[: int(meta.num_padded)].long()
        ids = ids[ids < mk]
        used[ids // meta.top_k if stage == "w13" else ids] = True
        a[~used] = float("nan")
    elif isinstance(meta, GroupedContiguousMeta):
        a[int(meta.offsets[-1]):] = float("nan")
    else:
        for e in range(meta.num_local):
            a[e, int(meta.counts[e]):] = float("nan")
    return a


def layout_activations(layout, meta, num_tokens, k, K, gen, dtype, stage="w13"):
    """Random GEMM input in the layout's shape ([L, T_max, K] slabs; [M*k, K] permuted or slot
    rows; [M, K] token rows for INDEXED GEMM1) with NaN in every row the layout must not read."""
    if layout == GemmLayout.GROUPED_MASKED:
        a = torch.randn(meta.num_local, meta.max_tokens_per_expert, K, generator=gen)
    else:
        slot_rows = layout == GemmLayout.GROUPED_CONTIGUOUS or stage == "w2"
        a = torch.randn(num_tokens * k if slot_rows else num_tokens, K, generator=gen)
    return nan_unused_rows(a.to(dtype), meta, stage)


def run_and_check(a, w, w64, meta, stage, *, bias=None, backend="auto", config=None):
    n_out = w64.shape[1]
    if isinstance(meta, GroupedMaskedMeta):
        out_shape = (meta.num_local, meta.max_tokens_per_expert, n_out)
    elif isinstance(meta, IndexedMeta):
        out_shape = (meta.num_tokens * meta.top_k, n_out)
    else:
        out_shape = (a.shape[0], n_out)
    out = torch.full(out_shape, SENTINEL, dtype=a.dtype)
    if config is None:
        res = expert_gemm(a, w, meta, stage=stage, bias=bias, out=out, backend=backend)
    else:  # a given kernel config (the Triton backend)
        from padded_moe.backends import get_backend

        res = get_backend("triton").gemm(a, w, meta, stage=stage, bias=bias, out=out, config=config)
    assert res is out
    a64 = torch.nan_to_num(a.double(), nan=0.0)
    ref = ref_rows(a64, w64, None if bias is None else bias.double(), meta, stage)
    flat = out.reshape(-1, n_out)
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    if ref:
        idx = torch.tensor(sorted(ref))
        written[idx] = True
        want = torch.stack([ref[i] for i in sorted(ref)])
        err = rel_err(flat[idx], want)
        assert err < REL_TOL[a.dtype], f"relative error {err:.3g}"
    assert (flat[~written] == SENTINEL).all(), "rows outside the layout were written"
    return out


# ---------------------------------------------------------------------------------------------
# the matrix: path x layout x weight dtype
# ---------------------------------------------------------------------------------------------

LAYOUTS = [GemmLayout.INDEXED, GemmLayout.GROUPED_CONTIGUOUS, GemmLayout.GROUPED_MASKED]
WDTYPES = [torch.float32, torch.bfloat16, torch.float16, "mxfp4"]

# Counts around the kernel block: 0, 1, BM-1, BM, BM+1, and a larger one.
EDGE_COUNTS = [0, 1, BM - 1, BM, BM + 1, 2 * BM + 3]


def edge_count_case(layout, wdtype, gen, extra_invalid):
    """(a, w, w64, meta) for GEMM1 over the EDGE_COUNTS experts: K=64, Nout=40 (not a multiple
    of the kernel's BN, so the N mask is exercised), k=2, invalid ids mixed in, NaN in every row
    the layout must not read."""
    K, n_out, k = 64, 40, 2
    counts = EDGE_COUNTS
    L = len(counts)
    dt = act_dtype(wdtype)
    w, w64 = make_weight(L, n_out, K, wdtype, gen)
    ids = ids_with_counts(counts, k, gen, extra_invalid=extra_invalid)
    M = ids.shape[0]
    t_max = max(counts) + 5 if layout == GemmLayout.GROUPED_MASKED else None
    meta = local_meta(layout, ids, L, t_max=t_max)
    return layout_activations(layout, meta, M, k, K, gen, dt), w, w64, meta


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("wdtype", WDTYPES, ids=str)
def test_layouts_all_dtypes(cpu_path, layout, wdtype, gen):
    a, w, w64, meta = edge_count_case(layout, wdtype, gen, extra_invalid=3)
    run_and_check(a, w, w64, meta, "w13")


@pytest.mark.parametrize("wdtype", [torch.bfloat16, "mxfp4"], ids=str)
def test_indexed_w2_stage_and_bias(cpu_path, wdtype, gen):
    """GEMM2 reads slot rows (`sorted_ids`, not `// k`); bias added per expert."""
    K, n_out, k, L = 64, 32, 3, 4
    counts = [5, 0, BM + 1, 2]
    dt = act_dtype(wdtype)
    w, w64 = make_weight(L, n_out, K, wdtype, gen)
    ids = ids_with_counts(counts, k, gen, extra_invalid=2)
    meta = local_meta(GemmLayout.INDEXED, ids, L)
    a = nan_unused_rows(torch.randn(ids.numel(), K, generator=gen).to(dt), meta, "w2")
    bias = torch.randn(L, n_out, generator=gen).to(dt)
    run_and_check(a, w, w64, meta, "w2", bias=bias)


@pytest.mark.parametrize("layout", [GemmLayout.GROUPED_CONTIGUOUS, GemmLayout.GROUPED_MASKED], ids=lambda l: l.value)
def test_grouped_bias_fp32(cpu_path, layout, gen):
    K, n_out, k, L = 96, 48, 2, 3
    counts = [3, BM, 0]
    w, w64 = make_weight(L, n_out, K, torch.float32, gen)
    ids = ids_with_counts(counts, k, gen)
    meta = local_meta(layout, ids, L)
    a = layout_activations(layout, meta, ids.shape[0], k, K, gen, torch.float32)
    run_and_check(a, w, w64, meta, "w13", bias=torch.randn(L, n_out, generator=gen))


@pytest.mark.parametrize("block_m", [8, 32, 48])
def test_indexed_block_m_variants(cpu_path, block_m, gen):
    """block_m below, above and not a power of two relative to the kernel's tile."""
    K, n_out, k, L = 64, 32, 2, 3
    counts = [block_m - 1, block_m + 1, 1]
    w, w64 = make_weight(L, n_out, K, torch.bfloat16, gen)
    ids = ids_with_counts(counts, k, gen)
    meta = local_meta(GemmLayout.INDEXED, ids, L, block_m=block_m)
    a = nan_unused_rows(torch.randn(ids.shape[0], K, generator=gen).to(torch.bfloat16), meta, "w13")
    run_and_check(a, w, w64, meta, "w13")


def test_masked_batched_counts(cpu_path, gen):
    """Receive-buffer style slabs: counts 0, 1, BM-1, BM, BM+1, full; stale counts past T clamp."""
    t_max = 2 * BM + 1
    counts = [0, 1, BM - 1, BM, BM + 1, t_max]
    L, K, n_out = len(counts), 64, 32
    meta = masked_meta(counts, t_max)
    w, w64 = make_weight(L, n_out, K, torch.bfloat16, gen)
    a = nan_unused_rows(torch.randn(L, t_max, K, generator=gen).to(torch.bfloat16), meta, "w13")
    run_and_check(a, w, w64, meta, "w13")


def test_masked_count_above_capacity_is_clamped(cpu_path, gen):
    t_max, L, K, n_out = BM, 2, 64, 32
    meta = masked_meta([BM + 7, 3], t_max)  # stale garbage count > T_max
    w, w64 = make_weight(L, n_out, K, torch.bfloat16, gen)
    a = torch.randn(L, t_max, K, generator=gen).to(torch.bfloat16)
    a[1, 3:] = float("nan")
    out = torch.full((L, t_max, n_out), SENTINEL, dtype=torch.bfloat16)
    expert_gemm(a, w, meta, out=out)
    ref0 = a[0].double() @ w64[0].T
    assert rel_err(out[0], ref0) < REL_TOL[torch.bfloat16]
    assert (out[1, 3:] == SENTINEL).all()


def test_empty_and_all_dropped(cpu_path, gen):
    """Every slot dropped: nothing is computed, nothing written, NaN input never read."""
    K, n_out, k, L = 64, 32, 2, 3
    ids = torch.tensor([[-1, 3], [7, -5]], dtype=torch.int32)
    w, w64 = make_weight(L, n_out, K, torch.bfloat16, gen)
    for layout in LAYOUTS:
        meta = local_meta(layout, ids, L)
        if layout == GemmLayout.GROUPED_MASKED:
            a = torch.full((L, meta.max_tokens_per_expert, K), float("nan"), dtype=torch.bfloat16)
        elif layout == GemmLayout.GROUPED_CONTIGUOUS:
            a = torch.full((4, K), float("nan"), dtype=torch.bfloat16)
        else:
            a = torch.full((2, K), float("nan"), dtype=torch.bfloat16)
        run_and_check(a, w, w64, meta, "w13")


def test_out_none_allocates(cpu_path, gen):
    K, n_out, L = 64, 32, 2
    meta = masked_meta([3, 5], 8)
    w, w64 = make_weight(L, n_out, K, torch.bfloat16, gen)
    a = torch.randn(L, 8, K, generator=gen).to(torch.bfloat16)
    out = expert_gemm(a, w, meta)
    assert out.shape == (L, 8, n_out) and out.dtype == torch.bfloat16
    assert rel_err(out[1, :5], a[1, :5].double() @ w64[1].T) < REL_TOL[torch.bfloat16]


def test_triton_and_torch_agree(monkeypatch, gen):
    """Both backends on the same random problem (interpreter vs loop), all layouts."""
    from padded_moe._platform import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("interpreter not in use")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    K, n_out, k, L = 64, 32, 2, 4
    ids = torch.randint(-1, L + 1, (20, k), generator=gen, dtype=torch.int32)
    w, _ = make_weight(L, n_out, K, torch.bfloat16, gen)
    for layout in LAYOUTS:
        meta = local_meta(layout, ids, L)
        a = layout_activations(layout, meta, ids.shape[0], k, K, gen, torch.bfloat16)
        outs = []
        for backend in ("triton", "torch"):
            out = torch.full((a.shape[0] * (k if layout == GemmLayout.INDEXED else 1),) + (n_out,)
                             if layout != GemmLayout.GROUPED_MASKED else (L, a.shape[1], n_out),
                             SENTINEL, dtype=torch.bfloat16)
            outs.append(expert_gemm(a, w, meta, out=out, backend=backend))
        assert rel_err(outs[0], outs[1]) < 1e-2


def test_with_build_layout(cpu_path, gen):
    """The shared builder's metadata drives the GEMM the same way (skips until it lands)."""
    from padded_moe import layouts

    if not hasattr(layouts, "build_layout"):
        pytest.skip("padded_moe.layouts.build_layout not implemented yet")
    K, n_out, k, L = 64, 32, 2, 4
    ids = torch.randint(-2, L + 2, (12, k), generator=gen, dtype=torch.int32)
    w, w64 = make_weight(L, n_out, K, torch.bfloat16, gen)
    for layout in LAYOUTS:
        try:
            meta = layouts.build_layout(layout, ids, L, block_m=BM)
        except NotImplementedError:
            pytest.skip("build_layout not implemented yet")
        a = layout_activations(layout, meta, ids.shape[0], k, K, gen, torch.bfloat16)
        run_and_check(a, w, w64, meta, "w13")


# ---------------------------------------------------------------------------------------------
# validation and backend selection
# ---------------------------------------------------------------------------------------------


def _small(gen):
    meta = masked_meta([2, 1], 4)
    a = torch.randn(2, 4, 32, generator=gen).to(torch.bfloat16)
    w = torch.randn(2, 16, 32, generator=gen).to(torch.bfloat16)
    return a, w, meta


def test_errors_name_the_argument(gen):
    a, w, meta = _small(gen)
    with pytest.raises(ValueError, match="stage"):
        expert_gemm(a, w, meta, stage="w3")
    with pytest.raises(TypeError, match="layout_meta"):
        expert_gemm(a, w, object())
    with pytest.raises(TypeError, match="^a must"):
        expert_gemm(a.to(torch.int32), w, meta)
    with pytest.raises(TypeError, match="^w must"):
        expert_gemm(a, w.float(), meta)
    with pytest.raises(ValueError, match="num_local"):
        expert_gemm(a, w[:1], meta)
    with pytest.raises(ValueError, match="last dimension"):
        expert_gemm(a, w[..., :16].contiguous(), meta)
    with pytest.raises(ValueError, match="^a must be"):
        expert_gemm(a[:, :3], w, meta)
    with pytest.raises(ValueError, match="^bias"):
        expert_gemm(a, w, meta, bias=torch.zeros(2, 15, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="^out"):
        expert_gemm(a, w, meta, out=torch.empty(2, 4, 15, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="backend"):
        expert_gemm(a, w, meta, backend="cutlass")
    ids = torch.tensor([[0, 1]], dtype=torch.int32)
    imeta = local_meta(GemmLayout.INDEXED, ids, 2)
    with pytest.raises(ValueError, match="M \\(tokens\\)"):
        expert_gemm(torch.randn(2, 32).to(torch.bfloat16), w, imeta, stage="w13")
    with pytest.raises(ValueError, match="M\\*k"):
        expert_gemm(torch.randn(1, 32).to(torch.bfloat16), w, imeta, stage="w2")
    q = quantize_mxfp4(torch.randn(2, 16, 64))
    with pytest.raises(ValueError, match="last dimension"):
        expert_gemm(a, q, meta)


def test_triton_backend_refused_without_interpreter(monkeypatch, gen):
    a, w, meta = _small(gen)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(NotImplementedError, match="'triton'"):
        expert_gemm(a, w, meta, backend="triton")


def test_humming_backend_refused_when_unavailable(gen):
    a, w, meta = _small(gen)
    q = quantize_mxfp4(torch.randn(2, 16, 32))
    with pytest.raises(NotImplementedError, match="'humming'"):
        expert_gemm(a, q, meta, backend="humming")  # CPU tensors: humming needs CUDA
    with pytest.raises(NotImplementedError, match="'humming'"):
        expert_gemm(a, w, meta, backend="humming")


def test_auto_picks(monkeypatch):
    from padded_moe._platform import kernels_interpreted
    from padded_moe.backends import resolve_backend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_backend("auto", torch.device("cpu"), GemmLayout.INDEXED, None).name == "torch"
    if kernels_interpreted():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert resolve_backend("auto", torch.device("cpu"), GemmLayout.INDEXED, None).name == "triton"


@pytest.mark.parametrize("with_bias", [False, True])
def test_torch_cuda_fast_paths_run_on_cpu(with_bias, gen):
    """The torch backend's CUDA-only paths (_grouped_mm + where, bmm + where), called directly on
    CPU tensors so their row handling is checked here too."""
    from padded_moe.torch_path import gemm as tg

    K, n_out, k, L = 64, 32, 2, 4
    ids = ids_with_counts([3, 0, BM + 1, 5], k, gen, extra_invalid=2)
    w, w64 = make_weight(L, n_out, K, torch.bfloat16, gen)
    bias = torch.randn(L, n_out, generator=gen).to(torch.bfloat16) if with_bias else None
    for layout, fn in ((GemmLayout.GROUPED_CONTIGUOUS, tg.grouped_mm), (GemmLayout.GROUPED_MASKED, tg.masked_bmm)):
        if layout == GemmLayout.GROUPED_CONTIGUOUS and not hasattr(torch, "_grouped_mm"):
            continue
        meta = local_meta(layout, ids, L)
        a = layout_activations(layout, meta, ids.shape[0], k, K, gen, torch.bfloat16)
        out = torch.full((*a.shape[:-1], n_out), SENTINEL, dtype=torch.bfloat16)
        # Padded rows are NaN: these paths compute them and then discard them with `where`.
        fn(a, w, meta, bias, out)
        ref = ref_rows(torch.nan_to_num(a.double()), w64, None if bias is None else bias.double(), meta, "w13")
        flat = out.reshape(-1, n_out)
        idx = torch.tensor(sorted(ref))
        assert rel_err(flat[idx], torch.stack([ref[i] for i in sorted(ref)])) < 2 * REL_TOL[torch.bfloat16]
        rest = torch.ones(flat.shape[0], dtype=torch.bool)
        rest[idx] = False
        assert (flat[rest] == SENTINEL).all()


@pytest.mark.parametrize("trial", range(4))
def test_randomised_shapes(cpu_path, trial):
    """Fresh random sizes each run (seed in the failure message), including M = 0 (idle rank)."""
    # PADDED_MOE_SEED=<seed> replays a failure, as for the `gen` fixture (conftest.py).
    seed = int(os.environ.get("PADDED_MOE_SEED") or int.from_bytes(os.urandom(4), "little"))
    gen = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=gen))]  # noqa: E731
    L, k, K, n_out = pick([1, 3, 5]), pick([1, 2, 3]), pick([32, 64, 96]), pick([16, 40])
    M = 0 if trial == 0 else pick([1, 7, 19, 33])
    layout, wdtype, stage = pick(LAYOUTS), pick([torch.bfloat16, "mxfp4", torch.float16]), pick(["w13", "w2"])
    ids = torch.randint(-2, L + 2, (M, k), generator=gen, dtype=torch.int32)
    w, w64 = make_weight(L, n_out, K, wdtype, gen)
    meta = local_meta(layout, ids, L, block_m=pick([8, 16, 32]))
    dt = act_dtype(wdtype)
    a = layout_activations(layout, meta, M, k, K, gen, dt, stage)
    try:
        run_and_check(a, w, w64, meta, stage)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}: L={L} k={k} K={K} N={n_out} M={M} {layout} {wdtype} {stage}: {exc}")


def test_grouped_contiguous_capacity_buffers(cpu_path, gen):
    """a and out may be capacity buffers of different sizes (both >= M*k)."""
    K, n_out, k, L = 64, 32, 2, 3
    ids = ids_with_counts([4, 0, BM + 2], k, gen)
    meta = local_meta(GemmLayout.GROUPED_CONTIGUOUS, ids, L)
    w, w64 = make_weight(L, n_out, K, torch.bfloat16, gen)
    mk = ids.numel()
    a = nan_unused_rows(torch.randn(mk + 5, K, generator=gen).to(torch.bfloat16), meta, "w13")
    out = torch.full((mk + 9, n_out), SENTINEL, dtype=torch.bfloat16)
    expert_gemm(a, w, meta, out=out)
    off = meta.offsets.tolist()
    for e in range(L):
        sl = slice(off[e], off[e + 1])
        if off[e + 1] > off[e]:
            assert rel_err(out[sl], a[sl].double() @ w64[e].T) < REL_TOL[torch.bfloat16]
    assert (out[off[-1]:] == SENTINEL).all()
    with pytest.raises(ValueError, match="^out must be"):
        expert_gemm(a, w, meta, out=torch.empty(mk - 1, n_out, dtype=torch.bfloat16))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=str)
def test_tma_descriptor_path(monkeypatch, layout, wdtype, gen):
    """The `tma` config reads A (grouped layouts) and the weights through tensor descriptors; the
    interpreter runs descriptors, so the same reference check covers that code path on CPU. NaN
    rows past each expert's end are loaded by the descriptor but must not reach any stored row."""
    from padded_moe._platform import kernels_interpreted
    from padded_moe.backends import get_backend
    from padded_moe.kernels import gemm as kg

    if not kernels_interpreted():
        pytest.skip("interpreter-only check; the GPU tests cover the compiled TMA path")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # Nout=40 is not a multiple of BN: the descriptor over-reads columns, the store masks them.
    a, w, w64, meta = edge_count_case(layout, wdtype, gen, extra_invalid=2)
    n_out = w64.shape[1]
    rows = a.shape[:-1] if layout == GemmLayout.GROUPED_MASKED else (meta.num_tokens * meta.top_k,)
    out = torch.full((*rows, n_out), SENTINEL, dtype=wdtype)
    cfg = dataclasses.replace(kg.INTERPRET_CONFIG, tma=True)
    get_backend("triton").gemm(a, w, meta, stage="w13", bias=None, out=out, config=cfg)
    ref = ref_rows(torch.nan_to_num(a.double(), nan=0.0), w64, None, meta, "w13")
    flat = out.reshape(-1, n_out)
    idx = torch.tensor(sorted(ref))
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[idx] = True
    assert (flat[~written] == SENTINEL).all(), "rows outside the layout were written"
    err = rel_err(flat[idx], torch.stack([ref[i] for i in sorted(ref)]))
    assert err < REL_TOL[wdtype], f"relative error {err:.3g}"


@pytest.mark.parametrize("layout", [GemmLayout.INDEXED, GemmLayout.GROUPED_CONTIGUOUS], ids=lambda l: l.value)
@pytest.mark.parametrize("M,k,L", [(1, 2, 64), (3, 4, 40), (9, 2, 3)])
def test_grid_bound_few_rows_many_experts(cpu_path, layout, M, k, L, gen):
    """The grid holds cdiv(rows, tile) + min(L, rows) m-tiles, not one per expert: the decode case
    (few rows over many experts, some experts with several tiles) must still cover every row."""
    K, n_out = 32, 24
    w, w64 = make_weight(L, n_out, K, torch.float32, gen)
    ids = torch.stack([torch.randperm(L, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    if L < M * k:  # few experts: most rows pile onto expert 0, which then spans several tiles
        ids[:, 0] = 0
    meta = local_meta(layout, ids, L)
    a = torch.randn(M if layout == GemmLayout.INDEXED else M * k, K, generator=gen)
    run_and_check(nan_unused_rows(a, meta, "w13"), w, w64, meta, "w13")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, "mxfp4", "mxfp4-prepared"], ids=str)
def test_persistent_programs_walk_every_tile(monkeypatch, layout, wdtype, gen):
    """`GemmConfig.persistent`: fewer programs than tiles (the interpreter's cap is 4), each walking
    the tiles with rows (invalid ids, empty experts, a worst-case grouped grid around them): the
    reference on every written row, nothing else written, and the same bits as one program per
    tile. GROUPED_MASKED walks as `kernels.gemm.MASKED_WALK` says, whatever the config."""
    from padded_moe.kernels import _launch
    from padded_moe.kernels import gemm as kg

    require_interpreter(monkeypatch)
    prepared = wdtype == "mxfp4-prepared"
    a, w, w64, meta = edge_count_case(layout, "mxfp4" if prepared else wdtype, gen, extra_invalid=3)
    base = kg.INTERPRET_HOPPER_CONFIG if prepared else kg.INTERPRET_CONFIG
    if prepared:
        w = prepared_only(w, 4)
    grids = []
    real = _launch.launch

    def spy(fn, grid, *args, **kwargs):
        grids.append(grid[0])
        return real(fn, grid, *args, **kwargs)

    monkeypatch.setattr(kg, "launch_kernel", spy)
    masked = layout == GemmLayout.GROUPED_MASKED
    monkeypatch.setattr(kg, "MASKED_WALK", False)
    one = run_and_check(a, w, w64, meta, "w13", backend="triton", config=base)
    if masked:  # the config's flag does not walk GROUPED_MASKED; MASKED_WALK does, even without it
        persistent = run_and_check(a, w, w64, meta, "w13", backend="triton",
                                   config=dataclasses.replace(base, persistent=True))
        assert grids[1] == grids[0] and torch.equal(one, persistent), grids
        monkeypatch.setattr(kg, "MASKED_WALK", True)
    walked = run_and_check(a, w, w64, meta, "w13", backend="triton",
                           config=base if masked else dataclasses.replace(base, persistent=True))
    assert grids[-1] <= 4 < grids[0], grids
    assert torch.equal(one, walked)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, "mxfp4"], ids=str)
def test_dynamic_tile_order_walks_every_tile(monkeypatch, layout, wdtype, gen):
    """`GemmConfig.dynamic`: persistent programs take tiles from a device counter; every tile with
    rows is computed once (the reference on every written row, nothing else written) and the bits
    are those of the static walk."""
    from padded_moe.kernels import gemm as kg

    require_interpreter(monkeypatch)
    a, w, w64, meta = edge_count_case(layout, wdtype, gen, extra_invalid=3)
    walked = dataclasses.replace(kg.INTERPRET_CONFIG, persistent=True)
    static = run_and_check(a, w, w64, meta, "w13", backend="triton", config=walked)
    dynamic = run_and_check(a, w, w64, meta, "w13", backend="triton", config=dataclasses.replace(walked, dynamic=True))
    assert torch.equal(static, dynamic)


def test_dynamic_tile_order_needs_the_persistent_layout_kernel(gen):
    """`dynamic` without `persistent`, or on the prepared-MXFP4 kernel, is refused by name."""
    from padded_moe.kernels import gemm as kg

    a, w, w64, meta = edge_count_case(GemmLayout.INDEXED, torch.float32, gen, extra_invalid=0)
    with pytest.raises(ValueError, match="config.dynamic"):
        run_and_check(a, w, w64, meta, "w13", backend="triton",
                      config=dataclasses.replace(kg.INTERPRET_CONFIG, dynamic=True))
    aq, wq, wq64, metaq = edge_count_case(GemmLayout.INDEXED, "mxfp4", gen, extra_invalid=0)
    with pytest.raises(ValueError, match="config.dynamic"):
        run_and_check(aq, prepared_only(wq, 4), wq64, metaq, "w13", backend="triton",
                      config=dataclasses.replace(kg.INTERPRET_HOPPER_CONFIG, persistent=True, dynamic=True))


# Experts whose last 32-row tile holds at most 16 rows (1, 15, 16, 33, 48), more (17, 31), exactly
# one full tile (32), none (0), and three tiles (81: 17 rows in the last).
HALF_TAIL_COUNTS = [0, 1, 15, 16, 17, 31, 32, 33, 48, 81]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, "mxfp4", "mxfp4-prepared"], ids=str)
@pytest.mark.parametrize("persistent", [False, True], ids=["one_per_tile", "persistent"])
def test_half_tail_tiles_match_full_tiles(monkeypatch, layout, wdtype, persistent, gen):
    """`GemmConfig.half_tail` with 32-row tiles: a tile whose valid rows all lie in its first 16 runs
    as a 16-row tile (experts ending 1-16 rows into a tile, or holding that few), the others as
    full tiles. The reference on every written row, nothing else written (NaN in every row the
    layout must not read, invalid ids mixed in), and the bits of the same config without it."""
    from padded_moe.kernels import gemm as kg

    require_interpreter(monkeypatch)
    prepared = wdtype == "mxfp4-prepared"
    K, n_out, k = 64, 40, 2
    counts, L = HALF_TAIL_COUNTS, len(HALF_TAIL_COUNTS)
    w, w64 = make_weight(L, n_out, K, "mxfp4" if prepared else wdtype, gen)
    if prepared:
        w = prepared_only(w, 4)
    ids = ids_with_counts(counts, k, gen, extra_invalid=3)
    t_max = max(counts) + 5 if layout == GemmLayout.GROUPED_MASKED else None
    meta = local_meta(layout, ids, L, block_m=32, t_max=t_max)
    a = layout_activations(layout, meta, ids.shape[0], k, K, gen, act_dtype("mxfp4" if prepared else wdtype))
    # On a binary grid coarse enough that every product and partial sum is exact in float32: the
    # interpreter's dot (bf16 and MXFP4 too) is numpy's float32 matmul, whose BLAS sums in an order
    # that depends on the CPU, its threads and the tile's height, so only exact sums make the bits
    # comparable here. (MXFP4 weights are already on such a grid: e2m1 codes times close scales.)
    if isinstance(wdtype, torch.dtype):
        w = (w * 64).round() / 64
        w64 = w.double()
    a = (a * 16).round() / 16
    base = dataclasses.replace(kg.INTERPRET_HOPPER_CONFIG if prepared else kg.INTERPRET_CONFIG, BM=32,
                               persistent=persistent)
    full = run_and_check(a, w, w64, meta, "w13", backend="triton", config=base)
    half = run_and_check(a, w, w64, meta, "w13", backend="triton", config=dataclasses.replace(base, half_tail=True))
    assert torch.equal(full, half)


# ---------------------------------------------------------------------------------------------
# MXFP4 in the prepared Hopper arrangement (`Mxfp4Tensor.prepare_for`, the Hopper kernel)
# ---------------------------------------------------------------------------------------------


def prepared_only(q: Mxfp4Tensor, planes: int = 2) -> Mxfp4Tensor:
    """`q` prepared (`planes`: the arrangement), with its canonical bytes replaced by NaN-scaled
    garbage: a result that matches the reference can only have come from the prepared form."""
    h = q.hopper if q.hopper is not None and q.hopper.planes == planes else prepare_hopper(q, planes=planes)
    return Mxfp4Tensor(torch.full_like(q.blocks, 0x77), torch.full_like(q.scales, 255), h)


def require_interpreter(monkeypatch):
    from padded_moe._platform import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("interpreter-only check; tests/test_gemm_gpu.py covers the compiled kernel")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# The prepared arrangements and, on 4 planes, the weight tile as either MMA operand.
HOPPER_VARIANTS = [(2, False), (4, False), (4, True)]
HOPPER_VARIANT_IDS = ["2planes", "4planes", "4planes-wshared"]


def hopper_config(w_shared: bool):
    from padded_moe.kernels import gemm as kg

    return dataclasses.replace(kg.INTERPRET_HOPPER_CONFIG, mx_w_shared=True) if w_shared else None


@pytest.mark.parametrize("planes,w_shared", HOPPER_VARIANTS, ids=HOPPER_VARIANT_IDS)
@pytest.mark.parametrize("K", [64, 96, 160])  # 96, 160: multiples of 32 but not of the 64-block
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_mxfp4_hopper_layouts(monkeypatch, layout, K, planes, w_shared, gen):
    """Every layout, edge counts around the tile, invalid ids, NaN in unread rows, SENTINEL in
    unwritten ones, Nout not a multiple of BN, and K not a multiple of the layout's 64-block."""
    require_interpreter(monkeypatch)
    n_out, k = 40, 2
    counts = EDGE_COUNTS
    L = len(counts)
    w64 = torch.randn(L, n_out, K, generator=gen, dtype=torch.float64) / math.sqrt(K)
    q = quantize_mxfp4(w64)
    ids = ids_with_counts(counts, k, gen, extra_invalid=3)
    meta = local_meta(layout, ids, L, t_max=max(counts) + 5 if layout == GemmLayout.GROUPED_MASKED else None)
    a = layout_activations(layout, meta, ids.shape[0], k, K, gen, torch.bfloat16)
    run_and_check(a, prepared_only(q, planes), dequantize_mxfp4(q, torch.float64), meta, "w13", backend="triton",
                  config=hopper_config(w_shared))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_mxfp4_hopper_w2_stage_bias(monkeypatch, layout, gen):
    """GEMM2 (slot rows), per-expert bias, swigluoai-sized w2 (K = N = 32: one padded block)."""
    require_interpreter(monkeypatch)
    K, n_out, k, L = 32, 48, 3, 4
    q = quantize_mxfp4(torch.randn(L, n_out, K, generator=gen, dtype=torch.float64))
    ids = ids_with_counts([5, 0, BM + 1, 2], k, gen, extra_invalid=2)
    meta = local_meta(layout, ids, L, t_max=BM + 4 if layout == GemmLayout.GROUPED_MASKED else None)
    a = layout_activations(layout, meta, ids.shape[0], k, K, gen, torch.bfloat16, stage="w2")
    bias = torch.randn(L, n_out, generator=gen).to(torch.bfloat16)
    run_and_check(a, prepared_only(q), dequantize_mxfp4(q, torch.float64), meta, "w2", bias=bias, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_mxfp4_hopper_other_activation_dtypes(monkeypatch, dtype, gen):
    """fp32 / fp16 activations: the weights are rounded to the activation dtype, as in the other kernel."""
    require_interpreter(monkeypatch)
    K, n_out, L = 128, 24, 3
    q = quantize_mxfp4(torch.randn(L, n_out, K, generator=gen, dtype=torch.float64))
    meta = masked_meta([3, BM + 2, 0], BM + 4)
    a = nan_unused_rows(torch.randn(L, BM + 4, K, generator=gen).to(dtype), meta, "w13")
    run_and_check(a, prepared_only(q), dequantize_mxfp4(q, dtype).double(), meta, "w13", backend="triton")


@pytest.mark.parametrize("planes,w_shared", HOPPER_VARIANTS, ids=HOPPER_VARIANT_IDS)
@pytest.mark.parametrize("finite,folded", [(True, False), (False, False), (True, True)],
                         ids=["finite", "inf_nan", "folded"])
def test_mxfp4_hopper_upcast_is_exact(monkeypatch, finite, folded, planes, w_shared, gen):
    """Identity activations make the GEMM output the upcast weights themselves (one product per
    output, the other terms +-0): they must equal dequantize_mxfp4 bit for bit, including the
    subnormal products of scales 0..3, the largest finite values, and inf/NaN where the
    canonical dequantization gives them (0 * inf = NaN spreads over a row, as in float64).

    float32 activations here: Triton 3.6's interpreter converts float32 subnormals to bf16
    wrongly (its `_convert_float` clamps the exponent without shifting the mantissa), so the bf16
    version of this check runs on the GPU only (tests/test_gemm_gpu.py)."""
    require_interpreter(monkeypatch)
    K = 96
    q = extreme_mxfp4_weight(gen, K, finite, max_scale=128 if folded else 254)
    assert prepare_hopper(q).folded == folded  # scales up to 128 fold: one multiply per element
    meta = masked_meta([K], K)
    a = torch.eye(K, dtype=torch.float32).unsqueeze(0)
    out = torch.full((1, K, q.shape[1]), SENTINEL, dtype=torch.float32)
    if w_shared:
        from padded_moe.backends import get_backend

        get_backend("triton").gemm(a, prepared_only(q, planes), meta, stage="w13", bias=None, out=out,
                                   config=hopper_config(True))
    else:
        expert_gemm(a, prepared_only(q, planes), meta, out=out, backend="triton")
    if finite:
        assert torch.equal(out[0], dequantize_mxfp4(q, torch.float32)[0].T)
    want = (a[0].double() @ dequantize_mxfp4(q, torch.float32)[0].double().T).float()
    torch.testing.assert_close(out[0], want, rtol=0, atol=0, equal_nan=True)
    assert bool(torch.isnan(out[0]).any()) != finite


def test_mxfp4_hopper_config_needs_its_arrangement(monkeypatch, gen):
    """mx_wide loops over the 2-plane arrangement only, mx_w_shared over the 4-plane one: the
    other arrangement is a ValueError naming the option."""
    require_interpreter(monkeypatch)
    from padded_moe.backends import get_backend
    from padded_moe.kernels import gemm as kg

    q = quantize_mxfp4(torch.randn(1, 32, 128, generator=gen))
    meta = masked_meta([8], 8)
    wide = dataclasses.replace(kg.INTERPRET_HOPPER_CONFIG, BK=128, mx_wide=True)
    shared = dataclasses.replace(kg.INTERPRET_HOPPER_CONFIG, mx_w_shared=True)
    for cfg, planes, msg in ((wide, 4, "mx_wide needs the 2-plane prepared arrangement, got planes=4"),
                             (shared, 2, "mx_w_shared needs the 4-plane prepared arrangement, got planes=2")):
        assert not cfg.planes_ok(planes) and cfg.planes_ok(6 - planes)
        with pytest.raises(ValueError, match=msg):
            get_backend("triton").gemm(torch.randn(1, 8, 128), prepared_only(q, planes), meta, stage="w13",
                                       bias=None, out=torch.empty(1, 8, 32), config=cfg)
    both = dataclasses.replace(wide, mx_w_shared=True)
    with pytest.raises(ValueError, match="mx_wide .2 planes. and config.mx_w_shared .4 planes. exclude each other"):
        get_backend("triton").gemm(torch.randn(1, 8, 128), prepared_only(q, 4), meta, stage="w13",
                                   bias=None, out=torch.empty(1, 8, 32), config=both)


@pytest.mark.parametrize("K", [96, 192, 256])
def test_mxfp4_hopper_wide_iteration_is_exact(monkeypatch, gen, K):
    """The WIDE loop (one dot per nibble plane over all BK/64 blocks of an iteration, scales widened
    per 32 columns) gives the upcast weights bit for bit, with K a multiple of neither BK nor 64
    (blocks past K_PAD in the last iteration, columns past K inside the last block): identity
    activations make each output one product."""
    require_interpreter(monkeypatch)
    from padded_moe.backends import get_backend
    from padded_moe.kernels import gemm as kg

    q = extreme_mxfp4_weight(gen, K, True)
    meta = masked_meta([K], K)
    a = torch.eye(K, dtype=torch.float32).unsqueeze(0)
    wide = dataclasses.replace(kg.INTERPRET_HOPPER_CONFIG, BK=128, mx_wide=True)
    out = get_backend("triton").gemm(a, prepared_only(q), meta, stage="w13", bias=None,
                                     out=torch.full((1, K, q.shape[1]), SENTINEL, dtype=torch.float32), config=wide)
    assert torch.equal(out[0], dequantize_mxfp4(q, torch.float32)[0].T)


def test_mxfp4_hopper_config_errors(monkeypatch, gen):
    require_interpreter(monkeypatch)
    from padded_moe.backends import get_backend
    from padded_moe.kernels import gemm as kg

    q = quantize_mxfp4(torch.randn(2, 16, 64, generator=gen))
    meta = masked_meta([2, 1], 4)
    a = torch.randn(2, 4, 64, generator=gen).to(torch.bfloat16)
    out = torch.empty(2, 4, 16, dtype=torch.bfloat16)
    be = get_backend("triton")
    with pytest.raises(ValueError, match="prepare_for"):
        be.gemm(a, q, meta, stage="w13", bias=None, out=out, config=kg.INTERPRET_HOPPER_CONFIG)
    with pytest.raises(ValueError, match="config.BK"):
        be.gemm(a, q.prepare_for(), meta, stage="w13", bias=None, out=out,
                config=dataclasses.replace(kg.INTERPRET_HOPPER_CONFIG, BK=32))
    with pytest.raises(ValueError, match="config.mx_hopper=False .* does not hold"):  # the canonical bytes
        be.gemm(a, q.prepare_for(keep_canonical=False), meta, stage="w13", bias=None, out=out,
                config=kg.INTERPRET_CONFIG)
    # mx_hopper=False keeps the tl.dot_scaled / bit-assembly kernel on the canonical bytes.
    w64 = dequantize_mxfp4(q, torch.float64)
    out = be.gemm(a, q, meta, stage="w13", bias=None, out=torch.full_like(out, SENTINEL), config=kg.INTERPRET_CONFIG)
    assert rel_err(out[0, :2], a[0, :2].double() @ w64[0].T) < REL_TOL[torch.bfloat16]


def test_config_register_cap(monkeypatch, gen):
    """`GemmConfig.maxnreg`: a value ptxas cannot take is a ValueError naming it (made with the
    config); a cap runs and (under the interpreter, where it changes nothing) gives the bits of the
    uncapped config."""
    require_interpreter(monkeypatch)
    from padded_moe.backends import get_backend
    from padded_moe.kernels import gemm as kg

    w = torch.randn(2, 32, 64, generator=gen)
    meta = masked_meta([3, 1], 4)
    a = torch.randn(2, 4, 64, generator=gen)
    a[0, 3:], a[1, 1:] = float("nan"), float("nan")  # past each expert's count: never read
    be = get_backend("triton")
    for bad in (0, 8, 256, 168.0, True):  # refused where the config is made, before any launch
        with pytest.raises(ValueError, match="config.maxnreg must be None or an int from 16 to 255"):
            dataclasses.replace(kg.INTERPRET_CONFIG, maxnreg=bad)
    plain, capped = (be.gemm(a, w, meta, stage="w13", bias=None, out=torch.full((2, 4, 32), SENTINEL),
                             config=dataclasses.replace(kg.INTERPRET_CONFIG, maxnreg=cap)) for cap in (None, 168))
    for e, rows in enumerate((3, 1)):
        assert rel_err(plain[e, :rows], a[e, :rows].double() @ w[e].double().T) < REL_TOL[torch.float32]
        assert (plain[e, rows:] == SENTINEL).all()
    assert torch.equal(plain, capped)


def test_every_tuned_entry_leads_its_sweep():
    """Each tuned entry is the first candidate of its regime's sweep list: the benchmark then
    times it next to its rivals, and the GPU test that runs every sweep candidate covers it."""
    from padded_moe.kernels import gemm as kg

    sweeps = {"bf16": kg.SWEEP, "mxfp4": kg.SWEEP_MXFP4, "mxfp4_hopper": kg.SWEEP_MXFP4_HOPPER}
    for (kind, reg), cfg in kg.TUNED.items():
        if kind == "mxfp4_hopper4":  # both arrangements sweep the same list; the 2-plane entry leads it
            assert cfg in kg.SWEEP_MXFP4_HOPPER[reg] and cfg.planes_ok(4), (kind, reg, cfg.short())
            continue
        assert sweeps[kind][reg][0] == cfg, (kind, reg, cfg.short(), sweeps[kind][reg][0].short())
        assert len(set(sweeps[kind][reg])) == len(sweeps[kind][reg]), f"{kind}/{reg}: a candidate is listed twice"


def test_default_indexed_blocks_are_one_tile_of_their_regime():
    """`fused_experts`' INDEXED blocks (`default_block_m`) are never split into several tiles by
    the config their metadata picks: a split tile reads (and, for MXFP4, upcasts) the expert's
    weights once per tile."""
    from padded_moe.kernels import gemm as kg
    from padded_moe.layouts import build_layout_resolved, default_block_m

    for L in (8, 32):
        for mean in (0.5, 1, 4, 12, 13, 16, 24, 26, 27, 32, 48, 64, 71, 72, 80, 95, 96, 100, 128, 192, 255, 256, 512,
                     2048):
            S = max(1, round(mean * L))
            bm = default_block_m(S, L)
            meta = build_layout_resolved(GemmLayout.INDEXED, torch.zeros(S, 1, dtype=torch.int32), L, L, None)
            assert meta.block_m == bm
            for kind in {k for k, _ in kg.TUNED}:
                hopper = kind.startswith("mxfp4_hopper")
                cfg = kg.pick_config(meta.rows_per_expert(), kind != "bf16", False, hopper=hopper,
                                     planes=4 if kind == "mxfp4_hopper4" else 2, block_rows=bm)
                _, sub, _ = kg.indexed_tiling(bm, cfg.BM)
                assert sub == 1, (L, mean, bm, kind, cfg.short())


def test_config_short_names_read_back():
    """`GemmConfig.from_short` inverts `short()` for every table and sweep config, and refuses
    names `short()` cannot produce."""
    from padded_moe.kernels import gemm as kg

    tables = [kg.TUNED, kg.TUNED_NARROW]
    configs = {c for t in tables for c in t.values()} | {c for kind in ("bf16", "mxfp4", "mxfp4_hopper4")
                                                         for cands in kg.sweep_lists(kind).values() for c in cands}
    for c in configs:
        assert kg.GemmConfig.from_short(c.short()) == c
        capped = dataclasses.replace(c, maxnreg=168)
        assert capped.short() == c.short() + "_r168" and kg.GemmConfig.from_short(capped.short()) == capped
    for bad in ("BM64_BN128", "BM64_BN128_BK64_G4_w4_s4_hop_xyz", "BM64_BN128_BK64_G4_w4_s4_ptx_hop",
                "BM64_BN128_BK64_G4_w4_s4_r168_hop"):
        with pytest.raises(ValueError, match="short name|unknown tags|reads back"):
            kg.GemmConfig.from_short(bad)


def test_the_medium_regime_starts_where_indexed_blocks_widen():
    """Every weight kind is in the medium regime (128-row tiles) from `BLOCK_128_MEAN_ROWS` rows
    per expert, where INDEXED blocks turn to 128 rows: a GROUPED_CONTIGUOUS call and an INDEXED
    block at the same mean rows take the same tile."""
    from padded_moe.kernels import gemm as kg
    from padded_moe.layouts import BLOCK_128_MEAN_ROWS as B

    assert 32 < B <= 128
    assert kg.regime(32) == "decode" and kg.regime(B - 0.5) == "small" and kg.regime(B) == "medium"
    assert kg.regime(512) == "medium" and kg.regime(513) == "prefill"
    for kind in {k for k, _ in kg.TUNED}:
        mx, hopper = kind != "bf16", kind.startswith("mxfp4_hopper")
        planes = 4 if kind == "mxfp4_hopper4" else 2
        for rows, block in ((B, None), (B, 128), (128, 128), (B - 1, None), (B - 1, 64)):
            cfg = kg.pick_config(rows, mx, False, hopper=hopper, planes=planes, block_rows=block)
            assert cfg == kg.TUNED[(kind, "medium" if rows >= B else "small")], (kind, rows, block)


def test_indexed_blocks_narrower_than_the_entry_take_the_narrow_entry():
    """`TUNED_NARROW` applies exactly when an INDEXED block holds fewer rows than the regime
    entry's BM; other layouts (no block) and full-width blocks keep `TUNED`."""
    from padded_moe.kernels import gemm as kg

    for (kind, reg), narrow in kg.TUNED_NARROW.items():
        wide = kg.TUNED[(kind, reg)]
        rows = {"decode": 16, "small": 96, "medium": 192, "prefill": 1024}[reg]
        assert kg.regime(rows) == reg
        planes = 4 if kind == "mxfp4_hopper4" else 2
        pick = lambda b: kg.pick_config(rows, kind != "bf16", False, hopper=kind.startswith("mxfp4_hopper"),  # noqa: E731
                                        planes=planes, block_rows=b)
        assert pick(wide.BM // 2) == narrow
        assert pick(wide.BM) == wide
        assert pick(None) == wide


def test_grouped_walk_rule():
    """The grouped layouts walk the tiles with rows only for the prepared-MXFP4 decode tile in a
    grid (from shapes) of at least GROUPED_WALK_MIN_RATIO times the m-tiles the expected rows need."""
    from padded_moe.kernels import gemm as kg

    decode16, decode32 = (dataclasses.replace(kg.TUNED[("mxfp4_hopper4", "decode")], BM=b) for b in (16, 32))
    small = kg.TUNED[("mxfp4_hopper4", "small")]
    L = 128
    assert kg.MASKED_WALK is None
    assert kg.grouped_walks(decode16, True, L * 9, L, 4.0)  # masked slabs of 144 rows: 9 m-tiles, 1 expected
    assert kg.grouped_walks(decode32, True, L * 18, L, 24.0)
    assert kg.grouped_walks(decode16, True, L * 4, L, 0.0)  # an idle expectation: 1 m-tile each
    assert not kg.grouped_walks(decode16, True, L * 3, L, 4.0)
    assert not kg.grouped_walks(decode32, True, L * 2, L, 24.0)
    assert not kg.grouped_walks(decode16, True, L * 9, L, 144.0)  # no hint: rows from the shape
    assert not kg.grouped_walks(small, True, L * 13, L, 32.0)
    assert not kg.grouped_walks(kg.TUNED[("bf16", "decode")], False, L * 18, L, 4.0)
    # GROUPED_CONTIGUOUS: a flat receive buffer of 8 ranks x 256 tokens x top-8 slots on 32 local
    # experts, about 4 rows each expected; the same grid without a hint (its mean, 512 rows)
    from padded_moe import layout_codes as codes

    rows = 8 * 256 * 8
    grid = kg.grouped_grid_m(codes.GROUPED_CONTIGUOUS, rows, 32, 1, 16)
    assert grid == rows // 16 + 32 and kg.grouped_grid_m(codes.GROUPED_MASKED, rows, 32, 144, 16) == 32 * 9
    assert kg.grouped_walks(decode16, True, grid, 32, 4.0)
    assert not kg.grouped_walks(decode16, True, grid, 32, rows / 32)
    assert not kg.grouped_walks(decode16, True, kg.grouped_grid_m(codes.GROUPED_CONTIGUOUS, 32 * 4, 32, 1, 16), 32,
                                4.0)  # a buffer as full as expected


def test_grouped_tiles_are_the_ones_indexed_runs():
    """GROUPED_CONTIGUOUS runs the tile INDEXED runs for the same call: INDEXED's default block for
    the mean rows, the regime of max(mean, block) (the small tile from 27 mean rows, where routed
    counts pass 32), and for prepared MXFP4 the tile capped at the block (16 rows up to 12 mean
    rows; bf16 and the dot_scaled kernel keep their decode tile's rows). GROUPED_MASKED given an
    expected count below its slab capacity takes that same tile where the capacity holds INDEXED's
    block, else the regime of the capacity; given none (the count is the capacity) the regime of
    its capacity and, prepared, the same cap."""
    from padded_moe import layout_codes as codes
    from padded_moe.kernels import gemm as kg
    from padded_moe.layouts import default_block_m

    class Prepared:
        def __init__(self, planes):
            self.planes = planes

    def kinds():
        yield None, False, "bf16"
        yield None, True, "mxfp4"
        for planes in (2, 4):
            yield Prepared(planes), True, kg.table_kind(True, True, planes)

    for w, mx, kind in kinds():
        capped = w is not None
        decode, small = kg.TUNED[(kind, "decode")], kg.TUNED[(kind, "small")]
        for rows in (0.25, 1, 4, 8, 12, 12.5, 13, 16, 24, 26, 27, 32, 33, 48, 64, 71, 72, 100, 128, 256, 600):
            block = default_block_m(rows, 1)
            indexed = kg.default_config(True, mx, w, codes.INDEXED, block, max(rows, block))
            contiguous = got = kg.default_config(True, mx, w, codes.GROUPED_CONTIGUOUS, 1, rows)
            tile_bm = kg.indexed_tiling(block, indexed.BM)[0]
            if not capped:
                got = dataclasses.replace(got, BM=kg.indexed_tiling(block, got.BM)[0])
            assert got == dataclasses.replace(indexed, BM=tile_bm), (kind, rows, got.short(), indexed.short())
            # capacities above the expected count (a meta never gives a count past its capacity)
            for t_max in (c for c in (4 * math.ceil(rows) + 128, math.floor(rows) + 1, block) if c > rows):
                masked = kg.default_config(True, mx, w, codes.GROUPED_MASKED, 1, rows, t_max)
                if max(rows, block) <= t_max:
                    assert masked == contiguous, (kind, rows, t_max, masked.short(), contiguous.short())
                else:  # the capacity bounds the rows: its regime, the block's cap
                    table = kg.TUNED[(kind, kg.regime(t_max))]
                    assert dataclasses.replace(masked, BM=table.BM) == table, (kind, rows, t_max, masked.short())
                    assert masked.BM == (min(table.BM, block) if capped and kg.regime(t_max) == "decode" else table.BM)
        narrow = dataclasses.replace(decode, BM=16) if capped else decode
        for rows, want in ((1, narrow), (12, narrow), (16, decode), (26, decode), (27, small), (32, small)):
            assert kg.default_config(True, mx, w, codes.GROUPED_CONTIGUOUS, 1, rows) == want, (kind, rows)
        for rows, want in ((1, narrow), (12, narrow), (16, decode), (27, decode), (32, decode), (33, small)):
            assert kg.default_config(True, mx, w, codes.GROUPED_MASKED, 1, rows) == want, (kind, rows)
            assert kg.default_config(True, mx, w, codes.GROUPED_MASKED, 1, rows, rows) == want, (kind, rows)
