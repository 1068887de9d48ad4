"""The stages of expert-parallel dispatch and combine, each with a torch implementation.

Every stage function runs the Triton launcher of `padded_moe.ep.launchers` on CUDA (and on CPU
under `TRITON_INTERPRET=1`), else its torch implementation here (the CPU/gloo path and the tests'
reference). Stages never communicate: `ExpertParallel` runs them around the transport's
`exchange`. Order per call:

- dispatch: `pack_rows` (send rows: one compacted chunk per peer, meta in-band), exchange, then
  `receive_flat` / `receive_batched`; with the own chunk kept home, `local_flat` /
  `local_batched` put this rank's tokens straight into the receive side meanwhile;
- combine: `combine_flat_rows` / `combine_batched_rows` (expert outputs back into chunk order),
  exchange, `reduce_partials` (each token's partials summed in float32).

`rank` >= 0 (keyword of every stage that has one) is this rank, whose own chunk never travels;
-1 when every chunk goes through the exchange.
"""

from __future__ import annotations

from typing import Optional

import torch

from padded_moe._platform import use_triton
from padded_moe.ep.launchers import (
    _combine_batched_triton,
    _combine_flat_triton,
    _local_batched_triton,
    _local_flat_triton,
    _pack_triton,
    _receive_batched_triton,
    _receive_flat_triton,
    _reduce_triton,
)
from padded_moe.ep.wire import EPGeometry, _dequantize_fp8, _quantize_fp8, fp8_scale_columns
from padded_moe.expert_map import guarded_lookup, sanitize_torch


def _slot_owner_torch(topk_ids: torch.Tensor, owner: torch.Tensor, E: int, R: int) -> torch.Tensor:
    """Owning rank of each slot (int64); R for invalid ids. Range check before the table read."""
    return guarded_lookup(topk_ids, E, owner, R).long()


def peer_counts(topk_ids: torch.Tensor, owner: torch.Tensor, geo: EPGeometry) -> torch.Tensor:
    """int64 [R]: how many tokens go to each peer (graph_safe=False sizes its splits with it)."""
    R = geo.ep_size
    slot_owner = _slot_owner_torch(topk_ids, owner, geo.num_experts, R)
    peers = torch.arange(R, device=topk_ids.device).view(R, 1, 1)
    return (slot_owner.unsqueeze(0) == peers).any(-1).sum(1)


def _refuse_put(targets) -> None:
    """The torch path has no put: a put transport's destinations are honoured by the kernels only."""
    if targets is not None:
        raise NotImplementedError("the put transport needs the Triton path (a CUDA device)")


# ---------------------------------------------------------------------------------------- pack
def pack_rows(hidden, topk_ids, topk_weights, owner, geo: EPGeometry, send_wire, token_rows,
              send_base: Optional[torch.Tensor] = None, zero_counts: Optional[torch.Tensor] = None, *,
              rank: int = -1, block_counts: Optional[torch.Tensor] = None, put=None) -> None:
    """Fill the send rows: chunk r holds the tokens with a slot on peer r, compacted, with their
    peer-masked ids, weights (, fp8 scales) and (graph-safe: `send_base` None) the count column of
    row r*T; `token_rows[r, t]` = send row of (t, r) or R*T. With `send_base` ([R] int32) chunks start
    at `send_base[r]` (exact splits) and no count is written. `zero_counts`: the batched counts,
    zeroed here so the receive kernels can count with atomics. `rank` >= 0: this rank, whose own
    chunk (handled by `local_batched` / `local_flat`) is not packed and its `token_rows` row is left
    as it is. `block_counts` int32 `[R, >= cdiv(m, tile rows)]`: scratch of the Triton path
    (allocated when None; `ExpertParallel` passes a persistent one, see `route_block_columns`).
    `put` (`PutTargets`, Triton path only): chunk r goes straight into peer r's receive rows, not
    `send_wire` (which then only lends its dtype and strides), and the peers are signalled."""
    if use_triton(hidden.device):
        _pack_triton(hidden, topk_ids, topk_weights, owner, geo, send_wire, token_rows, send_base, zero_counts,
                     rank, block_counts, put)
    else:
        _refuse_put(put)
        _pack_torch(hidden, topk_ids, topk_weights, owner, geo, send_wire, token_rows, send_base, rank)
        if zero_counts is not None:
            zero_counts.zero_()


def _pack_torch(hidden, topk_ids, topk_weights, owner, geo, send_wire, token_rows, send_base, rank=-1) -> None:
    R, T, k, rows, w = geo.ep_size, geo.max_tokens, geo.wire.top_k, geo.rows, geo.wire
    dev = hidden.device
    m = hidden.shape[0]
    x, meta_i, meta_f = w.views(send_wire)
    slot_owner = _slot_owner_torch(topk_ids, owner, geo.num_experts, R)        # [m, k] in [0, R]
    to_peer = (slot_owner.unsqueeze(0) == torch.arange(R, device=dev).view(R, 1, 1)).any(-1)   # [R, m]
    pos = torch.cumsum(to_peer, dim=1) - 1                                       # row inside the chunk
    base = send_base.long() if send_base is not None else torch.arange(R, device=dev) * T
    tr = torch.where(to_peer, base.view(R, 1) + pos, torch.full_like(pos, rows))  # [R, m]
    packed = [r for r in range(R) if r != rank]
    token_rows[packed, :m] = tr[packed].to(torch.int32)
    if send_base is None:  # the chunk's count, in-band on its first row (also when it is 0)
        meta_i[torch.arange(R, device=dev) * T, w.count_col] = to_peer.sum(1).to(torch.int32)
    if m == 0:
        return
    # Invert token_rows: which token (and for which peer) fills each send row; unsent pairs land
    # on the dump slot `rows`. Rows no token fills are written too (never read by the receiver).
    flat = tr.reshape(-1)
    src_tok = torch.zeros(rows + 1, dtype=torch.int64, device=dev)
    src_tok.scatter_(0, flat, torch.arange(m, device=dev).repeat(R))
    row_peer = torch.full((rows + 1,), -1, dtype=torch.int64, device=dev)
    row_peer.scatter_(0, flat, torch.arange(R, device=dev).repeat_interleave(m))
    src_tok, row_peer = src_tok[:rows], row_peer[:rows]
    keep = slot_owner.index_select(0, src_tok) == row_peer.unsqueeze(1)         # [rows, k]
    ids = topk_ids.index_select(0, src_tok)
    # ids kept are in [0, E): narrowing to int32 after the mask is safe.
    meta_i[:, :k] = torch.where(keep, ids, torch.full_like(ids, -1)).to(torch.int32)
    wts = topk_weights.index_select(0, src_tok).to(torch.float32)
    meta_f[:, k:2 * k] = torch.where(keep, wts, torch.zeros_like(wts))
    rows_x = hidden.index_select(0, src_tok)
    if w.fp8:
        q, scales = _quantize_fp8(rows_x)
        w.x_bytes_view(send_wire).copy_(q)
        meta_f[:, w.scale_col:w.scale_col + scales.shape[1]] = scales
    else:
        x.copy_(rows_x)


# ---------------------------------------------------------------------------------------- receive
def _received_counts_torch(geo, meta_i, chunk_counts, in_band: bool, rank: int = -1) -> torch.Tensor:
    """int64 [R] valid rows per source chunk, clamped to [0, T]; in-band ones are stored too
    (except this rank's (`rank` >= 0), whose chunk never arrived: its count is `chunk_counts`' own)."""
    R, T = geo.ep_size, geo.max_tokens
    if in_band:
        cnt = meta_i[torch.arange(R, device=meta_i.device) * T, geo.wire.count_col].long().clamp(0, T)
        if rank >= 0:
            cnt[rank] = chunk_counts[rank].long().clamp(0, T)
        chunk_counts.copy_(cnt.to(torch.int32))
    else:
        cnt = chunk_counts.long().clamp(0, T)
    return cnt


def _valid_recv_rows_torch(geo, cnt, graph_safe: bool) -> torch.Tensor:
    """bool [R*T]: which rows of the receive buffer hold a real token."""
    T = geo.max_tokens
    i = torch.arange(geo.rows, device=cnt.device)
    if graph_safe:
        return (i % T) < cnt[i // T]
    return i < cnt.sum()


def _decode_rows_torch(geo, wire, src) -> torch.Tensor:
    """Received rows `src` in `dtype` (dequantized when the wire is fp8)."""
    w = geo.wire
    if w.fp8:
        q = w.x_bytes_view(wire).index_select(0, src)
        _, _, meta_f = w.views(wire)
        scales = meta_f[:, w.scale_col:w.scale_col + fp8_scale_columns(w.hidden_size)].index_select(0, src)
        return _dequantize_fp8(q, scales, w.dtype)
    x, _, _ = w.views(wire)
    return x.index_select(0, src)


def receive_flat(geo: EPGeometry, recv_wire, chunk_counts, in_band: bool, rb_x, rb_ids, rb_w, rb_valid, *,
                 rank: int = -1, wait=None) -> None:
    """Compact the R received chunks: rows `[0, valid)` of rb_x / rb_ids / rb_w are the real rows in
    source-rank order; ids -1 and weights 0 on rows `[valid, R*T)` (their x is not written).
    Counts: the in-band column (`in_band`, stored into `chunk_counts`) or `chunk_counts` (exact
    splits: chunks back to back). `rank` >= 0: this rank, whose chunk never travelled; `local_flat`
    already put its rows first (count in `chunk_counts[rank]`), the others follow by rank. `wait`
    (`PutTargets`, Triton path only): first wait until every peer's put of this call has landed."""
    if use_triton(recv_wire.device):
        _receive_flat_triton(geo, recv_wire, chunk_counts, in_band, rb_x, rb_ids, rb_w, rb_valid, rank, wait)
    else:
        _refuse_put(wait)
        _receive_flat_torch(geo, recv_wire, chunk_counts, in_band, rb_x, rb_ids, rb_w, rb_valid, rank)


def _compaction_order(R: int, rank: int) -> list:
    """Chunks in compaction order: this rank's first (when `rank` >= 0), then the others by rank."""
    return ([rank] if rank >= 0 else []) + [r for r in range(R) if r != rank]


def _receive_flat_torch(geo, recv_wire, chunk_counts, in_band, rb_x, rb_ids, rb_w, rb_valid, rank=-1) -> None:
    R, T, k, rows = geo.ep_size, geo.max_tokens, geo.wire.top_k, geo.rows
    _, meta_i, meta_f = geo.wire.views(recv_wire)
    cnt = _received_counts_torch(geo, meta_i, chunk_counts, in_band, rank)
    dev = cnt.device
    order = torch.tensor(_compaction_order(R, rank), device=dev)
    cnt_o = cnt[order]
    incl = torch.cumsum(cnt_o, 0)
    pre_o, total = incl - cnt_o, incl[-1]
    d = torch.arange(rows, device=dev)
    slot = torch.searchsorted(incl, d, right=True).clamp(max=R - 1)             # order slot of compacted row d
    r_of = order[slot]
    # Where chunk r sits in the receive buffer: at r*T, or back to back (exact splits, rank order).
    base = torch.arange(R, device=dev) * T if in_band else torch.cumsum(cnt, 0) - cnt
    valid = d < total
    copy = valid & (r_of != rank)
    src = torch.where(copy, base[r_of] + d - pre_o[slot], torch.zeros_like(d))
    v = copy.unsqueeze(1)
    rb_x.copy_(torch.where(v, _decode_rows_torch(geo, recv_wire, src), rb_x))
    ids = meta_i[:, :k].index_select(0, src)
    rb_ids.copy_(torch.where(v, ids, torch.where(valid.unsqueeze(1), rb_ids, torch.full_like(ids, -1))))
    wts = meta_f[:, k:2 * k].index_select(0, src)
    rb_w.copy_(torch.where(v, wts, torch.where(valid.unsqueeze(1), rb_w, torch.zeros_like(wts))))
    rb_valid.copy_(total.view(1).to(torch.int32))


def local_flat(hidden, topk_ids, topk_weights, owner, geo: EPGeometry, rank: int, rb_x, rb_ids, rb_w, token_rows,
               chunk_counts, block_counts: Optional[torch.Tensor] = None) -> None:
    """Flat mode's own tokens straight into the receive rows (they never travel): the tokens with a
    slot on this rank (`rank`) take rows `[0, count)` in token order (its chunk comes first in the
    compaction), ids masked to `rank` (-1 elsewhere) and their weights; `token_rows[rank, t]` =
    that row (the expert output's row the reduction reads; the pad `R*T` when token t has no slot
    here), `chunk_counts[rank]` = the count. An fp8 wire's rounding is applied all the same. Triton path:
    `block_counts` are the route counts `pack_rows` just wrote (same blocks)."""
    if use_triton(hidden.device):
        _local_flat_triton(hidden, topk_ids, topk_weights, owner, geo, rank, rb_x, rb_ids, rb_w, token_rows,
                           chunk_counts, block_counts)
        return
    m, dev = hidden.shape[0], hidden.device
    mine = _slot_owner_torch(topk_ids, owner, geo.num_experts, geo.ep_size) == rank    # [m, k]
    sent = mine.any(1)
    pos = torch.cumsum(sent.long(), 0) - 1
    chunk_counts[rank] = int(sent.sum())
    token_rows[rank, :m] = torch.where(sent, pos, torch.full_like(pos, geo.rows)).to(torch.int32)
    rows = pos[sent]
    x = hidden[sent]
    if geo.wire.fp8 and x.shape[0]:
        q, scales = _quantize_fp8(x)
        x = _dequantize_fp8(q, scales, hidden.dtype)
    rb_x[rows] = x.to(rb_x.dtype)
    rb_ids[rows] = torch.where(mine, topk_ids, torch.full_like(topk_ids, -1))[sent].to(torch.int32)
    rb_w[rows] = torch.where(mine, topk_weights.float(), torch.zeros((), device=dev))[sent]


def receive_batched(geo: EPGeometry, recv_wire, chunk_counts, in_band: bool, expert_table, num_local: int,
                    slab, counts, slot_rows, slot_weights, *, rank: int = -1, wait=None) -> None:
    """Scatter every (received row, local expert) pair into the expert's slab (`slab` rows
    `e*R*T + pos`, one row per (token, expert) even when ids repeat), counting on from `counts`
    (zero before the first writer: the pack step zeroes it), and record each slot's slab row in
    `slot_rows` (-1 for non-local slots) and its router weight in `slot_weights` (0 there); rows of
    padding are untouched. `rank` >= 0: this rank, whose chunk is not read (`local_batched` did it).
    `wait`: as in `receive_flat`."""
    if use_triton(recv_wire.device):
        _receive_batched_triton(geo, recv_wire, chunk_counts, in_band, expert_table, slab, counts, slot_rows,
                                slot_weights, rank, wait)
    else:
        _refuse_put(wait)
        _receive_batched_torch(geo, recv_wire, chunk_counts, in_band, expert_table, num_local, slab, counts,
                               slot_rows, slot_weights, rank)


def _append_to_slabs_torch(local, x_rows, L, slab, counts, slot_rows, slot_weights, weights, rows_of) -> None:
    """torch path of the slab scatter: `local` [n, k] local expert per slot (L = not local),
    `x_rows` [n, K] the rows, written at `rows_of` [n] of slot_rows / slot_weights."""
    slab_rows = slab.shape[0] - 1 if L == 0 else (slab.shape[0] - 1) // L
    keep = local < L
    slot_weights[rows_of] = torch.where(keep, weights.float(), torch.zeros((), device=weights.device))
    if L == 0:
        slot_rows[rows_of] = -1
        return
    present = torch.zeros(local.shape[0], L + 1, dtype=torch.int32, device=local.device)
    present.scatter_(1, local, 1)       # one row per (token, expert) even if ids repeat
    present = present[:, :L]
    pos = counts.view(1, L) + torch.cumsum(present, 0, dtype=torch.int32) - 1   # [n, L]
    counts += present.sum(0, dtype=torch.int32)
    slot_pos = pos.gather(1, local.clamp(max=L - 1)).long()
    srow = torch.where(keep, local * slab_rows + slot_pos, torch.full_like(local, -1))
    slot_rows[rows_of] = srow.to(torch.int32)
    dump = L * slab_rows
    for j in range(local.shape[1]):  # k row copies; non-local slots land on the dump row
        slab.index_copy_(0, torch.where(keep[:, j], srow[:, j], dump), x_rows)


def _receive_batched_torch(geo, recv_wire, chunk_counts, in_band, expert_table, L, slab, counts, slot_rows,
                           slot_weights, rank=-1):
    k, rows, T, dev = geo.wire.top_k, geo.rows, geo.max_tokens, recv_wire.device
    _, meta_i, meta_f = geo.wire.views(recv_wire)
    cnt = _received_counts_torch(geo, meta_i, chunk_counts, in_band, rank)
    valid = _valid_recv_rows_torch(geo, cnt, in_band)
    if rank >= 0:
        valid &= torch.arange(rows, device=dev) // T != rank
    src = torch.nonzero(valid).flatten()
    ids = meta_i[:, :k].index_select(0, src)
    local = sanitize_torch(ids, geo.num_experts, L, expert_table, None).long()  # [n, k], L = dropped
    _append_to_slabs_torch(local, _decode_rows_torch(geo, recv_wire, src), L, slab, counts, slot_rows,
                           slot_weights, meta_f[:, k:2 * k].index_select(0, src), src)


def local_batched(hidden, topk_ids, topk_weights, geo: EPGeometry, rank: int, expert_table, num_local: int,
                  slab, counts, slot_rows, slot_weights, token_rows, chunk_counts) -> None:
    """This rank's own tokens straight into its slabs, as if they were chunk `rank` of the receive
    buffer with token t at row `rank*T + t` (they never travel): the slab scatter of
    `receive_batched` (counting on from `counts`), `slot_rows / slot_weights[rank*T + t]`,
    `token_rows[rank, t]` (`rank*T + t`, or the pad `R*T` when token t has no local slot) and
    `chunk_counts[rank] = m`. An fp8 wire's rounding is applied all the same (e4m3(x/s)·s), so a
    result never depends on where its expert lives."""
    if use_triton(hidden.device):
        _local_batched_triton(hidden, topk_ids, topk_weights, geo, rank, expert_table, slab, counts, slot_rows,
                              slot_weights, token_rows, chunk_counts)
    else:
        _local_batched_torch(hidden, topk_ids, topk_weights, geo, rank, expert_table, num_local, slab, counts,
                             slot_rows, slot_weights, token_rows, chunk_counts)


def _local_batched_torch(hidden, topk_ids, topk_weights, geo, rank, expert_table, L, slab, counts, slot_rows,
                         slot_weights, token_rows, chunk_counts) -> None:
    m, T, dev = hidden.shape[0], geo.max_tokens, hidden.device
    chunk_counts[rank] = m
    if m == 0:
        return
    local = sanitize_torch(topk_ids, geo.num_experts, L, expert_table, None).long()   # [m, k], L = dropped
    t = torch.arange(m, device=dev)
    token_rows[rank, :m] = torch.where((local < L).any(1), rank * T + t, geo.rows).to(torch.int32)
    x = hidden
    if geo.wire.fp8:
        q, scales = _quantize_fp8(hidden)
        x = _dequantize_fp8(q, scales, hidden.dtype)
    _append_to_slabs_torch(local, x.to(slab.dtype), L, slab, counts, slot_rows, slot_weights, topk_weights,
                           rank * T + t)


# ---------------------------------------------------------------------------------------- combine
def combine_flat_rows(geo: EPGeometry, chunk_counts, expert_out, comb_send, *, rank: int = -1, put=None) -> None:
    """Graph-safe flat combine: `comb_send[r*T + p] = expert_out[start_r + p]` for `p < count_r`
    (compacted rows back into chunk order; other rows untouched). `rank` >= 0: this rank's chunk
    came first in the compaction and stays where it is (the reduction reads it from `expert_out`).
    `put`: as in `pack_rows` (chunk r goes into peer r's combine receive rows)."""
    if use_triton(expert_out.device):
        _combine_flat_triton(geo, chunk_counts, expert_out, comb_send, rank, put)
        return
    _refuse_put(put)
    R, T = geo.ep_size, geo.max_tokens
    cnt = chunk_counts.long().clamp(0, T)
    order = torch.tensor(_compaction_order(R, rank), device=cnt.device)
    pre = torch.empty_like(cnt)
    pre[order] = torch.cumsum(cnt[order], 0) - cnt[order]
    i = torch.arange(geo.rows, device=cnt.device)
    r, p = i // T, i % T
    valid = (p < cnt[r]) & (r != rank)
    src = torch.where(valid, pre[r] + p, torch.zeros_like(p))
    comb_send.copy_(torch.where(valid.unsqueeze(1), expert_out.index_select(0, src), comb_send))


def combine_batched_rows(geo: EPGeometry, chunk_counts, graph_safe: bool, slot_rows, slot_weights,
                         expert_out, comb_send, *, rank: int = -1, own_only: bool = False, put=None) -> None:
    """Batched combine, receiver side: `comb_send[i] = Σ_j slot_weights[i,j] · Y[slot_rows[i,j]]`
    over the local slots of every valid received row `i` (fp32). `rank` >= 0: every chunk but this
    rank's, or (`own_only`) this rank's alone (the overlapped combine does its own chunk while the
    others travel). `put`: as in `combine_flat_rows`."""
    if own_only and rank < 0:
        raise ValueError("combine_batched_rows: own_only needs rank >= 0 (the chunk to combine)")
    if use_triton(expert_out.device):
        _combine_batched_triton(geo, chunk_counts, graph_safe, slot_rows, slot_weights, expert_out, comb_send,
                                rank, own_only, put)
        return
    _refuse_put(put)
    k, K, rows, T = geo.wire.top_k, geo.wire.hidden_size, geo.rows, geo.max_tokens
    cnt = chunk_counts.long().clamp(0, T)
    valid = _valid_recv_rows_torch(geo, cnt, graph_safe)
    chunk = torch.arange(rows, device=valid.device) // T  # graph-safe rows; exact mode never selects
    if rank >= 0:
        valid &= (chunk == rank) if own_only else (chunk != rank)
    flat = expert_out.reshape(-1, K)
    acc = torch.zeros(rows, K, dtype=torch.float32, device=expert_out.device)
    if flat.shape[0]:
        for j in range(k):
            sr = slot_rows[:, j].long()
            keep = (valid & (sr >= 0)).unsqueeze(1)
            y = flat.index_select(0, torch.where(keep[:, 0], sr, 0)).float() * slot_weights[:, j:j + 1]
            # where, not a multiply by 0: rows past a count may hold NaN and must not leak.
            acc += torch.where(keep, y, torch.zeros((), device=acc.device))
    comb_send.copy_(torch.where(valid.unsqueeze(1), acc.to(comb_send.dtype), comb_send))


def reduce_partials(geo: EPGeometry, comb_recv, token_rows, m: int, out, *, rank: int = -1,
                    own_rows: Optional[torch.Tensor] = None, wait=None) -> None:
    """Sender side: `out[t] = Σ_r partial_r[token_rows[r, t]]` over peers that got token t (fp32);
    partials come from `comb_recv`, except this rank's own (`rank` >= 0), which never
    travelled: rows of `own_rows` (batched: the combine send buffer; flat: the expert output).
    `wait`: as in `receive_flat` (it runs on an idle rank too: m == 0 still waits)."""
    R, rows, K = geo.ep_size, geo.rows, geo.wire.hidden_size
    if rank >= 0 and own_rows is None:
        raise ValueError("reduce_partials: rank >= 0 needs own_rows (where that partial stayed)")
    if not use_triton(out.device):
        _refuse_put(wait)
    if m == 0 and wait is None:
        return
    if use_triton(out.device):
        _reduce_triton(geo, comb_recv, token_rows, m, out, rank, own_rows, wait)
        return
    tr = token_rows[:, :m].long()
    keep = (tr >= 0) & (tr < rows)
    idx = torch.where(keep, tr, torch.zeros_like(tr))
    parts = torch.stack([(own_rows if r == rank else comb_recv).index_select(0, idx[r]) for r in range(R)])
    out.copy_(torch.where(keep.unsqueeze(-1), parts.float(), torch.zeros((), device=out.device)).sum(0))
