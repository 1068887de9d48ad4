"""Top-k routing of router logits in one kernel (spec 02's softmax routers).

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

Replaces the 3-6 small kernels of the torch formula (softmax, top-k, sum, divide, casts): a
decode step pays each of them in launch and tail time.
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
def _topk_router_kernel(logits_ptr, stride_lm, w_ptr, stride_wm, ids_ptr, stride_im, E,
                        K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_E: tl.constexpr,
                        SOFTMAX_FIRST: tl.constexpr, RENORM: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    in_row = cols < E
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_lm + cols, mask=in_row, other=float("-inf")).to(tl.float32)
    if SOFTMAX_FIRST:
        e = _exp(x - tl.max(x, axis=0), LIBDEVICE)
        vals = e / tl.sum(e, axis=0)
    else:
        vals = x
    vals = tl.where(in_row, vals, float("-inf"))
    slots = tl.arange(0, K_POW2)
    top = tl.zeros([K_POW2], dtype=tl.float32)
    ids = tl.zeros([K_POW2], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(vals, axis=0)
        at = tl.min(tl.where(vals == best, cols, BLOCK_E), axis=0)
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
