"""Triton launchers of the expert-parallel stages (kernels: `padded_moe.kernels.ep`).

One `_<stage>_triton` per stage of `padded_moe.ep.stages`, which calls them on CUDA (and on CPU
under `TRITON_INTERPRET=1`): each picks the launch shape (`padded_moe.ep.tiles`) and passes the
wire views. `rank` >= 0 names this rank, whose own chunk never travels (-1: every chunk does).
"""

from __future__ import annotations

import torch

from padded_moe.ep import tiles  # _capped_grid looked up at call time: tests replace it
from padded_moe.ep.tiles import PACK_ONE_BLOCK_TOKENS, _cdiv, _k_tiles, _next_pow2, _pack_blocks, _tile
from padded_moe.ep.wire import FP8_BLOCK, EPGeometry


def _put_args(put, placeholder: torch.Tensor) -> tuple:
    """(destination table, sig, flag table, this rank) for a kernel that writes into peers
    (`padded_moe.ep.transport.PutTargets`); placeholders (valid pointers, never read) without."""
    if put is None:
        return placeholder, placeholder, placeholder, 0
    return put.table, put.sig, put.flag_table, put.rank


def _wait_args(wait, placeholder: torch.Tensor) -> tuple:
    """(sig, this rank's flags) for a kernel that first waits for the peers' writes."""
    return (placeholder, placeholder) if wait is None else (wait.sig, wait.flags)


def _fp8_tiles(geo: EPGeometry, device, row_programs, elem_size, split=True, per_sm=4):
    """K tiling for a kernel that reads or writes an fp8 wire (a slice never straddles a scale)."""
    w = geo.wire
    if not w.fp8:
        return _k_tiles(device, w.hidden_size, elem_size, row_programs, split=split, per_sm=per_sm)
    if w.scale_group == w.hidden_size:  # one scale per row: the kernel loops over all of K itself
        return _k_tiles(device, w.hidden_size, 1, row_programs, split=False)
    return _k_tiles(device, w.hidden_size, 1, row_programs, group=FP8_BLOCK, split=split, per_sm=per_sm)


def _unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its rows have unit stride (the kernels' assumption), else a contiguous copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _pack_triton(hidden, topk_ids, topk_weights, owner, geo, send_wire, token_rows, send_base, zero_counts,
                 rank, block_counts, put=None):
    from padded_moe.kernels.ep import _pack_kernel, _route_count_kernel

    R, T, w, dev = geo.ep_size, geo.max_tokens, geo.wire, hidden.device
    m, K, k = hidden.shape[0], w.hidden_size, w.top_k
    peers = R - (1 if rank >= 0 else 0)
    if peers == 0:  # a world of one that keeps its chunk: nothing to pack
        if zero_counts is not None:
            zero_counts.zero_()
        return
    hidden = _unit_stride_rows(hidden)
    x, meta_i, meta_f = w.views(send_wire)
    kp = _next_pow2(k)
    tile, bt, nb, nb_max, routed = _pack_blocks(m, T, dev)
    if routed:
        if block_counts is None:
            block_counts = torch.empty(R, nb_max, dtype=torch.int32, device=dev)
        if block_counts.shape[0] != R or block_counts.shape[1] < nb_max or block_counts.dtype != torch.int32:
            raise ValueError(f"block_counts must be int32 [{R}, >= {nb_max}], got {block_counts.dtype} "
                             f"{list(block_counts.shape)}")
        _route_count_kernel[(nb,)](topk_ids, topk_ids.stride(0), topk_ids.stride(1), owner, block_counts,
                                   m, geo.num_experts, block_counts.stride(0), R=R, TOP_K=k, KP=kp, BT=bt,
                                   num_warps=tile.num_warps)
    else:
        block_counts = token_rows  # any valid pointer: not read
    bk, kpp, ks = _fp8_tiles(geo, dev, peers * nb, hidden.element_size(), per_sm=tile.per_sm)
    zero = zero_counts if zero_counts is not None else token_rows  # any valid pointer when unused
    base = send_base if send_base is not None else token_rows
    _pack_kernel[(peers * nb, ks)](
        hidden, hidden.stride(0), topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        topk_weights, topk_weights.stride(0), topk_weights.stride(1), owner,
        x, x.stride(0), meta_i, meta_f, meta_i.stride(0), token_rows, base, block_counts,
        zero, zero_counts.numel() if zero_counts is not None else 0, *_put_args(put, token_rows),
        m, T, geo.num_experts, K, kpp, nb, block_counts.stride(0), rank,
        R=R, TOP_K=k, KP=kp, BT=bt, BK=bk, NBP=_next_pow2(nb_max),
        COUNT_COL=w.count_col, SCALE_COL=w.scale_col, HAS_BASE=send_base is not None, FP8=w.fp8,
        ROW_SCALE=w.fp8 and w.scale_group == K, ZERO=zero_counts is not None, ROUTED=routed,
        PUT=put is not None, X_BYTES=w.x_bytes, num_warps=tile.num_warps)


def _receive_flat_triton(geo, recv_wire, chunk_counts, in_band, rb_x, rb_ids, rb_w, rb_valid, rank, wait=None) -> None:
    from padded_moe.kernels.ep import _recv_flat_kernel

    R, T, w, dev = geo.ep_size, geo.max_tokens, geo.wire, recv_wire.device
    x, meta_i, meta_f = w.views(recv_wire)
    tile = _tile("recv_flat", dev)
    bt = tile.rows
    nb = _cdiv(T, bt)
    bk, kpp, ks = _fp8_tiles(geo, dev, R * nb, rb_x.element_size(), per_sm=tile.per_sm)
    _recv_flat_kernel[(R * nb, ks)](
        x, x.stride(0), meta_i, meta_f, meta_i.stride(0), chunk_counts,
        rb_x, rb_x.stride(0), rb_ids, rb_ids.stride(0), rb_w, rb_w.stride(0), rb_valid,
        *_wait_args(wait, chunk_counts), T, w.hidden_size, kpp, nb, rank,
        R=R, RP=_next_pow2(R), TOP_K=w.top_k, KP=_next_pow2(w.top_k), BT=bt, BK=bk,
        COUNT_COL=w.count_col, SCALE_COL=w.scale_col, IN_BAND=in_band, FP8=w.fp8,
        ROW_SCALE=w.fp8 and w.scale_group == w.hidden_size, GROUP=w.scale_group if w.fp8 else 1,
        WAIT=wait is not None, num_warps=tile.num_warps)


def _local_flat_triton(hidden, topk_ids, topk_weights, owner, geo, rank, rb_x, rb_ids, rb_w, token_rows, chunk_counts,
                       block_counts) -> None:
    from padded_moe.kernels.ep import _local_flat_kernel

    w, dev = geo.wire, hidden.device
    m, K = hidden.shape[0], w.hidden_size
    hidden = _unit_stride_rows(hidden)
    _, bt, nb, nb_max, routed = _pack_blocks(m, geo.max_tokens, dev)
    if routed and block_counts is None:
        raise ValueError("local_flat: block_counts (the route counts of pack_rows) is needed above "
                         f"{PACK_ONE_BLOCK_TOKENS} tokens")
    tile = _tile("local_flat", dev)
    if w.fp8 and w.scale_group != K:
        bk = FP8_BLOCK
    else:
        bk = min(_next_pow2(max(K, 1)), (1024 // rb_x.element_size()) if dev.type == "cuda" else 256)
    bc = block_counts if routed else token_rows
    _local_flat_kernel[(tiles._capped_grid(dev, nb),)](
        hidden, hidden.stride(0), topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        topk_weights, topk_weights.stride(0), topk_weights.stride(1), owner, bc,
        rb_x, rb_x.stride(0), rb_ids, rb_ids.stride(0), rb_w, rb_w.stride(0), token_rows, chunk_counts,
        rank, m, geo.max_tokens, geo.num_experts, K, nb, bc.stride(0), geo.rows,
        TOP_K=w.top_k, KP=_next_pow2(w.top_k), BT=bt, BK=bk, NBP=_next_pow2(nb_max), ROUTED=routed,
        FP8=w.fp8, ROW_SCALE=w.fp8 and w.scale_group == K, num_warps=tile.num_warps)


def _receive_batched_triton(geo, recv_wire, chunk_counts, in_band, expert_table, slab, counts, slot_rows,
                            slot_weights, rank, wait=None):
    from padded_moe.kernels.ep import _recv_batched_kernel

    R, T, w, dev = geo.ep_size, geo.max_tokens, geo.wire, recv_wire.device
    peers = R - (1 if rank >= 0 else 0)
    if peers == 0:
        return
    x, meta_i, meta_f = w.views(recv_wire)
    tile = _tile("recv_batched", dev)  # no split along K (positions come from atomics)
    bt = tile.rows
    nb = _cdiv(T, bt)
    bk, _, _ = _fp8_tiles(geo, dev, peers * nb, slab.element_size(), split=False)
    _recv_batched_kernel[(peers * nb,)](
        x, x.stride(0), meta_i, meta_f, meta_i.stride(0), chunk_counts, expert_table,
        slab, slab.stride(0), counts, slot_rows, slot_weights, slot_rows.stride(0), *_wait_args(wait, counts),
        T, geo.num_experts, w.hidden_size, nb, geo.rows, rank,
        R=R, RP=_next_pow2(R), TOP_K=w.top_k, KP=_next_pow2(w.top_k), BT=bt, BK=bk,
        COUNT_COL=w.count_col, SCALE_COL=w.scale_col, IN_BAND=in_band, FP8=w.fp8,
        ROW_SCALE=w.fp8 and w.scale_group == w.hidden_size, GROUP=w.scale_group if w.fp8 else 1,
        WAIT=wait is not None, num_warps=tile.num_warps)


def _local_batched_triton(hidden, topk_ids, topk_weights, geo, rank, expert_table, slab, counts, slot_rows,
                          slot_weights, token_rows, chunk_counts) -> None:
    from padded_moe.kernels.ep import _local_batched_kernel

    w, dev = geo.wire, hidden.device
    m, K = hidden.shape[0], w.hidden_size
    hidden = _unit_stride_rows(hidden)
    tile = _tile("local_batched", dev)
    bt = tile.rows
    if w.fp8 and w.scale_group != K:
        bk = FP8_BLOCK
    else:
        bk = min(_next_pow2(max(K, 1)), (1024 // slab.element_size()) if dev.type == "cuda" else 256)
    nb = max(1, _cdiv(m, bt))
    _local_batched_kernel[(tiles._capped_grid(dev, nb),)](
        hidden, hidden.stride(0), topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        topk_weights, topk_weights.stride(0), topk_weights.stride(1), expert_table,
        slab, slab.stride(0), counts, slot_rows, slot_weights, slot_rows.stride(0),
        token_rows, chunk_counts, rank, m, geo.max_tokens, geo.num_experts, K, geo.rows, geo.rows, nb,
        TOP_K=w.top_k, KP=_next_pow2(w.top_k), BT=bt, BK=bk, FP8=w.fp8,
        ROW_SCALE=w.fp8 and w.scale_group == K, num_warps=tile.num_warps)


def _combine_batched_triton(geo, chunk_counts, graph_safe, slot_rows, slot_weights, expert_out, comb_send,
                            rank, own_only, put=None) -> None:
    from padded_moe.kernels.ep import _combine_batched_kernel

    expert_out = _unit_stride_rows(expert_out)
    R, T, w, dev = geo.ep_size, geo.max_tokens, geo.wire, expert_out.device
    chunks = 1 if own_only else R - (1 if rank >= 0 else 0)
    if chunks == 0:
        return
    tile = _tile("combine_own" if own_only else "combine_batched", dev)  # own: overlapped, capped grid
    bt = tile.rows
    nb = _cdiv(T, bt)
    bk, kpp, ks = _k_tiles(dev, w.hidden_size, expert_out.element_size(), chunks * nb, per_sm=tile.per_sm)
    grid0 = tiles._capped_grid(dev, chunks * nb, ks) if own_only else chunks * nb
    _combine_batched_kernel[(grid0, ks)](
        expert_out, expert_out.stride(0), expert_out.stride(1), expert_out.shape[1], chunk_counts,
        slot_rows, slot_weights, slot_rows.stride(0), comb_send, comb_send.stride(0), *_put_args(put, chunk_counts),
        T, w.hidden_size, kpp, nb, chunks * nb, -1 if own_only else rank, rank if own_only else -1,
        R=R, RP=_next_pow2(R), TOP_K=w.top_k, BT=bt, BK=bk, GRAPH_SAFE=graph_safe, PUT=put is not None,
        num_warps=tile.num_warps)


def _combine_flat_triton(geo, chunk_counts, expert_out, comb_send, rank, put=None) -> None:
    from padded_moe.kernels.ep import _combine_flat_kernel

    expert_out = _unit_stride_rows(expert_out)
    R, T, K, dev = geo.ep_size, geo.max_tokens, geo.wire.hidden_size, expert_out.device
    chunks = R - (1 if rank >= 0 else 0)
    if chunks == 0:
        return
    tile = _tile("combine_flat", dev)
    bt = tile.rows
    nb = _cdiv(T, bt)
    bk, kpp, ks = _k_tiles(dev, K, expert_out.element_size(), chunks * nb, per_sm=tile.per_sm)
    _combine_flat_kernel[(chunks * nb, ks)](
        expert_out, expert_out.stride(0), chunk_counts, comb_send, comb_send.stride(0), *_put_args(put, chunk_counts),
        T, K, kpp, nb, rank, R=R, RP=_next_pow2(R), BT=bt, BK=bk, PUT=put is not None, num_warps=tile.num_warps)


def _reduce_triton(geo, comb_recv, token_rows, m, out, rank, own_rows, wait=None) -> None:
    from padded_moe.kernels.ep import _reduce_kernel

    R, rows, K, dev = geo.ep_size, geo.rows, geo.wire.hidden_size, out.device
    tile = _tile("reduce", dev)
    bt = tile.rows
    nb = max(1, _cdiv(m, bt))  # one program at least: an idle rank still waits for its peers
    bk, kpp, ks = _k_tiles(dev, K, out.element_size(), nb, per_sm=tile.per_sm)
    own = _unit_stride_rows(own_rows) if own_rows is not None else comb_recv
    _reduce_kernel[(nb, ks)](comb_recv, comb_recv.stride(0), own, own.stride(0), token_rows, token_rows.stride(0),
                             out, out.stride(0), *_wait_args(wait, token_rows), m, K, kpp, rows, rank,
                             R=R, BT=bt, BK=bk, WAIT=wait is not None, num_warps=tile.num_warps)
