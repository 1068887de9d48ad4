"""The decode path of `fused_experts`: a call of few routed slots in two kernels, no layout.

A decode step routes a handful of slots (tokens × k). On the layout path such a call runs five
kernels — the layout, GEMM1, the activation, GEMM2, the unpermute — and the three small ones cost
about as much as reading a small expert's weights. Here GEMM1 routes its slots itself, gathers
the hidden rows on load and applies the activation on store; GEMM2 applies the router weights and
sums each token's slots into its output row in a fixed order (`padded_moe.kernels.decode`).

The path is taken when `fused_experts` chooses the layout itself (`layout=None` and
`PADDED_MOE_GEMM_LAYOUT` unset or "auto"), the call has at most `DECODE_MAX_TOKENS` tokens and
`DECODE_MAX_SLOTS` slots, runs Triton (`backend` "auto" or "triton") and spec 01's activation (no
callable, no output transform), with float weights of the hidden states' dtype or MXFP4 weights
(`Mxfp4Tensor` for both GEMMs; the canonical bytes are read and decoded in registers).
`PADDED_MOE_DECODE=off` switches it off. Its results follow the layout path's roundings (GEMM1's
and GEMM2's outputs rounded to the activation dtype, router weighting and the slot sum in fp32, in
slot order); its GEMMs sum in another order, so the two paths agree to rounding, not bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from padded_moe import _platform
from padded_moe._util import cdiv, next_pow2
from padded_moe.activation import ApplyMoEActivationConfig, MoEActivation, _resolve
from padded_moe.gemm import check_bias, check_weight
from padded_moe.mxfp4 import Mxfp4Tensor

DECODE_ENV = "PADDED_MOE_DECODE"
_CHOICES = ("auto", "off")

# Calls of at most this many slots (tokens × k) and tokens take the decode path. GEMM1 gathers every
# slot of an expert into one tile of at most DECODE_MAX_SLOTS rows; GEMM2 reads each token's experts
# on its own, so an expert shared by several tokens is read once per token: on the H200, Mixtral
# (8 experts, top-2) at 8 tokens took 1.07x the layout path's time, at 4 tokens 0.96x.
DECODE_MAX_SLOTS = 16
DECODE_MAX_TOKENS = 4


@dataclass(frozen=True)
class DecodeTiles:
    """Launch shape of the two decode kernels: GEMM1 `bn1` activation columns per program, `bk1`
    of K per step (software-pipelined over `stages1`); GEMM2 `bn2` output columns per program and
    `step2` weight elements per pipelined step (all k slots side by side)."""

    bn1: int
    bk1: int
    bn2: int
    step2: int  # GEMM2 reads a [k, bn2, bk2] weight step: bk2 = step2 // (k rounded up to a power of two)
    warps1: int = 4
    stages1: int = 4
    warps2: int = 4
    stages2: int = 3

    def bk2_for(self, top_k: int, n: int) -> int:
        # At least 32: an MXFP4 step covers whole 32-column scale groups.
        return max(32, min(next_pow2(n), self.step2 // (next_pow2(top_k) * self.bn2)))

    def short(self) -> str:
        return (f"g1_BN{self.bn1}_BK{self.bk1}_w{self.warps1}_s{self.stages1}"
                f"__g2_BN{self.bn2}_step{self.step2}_w{self.warps2}_s{self.stages2}")


INTERPRET_TILES = DecodeTiles(16, 32, 16, 256, stages1=1, stages2=1)

# Programs per SM the tile choice aims for: a decode GEMM is a weight read, and a few resident
# programs per SM keep enough loads in flight.
_PROGRAMS_PER_SM = 2


def decode_enabled() -> bool:
    """`PADDED_MOE_DECODE` read at call time: "auto" (or unset) enables the path, "off" disables it."""
    value = os.environ.get(DECODE_ENV, "").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"{DECODE_ENV} must be one of {', '.join(_CHOICES)}, got {os.environ[DECODE_ENV]!r}")
    return value == "auto"


def decode_allowed(hidden: torch.Tensor, w13, w2, backend: str) -> bool:
    """Whether a call `fused_experts` already checked (auto layout, spec 01 activation, no output
    transform) may take the decode path: the rest of the decision, `fits_decode`, is the slot count
    (made where the count is a plain int, also under the compiler's dynamic shapes)."""
    if not (decode_enabled() and backend in ("auto", "triton") and hidden.stride(1) == 1
            and _platform.use_triton(hidden.device)):
        return False
    if type(w13) is Mxfp4Tensor and type(w2) is Mxfp4Tensor:
        return True
    return (type(w13) in (torch.Tensor, torch.nn.Parameter) and type(w2) in (torch.Tensor, torch.nn.Parameter)
            and w13.dtype == hidden.dtype and w2.dtype == hidden.dtype)


def fits_decode(num_tokens: int, num_slots: int) -> bool:
    return 0 < num_tokens <= DECODE_MAX_TOKENS and num_slots <= DECODE_MAX_SLOTS


def pick_tiles(num_tokens: int, num_slots: int, n: int, hidden_size: int, device: torch.device,
               mxfp4: bool = False) -> DecodeTiles:
    """Tiles that give each kernel about `_PROGRAMS_PER_SM` programs per SM (counting every slot
    as its own expert, the decode case). MXFP4 steps are wider in elements (the same bytes)."""
    if device.type != "cuda":
        return INTERPRET_TILES
    want = _platform.program_cap(device, per_sm=_PROGRAMS_PER_SM)
    bn1 = 64
    while bn1 > 16 and num_slots * cdiv(n, bn1) < want:
        bn1 //= 2
    bn2 = 64
    while bn2 > 8 and num_tokens * cdiv(hidden_size, bn2) < want:
        bn2 //= 2
    if mxfp4:
        return DecodeTiles(bn1, 256, bn2, 16384, stages1=3)
    return DecodeTiles(bn1, 128, bn2, 8192)


# How the MXFP4 decode kernels read weights: "bytes", the canonical packed bytes decoded per byte
# in float32 (about 7.7 SASS instructions per weight in the sm_90 main loop); "words", the same
# bytes as 32-bit words upcast with inline PTX, or "prepared", the prepared 4-plane words
# (`HopperMxfp4`, what `prepare_for()` builds) upcast the same way (both about 5.2). The two word
# routes have not been timed on a GPU yet, so "bytes" stays the default until a run shows one faster.
MX_STEPS = ("bytes", "words", "prepared")
MX_STEP = "bytes"


def _weight_parts(w) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int], int, bool]:
    """(what the kernels read as weights, their scales, the scales' (expert, row, group) strides
    and words per row, the kernels' `MX_ROUTE`, whether the scales are folded): an
    `Mxfp4Tensor`'s canonical packed bytes `[L, rows, in/2]` (as int32 words `[L, rows, in/8]`
    for "words") and E8M0 scales `[L, rows, in/32]`, or for "prepared" its prepared words
    `[L, rows, k_padded/8]` and scales `[L, k_padded/32, rows]` (when it has them); or a float
    weight standing in for scales never read."""
    from padded_moe.kernels import decode as kd

    if MX_STEP not in MX_STEPS:
        raise ValueError(f"padded_moe.decode.MX_STEP must be one of {', '.join(MX_STEPS)}, got {MX_STEP!r}")
    if isinstance(w, Mxfp4Tensor):
        h = w.hopper
        if MX_STEP == "prepared" and h is not None and h.planes == 4:
            s = h.scales
            return h.blocks, s, (s.stride(0), s.stride(2), s.stride(1), h.blocks.shape[-1]), kd.MX_PREPARED.value, \
                h.folded
        s = w.scales
        strides = (s.stride(0), s.stride(1), s.stride(2))
        b = w.blocks
        # Words need each row to start on 4 bytes (true of any contiguous weight: in/2 is a multiple of 16).
        if MX_STEP == "words" and b.data_ptr() % 4 == 0 and b.stride(0) % 4 == 0 and b.stride(1) % 4 == 0:
            words = b.view(torch.int32)
            return words, s, strides + (words.shape[-1],), kd.MX_WORDS.value, False
        return b, s, strides + (0,), kd.MX_BYTES.value, False
    return w, w, (0, 0, 0, 0), kd.MX_BYTES.value, False


def decode_experts(hidden: torch.Tensor, w13, w2, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, act: MoEActivation, cfg: ApplyMoEActivationConfig, num_experts: int,
                   table: Optional[torch.Tensor], w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
                   valid_tokens: Optional[torch.Tensor], h: torch.Tensor, out: torch.Tensor,
                   tiles: Optional[DecodeTiles] = None) -> torch.Tensor:
    """Run the decode path on arguments `fused_experts` checked; `h [M*k, N]` is scratch for the
    activation's output, `out [M, K]` receives the result (rows at/after `valid_tokens` untouched)."""
    from padded_moe.kernels._launch import launch, ptr_key
    from padded_moe.kernels.activation import KERNEL_IDS
    from padded_moe.kernels.decode import _decode_w2_combine_kernel, _decode_w13_act_kernel, _decode_w13_mx_kernel

    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    num_local = w13.shape[0]
    n = w2.shape[2]
    check_weight(w13, hidden, num_local)
    check_bias(w13_bias, hidden, num_local, w13.shape[1])
    check_weight(w2, h, num_local)
    check_bias(w2_bias, h, num_local, hidden_size)
    p = _resolve(act, cfg)
    mx = isinstance(w13, Mxfp4Tensor)
    tiles = tiles or pick_tiles(num_tokens, num_slots, n, hidden_size, hidden.device, mxfp4=mx)
    interpreted = not hidden.is_cuda
    dummy = out  # stands in for the pointers of absent options (never dereferenced)
    ids_stride = (topk_ids.stride(0), topk_ids.stride(1))
    common = (topk_ids, dummy if table is None else table, dummy if valid_tokens is None else valid_tokens)
    flags = dict(TOP_K=top_k, HAS_MAP=table is not None, HAS_VT=valid_tokens is not None)

    w13_t, w13_s, w13_ss, w13_route, w13_fold = _weight_parts(w13)
    w2_t, w2_s, w2_ss, w2_route, w2_fold = _weight_parts(w2)
    floats = (p.limit if p.limit is not None else 0.0, p.alpha, p.beta, p.situ_beta,
              p.situ_lambda if p.situ_lambda is not None else 1.0)
    constexprs = dict(flags, HAS_BIAS=w13_bias is not None, ACT=KERNEL_IDS[act.value], HAS_LIMIT=p.limit is not None,
                      HAS_LAMBDA=p.situ_lambda is not None,
                      # The activation kernel's choice: approximate tanh only under 16-bit rounding.
                      FAST=hidden.is_cuda and hidden.dtype != torch.float32)
    b13 = dummy if w13_bias is None else w13_bias
    tail = (0 if w13_bias is None else w13_bias.stride(0), h.stride(0))
    ints = (n, hidden_size, num_slots, num_experts, num_local, hidden.stride(0)) + ids_stride + (
        w13_t.stride(0), w13_t.stride(1))
    if mx:  # a GEMV per slot, the weights decoded in registers
        ptrs = (hidden, w13_t, w13_s, b13, h) + common
        ints = ints + tuple(w13_ss) + tail
        constexprs.update(MX_ROUTE=w13_route, UPCAST_PTX=hidden.is_cuda, FOLDED=w13_fold, BN=tiles.bn1,
                          BK=tiles.bk1, STAGES=tiles.stages1 if hidden.is_cuda else 1)
        launch(_decode_w13_mx_kernel, (num_slots, cdiv(n, tiles.bn1)), ints + floats + ptr_key(*ptrs),
               ptrs + ints + floats, constexprs, num_warps=tiles.warps1)
    else:
        ptrs = (hidden, w13_t, b13, h) + common
        ints = ints + tail
        # Interpreter: triton 3.6's interpreted bf16 tl.dot is wrong, so upcast (exact).
        constexprs.update(FP32_DOT=hidden.dtype == torch.float32 or interpreted, RB=max(16, next_pow2(num_slots)),
                          BN=tiles.bn1, BK=tiles.bk1)
        launch(_decode_w13_act_kernel, (cdiv(n, tiles.bn1), num_slots), ints + floats + ptr_key(*ptrs),
               ptrs + ints + floats, constexprs, num_warps=tiles.warps1, num_stages=tiles.stages1)

    ptrs = (h, w2_t, w2_s, dummy if w2_bias is None else w2_bias, topk_weights, out) + common
    ints = (hidden_size, n, num_experts, num_local, h.stride(0), w2_t.stride(0), w2_t.stride(1), *w2_ss,
            0 if w2_bias is None else w2_bias.stride(0), topk_weights.stride(0), topk_weights.stride(1),
            out.stride(0)) + ids_stride
    constexprs = dict(TOP_K=top_k, K_POW2=next_pow2(top_k), HAS_MAP=table is not None, HAS_VT=valid_tokens is not None,
                      HAS_BIAS=w2_bias is not None, W_MX=mx, MX_ROUTE=w2_route, UPCAST_PTX=hidden.is_cuda,
                      FOLDED=w2_fold, BN=tiles.bn2, BK=tiles.bk2_for(top_k, n),
                      STAGES=tiles.stages2 if hidden.is_cuda else 1)
    launch(_decode_w2_combine_kernel, (num_tokens, cdiv(hidden_size, tiles.bn2)), ints + ptr_key(*ptrs),
           ptrs + ints, constexprs, num_warps=tiles.warps2)
    return out
