"""Triton kernels of the decode path (`padded_moe.decode`): the whole expert call in two launches.

For calls of few routed slots (decode) the layout kernels, the activation and the unpermute each
cost about as much as a GEMM's weight read of a small expert. These two kernels route the slots
themselves (the ID guard, the expert map and `valid_tokens` through `slot_local_expert`) and keep
every intermediate but one in registers:

- `_decode_w13_act_kernel`, grid (n-tiles of N, slots): the program of slot `s` returns unless `s`
  is the first slot routed to its expert; that program gathers every slot routed to the same expert
  (at most RB rows) straight from the hidden states, multiplies them with the expert's gate and up
  tiles, rounds the result to the activation dtype as GEMM1's output buffer would, applies the
  activation (the activation kernel's math, `_gated` / `_ungated`) and stores `h [slots, N]` rows of those slots
  only. Each expert's weights are read once per call, however many slots it has.
- `_decode_w2_combine_kernel`, grid (tokens, n-tiles of K): the program of token `t` computes its k
  slots' `h[slot] @ w2[e].T + b2[e]` side by side (one `[k, BN, BK]` weight step covers all k
  experts), rounds them to the activation dtype as GEMM2's output buffer would be, weights them and
  sums over the slots in fp32 with a fixed reduction tree (deterministic, no atomics), and stores
  the token's output row: no `[slots, K]` intermediate and no unpermute. Tokens of one
  n-tile are adjacent in launch order, so an expert shared by several tokens is read from L2.

MXFP4 weights (`Mxfp4Tensor`'s canonical bytes and scales) take `_decode_w13_mx_kernel` for GEMM1,
a GEMV per slot that decodes the packed bytes in registers (`_mx_step`), or with prepared words
`_decode_w13_mx_dot_kernel`, the prepared-MXFP4 GEMM's tile over the expert's slots; and GEMM2's
`W_MX` branch, the GEMV step over the k experts' rows.

Every operand's last dimension is contiguous (the host checks it). Dropped slots are never loaded
or computed, hidden rows at/after `valid_tokens` are never read and output rows at/after it are
never written; a token whose slots are all dropped gets zeros (as `unpermute` gives it).
"""

from __future__ import annotations

import triton
import triton.language as tl

from padded_moe.kernels.activation import ACT_SILU_NO_MUL, _bias_act, _gate_up_rows
from padded_moe.kernels.gemm import (_E2M1_PTX_FOLDED_ASM, _FOUR_PLANE_PTX_FOLDED_ASM, _byte_strided_rows, _dot_fp32_or,
                                     _e2m1_plane, _expert_gemm_mx_hopper_rows, _factor_f32, _four_plane,
                                     _gate_up_split, _scale_factor)
from padded_moe.kernels.guard import slot_local_expert

# How the MXFP4 decode kernels read weights (`MX_ROUTE`): the canonical packed bytes, decoded per
# byte in float32; the same bytes as 32-bit words of eight codes; the prepared 4-plane words.
MX_BYTES, MX_WORDS, MX_PREPARED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _mx_step(b_rows, s_rows, stride_sk, v_base, k0, K, rows_ok, v_ok, G: tl.constexpr):
    """One step of MXFP4 weight rows against vectors: columns [k0, k0 + 32*G) of K.

    `b_rows` / `s_rows` [..., 1] point at the rows' packed bytes and E8M0 scales (mask `rows_ok`);
    `v_base` [..., 1] at element 0 of the vector each row meets (mask `v_ok`), broadcast against
    the rows. Both nibbles of each byte are decoded exactly straight from the byte (`_e2m1_plane`,
    unscaled) and interleaved back into column order in registers, multiplied by the vector in fp32
    and summed per 32-column scale group, times the group's 2^(s-127) (a power of two: the
    dequantized weights' products, summed in another order). Returns fp32 [..., G]."""
    cb = k0 // 2 + tl.arange(0, 16 * G)
    packed = tl.load(b_rows + cb, mask=rows_ok & (cb < K // 2), other=0).to(tl.uint32)
    vals = tl.join(_e2m1_plane(packed, 1.0, 0, False), _e2m1_plane(packed, 1.0, 4, False))
    vals = tl.reshape(vals, vals.shape[:-2] + [32 * G])
    rk = k0 + tl.arange(0, 32 * G)
    xv = tl.load(v_base + rk, mask=v_ok & (rk < K), other=0.0).to(tl.float32)
    return _scaled_groups(vals * xv, s_rows, stride_sk, k0, K // 32, rows_ok, G, False)


@triton.jit
def _scaled_groups(acc, s_rows, stride_sk, k0, NG, rows_ok, G: tl.constexpr, FOLDED: tl.constexpr):
    """Products `acc [.., G*X]` of a step's columns (in any order within each 32-column group)
    summed per group, times the group's 2^(s-127) (`NG` groups per row; folded scales hold
    2^(s-1)): fp32 [.., G]."""
    X: tl.constexpr = acc.shape[-1] // G
    part = tl.sum(tl.reshape(acc, acc.shape[:-1] + [G, X]), -1)
    cs = k0 // 32 + tl.arange(0, G)
    sc = tl.load(s_rows + cs * stride_sk, mask=rows_ok & (cs < NG), other=127)
    if FOLDED:  # 2^(s-1) stored: times 2^-126
        factor = _factor_f32(sc, True) * 1.1754943508222875e-38
    else:
        factor = _scale_factor(sc)
    return part * factor


@triton.jit
def _word_step_loads(w_rows, v_base, k0, K, KB, rows_ok, v_ok, G: tl.constexpr):
    """A word step's loads: the rows' int32 words `[.., 4G]` of columns [k0, k0 + 32*G) (`KB`
    bytes per row) and the vector step `[.., 32G]` in fp32, contiguous."""
    cw = k0 // 8 + tl.arange(0, 4 * G)
    words = tl.load(w_rows + cw, mask=rows_ok & (cw < KB // 4), other=0)
    rk = k0 + tl.arange(0, 32 * G)
    return words, tl.load(v_base + rk, mask=v_ok & (rk < K), other=0.0).to(tl.float32)


@triton.jit
def _mx_route_step(w_rows, s_rows, stride_sk, v_base, k0, K, KB, rows_ok, v_ok, G: tl.constexpr,
                   MX_ROUTE: tl.constexpr, UPCAST_PTX: tl.constexpr, FOLDED: tl.constexpr, ROWS_3D: tl.constexpr):
    """The step of the route `MX_ROUTE` (`MX_BYTES` / `MX_WORDS` / `MX_PREPARED`)."""
    if MX_ROUTE == MX_PREPARED:
        part = _mx4_step(w_rows, s_rows, stride_sk, v_base, k0, K, KB, rows_ok, v_ok, G, UPCAST_PTX, FOLDED, ROWS_3D)
    elif MX_ROUTE == MX_WORDS:
        part = _mxw_step(w_rows, s_rows, stride_sk, v_base, k0, K, KB, rows_ok, v_ok, G, UPCAST_PTX)
    else:
        part = _mx_step(w_rows, s_rows, stride_sk, v_base, k0, K, rows_ok, v_ok, G)
    return part


# bf16 bits of 2^126: as the "scale" of a folded upcast it gives each code's own value (both
# halves set: the 2-plane upcast multiplies by a bf16 pair).
_TWO_POW_126_BF16 = tl.constexpr(0x7E80)
_TWO_POW_126_BF16X2 = tl.constexpr(0x7E807E80)


@triton.jit
def _mxw_step(w_rows, s_rows, stride_sk, v_base, k0, K, KB, rows_ok, v_ok, G: tl.constexpr,
              UPCAST_PTX: tl.constexpr):
    """`_mx_step` on the canonical packed bytes read as int32 words (`KB` bytes per row): word j holds
    elements 8j + 4t + 2b + n (byte 2t + b, nibble n). The upcast makes bf16 pairs of one nibble
    of two neighbouring bytes, (element e, e + 2); the vector step, loaded once, is split into the
    matching parts in registers. Exact code values (the folded upcast with 2^126 as the scale),
    two FMAs per pair, the group's 2^(s-127) after the group sum."""
    words, xv = _word_step_loads(w_rows, v_base, k0, K, KB, rows_ok, v_ok, G)
    x_n0, x_n1 = tl.split(tl.reshape(xv, xv.shape[:-1] + [4 * G, 2, 2, 2]))  # (word, t, b, n)
    x_n0b0, x_n0b1 = tl.split(x_n0)
    x_n1b0, x_n1b1 = tl.split(x_n1)
    x000, x001 = tl.split(x_n0b0)  # nibble 0, byte 2t: t = 0, 1
    x010, x011 = tl.split(x_n0b1)  # nibble 0, byte 2t + 1
    x100, x101 = tl.split(x_n1b0)
    x110, x111 = tl.split(x_n1b1)
    if UPCAST_PTX:
        f = tl.full(words.shape, _TWO_POW_126_BF16X2, tl.int32)
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            asm=_E2M1_PTX_FOLDED_ASM, constraints="=r,=r,=r,=r,r,r,r,r,r", args=[words, f, f, f, f],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        acc = _pair_times(tl.zeros(words.shape, dtype=tl.float32), p0, x000, x010)  # nibble 0, bytes 0 and 1
        acc = _pair_times(acc, p1, x001, x011)  # nibble 0, bytes 2 and 3
        acc = _pair_times(acc, p2, x100, x110)  # nibble 1, bytes 0 and 1
        acc = _pair_times(acc, p3, x101, x111)  # nibble 1, bytes 2 and 3
    else:
        w32 = words.to(tl.uint32, bitcast=True)
        acc = _e2m1_plane(w32, 1.0, 0, False) * x000 + _e2m1_plane(w32 >> 8, 1.0, 0, False) * x010
        acc += _e2m1_plane(w32 >> 16, 1.0, 0, False) * x001 + _e2m1_plane(w32 >> 24, 1.0, 0, False) * x011
        acc += _e2m1_plane(w32, 1.0, 4, False) * x100 + _e2m1_plane(w32 >> 8, 1.0, 4, False) * x110
        acc += _e2m1_plane(w32 >> 16, 1.0, 4, False) * x101 + _e2m1_plane(w32 >> 24, 1.0, 4, False) * x111
    return _scaled_groups(acc, s_rows, stride_sk, k0, KB // 16, rows_ok, G, False)


@triton.jit
def _pair_times(acc, p, x0, x1):
    """`acc` plus a bf16 pair (int32 `p`: low half, high half) times `x0`, `x1`, in fp32 (two
    fused multiply-adds); a bf16 widens to fp32 by its bits moving up 16 places."""
    acc = tl.fma((p << 16).to(tl.float32, bitcast=True), x0, acc)
    return tl.fma((p & -65536).to(tl.float32, bitcast=True), x1, acc)


@triton.jit
def _word_order(xv, G: tl.constexpr, ROWS_3D: tl.constexpr):
    """A vector step `[.., 32G]` (contiguous columns) -> its eight `[.., 4G]` parts in the prepared
    words' order: part (p, h) holds, at word j = 4g + c, element 32g + 8p + 2c + h. Loaded once
    and reordered in registers, instead of eight gathers per word."""
    if ROWS_3D:  # [k, 1, 32G]: one vector per slot
        R: tl.constexpr = xv.shape[0]
        x = tl.permute(tl.reshape(xv, (R, G, 2, 2, 4, 2)), (0, 1, 4, 5, 3, 2))  # (r, g, c, h, p_lo, p_hi)
        x = tl.reshape(x, (R, 1, 4 * G, 2, 2, 2))
    else:
        x = tl.permute(tl.reshape(xv, (G, 2, 2, 4, 2)), (0, 3, 4, 2, 1))
        x = tl.reshape(x, (4 * G, 2, 2, 2))
    lo_hi0, lo_hi1 = tl.split(x)  # p_hi
    h00, h01 = tl.split(lo_hi0)  # p_lo: planes 0, 1
    h10, h11 = tl.split(lo_hi1)  # planes 2, 3
    x00, x01 = tl.split(h00)  # h
    x10, x11 = tl.split(h01)
    x20, x21 = tl.split(h10)
    x30, x31 = tl.split(h11)
    return x00, x01, x10, x11, x20, x21, x30, x31


@triton.jit
def _mx4_step(w_rows, s_rows, stride_sk, v_base, k0, K, KB, rows_ok, v_ok, G: tl.constexpr,
              UPCAST_PTX: tl.constexpr, FOLDED: tl.constexpr, ROWS_3D: tl.constexpr):
    """`_mx_step` on the prepared 4-plane arrangement (`HopperMxfp4`, `planes == 4`): words
    `[.., 4G]` of columns [k0, k0 + 32*G) (`KB` bytes per row), scales `[k_padded/32, rows]`.

    Word j of the step (group j // 4, c = j % 4) holds elements 32g + 8p + 2c (+1) of plane p:
    the vector is put in that order (`_word_order`) instead of the weights being reordered. The
    codes come out as their exact values (the upcast's folded form with 2^126 as the scale); the
    products are summed per word, then per 32-column group, times the group's 2^(s-127)."""
    words, xv = _word_step_loads(w_rows, v_base, k0, K, KB, rows_ok, v_ok, G)
    x00, x01, x10, x11, x20, x21, x30, x31 = _word_order(xv, G, ROWS_3D)
    if UPCAST_PTX:
        f = tl.full(words.shape, _TWO_POW_126_BF16, tl.int16)
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            asm=_FOUR_PLANE_PTX_FOLDED_ASM, constraints="=r,=r,=r,=r,r,h", args=[words, f],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        acc = _pair_times(tl.zeros(words.shape, dtype=tl.float32), p0, x00, x01)
        acc = _pair_times(acc, p1, x10, x11)
        acc = _pair_times(acc, p2, x20, x21)
        acc = _pair_times(acc, p3, x30, x31)
    else:
        w32 = words.to(tl.uint32, bitcast=True)
        lo16 = w32 & 0xFFFF
        hi16 = w32 >> 16
        acc = _four_plane(lo16, 1.0, 0, False) * x00 + _four_plane(hi16, 1.0, 0, False) * x01
        acc += _four_plane(lo16, 1.0, 1, False) * x10 + _four_plane(hi16, 1.0, 1, False) * x11
        acc += _four_plane(lo16, 1.0, 2, False) * x20 + _four_plane(hi16, 1.0, 2, False) * x21
        acc += _four_plane(lo16, 1.0, 3, False) * x30 + _four_plane(hi16, 1.0, 3, False) * x31
    return _scaled_groups(acc, s_rows, stride_sk, k0, KB // 16, rows_ok, G, FOLDED)


@triton.jit
def _decode_w13_mx_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, h_ptr, ids_ptr, map_ptr, vt_ptr,
    N, K, S, E, L,
    stride_xm, stride_im, stride_ik, stride_we, stride_wn, stride_se, stride_sn, stride_sk, KB,
    stride_be, stride_hm,
    limit, alpha, beta, situ_beta, situ_lambda,
    TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, HAS_VT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr, FAST: tl.constexpr,
    MX_ROUTE: tl.constexpr, UPCAST_PTX: tl.constexpr, FOLDED: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
):
    """GEMM1 + activation of MXFP4 weights (`Mxfp4Tensor`'s canonical bytes and scales), a GEMV
    per slot, grid (slots, n-tiles of N): the weights stay packed from memory to registers and are
    decoded there, no MMA tile of mostly empty rows. Slots of one expert read the same tile at
    about the same time (slots vary fastest in launch order), so repeats come from L2."""
    s = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = slot_local_expert(ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr, s, s < S, E, L, TOP_K, HAS_MAP, HAS_VT)
    if e >= L:  # dropped slot: nothing to compute, its h row is never read
        return
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    GATED: tl.constexpr = ACT < ACT_SILU_NO_MUL
    g_rows, u_rows = _gate_up_rows(rn, N, ACT)
    e64 = e.to(tl.int64)
    gb = _byte_strided_rows(w_ptr, e64, g_rows.to(tl.int64)[:, None], stride_we, stride_wn, MX_ROUTE != MX_BYTES)
    ub = _byte_strided_rows(w_ptr, e64, u_rows.to(tl.int64)[:, None], stride_we, stride_wn, MX_ROUTE != MX_BYTES)
    gs = s_ptr + e64 * stride_se + g_rows.to(tl.int64)[:, None] * stride_sn
    us = s_ptr + e64 * stride_se + u_rows.to(tl.int64)[:, None] * stride_sn
    x_base = x_ptr + (s // TOP_K).to(tl.int64) * stride_xm
    G: tl.constexpr = BK // 32
    acc_g = tl.zeros((BN, G), dtype=tl.float32)
    acc_u = tl.zeros((BN, G), dtype=tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        acc_g += _mx_route_step(gb, gs, stride_sk, x_base, k0, K, KB, n_ok[:, None], True, G, MX_ROUTE, UPCAST_PTX,
                                FOLDED, False)
        if GATED:
            acc_u += _mx_route_step(ub, us, stride_sk, x_base, k0, K, KB, n_ok[:, None], True, G, MX_ROUTE,
                                    UPCAST_PTX, FOLDED, False)
    y = _bias_act(tl.sum(acc_g, 1), tl.sum(acc_u, 1), bias_ptr + e64 * stride_be, g_rows, u_rows, n_ok, h_ptr,
                  limit, alpha, beta, situ_beta, situ_lambda, HAS_BIAS, ACT, HAS_LIMIT, HAS_LAMBDA, FAST)
    tl.store(h_ptr + s.to(tl.int64) * stride_hm + rn, y.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _slot_owner(ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr, s, S, E, L, TOP_K: tl.constexpr,
                HAS_MAP: tl.constexpr, HAS_VT: tl.constexpr, RB: tl.constexpr):
    """Slot `s`'s local expert `e`, the slots `rows [RB]` routed to it, their tokens' hidden rows
    `x_rows [RB]` (int64; 0 for the other slots), and whether `s` owns the expert: a kept slot
    (dropped ones compute nothing; their h rows are never read) that is the first slot of its
    expert (the programs of later slots leave the expert to it)."""
    sl = tl.arange(0, RB)
    experts = slot_local_expert(ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr, sl, sl < S, E, L,
                                TOP_K, HAS_MAP, HAS_VT)
    e = tl.sum(tl.where(sl == s, experts, 0), 0)
    rows = experts == e
    owner = (e < L) & (tl.min(tl.where(rows, sl, RB), 0) == s)
    return e, rows, tl.where(rows, sl // TOP_K, 0).to(tl.int64), owner


@triton.jit
def _decode_w13_act_kernel(
    x_ptr, w_ptr, bias_ptr, h_ptr, ids_ptr, map_ptr, vt_ptr,
    N, K, S, E, L,
    stride_xm, stride_im, stride_ik, stride_we, stride_wn, stride_be, stride_hm,
    limit, alpha, beta, situ_beta, situ_lambda,
    TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, HAS_VT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr, FAST: tl.constexpr,
    FP32_DOT: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    sl = tl.arange(0, RB)
    e, rows, x_rows, owner = _slot_owner(ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr, s, S, E, L, TOP_K, HAS_MAP,
                                         HAS_VT, RB)
    if owner == 0:
        return
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    GATED: tl.constexpr = ACT < ACT_SILU_NO_MUL
    g_rows, u_rows = _gate_up_rows(rn, N, ACT)
    e64 = e.to(tl.int64)
    w_e = w_ptr + e64 * stride_we
    g_base = w_e + g_rows.to(tl.int64)[None, :] * stride_wn
    u_base = w_e + u_rows.to(tl.int64)[None, :] * stride_wn
    x_base = x_ptr + x_rows[:, None] * stride_xm
    acc_g = tl.zeros((RB, BN), dtype=tl.float32)
    acc_u = tl.zeros((RB, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_ok = rk < K
        a = tl.load(x_base + rk[None, :], mask=rows[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(g_base + rk[:, None], mask=w_mask, other=0.0)
        acc_g = _dot_fp32_or(a, wg, acc_g, FP32_DOT)
        if GATED:
            wu = tl.load(u_base + rk[:, None], mask=w_mask, other=0.0)
            acc_u = _dot_fp32_or(a, wu, acc_u, FP32_DOT)
    y = _bias_act(acc_g, acc_u, bias_ptr + e64 * stride_be, g_rows, u_rows, n_ok, h_ptr, limit, alpha, beta,
                  situ_beta, situ_lambda, HAS_BIAS, ACT, HAS_LIMIT, HAS_LAMBDA, FAST)
    h_ptrs = h_ptr + sl.to(tl.int64)[:, None] * stride_hm + rn[None, :]
    tl.store(h_ptrs, y.to(h_ptr.dtype.element_ty), mask=rows[:, None] & n_ok[None, :])


@triton.jit
def _decode_w13_tma_kernel(
    x_ptr, w_desc, bias_ptr, h_ptr, ids_ptr, map_ptr, vt_ptr,
    N, K, S, E, L, W_ROWS,
    stride_xm, stride_im, stride_ik, stride_be, stride_hm,
    limit, alpha, beta, situ_beta, situ_lambda,
    TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, HAS_VT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr, FAST: tl.constexpr,
    FP32_DOT: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HALVES: tl.constexpr,
):
    """`_decode_w13_act_kernel` with the weights on the MMA's M side, read by TMA: the program's
    weight rows (its BN columns' gate and up rows, 2*BN >= 64, or BN >= 64 rows non-gated) go
    straight to shared memory, and `acc^T [rows, RB] = W x^T` takes them from there as a wgmma
    operand (no per-thread copies, no ldmatrix). `w_desc`: the weight viewed as [L, 2, N, K] with
    `HALVES` (gate-first rows: the columns' gate rows, then their up rows), else as
    [L * W_ROWS, K] (interleaved gate/up rows, or non-gated rows; a tile's rows past the expert's
    belong to the next expert or read as zeros, and are never stored)."""
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    sl = tl.arange(0, RB)
    e, rows, x_rows, owner = _slot_owner(ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr, s, S, E, L, TOP_K, HAS_MAP,
                                         HAS_VT, RB)
    if owner == 0:
        return
    x_base = x_ptr + x_rows[:, None] * stride_xm
    n0 = pid_n * BN
    GATED: tl.constexpr = ACT < ACT_SILU_NO_MUL
    WR: tl.constexpr = 2 * BN if GATED else BN
    row0 = e * W_ROWS + (2 * n0 if GATED else n0)
    acc = tl.zeros((WR, RB), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(x_base + rk[None, :], mask=rows[:, None] & (rk < K)[None, :], other=0.0)
        if HALVES:
            w = tl.reshape(w_desc.load([e, 0, n0, k0]), (WR, BK))
        else:
            w = w_desc.load([row0, k0])
        acc = _dot_fp32_or(w, tl.trans(a), acc, FP32_DOT)
    if GATED:
        acc_g, acc_u = _gate_up_split(acc, ACT, True, HALVES, RB, BN)
    else:
        acc_g = tl.trans(acc)
        acc_u = acc_g
    rn = n0 + tl.arange(0, BN)
    n_ok = rn < N
    g_rows, u_rows = _gate_up_rows(rn, N, ACT)
    y = _bias_act(acc_g, acc_u, bias_ptr + e.to(tl.int64) * stride_be, g_rows, u_rows, n_ok, h_ptr, limit, alpha,
                  beta, situ_beta, situ_lambda, HAS_BIAS, ACT, HAS_LIMIT, HAS_LAMBDA, FAST)
    h_ptrs = h_ptr + sl.to(tl.int64)[:, None] * stride_hm + rn[None, :]
    tl.store(h_ptrs, y.to(h_ptr.dtype.element_ty), mask=rows[:, None] & n_ok[None, :])


@triton.jit
def _decode_w13_mx_dot_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, h_ptr, ids_ptr, map_ptr, vt_ptr,
    N, K, K_PAD, S, E, L,
    stride_xm, stride_im, stride_ik, stride_we, stride_wn, stride_se, stride_sg, stride_be, stride_hm,
    limit, alpha, beta, situ_beta, situ_lambda,
    TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, HAS_VT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr, FAST: tl.constexpr,
    FP32_DOT: tl.constexpr, K_TAIL: tl.constexpr, UPCAST_PTX: tl.constexpr, FOLDED: tl.constexpr,
    RB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """GEMM1 + activation of prepared 4-plane MXFP4 weights (`HopperMxfp4`) as an MMA, grid (n-tiles,
    slots): the owner program of an expert (`_slot_owner`) runs the prepared-MXFP4 GEMM's tile
    (`_expert_gemm_mx_hopper_rows`) over its `BN` weight rows (the gate and up rows of BN/2
    columns, gated) and the expert's slots as the MMA's narrow side (`RB` rows, the slots' hidden
    rows gathered on load). The upcast writes the weights straight into the MMA's register operand,
    so a weight costs its upcast and no multiply-add of its own (the GEMV route spends a widening
    and an FMA per weight per slot)."""
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    e, rows, x_rows, owner = _slot_owner(ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr, s, S, E, L, TOP_K, HAS_MAP,
                                         HAS_VT, RB)
    if owner == 0:
        return
    GATED: tl.constexpr = ACT < ACT_SILU_NO_MUL
    BN_OUT: tl.constexpr = BN // 2 if GATED else BN
    n0 = pid_n * BN_OUT
    rn = n0 + tl.arange(0, BN_OUT)
    _expert_gemm_mx_hopper_rows(1, e.to(tl.int64), n0, rn, rn < N, x_rows, tl.arange(0, RB), rows, x_ptr, w_ptr, s_ptr,
                                bias_ptr, h_ptr, N, K, K_PAD, stride_xm, stride_we, stride_wn, stride_se, stride_sg,
                                stride_be, stride_hm, limit, alpha, beta, situ_beta, situ_lambda, HAS_BIAS, FP32_DOT,
                                K_TAIL, UPCAST_PTX, False, FOLDED, 4, False, ACT, HAS_LIMIT, HAS_LAMBDA, FAST, GATED,
                                True, RB, BN, BN_OUT, BK, False)


@triton.jit
def _decode_w2_combine_kernel(
    h_ptr, w_ptr, s_ptr, bias_ptr, tw_ptr, out_ptr, ids_ptr, map_ptr, vt_ptr,
    K, N, E, L,
    stride_hm, stride_we, stride_wk, stride_se, stride_sk, stride_sg, KB, stride_be, stride_twm, stride_twk,
    stride_om, stride_im, stride_ik,
    TOP_K: tl.constexpr, K_POW2: tl.constexpr, HAS_MAP: tl.constexpr, HAS_VT: tl.constexpr,
    HAS_BIAS: tl.constexpr, W_MX: tl.constexpr, MX_ROUTE: tl.constexpr, UPCAST_PTX: tl.constexpr,
    FOLDED: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    if HAS_VT:
        if t >= tl.load(vt_ptr):  # rows at/after valid_tokens are not written
            return
    jj = tl.arange(0, K_POW2)
    experts = slot_local_expert(ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr, t * TOP_K + jj, jj < TOP_K, E, L,
                                TOP_K, HAS_MAP, HAS_VT)
    kept = experts < L
    e64 = tl.where(kept, experts, 0).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < K
    # All k slots at once, [k, BN, BK] per step: the k experts' weight reads are in flight together.
    h_base = h_ptr + (t * TOP_K + jj).to(tl.int64)[:, None] * stride_hm
    w_rows_ok = kept[:, None, None] & n_ok[None, :, None]
    if W_MX:  # MXFP4 (`_mx_step`): packed bytes and scales of the k experts' rows, per scale group
        G: tl.constexpr = BK // 32
        w_base = _byte_strided_rows(w_ptr, e64[:, None, None], rn.to(tl.int64)[None, :, None], stride_we, stride_wk,
                                    MX_ROUTE != MX_BYTES)
        s_base = s_ptr + e64[:, None, None] * stride_se + rn.to(tl.int64)[None, :, None] * stride_sk
        acc_g = tl.zeros((K_POW2, BN, G), dtype=tl.float32)
        for k0 in tl.range(0, N, BK, num_stages=STAGES):
            acc_g += _mx_route_step(w_base, s_base, stride_sg, h_base[:, :, None], k0, N, KB, w_rows_ok,
                                    kept[:, None, None], G, MX_ROUTE, UPCAST_PTX, FOLDED, True)
        acc = tl.sum(acc_g, 2)
    else:
        acc = tl.zeros((K_POW2, BN), dtype=tl.float32)
        w_base = w_ptr + e64[:, None, None] * stride_we + rn.to(tl.int64)[None, :, None] * stride_wk
        for k0 in tl.range(0, N, BK, num_stages=STAGES):
            rk = k0 + tl.arange(0, BK)
            k_ok = rk < N
            hv = tl.load(h_base + rk[None, :], mask=kept[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_base + rk[None, None, :], mask=w_rows_ok & k_ok[None, None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * hv[:, None, :], 2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e64[:, None] * stride_be + rn[None, :], mask=kept[:, None] & n_ok[None, :],
                       other=0.0).to(tl.float32)
    weight = tl.load(tw_ptr + t.to(tl.int64) * stride_twm + jj * stride_twk, mask=kept, other=0.0).to(tl.float32)
    # GEMM2's output rounding, then the router weighting and the slot sum in fp32. Select, never
    # multiply by zero: a dropped slot contributes nothing even where its weight is NaN.
    y = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
    total = tl.sum(tl.where(kept[:, None], y * weight[:, None], 0.0), 0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + rn, total.to(out_ptr.dtype.element_ty), mask=n_ok)
