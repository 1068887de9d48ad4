"""Triton kernel for the count-aware MoE activation.

One kernel serves plain, flat and batched buffers: a plain or flat buffer is a batch of one
expert. Each program owns one column block of one expert and strides over that expert's valid
row blocks, so a 5%-valid buffer costs about 5% of a full one and rows past the count are never
loaded or stored. The count is read on the device (CUDA-graph safe).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Activation ids (constexpr inside the kernel). Gated ids < 16, non-gated >= 16.
ACT_SILU = tl.constexpr(0)
ACT_GELU = tl.constexpr(1)
ACT_GELU_TANH = tl.constexpr(2)
ACT_SWIGLUOAI = tl.constexpr(3)  # interleaved gate/up
ACT_SWIGLUOAI_UNINTERLEAVE = tl.constexpr(4)
ACT_SWIGLUSTEP = tl.constexpr(5)
ACT_SITU = tl.constexpr(6)
ACT_SILU_NO_MUL = tl.constexpr(16)
ACT_GELU_NO_MUL = tl.constexpr(17)
ACT_GELU_TANH_NO_MUL = tl.constexpr(18)
ACT_RELU2_NO_MUL = tl.constexpr(19)

# Activation name (`MoEActivation` value) -> kernel id (a plain int for the launch).
_KERNEL_ID_CONSTANTS = {
    "silu": ACT_SILU, "gelu": ACT_GELU, "gelu_tanh": ACT_GELU_TANH, "swigluoai": ACT_SWIGLUOAI,
    "swigluoai_uninterleave": ACT_SWIGLUOAI_UNINTERLEAVE, "swiglustep": ACT_SWIGLUSTEP, "situ": ACT_SITU,
    "silu_no_mul": ACT_SILU_NO_MUL, "gelu_no_mul": ACT_GELU_NO_MUL,
    "gelu_tanh_no_mul": ACT_GELU_TANH_NO_MUL, "relu2_no_mul": ACT_RELU2_NO_MUL,
}
KERNEL_IDS = {name: c.value for name, c in _KERNEL_ID_CONSTANTS.items()}

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)


@triton.jit
def _tanh(z, FAST: tl.constexpr):
    if FAST:
        # One special-function op (MUFU.TANH, max rel. error ~2^-11): the kernel is bound by the
        # special-function unit otherwise (situ needs three tanh and a sigmoid per element).
        # Used only for 16-bit outputs, whose rounding is coarser than that error.
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [z], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        # Exact-enough tanh from exp, which the interpreter also runs; 1 - 2/(e^{2z}+1)
        # saturates correctly at both ends (e^{2z} -> inf or 0).
        return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@triton.jit
def _sigmoid(z, FAST: tl.constexpr):
    if FAST:
        return 0.5 * _tanh(0.5 * z, FAST) + 0.5
    else:
        return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _gelu_erf(x):
    return 0.5 * x * (1.0 + tl.math.erf(x * _INV_SQRT_2))


@triton.jit
def _gelu_tanh(x, FAST: tl.constexpr):
    return 0.5 * x * (1.0 + _tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x), FAST))


@triton.jit
def _gated(g, u, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, limit, alpha, beta,
           situ_beta, HAS_LAMBDA: tl.constexpr, situ_lambda, FAST: tl.constexpr):
    if ACT == ACT_SILU or ACT == ACT_SWIGLUOAI or ACT == ACT_SWIGLUOAI_UNINTERLEAVE:
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        if ACT == ACT_SILU:
            # Plain silu (alpha 1, beta 0; `activation.kernel_args` sends silu with other values
            # as swigluoai_uninterleave): two operations per element fewer.
            y = g * _sigmoid(g, FAST) * u
        else:
            y = g * _sigmoid(alpha * g, FAST) * (u + beta)
    elif ACT == ACT_GELU:
        y = _gelu_erf(g) * u
    elif ACT == ACT_GELU_TANH:
        y = _gelu_tanh(g, FAST) * u
    elif ACT == ACT_SWIGLUSTEP:
        s = g * _sigmoid(g, FAST)
        if HAS_LIMIT:
            s = tl.minimum(s, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        y = s * u
    else:  # ACT_SITU
        if HAS_LAMBDA:
            u = situ_lambda * _tanh(u / situ_lambda, FAST)
        y = situ_beta * _tanh(g / situ_beta, FAST) * _sigmoid(g, FAST) * u
    return y


@triton.jit
def _ungated(x, ACT: tl.constexpr, FAST: tl.constexpr):
    if ACT == ACT_SILU_NO_MUL:
        y = x * _sigmoid(x, FAST)
    elif ACT == ACT_GELU_NO_MUL:
        y = _gelu_erf(x)
    elif ACT == ACT_GELU_TANH_NO_MUL:
        y = _gelu_tanh(x, FAST)
    else:  # ACT_RELU2_NO_MUL
        r = tl.maximum(x, 0.0)
        y = r * r
    return y


@triton.jit
def moe_activation_kernel(
    out_ptr, in_ptr, counts_ptr,
    T, D,
    stride_in_e, stride_in_t, stride_out_e, stride_out_t,
    limit, alpha, beta, situ_beta, situ_lambda,
    ACT: tl.constexpr,
    HAS_COUNTS: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    HAS_LAMBDA: tl.constexpr,
    FAST: tl.constexpr,
    ROWS_I64: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid: (row programs, column blocks, experts). Output [E, T, D] from input [E, T, W]."""
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    num_row_programs = tl.num_programs(0)

    # The row loop, its bound and the masks in 32 bits (the host passes ROWS_I64 when T does not fit),
    # so no 64-bit compares; rows are widened only for addresses. (On an H200 this measured the same
    # time as the 64-bit loop; it is kept as the plainer code for the common case.)
    n = T
    if HAS_COUNTS:
        # Clamp on the device, in the count's own dtype (no narrowing before the clamp): negative
        # counts mean 0, counts above T mean T.
        c = tl.load(counts_ptr + e)
        n = tl.minimum(tl.maximum(c, 0), T)
    # tl.cast, not .to: T equal to 1 arrives as a constant, not a tensor.
    if ROWS_I64:
        n = tl.cast(n, tl.int64)
    else:
        n = tl.cast(n, tl.int32)

    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    if ACT == ACT_SWIGLUOAI:
        pair_cols = 2 * pid_d * BLOCK_D + tl.arange(0, 2 * BLOCK_D)
        pair_ok = pair_cols < 2 * D
    rows_in_block = tl.arange(0, BLOCK_T)
    in_base = in_ptr + e * stride_in_e
    out_base = out_ptr + e * stride_out_e

    for first_row in range(pid_t * BLOCK_T, n, num_row_programs * BLOCK_T):
        local = first_row + rows_in_block
        mask = (local < n)[:, None] & col_ok[None, :]
        if ACT == ACT_SWIGLUOAI:
            pair_mask = (local < n)[:, None] & pair_ok[None, :]
        rows = local.to(tl.int64)
        in_rows = in_base + rows[:, None] * stride_in_t
        if ACT >= ACT_SILU_NO_MUL:
            x = tl.load(in_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = _ungated(x, ACT, FAST)
        else:
            if ACT == ACT_SWIGLUOAI:
                # Interleaved gate/up: the block's 2*BLOCK_D inputs are one contiguous run, loaded
                # in 16-byte vectors and split in registers (two loads at stride 2 would move one
                # element per instruction).
                pairs = tl.load(in_rows + pair_cols[None, :], mask=pair_mask, other=0.0).to(tl.float32)
                g, u = tl.split(tl.reshape(pairs, (BLOCK_T, BLOCK_D, 2)))
            else:
                g = tl.load(in_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                u = tl.load(in_rows + (cols + D)[None, :], mask=mask, other=0.0).to(tl.float32)
            y = _gated(g, u, ACT, HAS_LIMIT, limit, alpha, beta, situ_beta, HAS_LAMBDA, situ_lambda, FAST)
        out_rows = out_base + rows[:, None] * stride_out_t
        tl.store(out_rows + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


# ---- GEMM1's epilogue: the same activation applied to GEMM1's accumulators (the decode kernels and
# the layout GEMM kernel), so that no [rows, 2N] buffer is written and read back ----


@triton.jit
def _gate_up_rows(rn, N, ACT: tl.constexpr):
    """w13 rows of activation columns `rn`: the gate's and the up projection's (interleaved for
    swigluoai, else the gate half first)."""
    if ACT == ACT_SWIGLUOAI:
        return 2 * rn, 2 * rn + 1
    return rn, rn + N


@triton.jit
def _bias_act(acc_g, acc_u, b_row, g_rows, u_rows, n_ok, h_ptr, limit, alpha, beta, situ_beta, situ_lambda,
              HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr,
              FAST: tl.constexpr):
    """GEMM1's epilogue, for accumulators of any rank ending in the activation columns: the gate and
    up biases (`b_row`: the expert's bias row), rounding to the activation dtype first (the values
    the activation reads from GEMM1's output buffer on the layout path), then the activation, fp32."""
    h_ty = h_ptr.dtype.element_ty
    if HAS_BIAS:
        acc_g += tl.load(b_row + g_rows, mask=n_ok, other=0.0).to(tl.float32)
    g = acc_g.to(h_ty).to(tl.float32)
    if ACT < ACT_SILU_NO_MUL:
        if HAS_BIAS:
            acc_u += tl.load(b_row + u_rows, mask=n_ok, other=0.0).to(tl.float32)
        return _gated(g, acc_u.to(h_ty).to(tl.float32), ACT, HAS_LIMIT, limit, alpha, beta, situ_beta, HAS_LAMBDA,
                      situ_lambda, FAST)
    return _ungated(g, ACT, FAST)
