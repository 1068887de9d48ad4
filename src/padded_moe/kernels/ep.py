"""Triton kernels for expert-parallel dispatch / combine. Host logic: `padded_moe.ep`.

Wire format (see `padded_moe.ep.wire.WireFormat`): one uint8 row of `row_bytes` per (token, peer),
`x` in the wire dtype first, then int32 "meta" columns: `TOP_K` global ids (-1 for slots owned by
another rank), `TOP_K` router weights (float32 bits), the chunk's valid-row count at column
`COUNT_COL` (meaningful on a chunk's first row only) and, for an fp8 wire, float32 scales from
`SCALE_COL`. Kernels get three strided views of the same bytes: `x` (wire dtype), meta as int32 and
meta as float32.

Chunks: sender rank r's chunk for peer d holds the rows of the tokens with at least one slot on d,
compacted to the front. Graph-safe mode puts chunk d at rows `[d*T, d*T + T)` and the count in-band;
exact mode (graph_safe=False) packs chunks back to back from `base[d]` (counts exchanged earlier).

Kernels (every program's rows are independent; no grid-wide synchronisation):

- `_route_count_kernel` grid (NB,): per token block, how many of its tokens go to each peer
  (only when m > PACK_ONE_BLOCK_TOKENS; below, the pack has one block per peer).
- `_pack_kernel` grid (peers * NB, KS): peer r (every peer, or every peer but SKIP), token block b,
  K slice kz. Range-checks the ids, finds each slot's owner, the token's position inside chunk r
  (an in-block `tl.cumsum` plus the earlier blocks' route counts), copies (or fp8-quantizes) the
  row slice, and (kz == 0) writes the meta, `token_rows[r, t]` and the chunk count; optionally
  zeroes the batched counts.
- `_recv_flat_kernel` grid (R * NB, KS): compacts the R received chunks into `rb_x/ids/weights`
  rows `[0, valid)`, writes -1 / 0 meta into rows `[valid, R*T)`, `valid_tokens` and the counts;
  with OWN >= 0 that chunk's rows are already first (only its padding meta is written here).
- `_local_flat_kernel` grid (capped, looping over the pack's token blocks): flat mode's own tokens
  straight from `hidden` to the front of the receive rows (the flat own-chunk overlap).
- `_recv_batched_kernel` grid (peers * NB,): scatters every (received row, local expert) pair into
  the expert's slab (atomic position; a repeated id of one token shares the first one's row) and
  records each slot's slab row and router weight for combine.
- `_local_batched_kernel` grid (capped, looping over token blocks): the same scatter for this
  rank's own tokens, read from `hidden` (batched graph-safe mode keeps them out of the
  all_to_all and runs this while the peers' chunks travel).
- `_combine_flat_kernel` grid (chunks * NB, KS): compacted expert output rows back into chunk order
  (the peers' chunks only, when the own chunk stayed).
- `_combine_batched_kernel` grid (chunks * NB, KS), or capped and looping for the own chunk:
  Σ_j w_j · Y[slot_row_j] (fp32, a select, not a multiply by 0: rows past a count may hold NaN)
  per received row, into chunk order.
- `_reduce_kernel` grid (cdiv(m, BT), KS): each token's R partial rows (pad row skipped), fp32;
  the own rank's partial, when it never travelled, from the combine send rows (batched) or the
  expert output (flat).
"""

from __future__ import annotations

import triton
import triton.language as tl

from padded_moe.kernels.guard import expert_id_ok


# ---------------------------------------------------------------------------------------- helpers
@triton.jit
def _round_to_e4m3(v):
    """Round float32 `v` (|v| <= ~448) to the nearest float8_e4m3fn value, ties to even.

    Done with integer arithmetic so the later cast is exact everywhere (Triton's interpreter does
    not round fp32 -> fp8 to nearest). With the IEEE divisions (`div_rn`) around it, the bytes equal
    torch's `(x / scale).to(float8_e4m3fn)` on every path. Normal range: keep 3 mantissa bits;
    below 2^-6 the grid is the subnormal spacing 2^-9 (adding 2^14 makes float32's own rounding
    land on it).
    """
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = bits.to(tl.float32, bitcast=True)
    tiny = (a + 16384.0) - 16384.0
    r = tl.minimum(tl.where(a < 0.015625, tiny, normal), 448.0)
    # Copy the sign bit (keeps -0.0, which `-r` would not: Triton negates as 0 - r).
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _chunk_geometry(meta_ptr, stride_m, cc_ptr, r, T, OWN,
                    R: tl.constexpr, RP: tl.constexpr, COUNT_COL: tl.constexpr, IN_BAND: tl.constexpr):
    """Counts of the R received chunks (in-band column, or `cc_ptr`; chunk OWN >= 0, which never
    travelled, always from `cc_ptr`), clamped to [0, T]. Compaction order: chunk OWN first, then
    the others by rank (OWN = -1: by rank). Returns (count of chunk r, compacted start of chunk r,
    total valid rows, padding rows of the chunks before r)."""
    rr = tl.arange(0, RP)
    rm = rr < R
    if IN_BAND:
        cnt = tl.load(meta_ptr + (rr * T).to(tl.int64) * stride_m + COUNT_COL, mask=rm & (rr != OWN), other=0)
        cnt = tl.where(rr == OWN, tl.load(cc_ptr + rr, mask=rm & (rr == OWN), other=0), cnt)
    else:
        cnt = tl.load(cc_ptr + rr, mask=rm, other=0)
    cnt = tl.minimum(tl.maximum(cnt, 0), T)
    key = tl.where(rr == OWN, -1, rr)
    key_r = tl.where(r == OWN, -1, r)
    before = rm & (key < key_r)
    cnt_r = tl.sum(tl.where(rr == r, cnt, 0), axis=0)
    pre_r = tl.sum(tl.where(before, cnt, 0), axis=0)
    pad_before = tl.sum(tl.where(before, T - cnt, 0), axis=0)
    total = tl.sum(cnt, axis=0)
    return cnt_r, pre_r, total, pad_before


@triton.jit
def _slots_for_peer(ids_ptr, stride_im, stride_ik, owner_ptr, t, tmask, r, E, jj, jm):
    """ids [BT, KP] of tokens `t` and which slots peer r owns. Ids are range-checked in their own
    dtype before the owner table is read; the table load is masked, so garbage never forms an address."""
    msk = tmask[:, None] & jm[None, :]
    g = tl.load(ids_ptr + t.to(tl.int64)[:, None] * stride_im + jj[None, :] * stride_ik, mask=msk, other=-1)
    ok = expert_id_ok(g, msk, E)
    own = tl.load(owner_ptr + tl.where(ok, g, 0), mask=ok, other=-1)
    return g, ok & (own == r)


@triton.jit
def _load_wire_row_slice(rx_ptr, src64, stride_rx, rmf_ptr, stride_rm, cols, msk, k0,
                         SCALE_COL: tl.constexpr, FP8: tl.constexpr, ROW_SCALE: tl.constexpr,
                         GROUP: tl.constexpr):
    """x[src, cols] as float32 (dequantized for an fp8 wire: value · its block's scale)."""
    x = tl.load(rx_ptr + src64[:, None] * stride_rx + cols[None, :], mask=msk, other=0.0).to(tl.float32)
    if FP8:
        if ROW_SCALE:
            s = tl.load(rmf_ptr + src64 * stride_rm + SCALE_COL, mask=tl.max(msk.to(tl.int32), axis=1) > 0,
                        other=0.0)
            x = x * s[:, None]
        else:
            # One scale per GROUP columns; a slice [k0, k0 + BK) with BK == GROUP is one group.
            s = tl.load(rmf_ptr + src64 * stride_rm + SCALE_COL + k0 // GROUP,
                        mask=tl.max(msk.to(tl.int32), axis=1) > 0, other=0.0)
            x = x * s[:, None]
    return x


# ------------------------------------------------------------------------------- put signalling
# The put transport's exchange is a device-side handshake, not a separate barrier launch: the
# kernels that write into peers (pack, combine) signal when their last program is done, and the
# kernels that read what peers wrote (receive, reduce) wait for it first. `sig_ptr` int32 [4] is
# local: programs finished per channel ([CH]) and calls so far per channel ([2 + CH], the epoch).
# Flags live in every rank's symmetric memory: int32 [2, R], channel CH from source r at CH*R + r,
# holding the epoch of the source's latest finished call.
@triton.jit
def _signal_peers(sig_ptr, flag_tbl_ptr, flag_idx, CH: tl.constexpr, R: tl.constexpr):
    """Called by every program once its stores are issued: the last program of the launch bumps
    the epoch and publishes it to every peer (release, system scope). `flag_idx`: this rank."""
    tl.debug_barrier()  # every thread's stores of this program precede the release below
    total = tl.num_programs(0) * tl.num_programs(1)
    done = tl.atomic_add(sig_ptr + CH, 1, sem="acq_rel", scope="sys")
    if done == total - 1:
        tl.atomic_xchg(sig_ptr + CH, 0, sem="relaxed", scope="gpu")
        epoch = tl.atomic_add(sig_ptr + 2 + CH, 1, sem="relaxed", scope="gpu") + 1
        for r in tl.static_range(R):
            flag = tl.load(flag_tbl_ptr + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flag + CH * R + flag_idx, epoch, sem="release", scope="sys")


@triton.jit
def _wait_peers(sig_ptr, flags_ptr, CH: tl.constexpr, R: tl.constexpr):
    """Spin until every source has published this rank's current epoch of channel CH (this rank's
    own signalling kernel ran earlier on the stream, so the local epoch is already this call's)."""
    epoch = tl.atomic_add(sig_ptr + 2 + CH, 0, sem="relaxed", scope="gpu")
    for r in tl.static_range(R):
        seen = tl.atomic_add(flags_ptr + CH * R + r, 0, sem="acquire", scope="sys")
        while seen < epoch:
            seen = tl.atomic_add(flags_ptr + CH * R + r, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # the acquire precedes every thread's loads


@triton.jit
def _chunk_rows(r, b, T, pre_r, cnt_r, FIXED: tl.constexpr, BT: tl.constexpr):
    """Row block b of received chunk r: the chunk's first row (`r*T` with fixed chunks, `pre_r`
    with chunks back to back), the block's positions in the chunk, and which are real rows."""
    if FIXED:
        base = r * T
    else:
        base = pre_r
    p = b * BT + tl.arange(0, BT)
    return base, p, p < cnt_r


@triton.jit
def _k_range(kz, K_PER_PROG, K):
    """The columns [k_lo, k_hi) of K that program kz of a K-split grid handles."""
    k_lo = kz * K_PER_PROG
    return k_lo, tl.minimum(k_lo + K_PER_PROG, K)


@triton.jit
def _k_cols(k0, k_hi, BK: tl.constexpr):
    """One BK-column slice from k0 and its in-range mask."""
    cols = k0 + tl.arange(0, BK)
    return cols, cols < k_hi


# ---------------------------------------------------------------------------------------- dispatch
@triton.jit
def _peer_of(i, SKIP):
    """Program group i -> peer: i itself, or (SKIP >= 0) the i-th peer other than SKIP."""
    return i + ((SKIP >= 0) & (i >= SKIP)).to(tl.int32)


@triton.jit
def _route_count_kernel(ids_ptr, stride_im, stride_ik, owner_ptr, block_counts_ptr, m, E, NB_MAX,
                        R: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr):
    """block_counts[r, b] = tokens of block b (BT tokens) with a slot on peer r."""
    b = tl.program_id(0)
    jj = tl.arange(0, KP)
    jm = jj < TOP_K
    t = b * BT + tl.arange(0, BT)
    tm = t < m
    for r in tl.static_range(R):
        _, mine = _slots_for_peer(ids_ptr, stride_im, stride_ik, owner_ptr, t, tm, r, E, jj, jm)
        tl.store(block_counts_ptr + r * NB_MAX + b, tl.sum(tl.max(mine.to(tl.int32), axis=1), axis=0))


@triton.jit(do_not_specialize=["SKIP"])
def _pack_kernel(h_ptr, stride_h, ids_ptr, stride_im, stride_ik, w_ptr, stride_wm, stride_wk, owner_ptr,
                 sx_ptr, stride_sx, smi_ptr, smf_ptr, stride_sm, token_rows_ptr, base_ptr,
                 block_counts_ptr, zero_ptr, n_zero, put_ptr, sig_ptr, flag_tbl_ptr, flag_idx,
                 m, T, E, K, K_PER_PROG, NB, NB_MAX, SKIP,
                 R: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                 BK: tl.constexpr, NBP: tl.constexpr, COUNT_COL: tl.constexpr,
                 SCALE_COL: tl.constexpr, HAS_BASE: tl.constexpr, FP8: tl.constexpr,
                 ROW_SCALE: tl.constexpr, ZERO: tl.constexpr, ROUTED: tl.constexpr,
                 PUT: tl.constexpr, X_BYTES: tl.constexpr):
    """PUT: chunk r is written straight into peer r's receive rows: `put_ptr[r]` (int64) is the
    byte address that plays the role of the send buffer's row 0 for chunk r (the transport folds
    the chunk offsets into it), so the row arithmetic below is the same for both transports."""
    pid = tl.program_id(0)
    kz = tl.program_id(1)
    r = _peer_of(pid // NB, SKIP)
    if PUT:
        row0 = tl.load(put_ptr + r)
        sx_ptr = row0.to(tl.pointer_type(sx_ptr.dtype.element_ty))
        smi_ptr = (row0 + X_BYTES).to(tl.pointer_type(tl.int32))
        smf_ptr = (row0 + X_BYTES).to(tl.pointer_type(tl.float32))
    b = pid % NB
    jj = tl.arange(0, KP)
    jm = jj < TOP_K
    t = b * BT + tl.arange(0, BT)
    tm = t < m
    g, mine = _slots_for_peer(ids_ptr, stride_im, stride_ik, owner_ptr, t, tm, r, E, jj, jm)
    sent = tl.max(mine.to(tl.int32), axis=1)            # [BT] 1 when token t goes to peer r
    if ROUTED:
        # Rows taken in chunk r by the tokens of the earlier blocks, and by all of them.
        bb = tl.arange(0, NBP)
        bc = tl.load(block_counts_ptr + r * NB_MAX + bb, mask=bb < NB, other=0)
        earlier = tl.sum(tl.where(bb < b, bc, 0), axis=0)
        chunk_total = tl.sum(bc, axis=0)
    else:  # one block holds every token (small m): no route-count kernel ran
        earlier = tl.full([], 0, tl.int32)
        chunk_total = tl.sum(sent, axis=0)
    pos = earlier + tl.cumsum(sent, axis=0) - 1
    if HAS_BASE:
        base = tl.load(base_ptr + r)
    else:
        base = r * T
    row = base + pos
    to_peer = sent > 0
    row64 = row.to(tl.int64)
    t64 = t.to(tl.int64)

    if kz == 0:
        tl.store(token_rows_ptr + r * T + t, tl.where(to_peer, row, R * T), mask=tm)
        mm = to_peer[:, None] & jm[None, :]
        # Kept ids are in [0, E): narrowing to int32 after the mask is safe.
        tl.store(smi_ptr + row64[:, None] * stride_sm + jj[None, :], tl.where(mine, g, -1).to(tl.int32), mask=mm)
        w = tl.load(w_ptr + t64[:, None] * stride_wm + jj[None, :] * stride_wk, mask=mm, other=0.0)
        tl.store(smf_ptr + row64[:, None] * stride_sm + TOP_K + jj[None, :],
                 tl.where(mine, w.to(tl.float32), 0.0), mask=mm)
        if not HAS_BASE:
            # The chunk's valid-row count, always written (also for 0 rows and m == 0).
            tl.store(smi_ptr + (r * T).to(tl.int64) * stride_sm + COUNT_COL, chunk_total, mask=b == NB - 1)
        if ZERO:
            if pid == 0:
                for z0 in range(0, n_zero, 1024):
                    zz = z0 + tl.arange(0, 1024)
                    tl.store(zero_ptr + zz, tl.zeros([1024], dtype=tl.int32), mask=zz < n_zero)

    src = h_ptr + t64[:, None] * stride_h
    dst = sx_ptr + row64[:, None] * stride_sx
    if FP8:
        if ROW_SCALE:  # one scale per row (K % 128 != 0): amax pass, then quantize (KS == 1)
            scale = _row_fp8_scale(src, to_peer, K, BT, BK)
            tl.store(smf_ptr + row64 * stride_sm + SCALE_COL, scale, mask=to_peer)
            for k0 in range(0, K, BK):
                cols = k0 + tl.arange(0, BK)
                msk = to_peer[:, None] & (cols < K)[None, :]
                x = tl.load(src + cols[None, :], mask=msk, other=0.0).to(tl.float32)
                q = _round_to_e4m3(tl.math.div_rn(x, scale[:, None]))
                tl.store(dst + cols[None, :], q.to(sx_ptr.dtype.element_ty), mask=msk)
        else:  # BK == 128: every slice is one scale block
            k_lo, k_hi = _k_range(kz, K_PER_PROG, K)
            for k0 in range(k_lo, k_hi, BK):
                cols = k0 + tl.arange(0, BK)
                msk = to_peer[:, None] & (cols < k_hi)[None, :]
                x = tl.load(src + cols[None, :], mask=msk, other=0.0).to(tl.float32)
                scale = _fp8_scale(tl.max(tl.abs(x), axis=1))
                tl.store(smf_ptr + row64 * stride_sm + SCALE_COL + k0 // BK, scale, mask=to_peer)
                q = _round_to_e4m3(tl.math.div_rn(x, scale[:, None]))
                tl.store(dst + cols[None, :], q.to(sx_ptr.dtype.element_ty), mask=msk)
    else:
        k_lo, k_hi = _k_range(kz, K_PER_PROG, K)
        for k0 in range(k_lo, k_hi, BK):
            cols = k0 + tl.arange(0, BK)
            msk = to_peer[:, None] & (cols < k_hi)[None, :]
            tl.store(dst + cols[None, :], tl.load(src + cols[None, :], mask=msk), mask=msk)
    if PUT:
        _signal_peers(sig_ptr, flag_tbl_ptr, flag_idx, 0, R)


@triton.jit(do_not_specialize=["OWN"])
def _recv_flat_kernel(rx_ptr, stride_rx, rmi_ptr, rmf_ptr, stride_rm, cc_ptr,
                      ox_ptr, stride_ox, oid_ptr, stride_oid, ow_ptr, stride_ow, ovalid_ptr, sig_ptr, flags_ptr,
                      T, K, K_PER_PROG, NB, OWN,
                      R: tl.constexpr, RP: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, COUNT_COL: tl.constexpr, SCALE_COL: tl.constexpr,
                      IN_BAND: tl.constexpr, FP8: tl.constexpr, ROW_SCALE: tl.constexpr, GROUP: tl.constexpr,
                      WAIT: tl.constexpr):
    """OWN >= 0: chunk OWN's valid rows are already at the front (`_local_flat_kernel`); its
    programs only write the meta of its share of the padding rows. WAIT: the put transport's
    handshake first (`_wait_peers`)."""
    if WAIT:
        _wait_peers(sig_ptr, flags_ptr, 0, R)
    pid = tl.program_id(0)
    kz = tl.program_id(1)
    r = pid // NB
    b = pid % NB
    cnt_r, pre_r, total, pad_before = _chunk_geometry(rmi_ptr, stride_rm, cc_ptr, r, T, OWN, R, RP, COUNT_COL,
                                                      IN_BAND)
    base, p, valid = _chunk_rows(r, b, T, pre_r, cnt_r, IN_BAND, BT)
    pm = p < T
    copy = valid & (r != OWN)
    src64 = (base + p).to(tl.int64)
    # Valid rows go to the compact prefix; the invalid positions of chunk r map one to one onto
    # the padding rows [total, R*T) (chunk r's share starts after the earlier chunks' shares).
    dst64 = tl.where(valid, pre_r + p, total + pad_before + (p - cnt_r)).to(tl.int64)
    if kz == 0:
        jj = tl.arange(0, KP)
        jm = jj < TOP_K
        vm = copy[:, None] & jm[None, :]
        om = (pm & (copy | ~valid))[:, None] & jm[None, :]
        ids = tl.load(rmi_ptr + src64[:, None] * stride_rm + jj[None, :], mask=vm, other=-1)
        w = tl.load(rmf_ptr + src64[:, None] * stride_rm + TOP_K + jj[None, :], mask=vm, other=0.0)
        tl.store(oid_ptr + dst64[:, None] * stride_oid + jj[None, :], ids, mask=om)
        tl.store(ow_ptr + dst64[:, None] * stride_ow + jj[None, :], w, mask=om)
        if IN_BAND:
            tl.store(cc_ptr + r, cnt_r, mask=(b == 0) & (r != OWN))
        tl.store(ovalid_ptr, total, mask=pid == 0)
    k_lo, k_hi = _k_range(kz, K_PER_PROG, K)
    for k0 in range(k_lo, k_hi, BK):
        cols = k0 + tl.arange(0, BK)
        msk = copy[:, None] & (cols < k_hi)[None, :]
        if FP8:
            x = _load_wire_row_slice(rx_ptr, src64, stride_rx, rmf_ptr, stride_rm, cols, msk, k0,
                                     SCALE_COL, FP8, ROW_SCALE, GROUP)
        else:
            x = tl.load(rx_ptr + src64[:, None] * stride_rx + cols[None, :], mask=msk)
        tl.store(ox_ptr + dst64[:, None] * stride_ox + cols[None, :], x.to(ox_ptr.dtype.element_ty), mask=msk)


@triton.jit(do_not_specialize=["me"])
def _local_flat_kernel(h_ptr, stride_h, ids_ptr, stride_im, stride_ik, w_ptr, stride_wm, stride_wk, owner_ptr,
                       block_counts_ptr, ox_ptr, stride_ox, oid_ptr, stride_oid, ow_ptr, stride_ow,
                       token_rows_ptr, cc_ptr, me, m, T, E, K, NB, NB_MAX, PAD,
                       TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                       NBP: tl.constexpr, ROUTED: tl.constexpr, FP8: tl.constexpr, ROW_SCALE: tl.constexpr):
    """Flat mode's own tokens, straight from `hidden` into the receive rows: the tokens with a slot
    on this rank take rows [0, count) in token order (chunk `me` first in the compaction), with
    their ids masked to this rank and their weights; `token_rows[me, t]` is that row (the expert
    output's, which the reduction reads), `chunk_counts[me]` the count. The same blocks (BT, NB,
    route counts) as the pack; a capped grid loops over them."""
    jj = tl.arange(0, KP)
    jm = jj < TOP_K
    for b in range(tl.program_id(0), NB, tl.num_programs(0)):
        t = b * BT + tl.arange(0, BT)
        tm = t < m
        g, mine = _slots_for_peer(ids_ptr, stride_im, stride_ik, owner_ptr, t, tm, me, E, jj, jm)
        sent = tl.max(mine.to(tl.int32), axis=1)
        if ROUTED:
            bb = tl.arange(0, NBP)
            bc = tl.load(block_counts_ptr + me * NB_MAX + bb, mask=bb < NB, other=0)
            earlier = tl.sum(tl.where(bb < b, bc, 0), axis=0)
            chunk_total = tl.sum(bc, axis=0)
        else:
            earlier = tl.full([], 0, tl.int32)
            chunk_total = tl.sum(sent, axis=0)
        pos = earlier + tl.cumsum(sent, axis=0) - 1
        keep = sent > 0
        pos64 = pos.to(tl.int64)
        t64 = t.to(tl.int64)
        tl.store(token_rows_ptr + me * T + t, tl.where(keep, pos, PAD), mask=tm)
        tl.store(cc_ptr + me, chunk_total, mask=b == 0)
        mm = keep[:, None] & jm[None, :]
        tl.store(oid_ptr + pos64[:, None] * stride_oid + jj[None, :], tl.where(mine, g, -1).to(tl.int32), mask=mm)
        w = tl.load(w_ptr + t64[:, None] * stride_wm + jj[None, :] * stride_wk, mask=mm, other=0.0)
        tl.store(ow_ptr + pos64[:, None] * stride_ow + jj[None, :], tl.where(mine, w.to(tl.float32), 0.0), mask=mm)
        src, row_scale = _own_rows(h_ptr, t64, stride_h, keep, K, FP8, ROW_SCALE, BT, BK)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            msk = keep[:, None] & (cols < K)[None, :]
            x = tl.load(src + cols[None, :], mask=msk, other=0.0)
            x = _wire_rounding(x, row_scale, FP8, ROW_SCALE)
            tl.store(ox_ptr + pos64[:, None] * stride_ox + cols[None, :], x.to(ox_ptr.dtype.element_ty), mask=msk)


@triton.jit
def _slab_rows(e, local, jj, counts_ptr, SLAB_ROWS, KP: tl.constexpr):
    """Slab rows of the slots `e` [BT, KP] (local expert, valid where `local`): one row per
    (token, expert), taken with an atomic on the expert's count (the order inside a slab does not
    change any row's result); a repeated id takes the row of its first occurrence (both router
    weights apply at combine). Returns (first [BT, KP]: the slot owns a row, row of each first
    slot, slab row of every slot)."""
    # same[b, j, j']: slot j' of the token is local with the same expert as slot j.
    same = (e[:, :, None] == e[:, None, :]) & local[:, None, :]
    j_row = jj[None, :, None]
    j_col = jj[None, None, :]
    first = local & (tl.max((same & (j_col < j_row)).to(tl.int32), axis=2) == 0)
    pos = tl.atomic_add(counts_ptr + tl.where(first, e, 0), 1, mask=first, sem="relaxed")
    row = tl.where(first, e * SLAB_ROWS + pos, 0)
    fidx = tl.min(tl.where(same & (j_col <= j_row), j_col, KP), axis=2)
    srow = tl.sum(tl.where(j_col == fidx[:, :, None], row[:, None, :], 0), axis=2)
    return first, row, srow


@triton.jit
def _store_slab_rows(slab_ptr, stride_slab, x, first, row, jj, cols, cm, TOP_K: tl.constexpr):
    """x [BT, BK] into the slab row of each first slot (k stores, masked)."""
    for j in tl.static_range(TOP_K):
        sel = jj[None, :] == j
        fj = tl.max(tl.where(sel & first, 1, 0), axis=1) > 0
        rj = tl.sum(tl.where(sel, row, 0), axis=1).to(tl.int64)
        tl.store(slab_ptr + rj[:, None] * stride_slab + cols[None, :], x, mask=fj[:, None] & cm[None, :])


@triton.jit
def _row_fp8_scale(src, rows, K, BT: tl.constexpr, BK: tl.constexpr):
    """One fp8 scale per row (K % 128 != 0): the amax of rows `src[:, 0:K]` (where `rows`), in
    BK-column slices, through `_fp8_scale`."""
    amax = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(src + cols[None, :], mask=rows[:, None] & (cols < K)[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    return _fp8_scale(amax)


@triton.jit
def _own_rows(h_ptr, t64, stride_h, rows, K, FP8: tl.constexpr, ROW_SCALE: tl.constexpr, BT: tl.constexpr,
              BK: tl.constexpr):
    """This rank's own tokens `t64` of `h`: their row pointers, and their fp8 row scale when the
    wire has one scale per row (ones otherwise, unused)."""
    src = h_ptr + t64[:, None] * stride_h
    row_scale = tl.full([BT], 1.0, tl.float32)
    if FP8 and ROW_SCALE:
        row_scale = _row_fp8_scale(src, rows, K, BT, BK)
    return src, row_scale


@triton.jit
def _wire_rounding(x, row_scale, FP8: tl.constexpr, ROW_SCALE: tl.constexpr):
    """A row slice as a peer would receive it: with an fp8 wire, quantized and dequantized (one
    scale per row: `row_scale`; else one per 128-column slice, BK == 128). The own tokens never
    travel, yet must equal what travelling would give."""
    if FP8:
        x = x.to(tl.float32)
        if ROW_SCALE:
            x = _fp8_round_trip(x, row_scale)
        else:
            x = _fp8_round_trip(x, _fp8_scale(tl.max(tl.abs(x), axis=1)))
    return x


@triton.jit
def _fp8_round_trip(x, scale):
    """What an fp8 wire delivers for float32 `x` with per-row `scale` [BT]: e4m3(x / s) · s."""
    return _round_to_e4m3(tl.math.div_rn(x, scale[:, None])) * scale[:, None]


@triton.jit
def _fp8_scale(amax):
    return tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)


@triton.jit(do_not_specialize=["SKIP"])
def _recv_batched_kernel(rx_ptr, stride_rx, rmi_ptr, rmf_ptr, stride_rm, cc_ptr, map_ptr,
                         slab_ptr, stride_slab, counts_ptr, slot_rows_ptr, slot_w_ptr, stride_sr, sig_ptr, flags_ptr,
                         T, E, K, NB, SLAB_ROWS, SKIP,
                         R: tl.constexpr, RP: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                         BT: tl.constexpr, BK: tl.constexpr, COUNT_COL: tl.constexpr, SCALE_COL: tl.constexpr,
                         IN_BAND: tl.constexpr, FP8: tl.constexpr, ROW_SCALE: tl.constexpr,
                         GROUP: tl.constexpr, WAIT: tl.constexpr):
    if WAIT:  # the put transport's handshake (`_wait_peers`)
        _wait_peers(sig_ptr, flags_ptr, 0, R)
    pid = tl.program_id(0)
    r = _peer_of(pid // NB, SKIP)
    b = pid % NB
    cnt_r, pre_r, total, _ = _chunk_geometry(rmi_ptr, stride_rm, cc_ptr, r, T, -1, R, RP, COUNT_COL, IN_BAND)
    if IN_BAND:
        base = r * T
        tl.store(cc_ptr + r, cnt_r, mask=b == 0)
    else:
        base = pre_r
    p = b * BT + tl.arange(0, BT)
    valid = p < cnt_r
    src64 = (base + p).to(tl.int64)
    jj = tl.arange(0, KP)
    jm = jj < TOP_K
    vm = valid[:, None] & jm[None, :]
    g = tl.load(rmi_ptr + src64[:, None] * stride_rm + jj[None, :], mask=vm, other=-1)
    ok = expert_id_ok(g, vm, E)
    loc = tl.load(map_ptr + tl.where(ok, g, 0), mask=ok, other=-1)
    local = ok & (loc >= 0)
    first, row, srow = _slab_rows(tl.where(local, loc, -1), local, jj, counts_ptr, SLAB_ROWS, KP)
    w = tl.load(rmf_ptr + src64[:, None] * stride_rm + TOP_K + jj[None, :], mask=local, other=0.0)
    tl.store(slot_rows_ptr + src64[:, None] * stride_sr + jj[None, :], tl.where(local, srow, -1), mask=vm)
    tl.store(slot_w_ptr + src64[:, None] * stride_sr + jj[None, :], tl.where(local, w, 0.0), mask=vm)
    any_first = tl.max(first.to(tl.int32), axis=1) > 0
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        cm = cols < K
        msk = any_first[:, None] & cm[None, :]
        if FP8:
            x = _load_wire_row_slice(rx_ptr, src64, stride_rx, rmf_ptr, stride_rm, cols, msk, k0,
                                     SCALE_COL, FP8, ROW_SCALE, GROUP)
        else:
            x = tl.load(rx_ptr + src64[:, None] * stride_rx + cols[None, :], mask=msk)
        _store_slab_rows(slab_ptr, stride_slab, x.to(slab_ptr.dtype.element_ty), first, row, jj, cols, cm, TOP_K)


@triton.jit(do_not_specialize=["me"])
def _local_batched_kernel(h_ptr, stride_h, ids_ptr, stride_im, stride_ik, w_ptr, stride_wm, stride_wk, map_ptr,
                          slab_ptr, stride_slab, counts_ptr, slot_rows_ptr, slot_w_ptr, stride_sr,
                          token_rows_ptr, cc_ptr, me, m, T, E, K, SLAB_ROWS, PAD, NB,
                          TOP_K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                          FP8: tl.constexpr, ROW_SCALE: tl.constexpr):
    """This rank's own tokens, straight from `hidden` into the slabs (nothing travels): token t
    plays received row `me*T + t` of chunk `me` (so combine and reduce treat it like any chunk).
    An fp8 wire's rounding is applied all the same, so results do not depend on where a token's
    expert lives."""
    # A grid capped below the machine (EP_TILES["local_batched"]) loops over the token blocks, so
    # the all_to_all running meanwhile still finds room for its CTAs.
    for b in range(tl.program_id(0), NB, tl.num_programs(0)):
        t = b * BT + tl.arange(0, BT)
        tm = t < m
        t64 = t.to(tl.int64)
        jj = tl.arange(0, KP)
        jm = jj < TOP_K
        vm = tm[:, None] & jm[None, :]
        g = tl.load(ids_ptr + t64[:, None] * stride_im + jj[None, :] * stride_ik, mask=vm, other=-1)
        ok = expert_id_ok(g, vm, E)  # before the table read
        loc = tl.load(map_ptr + tl.where(ok, g, 0), mask=ok, other=-1)
        local = ok & (loc >= 0)
        first, row, srow = _slab_rows(tl.where(local, loc, -1), local, jj, counts_ptr, SLAB_ROWS, KP)
        w = tl.load(w_ptr + t64[:, None] * stride_wm + jj[None, :] * stride_wk, mask=local, other=0.0)
        rr64 = (me * T + t).to(tl.int64)
        tl.store(slot_rows_ptr + rr64[:, None] * stride_sr + jj[None, :], tl.where(local, srow, -1), mask=vm)
        tl.store(slot_w_ptr + rr64[:, None] * stride_sr + jj[None, :], tl.where(local, w.to(tl.float32), 0.0),
                 mask=vm)
        any_first = tl.max(first.to(tl.int32), axis=1) > 0
        tl.store(token_rows_ptr + me * T + t, tl.where(any_first, me * T + t, PAD), mask=tm)
        tl.store(cc_ptr + me, m, mask=b == 0)
        src, row_scale = _own_rows(h_ptr, t64, stride_h, any_first, K, FP8, ROW_SCALE, BT, BK)
        for k0 in range(0, K, BK):
            cols = k0 + tl.arange(0, BK)
            cm = cols < K
            x = tl.load(src + cols[None, :], mask=any_first[:, None] & cm[None, :], other=0.0)
            x = _wire_rounding(x, row_scale, FP8, ROW_SCALE)
            _store_slab_rows(slab_ptr, stride_slab, x.to(slab_ptr.dtype.element_ty), first, row, jj, cols, cm, TOP_K)


# ---------------------------------------------------------------------------------------- combine
@triton.jit(do_not_specialize=["OWN"])
def _combine_flat_kernel(y_ptr, stride_y, cc_ptr, cs_ptr, stride_cs, put_ptr, sig_ptr, flag_tbl_ptr, flag_idx,
                         T, K, K_PER_PROG, NB, OWN,
                         R: tl.constexpr, RP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         PUT: tl.constexpr):
    """OWN >= 0: chunk OWN came first in the compaction and stays (the reduction reads it from
    the expert output): programs cover the other chunks only. PUT: chunk r goes straight into peer
    r's combine receive rows (`put_ptr[r]`, as in `_pack_kernel`)."""
    pid = tl.program_id(0)
    kz = tl.program_id(1)
    r = _peer_of(pid // NB, OWN)
    if PUT:
        cs_ptr = tl.load(put_ptr + r).to(tl.pointer_type(cs_ptr.dtype.element_ty))
    b = pid % NB
    cnt_r, pre_r, total, _ = _chunk_geometry(cc_ptr, 0, cc_ptr, r, T, OWN, R, RP, 0, False)
    p = b * BT + tl.arange(0, BT)
    valid = p < cnt_r
    src64 = (pre_r + p).to(tl.int64)
    dst64 = (r * T + p).to(tl.int64)
    k_lo, k_hi = _k_range(kz, K_PER_PROG, K)
    for k0 in range(k_lo, k_hi, BK):
        cols = k0 + tl.arange(0, BK)
        msk = valid[:, None] & (cols < k_hi)[None, :]
        x = tl.load(y_ptr + src64[:, None] * stride_y + cols[None, :], mask=msk)
        tl.store(cs_ptr + dst64[:, None] * stride_cs + cols[None, :], x, mask=msk)
    if PUT:
        _signal_peers(sig_ptr, flag_tbl_ptr, flag_idx, 1, R)


@triton.jit(do_not_specialize=["SKIP", "ONLY"])
def _combine_batched_kernel(y_ptr, stride_y0, stride_y1, SLAB_ROWS, cc_ptr,
                            slot_rows_ptr, slot_w_ptr, stride_sr, cs_ptr, stride_cs, put_ptr, sig_ptr, flag_tbl_ptr,
                            flag_idx,
                            T, K, K_PER_PROG, NB, NBLK, SKIP, ONLY,
                            R: tl.constexpr, RP: tl.constexpr, TOP_K: tl.constexpr, BT: tl.constexpr,
                            BK: tl.constexpr, GRAPH_SAFE: tl.constexpr, PUT: tl.constexpr):
    """PUT: chunk r goes straight into peer r's combine receive rows (`put_ptr[r]`, as in
    `_pack_kernel`)."""
    kz = tl.program_id(1)
    # NBLK row blocks (NB per chunk); a capped grid (the overlapped own-chunk call) loops over them.
    for i in range(tl.program_id(0), NBLK, tl.num_programs(0)):
        r = _peer_of(i // NB, SKIP)
        if ONLY >= 0:
            r = ONLY + 0 * r
        b = i % NB
        cnt_r, pre_r, total, _ = _chunk_geometry(cc_ptr, 0, cc_ptr, r, T, -1, R, RP, 0, False)
        base, p, valid = _chunk_rows(r, b, T, pre_r, cnt_r, GRAPH_SAFE, BT)
        src64 = (base + p).to(tl.int64)
        k_lo, k_hi = _k_range(kz, K_PER_PROG, K)
        for k0 in range(k_lo, k_hi, BK):
            cols, cm = _k_cols(k0, k_hi, BK)
            acc = tl.zeros([BT, BK], dtype=tl.float32)
            for j in tl.static_range(TOP_K):
                sr = tl.load(slot_rows_ptr + src64 * stride_sr + j, mask=valid, other=-1)
                keep = valid & (sr >= 0)
                w = tl.load(slot_w_ptr + src64 * stride_sr + j, mask=keep, other=0.0)
                srk = tl.where(keep, sr, 0)
                yrow = (srk // SLAB_ROWS).to(tl.int64) * stride_y0 + (srk % SLAB_ROWS).to(tl.int64) * stride_y1
                y = tl.load(y_ptr + yrow[:, None] + cols[None, :], mask=keep[:, None] & cm[None, :], other=0.0)
                # Select, never multiply by zero: rows past a count may hold NaN.
                acc += tl.where(keep[:, None], y.to(tl.float32) * w[:, None], 0.0)
            if PUT:
                dst = tl.load(put_ptr + r).to(tl.pointer_type(cs_ptr.dtype.element_ty))
            else:
                dst = cs_ptr
            tl.store(dst + src64[:, None] * stride_cs + cols[None, :], acc.to(cs_ptr.dtype.element_ty),
                     mask=valid[:, None] & cm[None, :])
    if PUT:
        _signal_peers(sig_ptr, flag_tbl_ptr, flag_idx, 1, R)


@triton.jit(do_not_specialize=["SELF"])
def _reduce_kernel(cr_ptr, stride_cr, cs_ptr, stride_cs, tr_ptr, stride_tr, out_ptr, stride_o, sig_ptr, flags_ptr,
                   m, K, K_PER_PROG, PAD, SELF,
                   R: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, WAIT: tl.constexpr):
    """Partials of peer r come from the combine receive rows `cr`, except this rank's own
    (r == SELF >= 0), which never travelled: rows of `cs` (batched: the combine send buffer's own
    chunk; flat: the expert output). WAIT: the put transport's handshake first (`_wait_peers`)."""
    if WAIT:
        _wait_peers(sig_ptr, flags_ptr, 1, R)
    b = tl.program_id(0)
    kz = tl.program_id(1)
    t = b * BT + tl.arange(0, BT)
    tm = t < m
    k_lo, k_hi = _k_range(kz, K_PER_PROG, K)
    for k0 in range(k_lo, k_hi, BK):
        cols, cm = _k_cols(k0, k_hi, BK)
        acc = tl.zeros([BT, BK], dtype=tl.float32)
        for r in tl.static_range(R):
            row = tl.load(tr_ptr + r * stride_tr + t, mask=tm, other=PAD)
            keep = tm & (row >= 0) & (row < PAD)
            row64 = tl.where(keep, row, 0).to(tl.int64)[:, None]
            msk = keep[:, None] & cm[None, :]
            if r == SELF:
                y = tl.load(cs_ptr + row64 * stride_cs + cols[None, :], mask=msk, other=0.0)
            else:
                y = tl.load(cr_ptr + row64 * stride_cr + cols[None, :], mask=msk, other=0.0)
            acc += y.to(tl.float32)
        tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tm[:, None] & cm[None, :])
