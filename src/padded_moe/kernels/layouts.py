"""Triton kernels for the GEMM layouts (`GemmLayout`): guard + stable counting sort, row scatter, weighted gather.

`build_layout` is three launches, none of which needs a zeroed buffer or an atomic, so the result is
deterministic and identical to the torch path (within an expert, slots keep increasing slot order):

1. `_count_kernel` (one program per CHUNK slots): the invalid-id guard, the chunk's histogram over
   local experts (one-hot compare + reduce), and every slot's rank among the earlier slots of the same expert in its chunk.
2. `_scan_kernel` (one program): per expert, an exclusive scan of the chunk histograms (where each
   chunk starts inside its expert), then the scan over experts: offsets / padded offsets / counts.
3. `_place_kernel` (one program per chunk, then one per PBLK positions): every kept slot's final row
   (`inv`, `src`, `sorted_ids`); the position programs write the sentinels of padding rows and
   `block_expert`. The two sets of programs write disjoint addresses, so they need no ordering.

Up to one chunk of slots (decode batches), `_build_one_chunk_kernel` does the three steps in one
program, with a block barrier between them: one launch instead of three, where each launch costs
more than its work. Both paths share the step bodies (`_count_chunk`, `_scan_kernel` called as a
function, `_place_chunk`, `_place_positions`) and give identical buffers.

`_permute_kernel` reads each token's row once and stores it to its k destinations;
`_unpermute_kernel` gathers a token's k rows and accumulates in fp32. Both stride over tokens.
"""

from __future__ import annotations

import triton
import triton.language as tl

from padded_moe.kernels._codes import GROUPED_CONTIGUOUS, GROUPED_MASKED, INDEXED
from padded_moe.kernels.guard import clamp_count, slot_local_expert


@triton.jit
def _count_chunk(c, ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr,
                 slot_expert_ptr, rank_ptr, chunk_cnt_ptr,
                 S, E, L,
                 TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, HAS_VT: tl.constexpr,
                 CHUNK: tl.constexpr, L_PAD: tl.constexpr, BIN_TILE: tl.constexpr):
    i = tl.arange(0, CHUNK)
    s = c * CHUNK + i
    smask = s < S
    e = slot_local_expert(ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr, s, smask, E, L, TOP_K, HAS_MAP, HAS_VT)
    tl.store(slot_expert_ptr + s, e, mask=smask)
    # Stable rank inside the chunk: how many earlier slots of this chunk went to the same expert.
    earlier_same = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    tl.store(rank_ptr + s, rank, mask=smask)
    # Histogram by one-hot compare + reduce over tiles of bins (deterministic, no atomics, and no
    # reliance on tl.histogram's layout-dependent lowering). Dropped slots hold e = L: no bin < L.
    for b0 in range(0, L_PAD, BIN_TILE):
        bins = b0 + tl.arange(0, BIN_TILE)
        hist = tl.sum((e[:, None] == bins[None, :]).to(tl.int32), axis=0)
        tl.store(chunk_cnt_ptr + c * L + bins, hist, mask=bins < L)


@triton.jit
def _count_kernel(ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr,
                  slot_expert_ptr, rank_ptr, chunk_cnt_ptr,
                  S, E, L,
                  TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, HAS_VT: tl.constexpr,
                  CHUNK: tl.constexpr, L_PAD: tl.constexpr, BIN_TILE: tl.constexpr):
    _count_chunk(tl.program_id(0), ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr, slot_expert_ptr, rank_ptr,
                 chunk_cnt_ptr, S, E, L, TOP_K, HAS_MAP, HAS_VT, CHUNK, L_PAD, BIN_TILE)


@triton.jit
def _scan_kernel(chunk_cnt_ptr, chunk_base_ptr, counts_ptr, offs32_ptr, offsets64_ptr,
                 num_padded_ptr, act_ptr, overflow_ptr, vt_ptr,
                 NB, L, M, T_MAX,
                 LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, TOP_K: tl.constexpr,
                 HAS_VT: tl.constexpr, L_PAD: tl.constexpr, NB_TILE: tl.constexpr):
    cols = tl.arange(0, L_PAD)
    cmask = cols < L
    carry = tl.zeros([L_PAD], dtype=tl.int32)
    # Column-wise exclusive scan over chunks: where chunk c's slots start inside expert e.
    for c0 in range(0, NB, NB_TILE):
        rows = c0 + tl.arange(0, NB_TILE)
        m2 = (rows < NB)[:, None] & cmask[None, :]
        off2 = rows[:, None] * L + cols[None, :]
        tile = tl.load(chunk_cnt_ptr + off2, mask=m2, other=0)
        incl = tl.cumsum(tile, axis=0)
        tl.store(chunk_base_ptr + off2, incl - tile + carry[None, :], mask=m2)
        carry += tl.sum(tile, axis=0)
    counts = carry
    if LAYOUT == GROUPED_MASKED:
        # Slots past an expert's capacity are dropped (and counted in `overflow`).
        clamped = tl.minimum(counts, T_MAX)
        tl.store(counts_ptr + cols, clamped, mask=cmask)
        tl.store(overflow_ptr, tl.sum(counts - clamped, axis=0))
    else:
        tl.store(counts_ptr + cols, counts, mask=cmask)
        if LAYOUT == INDEXED:
            sizes = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        else:
            sizes = counts
        incl = tl.cumsum(sizes, axis=0)
        total = tl.sum(sizes, axis=0)
        tl.store(offs32_ptr + cols, incl - sizes, mask=cmask)
        tl.store(offs32_ptr + L, total)
        if LAYOUT == GROUPED_CONTIGUOUS:
            tl.store(offsets64_ptr + cols, (incl - sizes).to(tl.int64), mask=cmask)
            tl.store(offsets64_ptr + L, total.to(tl.int64))
        else:
            tl.store(num_padded_ptr, total)
            n_tok = M
            if HAS_VT:
                n_tok = clamp_count(tl.load(vt_ptr), M)
            tl.store(act_ptr, n_tok * TOP_K)


@triton.jit
def _place_chunk(c, slot_expert_ptr, rank_ptr, chunk_base_ptr, offs32_ptr, inv_ptr, src_ptr, sorted_ids_ptr,
                 S, L, T_MAX, LAYOUT: tl.constexpr, CHUNK: tl.constexpr):
    s = c * CHUNK + tl.arange(0, CHUNK)
    smask = s < S
    e = tl.load(slot_expert_ptr + s, mask=smask, other=L)
    kept = smask & (e < L)
    r = tl.load(rank_ptr + s, mask=kept, other=0) + tl.load(chunk_base_ptr + c * L + e, mask=kept, other=0)
    if LAYOUT == GROUPED_MASKED:
        fits = kept & (r < T_MAX)
        tl.store(inv_ptr + s, tl.where(fits, e * T_MAX + r, L * T_MAX), mask=smask)
    else:
        pos = tl.load(offs32_ptr + e, mask=kept, other=0) + r
        if LAYOUT == GROUPED_CONTIGUOUS:
            tl.store(inv_ptr + s, tl.where(kept, pos, S), mask=smask)
            tl.store(src_ptr + pos, s, mask=kept)
        else:
            tl.store(sorted_ids_ptr + pos, s, mask=kept)


@triton.jit
def _place_positions(q, counts_ptr, offs32_ptr, src_ptr, sorted_ids_ptr, block_expert_ptr, S, L, CAP,
                     LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, PBLK: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    p = q * PBLK + tl.arange(0, PBLK)
    total = tl.load(offs32_ptr + L)
    if LAYOUT == GROUPED_CONTIGUOUS:
        tl.store(src_ptr + p, S, mask=(p < S) & (p >= total))
    else:
        pm = p < CAP
        if q * PBLK < total:
            # Owner of position p: the largest e in [0, L) with padded_offset[e] <= p
            # (empty experts share their offset with the next one, so "largest" picks the owner).
            lo = tl.zeros([PBLK], dtype=tl.int32)
            hi = tl.zeros([PBLK], dtype=tl.int32) + (L - 1)
            for _ in tl.static_range(SEARCH_STEPS):
                mid = (lo + hi + 1) // 2
                v = tl.load(offs32_ptr + mid, mask=pm & (mid >= 0), other=0)
                go = v <= p
                lo = tl.where(go, mid, lo)
                hi = tl.where(go, hi, mid - 1)
            used = pm & (p < total)
            start = tl.load(offs32_ptr + lo, mask=used, other=0)
            cnt = tl.load(counts_ptr + lo, mask=used, other=0)
            padding = pm & ((p >= total) | (p - start >= cnt))
            tl.store(sorted_ids_ptr + p, S, mask=padding)
            tl.store(block_expert_ptr + p // BLOCK_M, tl.where(used, lo, -1), mask=pm & (p % BLOCK_M == 0))
        else:
            # The whole tile lies past the last expert's padded rows (most of the capacity at
            # decode, which reserves BLOCK_M-1 padding rows per expert): no owner to search for.
            tl.store(sorted_ids_ptr + p, S, mask=pm)
            tl.store(block_expert_ptr + p // BLOCK_M, tl.full([PBLK], -1, tl.int32), mask=pm & (p % BLOCK_M == 0))


@triton.jit
def _place_kernel(slot_expert_ptr, rank_ptr, chunk_base_ptr, counts_ptr, offs32_ptr,
                  inv_ptr, src_ptr, sorted_ids_ptr, block_expert_ptr,
                  S, L, NB, T_MAX, CAP,
                  LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  PBLK: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    pid = tl.program_id(0)
    if pid < NB:
        _place_chunk(pid, slot_expert_ptr, rank_ptr, chunk_base_ptr, offs32_ptr, inv_ptr, src_ptr, sorted_ids_ptr,
                     S, L, T_MAX, LAYOUT, CHUNK)
    else:
        _place_positions(pid - NB, counts_ptr, offs32_ptr, src_ptr, sorted_ids_ptr, block_expert_ptr, S, L, CAP,
                         LAYOUT, BLOCK_M, PBLK, SEARCH_STEPS)


@triton.jit
def _build_one_chunk_kernel(ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr,
                            slot_expert_ptr, rank_ptr, chunk_cnt_ptr, chunk_base_ptr, counts_ptr, offs32_ptr,
                            offsets64_ptr, num_padded_ptr, act_ptr, overflow_ptr,
                            inv_ptr, src_ptr, sorted_ids_ptr, block_expert_ptr,
                            S, E, L, M, T_MAX, CAP, N_POS,
                            LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, TOP_K: tl.constexpr,
                            HAS_MAP: tl.constexpr, HAS_VT: tl.constexpr, CHUNK: tl.constexpr,
                            L_PAD: tl.constexpr, BIN_TILE: tl.constexpr, PBLK: tl.constexpr,
                            SEARCH_STEPS: tl.constexpr):
    # The three kernels' work for S <= CHUNK in one program. Each phase reads what the previous
    # one stored to global memory; the barrier (bar.sync) makes a block's global stores visible to
    # all of its threads.
    _count_chunk(0, ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr, slot_expert_ptr, rank_ptr, chunk_cnt_ptr,
                 S, E, L, TOP_K, HAS_MAP, HAS_VT, CHUNK, L_PAD, BIN_TILE)
    tl.debug_barrier()
    _scan_kernel(chunk_cnt_ptr, chunk_base_ptr, counts_ptr, offs32_ptr, offsets64_ptr, num_padded_ptr, act_ptr,
                 overflow_ptr, vt_ptr, 1, L, M, T_MAX, LAYOUT, BLOCK_M, TOP_K, HAS_VT, L_PAD, 1)
    tl.debug_barrier()
    _place_chunk(0, slot_expert_ptr, rank_ptr, chunk_base_ptr, offs32_ptr, inv_ptr, src_ptr, sorted_ids_ptr,
                 S, L, T_MAX, LAYOUT, CHUNK)
    for q in range(N_POS):
        _place_positions(q, counts_ptr, offs32_ptr, src_ptr, sorted_ids_ptr, block_expert_ptr, S, L, CAP,
                         LAYOUT, BLOCK_M, PBLK, SEARCH_STEPS)


@triton.jit
def _permute_kernel(h_ptr, stride_hm, out_ptr, stride_o0, stride_o1, inv_ptr,
                    M, K, ROW_LIMIT, SLAB_ROWS,
                    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    jj = tl.arange(0, K_PAD)
    for t in range(pid, M, nprog):
        rows = tl.load(inv_ptr + t * TOP_K + jj, mask=jj < TOP_K, other=ROW_LIMIT)
        # A token with no kept slot (padding row, all experts remote) is never read: it may be NaN.
        any_kept = tl.sum((rows < ROW_LIMIT).to(tl.int32), axis=0) > 0
        src = h_ptr + tl.cast(t, tl.int64) * stride_hm
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cm = cols < K
            x = tl.load(src + cols, mask=cm & any_kept)
            for j in tl.static_range(TOP_K):
                r = tl.load(inv_ptr + t * TOP_K + j)
                # [S, K] is one slab of S rows; [L, T, K] is L slabs of T rows.
                dst = out_ptr + (r // SLAB_ROWS).to(tl.int64) * stride_o0 + (r % SLAB_ROWS).to(tl.int64) * stride_o1
                tl.store(dst + cols, x, mask=cm & (r < ROW_LIMIT))


@triton.jit
def _unpermute_kernel(y_ptr, stride_y0, stride_y1, SLAB_ROWS, w_ptr, stride_wm, stride_wk,
                      out_ptr, stride_om, rows_ptr, slot_expert_ptr, vt_ptr,
                      M, K, L, ROW_LIMIT,
                      TOP_K: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_VT: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_tok = M
    if HAS_VT:
        # Tokens at/after valid_tokens are not written at all.
        n_tok = clamp_count(tl.load(vt_ptr), M)
    for t in range(pid, n_tok, nprog):
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cm = cols < K
            acc = tl.zeros([BLOCK_K], dtype=tl.float32)
            for j in tl.static_range(TOP_K):
                s = t * TOP_K + j
                if HAS_ROWS:
                    r = tl.load(rows_ptr + s)
                    kept = r < ROW_LIMIT
                else:
                    r = s
                    kept = tl.load(slot_expert_ptr + s) < L
                w = tl.load(w_ptr + t * stride_wm + j * stride_wk).to(tl.float32)
                src = y_ptr + (r // SLAB_ROWS).to(tl.int64) * stride_y0 + (r % SLAB_ROWS).to(tl.int64) * stride_y1
                y = tl.load(src + cols, mask=cm & kept, other=0.0).to(tl.float32)
                # Select, never multiply by zero: a dropped row may hold NaN (never computed).
                acc += tl.where(kept, y * w, 0.0)
            tl.store(out_ptr + tl.cast(t, tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=cm)
