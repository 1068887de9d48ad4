"""The decode path of `fused_experts`: a call of few routed slots in two kernels, no layout.

A decode step routes a handful of slots (tokens × k). On the layout path such a call runs five
kernels — the layout, GEMM1, the activation, GEMM2, the unpermute — and the three small ones cost
about as much as reading a small expert's weights. Here GEMM1 routes its slots itself, gathers
the hidden rows on load and applies the activation on store; GEMM2 applies the router weights and
sums each token's slots into its output row in a fixed order (`padded_moe.kernels.decode`).

The path is taken when `fused_experts` chooses the layout itself (`layout=None` and
`PADDED_MOE_GEMM_LAYOUT` unset or "auto"), the call has at most `DECODE_MAX_TOKENS` tokens and
`DECODE_MAX_SLOTS` slots, runs Triton (`backend` "auto" or "triton") and a `MoEActivation` (no
callable, no output transform), with float weights of the hidden states' dtype or MXFP4 weights
(`Mxfp4Tensor` for both GEMMs; the canonical bytes are read and decoded in registers).
`PADDED_MOE_DECODE=off` switches it off. Its results follow the layout path's roundings (GEMM1's
and GEMM2's outputs rounded to the activation dtype, router weighting and the slot sum in fp32, in
slot order); its GEMMs sum in another order, so the two paths agree to rounding, not bit for bit.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch

from padded_moe import _platform
from padded_moe._util import cdiv, next_pow2
from padded_moe.activation import ApplyMoEActivationConfig, MoEActivation, _resolve, kernel_args
from padded_moe.backends import effective_backend
from padded_moe.gemm import check_bias, check_weight
from padded_moe.mxfp4 import HOPPER_KB, Mxfp4Tensor

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
    """Whether a call `fused_experts` already checked (auto layout, a `MoEActivation`, no output
    transform) may take the decode path: the rest of the decision, `fits_decode`, is the slot count
    (made where the count is a plain int, also under the compiler's dynamic shapes)."""
    if not (decode_enabled() and effective_backend(backend) in ("auto", "triton") and hidden.stride(1) == 1
            and _platform.use_triton(hidden.device)):
        return False
    if type(w13) is Mxfp4Tensor and type(w2) is Mxfp4Tensor:
        return True
    return (type(w13) in (torch.Tensor, torch.nn.Parameter) and type(w2) in (torch.Tensor, torch.nn.Parameter)
            and w13.dtype == hidden.dtype and w2.dtype == hidden.dtype)


def fits_decode(num_tokens: int, num_slots: int) -> bool:
    return 0 < num_tokens <= DECODE_MAX_TOKENS and num_slots <= DECODE_MAX_SLOTS


def pick_tiles(num_tokens: int, num_slots: int, n: int, hidden_size: int, device: torch.device,
               mxfp4: bool = False, mx_dot: bool = False) -> DecodeTiles:
    """Tiles that give each kernel about `_PROGRAMS_PER_SM` programs per SM (counting every slot
    as its own expert, the decode case). MXFP4 steps are wider in elements (the same bytes);
    `mx_dot`: MXFP4 GEMM1 as an MMA (`MX_W13 = "dot"`), whose upcast weight tile lives in registers,
    takes `MX_DOT_BK` columns per step over `MX_DOT_STAGES` stages."""
    if device.type != "cuda":
        return replace(INTERPRET_TILES, bk1=HOPPER_KB) if mx_dot else INTERPRET_TILES
    want = _platform.program_cap(device, per_sm=_PROGRAMS_PER_SM)
    bn1 = 64
    while bn1 > 16 and num_slots * cdiv(n, bn1) < want:
        bn1 //= 2
    bn2 = 64
    while bn2 > 8 and num_tokens * cdiv(hidden_size, bn2) < want:
        bn2 //= 2
    if mx_dot:
        return DecodeTiles(bn1, MX_DOT_BK, bn2, 16384, stages1=MX_DOT_STAGES)
    if mxfp4:
        # GEMM1 steps of 16384 weights per program (capped at 512 columns): at one token on an
        # H200, 32 x 512 took 41 µs against 44 for 32 x 256 on GPT-OSS; at two tokens 64 x 256
        # beat 64 x 512 on DeepSeek-V4 (83 against 92 µs).
        return DecodeTiles(bn1, min(512, 16384 // bn1), bn2, 16384, stages1=3)
    # At one token GEMM1's K step divides K where a power of two down to 64 does: a partial last
    # step costs a whole step's latency for part of its bytes. On an H200 (cold weights), GPT-OSS
    # bf16 (K = 2880) GEMM1 took 33.1-34.2 µs at BK 64 against 35.2-35.9 at BK 128. With more
    # tokens (BN 64) the whole call at 4 tokens measured 199 µs with BK 64 against 190.5 with BK 128
    # (separate runs), so wider calls keep BK 128. (GEMM2 with smaller steps, tried alongside, gained up
    # to 0.7 µs at one token and lost up to 35% of the call at 2-4 tokens.)
    bk1 = _dividing_step(hidden_size, 128) if num_tokens == 1 else 128
    return DecodeTiles(bn1, bk1, bn2, 8192)


def _dividing_step(k: int, step: int) -> int:
    """The largest power-of-two step from `step` down to 64 that divides `k`, else `step`."""
    s = step
    while s > 64 and k % s:
        s //= 2
    return s if k % s == 0 else step


# How the MXFP4 decode kernels read weights: "prepared" (the default), the prepared 4-plane words
# (`HopperMxfp4`, what `prepare_for()` builds) where the weight has them, else as "words"; "words",
# the canonical packed bytes as 32-bit words upcast with inline PTX; "bytes", the canonical bytes
# decoded per byte in float32. sm_90 main loop per weight: about 5.2, 6.3 and 7.7 SASS
# instructions. Measured on an H200 (one routed-experts call, graph replay, T = 1 / 2 / 4),
# prepared < words < bytes on every GPT-OSS and DeepSeek-V4 shape (docs/benchmarks.md).
MX_STEPS = ("bytes", "words", "prepared")
MX_STEP = "prepared"

# How MXFP4 GEMM1 runs where it reads prepared words: "gemv", a GEMV per slot (`_decode_w13_mx_kernel`:
# per weight an upcast, a widening to float32 and a multiply-add per slot); "dot", the expert's slots
# as the narrow side of an MMA whose weight operand the upcast writes straight into registers
# (`_decode_w13_mx_dot_kernel`, the prepared-MXFP4 GEMM's tile), `MX_DOT_BK` columns per step over
# `MX_DOT_STAGES` stages; "auto" (the default), "dot" for one token and "gemv" for more. On an H200
# (whole decode calls, graph replays in alternating rounds, µs gemv / dot): one token GPT-OSS 41.9 /
# 37.9, DeepSeek-V4 48.9 / 47.7; two tokens the dot lost on DeepSeek-V4 (83.0 / 89.6) and 128-column
# steps did not pay anywhere by more than 5%. Set it before the first call: launch plans keep what
# a call launched.
MX_W13S = ("auto", "gemv", "dot")
MX_W13 = "auto"
MX_DOT_BK = 256
MX_DOT_STAGES = 3


# How MXFP4 GEMM2 runs on the decode path: "auto" (the default), the native CUDA kernel
# (`padded_moe.kernels.native`: the prepared words straight into mma.sync's registers) on the shapes
# where it measured faster (`NATIVE_W2_MEASURED`) and can run, else the Triton kernel; "triton";
# "cuda", the native kernel on every shape, or an error saying why it cannot run. It needs an sm_90
# GPU, bf16 activations, prepared 4-plane words with folded scales (`prepare_for()`), an inner size
# that is a multiple of 32, an int32 expert map if any, at most 16 slots per token, and nvcc at
# first use (or a cached build). Set it before the first call: launch plans keep what a call
# launched.
MX_W2S = ("auto", "triton", "cuda")
MX_W2 = "auto"
# Shapes (hidden size, w2's inner size, top_k) on which the native GEMM2 beat the Triton kernel on an
# H200, with the configuration that did best (`mx_decode.cu`'s PMOE_W2_CONFIGS index). DeepSeek-V4
# (MXFP4), one token, cold L2: 15.3 against 18.7 µs per GEMM2; whole decode calls 1.06x / 1.07x at 1 / 2
# tokens. GPT-OSS (2880, 2880, 4) is not here: 15.4-20.6 against 12.4 µs (docs/benchmarks.md).
NATIVE_W2_MEASURED = {(4096, 2048, 6): 0}
# The native GEMM2's configuration for every call; None: the measured one, else `_native_w2_config`.
NATIVE_W2_CONFIG: Optional[int] = None
_NATIVE_MAX_WARPS = 16  # warps per program: top_k x the K split
_native_warned: set = set()


def native_w2_config(hidden: torch.Tensor, h: torch.Tensor, w2, a2: "_WeightArgs", topk_weights: torch.Tensor,
                     w2_bias: Optional[torch.Tensor], table: Optional[torch.Tensor], top_k: int) -> Optional[int]:
    """The native GEMM2 configuration this decode call runs (`MX_W2`), or None for the Triton
    kernel; `h` is GEMM1's output it reads, `a2` is `_weight_parts(w2)`. "cuda" raises
    `NotImplementedError` naming what rules the native kernel out."""
    from padded_moe.kernels import native
    from padded_moe.kernels.decode import MX_PREPARED

    if MX_W2 not in MX_W2S:
        raise ValueError(f"padded_moe.decode.MX_W2 must be one of {', '.join(MX_W2S)}, got {MX_W2!r}")
    if MX_W2 == "triton" or not isinstance(w2, Mxfp4Tensor):
        return None
    measured = NATIVE_W2_MEASURED.get((w2.shape[1], w2.shape[2], top_k))
    if MX_W2 == "auto" and measured is None:
        return None
    why = None
    if not hidden.is_cuda or hidden.dtype != torch.bfloat16:
        why = f"it needs bf16 activations on a CUDA device, got {hidden.dtype} on {hidden.device.type}"
    elif a2.route != MX_PREPARED.value or not a2.folded:
        why = "it needs w2 prepared with folded scales (prepare_for(), every scale up to FOLD_MAX_SCALE)"
    elif w2.shape[2] % 32 or h.stride(1) != 1 or h.stride(0) % 8 or h.data_ptr() % 16:
        why = "it needs w2's inner size a multiple of 32 and GEMM1's output rows on 16 bytes"
    elif top_k > _NATIVE_MAX_WARPS:
        why = f"it takes at most {_NATIVE_MAX_WARPS} slots per token, got top_k={top_k}"
    elif topk_weights.dtype not in native.DTYPE_CODES or (w2_bias is not None and w2_bias.dtype not in native.DTYPE_CODES):
        why = "it needs float32, bfloat16 or float16 router weights and bias"
    elif table is not None and table.dtype != torch.int32:
        why = f"it needs an int32 expert map, got {table.dtype}"
    else:
        why = native.unsupported_device(hidden.device)
        failure = native.load_failure() if why is None else None
        if failure is not None and MX_W2 == "auto" and failure not in _native_warned:
            _native_warned.add(failure)
            warnings.warn(f"padded_moe: the native MXFP4 decode GEMM2 is unavailable, using the Triton kernel: "
                          f"{failure}", RuntimeWarning, stacklevel=3)
        why = why or failure
    if why is not None:
        if MX_W2 == "cuda":
            raise NotImplementedError(f"padded_moe.decode.MX_W2 = 'cuda' but the native kernel cannot run this call: {why}")
        return None
    if NATIVE_W2_CONFIG is not None:
        if not (isinstance(NATIVE_W2_CONFIG, int) and 0 <= NATIVE_W2_CONFIG < native.w2_num_configs()):
            raise ValueError(f"padded_moe.decode.NATIVE_W2_CONFIG must be None or an int in "
                             f"[0, {native.w2_num_configs()}), got {NATIVE_W2_CONFIG!r}")
        config = NATIVE_W2_CONFIG
    elif measured is not None:
        config = measured
    else:
        config = _native_w2_config(hidden.shape[0], top_k, w2.shape[1], hidden.device)
    if not native_w2_fits(config, top_k):
        raise ValueError(f"native GEMM2 configuration {config} splits K over {native.w2_split(config)} warps per "
                         f"slot: top_k={top_k} needs at most {_NATIVE_MAX_WARPS // top_k}")
    return config


def native_w2_fits(config: int, top_k: int) -> bool:
    """Whether native GEMM2 configuration `config` fits a program: one warp per slot and K split."""
    from padded_moe.kernels import native

    return top_k * native.w2_split(config) <= _NATIVE_MAX_WARPS


def _native_w2_config(num_tokens: int, top_k: int, hidden_size: int, device: torch.device) -> int:
    """Configuration 1 (K split over 2 warps) where one warp per slot and 16-row block would leave
    fewer than 8 warps per SM, else 0 (one warp per slot)."""
    from padded_moe.kernels import native

    warps = cdiv(hidden_size, native.W2_ROWS) * num_tokens * top_k
    if warps < 8 * _platform.program_cap(device, per_sm=1) and native_w2_fits(1, top_k):
        return 1
    return 0


class _WeightArgs(NamedTuple):
    """One weight as the decode kernels take it."""

    tensor: torch.Tensor  # what the kernels read as weights
    scales: torch.Tensor  # MXFP4 scales (a float weight stands in: never read)
    strides: tuple[int, int]  # the weight's (expert, row) strides: in bytes for MXFP4, whatever the element type
    scale_strides: tuple[int, int, int]  # the scales' (expert, row, group) strides
    row_bytes: int  # bytes per weight row (the word routes' `KB`), 0 when unused
    route: int  # the kernels' `MX_ROUTE`
    folded: bool  # whether the scales are folded (prepared bf16 factors)


def _weight_parts(w) -> _WeightArgs:
    """An `Mxfp4Tensor`'s canonical packed bytes `[L, rows, in/2]` (read per byte, or as int32
    words for "words") and E8M0 scales `[L, rows, in/32]`, or for "prepared" its prepared words
    `[L, rows, k_padded/8]` and scales `[L, k_padded/32, rows]` (when it has them); or a float
    weight."""
    from padded_moe.kernels import decode as kd

    if MX_STEP not in MX_STEPS:
        raise ValueError(f"padded_moe.decode.MX_STEP must be one of {', '.join(MX_STEPS)}, got {MX_STEP!r}")
    if not isinstance(w, Mxfp4Tensor):
        return _WeightArgs(w, w, (w.stride(0), w.stride(1)), (0, 0, 0), 0, kd.MX_BYTES.value, False)
    h = w.hopper
    if MX_STEP == "prepared" and h is not None and h.planes == 4:
        b, s = h.blocks, h.scales
        size = b.element_size()
        return _WeightArgs(b, s, (b.stride(0) * size, b.stride(1) * size), (s.stride(0), s.stride(2), s.stride(1)),
                           b.shape[-1] * size, kd.MX_PREPARED.value, h.folded)
    if w.blocks is None:
        raise ValueError(f"padded_moe.decode.MX_STEP={MX_STEP!r} reads the canonical MXFP4 bytes (or needs the "
                         "4-plane prepared form), which this weight does not hold (prepare_for(keep_canonical="
                         "False)); use MX_STEP='prepared'")
    b, s = w.blocks, w.scales
    route = kd.MX_BYTES.value
    # Words need each row to start on 4 bytes (true of any contiguous weight: in/2 is a multiple of
    # 16); a weight sliced otherwise is read per byte.
    if MX_STEP != "bytes" and b.data_ptr() % 4 == 0 and b.stride(0) % 4 == 0 and b.stride(1) % 4 == 0:
        route = kd.MX_WORDS.value
    return _WeightArgs(b, s, (b.stride(0), b.stride(1)), (s.stride(0), s.stride(1), s.stride(2)), b.shape[-1],
                       route, False)


# How the bf16/fp16 decode GEMM1 reads its weights: "tma", tiles of the program's gate and up rows
# by TMA into shared memory, the weights on the MMA's M side (`_decode_w13_tma_kernel`), where the
# weight is TMA-readable (16-byte aligned rows, each expert's rows one run); "pointer", per-thread
# copies into an MMA tile of the slot rows (`_decode_w13_act_kernel`). Set it before the first call:
# launch plans keep what a call launched.
W13_READS = ("tma", "pointer")
W13_READ = "tma"


def _w13_descriptor(w13, hidden: torch.Tensor, act: MoEActivation, tiles: DecodeTiles):
    """(TMA descriptor of `w13`, activation columns per program, gate-first halves) for
    `_decode_w13_tma_kernel`, or None where W13_READ or the weight rules it out. A program's weight
    tile is at least 64 rows (wgmma's M): BN >= 32 columns gated, >= 64 not."""
    if W13_READ not in W13_READS:
        raise ValueError(f"padded_moe.decode.W13_READ must be one of {', '.join(W13_READS)}, got {W13_READ!r}")
    from padded_moe.kernels.gemm import gate_up_descriptor, rows_descriptor, weight_rows_tma_ok

    if W13_READ != "tma" or type(w13) not in (torch.Tensor, torch.nn.Parameter) or hidden.dtype == torch.float32 \
            or not weight_rows_tma_ok(w13, tiles.bk1):
        return None
    gated = act.is_gated
    bn = max(tiles.bn1, 32 if gated else 64)
    if gated and not act.interleaved:
        return gate_up_descriptor(w13, bn, tiles.bk1), bn, True
    return rows_descriptor(w13, 2 * bn if gated else bn, tiles.bk1), bn, False


def uses_mx_dot(w13, num_tokens: int) -> bool:
    """Whether a decode call of `num_tokens` runs MXFP4 GEMM1 as an MMA (`MX_W13`): only on the
    prepared words (`_weight_parts`' "prepared" route)."""
    from padded_moe.kernels.decode import MX_PREPARED

    if MX_W13 not in MX_W13S:
        raise ValueError(f"padded_moe.decode.MX_W13 must be one of {', '.join(MX_W13S)}, got {MX_W13!r}")
    return (isinstance(w13, Mxfp4Tensor) and _weight_parts(w13).route == MX_PREPARED.value
            and (MX_W13 == "dot" or (MX_W13 == "auto" and num_tokens == 1)))


def decode_experts(hidden: torch.Tensor, w13, w2, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, act: MoEActivation, cfg: ApplyMoEActivationConfig, num_experts: int,
                   table: Optional[torch.Tensor], w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
                   valid_tokens: Optional[torch.Tensor], h: torch.Tensor, out: torch.Tensor,
                   tiles: Optional[DecodeTiles] = None) -> torch.Tensor:
    """Run the decode path on arguments `fused_experts` checked; `h [M*k, N]` is scratch for the
    activation's output, `out [M, K]` receives the result (rows at/after `valid_tokens` untouched)."""
    from padded_moe.kernels._launch import launch, ptr_key
    from padded_moe.kernels.decode import (_decode_w2_combine_kernel, _decode_w13_act_kernel, _decode_w13_mx_dot_kernel,
                                           _decode_w13_mx_kernel, _decode_w13_tma_kernel)

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
    a13, a2 = _weight_parts(w13), _weight_parts(w2)
    mx_dot = uses_mx_dot(w13, num_tokens)
    tiles = tiles or pick_tiles(num_tokens, num_slots, n, hidden_size, hidden.device, mxfp4=mx, mx_dot=mx_dot)
    interpreted = not hidden.is_cuda
    dummy = out  # stands in for the pointers of absent options (never dereferenced)
    ids_stride = (topk_ids.stride(0), topk_ids.stride(1))
    common = (topk_ids, dummy if table is None else table, dummy if valid_tokens is None else valid_tokens)
    flags = dict(TOP_K=top_k, HAS_MAP=table is not None, HAS_VT=valid_tokens is not None)

    # The activation kernel's choice: approximate tanh only under 16-bit rounding.
    floats, act_flags = kernel_args(act, p, fast=hidden.is_cuda and hidden.dtype != torch.float32)
    constexprs = dict(flags, HAS_BIAS=w13_bias is not None, **act_flags)
    b13 = dummy if w13_bias is None else w13_bias
    tail = (0 if w13_bias is None else w13_bias.stride(0), h.stride(0))
    ints = (n, hidden_size, num_slots, num_experts, num_local, hidden.stride(0)) + ids_stride + a13.strides
    if mx_dot:  # the expert's slots against the upcast weight tile as an MMA
        hb = w13.hopper
        if tiles.bk1 % HOPPER_KB:
            raise ValueError(f"tiles.bk1 must be a multiple of {HOPPER_KB} for MXFP4 GEMM1 as an MMA "
                             f"(MX_W13 = 'dot'), got {tiles.bk1}")
        gated = act.is_gated
        bn = 2 * max(tiles.bn1, 32) if gated else max(tiles.bn1, 64)  # wgmma's M: >= 64 weight rows
        ptrs = (hidden, a13.tensor, a13.scales, b13, h) + common
        ints = (n, hidden_size, hb.k_padded, num_slots, num_experts, num_local, hidden.stride(0)) + ids_stride \
            + a13.strides + (a13.scale_strides[0], a13.scale_strides[2]) + tail
        constexprs.update(FP32_DOT=hidden.dtype == torch.float32 or interpreted,
                          K_TAIL=hb.k_padded % tiles.bk1 != 0 or hidden_size != hb.k_padded,
                          UPCAST_PTX=hidden.is_cuda and hidden.dtype == torch.bfloat16, FOLDED=a13.folded,
                          RB=max(16, next_pow2(num_slots)), BN=bn, BK=tiles.bk1)
        launch(_decode_w13_mx_dot_kernel, (cdiv(n, bn // 2 if gated else bn), num_slots),
               ints + floats + ptr_key(*ptrs), ptrs + ints + floats, constexprs, num_warps=tiles.warps1,
               num_stages=tiles.stages1 if hidden.is_cuda else 1)
    elif mx:  # a GEMV per slot, the weights decoded in registers
        ptrs = (hidden, a13.tensor, a13.scales, b13, h) + common
        ints = ints + a13.scale_strides + (a13.row_bytes,) + tail
        constexprs.update(MX_ROUTE=a13.route, UPCAST_PTX=hidden.is_cuda, FOLDED=a13.folded, BN=tiles.bn1,
                          BK=tiles.bk1, STAGES=tiles.stages1 if hidden.is_cuda else 1)
        launch(_decode_w13_mx_kernel, (num_slots, cdiv(n, tiles.bn1)), ints + floats + ptr_key(*ptrs),
               ptrs + ints + floats, constexprs, num_warps=tiles.warps1)
    else:
        # Interpreter: triton 3.6's interpreted bf16 tl.dot is wrong, so upcast (exact).
        constexprs.update(FP32_DOT=hidden.dtype == torch.float32 or interpreted, RB=max(16, next_pow2(num_slots)))
        desc = _w13_descriptor(w13, hidden, act, tiles)
        if desc is not None:
            w_desc, bn, halves = desc
            ptrs = (hidden, b13, h) + common
            ints = (n, hidden_size, num_slots, num_experts, num_local, w13.shape[1], hidden.stride(0)) + ids_stride \
                + tail
            constexprs.update(BN=bn, BK=tiles.bk1, HALVES=halves)
            launch(_decode_w13_tma_kernel, (cdiv(n, bn), num_slots), ints + floats + (num_local,) + ptr_key(w13, *ptrs),
                   (hidden, w_desc) + ptrs[1:] + ints + floats, constexprs, num_warps=tiles.warps1,
                   num_stages=tiles.stages1)
        else:
            ptrs = (hidden, a13.tensor, b13, h) + common
            ints = ints + tail
            constexprs.update(BN=tiles.bn1, BK=tiles.bk1)
            launch(_decode_w13_act_kernel, (cdiv(n, tiles.bn1), num_slots), ints + floats + ptr_key(*ptrs),
                   ptrs + ints + floats, constexprs, num_warps=tiles.warps1, num_stages=tiles.stages1)

    native_config = native_w2_config(hidden, h, w2, a2, topk_weights, w2_bias, table, top_k) if mx else None
    if native_config is not None:
        from padded_moe.kernels import native
        from padded_moe.kernels._launch import launch_native

        codes = native.DTYPE_CODES
        vt64 = int(valid_tokens is not None and valid_tokens.dtype == torch.int64)
        args = (native_config, h, h.stride(0), a2.tensor, a2.strides[0] // 4, a2.strides[1] // 4, a2.scales,
                *a2.scale_strides, w2_bias, 0 if w2_bias is None else w2_bias.stride(0),
                0 if w2_bias is None else codes[w2_bias.dtype], topk_weights, *topk_weights.stride(),
                codes[topk_weights.dtype], topk_ids, *ids_stride, int(topk_ids.dtype == torch.int64), table,
                valid_tokens, vt64, out, out.stride(0), hidden_size, n, w2.hopper.k_padded, num_experts, num_local,
                top_k)
        launch_native(native.entry("pmoe_mx_w2_combine"), (cdiv(hidden_size, native.W2_ROWS), num_tokens), args)
        return out
    ptrs = (h, a2.tensor, a2.scales, dummy if w2_bias is None else w2_bias, topk_weights, out) + common
    ints = (hidden_size, n, num_experts, num_local, h.stride(0), *a2.strides, *a2.scale_strides, a2.row_bytes,
            0 if w2_bias is None else w2_bias.stride(0), topk_weights.stride(0), topk_weights.stride(1),
            out.stride(0)) + ids_stride
    constexprs = dict(TOP_K=top_k, K_POW2=next_pow2(top_k), HAS_MAP=table is not None, HAS_VT=valid_tokens is not None,
                      HAS_BIAS=w2_bias is not None, W_MX=mx, MX_ROUTE=a2.route, UPCAST_PTX=hidden.is_cuda,
                      FOLDED=a2.folded, BN=tiles.bn2, BK=tiles.bk2_for(top_k, n),
                      STAGES=tiles.stages2 if hidden.is_cuda else 1)
    launch(_decode_w2_combine_kernel, (num_tokens, cdiv(hidden_size, tiles.bn2)), ints + ptr_key(*ptrs),
           ptrs + ints, constexprs, num_warps=tiles.warps2)
    return out
