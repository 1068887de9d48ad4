"""Top-k routing of router logits in one kernel (the softmax routers of `padded_moe.routing`).

One program per row of `logits [M, E]`: the row is read once into registers (E up to 1024), then

- SOFTMAX_FIRST (Mixtral, Qwen3-MoE, OLMoE): the softmax over all E in float32, the k largest
  probabilities, optionally divided by their sum (RENORM);
- otherwise (GPT-OSS): the k largest logits, then the softmax over those k;

and the k weights (in the output's dtype) and ids are stored, largest first. The k largest are
found by k rounds of "maximum, then the lowest column holding it" with that column struck out, so
ties go to the lower expert id. Padding columns (past E) are never chosen; a row whose values are
all NaN yields the id E, which every expert guard drops. The exponential is libdevice's `expf`
(as torch's CUDA softmax computes it), not the fast approximation (the interpreter, which has no
libdevice, computes `exp` in numpy: LIBDEVICE False).

`_biased_router_kernel` is DeepSeek-V3 / V4's router (`padded_moe.routing.biased_grouped_topk`) the same
way: the scores (sigmoid, sqrt(softplus) or softmax), the choice scores with the correction bias,
for V3 the group limit (each group scored by the sum of its two best choice scores, the
TOPK_GROUPS best groups kept, ties to the lower group), the k best choices, and as weights the
chosen experts' unbiased scores, renormalised (sum + 1e-20) and scaled.

`_gate_kernel` is the router's gate projection for decode-sized batches (`routing.gate_sums`):
partial float32 sums of `x @ W.T` for up to 16 rows, each program a block of 16 experts and one
split of the hidden size (enough programs to stream the gate weight at the device's rate); the
router kernels then add the splits in order, add the bias and round once to the logits' dtype, as
a GEMM with a bias epilogue rounds, before routing (`_row_logits`).

Replaces the 3-6 small kernels of the torch formula (softmax, top-k, sum, divide, casts; for
DeepSeek also softplus, sqrt, the bias add, the gather): a decode step pays each of them in launch
and tail time, and torch's top-k over 8192 rows of 256 experts alone took ~137 µs on an H200.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _log1p(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log1p(x)
    # log(1 + x) scaled by x / ((1 + x) - 1): exact to a few ulps where 1 + x rounds (Goldberg).
    w = 1.0 + x
    exact = w == 1.0
    return tl.where(exact, x, tl.log(w) * (x / tl.where(exact, 1.0, w - 1.0)))


@triton.jit
def _softmax(x, LIBDEVICE: tl.constexpr):
    """The float32 softmax of one row (padding columns at -inf get 0)."""
    e = _exp(x - tl.max(x, axis=0), LIBDEVICE)
    return e / tl.sum(e, axis=0)


@triton.jit
def _round_bf16(x):
    """`x` rounded to the nearest bfloat16 (ties to even), returned as float32. By bit arithmetic,
    so that Triton's interpreter (whose bfloat16 cast truncates) rounds exactly as the GPU does."""
    b = x.to(tl.int32, bitcast=True)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, r)


@triton.jit
def _best(vals, cols, NONE: tl.constexpr):
    """The largest of `vals` and the lowest column holding it (NONE where no column equals the
    maximum: a NaN row)."""
    best = tl.max(vals, axis=0)
    return best, tl.min(tl.where(vals == best, cols, NONE), axis=0)


@triton.jit
def _row_logits(logits_ptr, row, stride_lm, stride_ls, gbias_ptr, cols, in_row, PARTS: tl.constexpr,
                GATE_BIAS: tl.constexpr, ROUND: tl.constexpr):
    """A row of router logits in float32, -inf past E. PARTS == 0: read from `logits`. Otherwise
    `logits` holds `_gate_kernel`'s PARTS partial sums (`[PARTS, M, E]` float32): added in split
    order (the same bits on every call), plus the gate's bias, rounded once to the logits' dtype
    as a GEMM with a bias epilogue rounds (ROUND: 0 float32, 1 bfloat16, 2 float16)."""
    base = logits_ptr + row.to(tl.int64) * stride_lm + cols
    if PARTS == 0:
        x = tl.load(base, mask=in_row, other=float("-inf")).to(tl.float32)
    else:
        x = tl.load(base, mask=in_row, other=0.0)
        for s in tl.static_range(1, PARTS):
            x += tl.load(base + s * stride_ls, mask=in_row, other=0.0)
        if GATE_BIAS:
            x += tl.load(gbias_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        if ROUND == 1:
            x = _round_bf16(x)
        elif ROUND == 2:
            x = x.to(tl.float16).to(tl.float32)
        x = tl.where(in_row, x, float("-inf"))
    return x


@triton.jit
def _topk_router_kernel(logits_ptr, stride_lm, stride_ls, gbias_ptr, w_ptr, stride_wm, ids_ptr, stride_im, E,
                        K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_E: tl.constexpr,
                        SOFTMAX_FIRST: tl.constexpr, RENORM: tl.constexpr, LIBDEVICE: tl.constexpr,
                        PARTS: tl.constexpr, GATE_BIAS: tl.constexpr, ROUND: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    in_row = cols < E
    x = _row_logits(logits_ptr, row, stride_lm, stride_ls, gbias_ptr, cols, in_row, PARTS, GATE_BIAS, ROUND)
    if SOFTMAX_FIRST:
        vals = _softmax(x, LIBDEVICE)
    else:
        vals = x
    vals = tl.where(in_row, vals, float("-inf"))
    slots = tl.arange(0, K_POW2)
    top = tl.zeros([K_POW2], dtype=tl.float32)
    ids = tl.zeros([K_POW2], dtype=tl.int32)
    for j in tl.static_range(K):
        best, at = _best(vals, cols, BLOCK_E)
        top = tl.where(slots == j, best, top)
        ids = tl.where(slots == j, tl.minimum(at, E), ids)
        vals = tl.where(cols == at, float("-inf"), vals)
    kept = slots < K
    if SOFTMAX_FIRST:
        if RENORM:
            top = top / tl.sum(tl.where(kept, top, 0.0), axis=0)
    else:
        e = tl.where(kept, _exp(top - tl.max(tl.where(kept, top, float("-inf")), axis=0), LIBDEVICE), 0.0)
        top = e / tl.sum(e, axis=0)
    tl.store(w_ptr + row.to(tl.int64) * stride_wm + slots, top.to(w_ptr.dtype.element_ty), mask=kept)
    tl.store(ids_ptr + row.to(tl.int64) * stride_im + slots, ids.to(ids_ptr.dtype.element_ty), mask=kept)


# Scoring functions of `_biased_router_kernel` (routing.SCORING_FUNCS' order).
SCORE_SIGMOID = tl.constexpr(0)
SCORE_SQRTSOFTPLUS = tl.constexpr(1)
SCORE_SOFTMAX = tl.constexpr(2)


@triton.jit
def _biased_router_kernel(logits_ptr, stride_lm, stride_ls, gbias_ptr, bias_ptr, w_ptr, stride_wm, ids_ptr,
                          stride_im, E, scale,
                          K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, SCORING: tl.constexpr,
                          HAS_BIAS: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                          RENORM: tl.constexpr, LIBDEVICE: tl.constexpr, BF16_STEPS: tl.constexpr,
                          BF16_CHOICE: tl.constexpr, PARTS: tl.constexpr, GATE_BIAS: tl.constexpr,
                          ROUND: tl.constexpr):
    """One program per row. With TOPK_GROUPS < GROUPS the host guarantees BLOCK_E == E (E and
    GROUPS powers of two), so group g is columns [g * E / GROUPS, (g + 1) * E / GROUPS).

    BF16_STEPS: every step torch would store in bfloat16 is rounded to it (transformers' DeepSeek-V4
    router computes in the model's dtype): softplus, its square root or the sigmoid, the sum of
    the chosen scores, the sum + 1e-20, the quotient and the scaled weight; BF16_CHOICE also the
    biased choice scores (a bfloat16 correction bias). The host allows it with sigmoid and
    sqrt(softplus) scoring and no group limit only. PARTS, GATE_BIAS, ROUND: `_row_logits`."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    in_row = cols < E
    x = _row_logits(logits_ptr, row, stride_lm, stride_ls, gbias_ptr, cols, in_row, PARTS, GATE_BIAS, ROUND)
    if BF16_STEPS:
        x = _round_bf16(x)  # the formula's input is bfloat16 (a no-op on bfloat16 logits)
    if SCORING == SCORE_SIGMOID:
        if BF16_STEPS:  # torch divides to nearest (div.rn); Triton's `/` is the approximate div.full
            scores = _round_bf16(tl.math.div_rn(1.0, 1.0 + _exp(-x, LIBDEVICE)))
        else:
            scores = 1.0 / (1.0 + _exp(-x, LIBDEVICE))
    elif SCORING == SCORE_SQRTSOFTPLUS:
        # torch's softplus: x itself above the threshold 20, else log1p(exp(x)).
        soft = tl.where(x > 20.0, x, _log1p(_exp(x, LIBDEVICE), LIBDEVICE))
        if BF16_STEPS:
            scores = _round_bf16(tl.sqrt_rn(_round_bf16(soft)))
        else:
            scores = tl.sqrt_rn(soft)
    else:
        scores = _softmax(x, LIBDEVICE)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        if BF16_CHOICE:
            choice = _round_bf16(choice)
    choice = tl.where(in_row, choice, float("-inf"))
    if TOPK_GROUPS < GROUPS:
        SIZE: tl.constexpr = BLOCK_E // GROUPS
        grouped = tl.reshape(choice, (GROUPS, SIZE))
        within = tl.arange(0, SIZE)[None, :]
        first = tl.max(grouped, axis=1)
        first_at = tl.min(tl.where(grouped == first[:, None], within, SIZE), axis=1)
        second = tl.max(tl.where(within == first_at[:, None], float("-inf"), grouped), axis=1)
        group_score = first + second
        groups = tl.arange(0, GROUPS)
        keep = groups < 0
        for _ in tl.static_range(TOPK_GROUPS):
            _, g = _best(group_score, groups, GROUPS)
            keep = keep | (groups == g)
            group_score = tl.where(groups == g, float("-inf"), group_score)
        choice = tl.reshape(tl.where(keep[:, None], grouped, float("-inf")), (BLOCK_E,))
    slots = tl.arange(0, K_POW2)
    top = tl.zeros([K_POW2], dtype=tl.float32)
    ids = tl.zeros([K_POW2], dtype=tl.int32)
    for j in tl.static_range(K):
        _, at = _best(choice, cols, BLOCK_E)
        # the weight is the chosen expert's unbiased score (0 for a NaN row's id E)
        top = tl.where(slots == j, tl.sum(tl.where(cols == at, scores, 0.0), axis=0), top)
        ids = tl.where(slots == j, tl.minimum(at, E), ids)
        choice = tl.where(cols == at, float("-inf"), choice)
    kept = slots < K
    if BF16_STEPS:
        if RENORM:
            total = _round_bf16(_round_bf16(tl.sum(tl.where(kept, top, 0.0), axis=0)) + 1e-20)
            top = _round_bf16(tl.math.div_rn(top, total))
        top = _round_bf16(top * scale)
    else:
        if RENORM:
            top = top / (tl.sum(tl.where(kept, top, 0.0), axis=0) + 1e-20)
        top = top * scale
    tl.store(w_ptr + row.to(tl.int64) * stride_wm + slots, top.to(w_ptr.dtype.element_ty), mask=kept)
    tl.store(ids_ptr + row.to(tl.int64) * stride_im + slots, ids.to(ids_ptr.dtype.element_ty), mask=kept)


@triton.jit
def _gate_kernel(x_ptr, stride_xm, g_ptr, stride_ge, part_ptr, stride_ps, stride_pm, M, E, D, KS,
                 BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, FP32_DOT: tl.constexpr):
    """Partial gate projections: program (i, s) writes `part[s, m, e] = sum_{d in split s} x[m, d] *
    g[e, d]` (float32) for rows m < M <= BM and the BE experts of block i, split s covering columns
    [s * KS, (s + 1) * KS) (KS a multiple of BK). Rows past M are not read (they may be padding).
    The router kernels add the splits in order (`_row_logits`). FP32_DOT: the operands multiply as
    float32 in full precision (not TF32): float32 weights, and the interpreter, whose 16-bit
    `tl.dot` is wrong in Triton 3.6 (a 16-bit product is exact in float32 either way)."""
    e0 = tl.program_id(0) * BE
    split = tl.program_id(1)
    rm = tl.arange(0, BM)
    re = e0 + tl.arange(0, BE)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    e_ok = re < E
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    g_rows = g_ptr + re.to(tl.int64)[:, None] * stride_ge
    acc = tl.zeros((BM, BE), dtype=tl.float32)
    k_end = tl.minimum(split * KS + KS, D)
    for k0 in range(split * KS, k_end, BK):
        k_ok = (k0 + rk) < k_end
        a = tl.load(x_rows + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_rows + (k0 + rk)[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), tl.trans(g.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(g), acc)
    tl.store(part_ptr + split * stride_ps + rm.to(tl.int64)[:, None] * stride_pm + re[None, :], acc,
             mask=m_ok[:, None] & e_ok[None, :])
