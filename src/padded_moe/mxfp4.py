"""MXFP4 (OCP MX v1.0) expert weights: storage class, quantize / dequantize, checkpoint converters.

Format: FP4 E2M1 elements, two per byte along K (even K index in the low nibble),
one E8M0 scale per 32 consecutive K elements: `w[n, k] = LUT[nib] * 2^(scale[n, k // 32] - 127)`,
scale 255 = NaN. Activations stay bf16; the GEMM dequantizes in registers.

`Mxfp4Tensor.prepare_for()` adds, once at load time, a second arrangement of the same bytes for
the Triton GEMM (`HopperMxfp4`, see `prepare_hopper`); the canonical `blocks` / `scales` above stay
the contract and are never changed by it. `prepare_for(keep_canonical=False)` returns a tensor
that holds the prepared arrangement only (half the memory); its canonical bytes are rebuilt from
it (`canonical()`) where a path needs them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from padded_moe._validation import FLOAT_DTYPES, require_bool, require_dtype, require_rank, require_tensor

GROUP = 32  # K elements sharing one E8M0 scale
SCALE_BIAS = 127
SCALE_NAN = 255
HOPPER_KB = 64  # K elements per block of the prepared Hopper layout (two nibble planes of 32)
# Prepared scales are "folded" when every scale is at most this: `HopperMxfp4.scales` then holds
# the bf16 bits of 2^(s-1) as int16 instead of the E8M0 byte s. The GEMM places an e2m1 code's bits
# into a bf16 whose value is the code's value times 2^-126; one multiply by 2^(s-1) then gives the
# weight exactly, and 2^(s-1) is a finite bf16 up to s = 128. Larger scales (with `quantize_mxfp4`'s
# rule: a 32-group whose largest |w| is 16 or more; real checkpoints stay far below) keep the byte
# and cost the GEMM a second multiply.
FOLD_MAX_SCALE = 128
_BF16_EXP_BIAS = 127
# The 4-plane arrangement: each 16-bit half of a 32-bit word holds four codes (planes 0-3); for
# plane p, the bit of the half that holds the code's sign, then its three magnitude bits (e1, e0,
# m), high to low. Planes 0-2 sit where a shift left by 3p puts them at bf16 bits 15 and 8..6 (the
# code's value times 2^-126, as in the 2-plane upcast); plane 3 fills the four bits left over.
FOUR_PLANE_BITS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (14, 13, 11, 10))


def prepared_stands_alone(k: int) -> bool:
    """Whether the prepared form of a weight of inner width `k` can hold it without the canonical
    bytes (`prepare_for(keep_canonical=False)`): K whole 64-element blocks, so no padding hides the
    logical K."""
    return k % HOPPER_KB == 0


def canonical_kept(keep_canonical: bool, *inner_widths: int) -> bool:
    """Whether a layer holding MXFP4 weights of these inner widths keeps their canonical bytes next
    to the prepared form (`FusedMoE(keep_canonical=...)`): when asked to, or where some weight's
    prepared form cannot stand alone."""
    return keep_canonical or not all(prepared_stands_alone(k) for k in inner_widths)

# E2M1 magnitudes for nibble codes 0..7; codes 8..15 are the negatives.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive codes; a tie goes to the even code (round to nearest even).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_lut(device=None, dtype=torch.float32) -> torch.Tensor:
    """The 16-entry nibble -> value table."""
    pos = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([pos, -pos])


@dataclass(frozen=True)
class Mxfp4Tensor:
    """Weights `[L, rows, K]` stored as `blocks uint8 [L, rows, K/2]` + `scales uint8 [L, rows, K/32]`.

    `blocks` and `scales` are None in a tensor that holds only its prepared arrangement
    (`prepare_for(keep_canonical=False)`); `canonical()` gives them back (rebuilt, a copy)."""

    blocks: Optional[torch.Tensor]
    scales: Optional[torch.Tensor]
    # The prepared GEMM layout (`prepare_for`), built once and carried along by `to` / slicing.
    hopper: Optional["HopperMxfp4"] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.blocks is None or self.scales is None:
            self._check_prepared_only()
            return
        for name in ("blocks", "scales"):
            t = require_tensor(name, getattr(self, name))
            require_dtype(name, t, (torch.uint8,))
            require_rank(name, t, (3,))
        b, s = self.blocks, self.scales
        if b.shape[:2] != s.shape[:2] or b.shape[2] * 2 != s.shape[2] * GROUP:
            raise ValueError(
                "Mxfp4Tensor needs blocks [L, rows, K/2] and scales [L, rows, K/32] of one K, "
                f"got blocks {tuple(b.shape)} and scales {tuple(s.shape)}"
            )
        if b.device != s.device:
            raise ValueError(f"scales must be on blocks' device {b.device}, got {s.device}")
        if (b.shape[-1] > 1 and b.stride(-1) != 1) or (s.shape[-1] > 1 and s.stride(-1) != 1):
            raise ValueError("Mxfp4Tensor blocks and scales must have a contiguous last dimension")
        h = self.hopper
        if h is not None:
            if not isinstance(h, HopperMxfp4):
                raise TypeError(f"hopper must be a HopperMxfp4 (from prepare_hopper) or None, got {type(h).__name__}")
            if h.blocks.shape[:2] != b.shape[:2] or h.k != b.shape[2] * 2 or h.blocks.device != b.device:
                raise ValueError(f"hopper must be prepared from these weights [{b.shape[0]}, {b.shape[1]}, "
                                 f"{b.shape[2] * 2}] on {b.device}, got blocks {tuple(h.blocks.shape)} with "
                                 f"K={h.k} on {h.blocks.device}")

    def _check_prepared_only(self) -> None:
        """A tensor without its canonical bytes: both None, and the prepared form holds every K
        column (`k == k_padded`, so `k` follows from its shape wherever it is rebuilt)."""
        if (self.blocks is None) != (self.scales is None):
            raise ValueError("blocks and scales must both be tensors, or both None (a tensor that holds only its "
                             "prepared form)")
        h = self.hopper
        if not isinstance(h, HopperMxfp4):
            raise TypeError("an Mxfp4Tensor without blocks and scales must hold its prepared form: hopper must be "
                            f"a HopperMxfp4, got {type(h).__name__}")
        if h.k != h.k_padded or not prepared_stands_alone(h.k):
            raise ValueError(f"an Mxfp4Tensor without its canonical bytes needs K a multiple of {HOPPER_KB}, got "
                             f"K={h.k}")

    @property
    def holds_canonical(self) -> bool:
        """Whether the canonical `blocks` / `scales` are held (False after
        `prepare_for(keep_canonical=False)`)."""
        return self.blocks is not None

    def canonical(self) -> "Mxfp4Tensor":
        """The canonical form: this tensor when it holds `blocks` / `scales`, else a new one rebuilt
        from the prepared arrangement (`unprepare_hopper`: a full-size copy, made on each call)."""
        return self if self.blocks is not None else unprepare_hopper(self.hopper)

    @property
    def shape(self) -> torch.Size:
        """Logical (dequantized) shape `[L, rows, K]`."""
        if self.blocks is None:
            L, rows = self.hopper.blocks.shape[:2]
            return torch.Size((L, rows, self.hopper.k))
        L, rows, half_k = self.blocks.shape
        return torch.Size((L, rows, half_k * 2))

    @property
    def device(self) -> torch.device:
        return (self.hopper if self.blocks is None else self).blocks.device

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    def dim(self) -> int:
        return 3

    def size(self, i: Optional[int] = None):
        return self.shape if i is None else self.shape[i]

    def nbytes(self) -> int:
        """Bytes of the format (e2m1 codes + E8M0 scales), whichever arrangement holds them."""
        L, rows, K = self.shape
        return L * rows * (K // 2 + K // GROUP)

    def to(self, device) -> "Mxfp4Tensor":
        h = self.hopper
        if self.blocks is None:
            return Mxfp4Tensor(None, None, h.to(device))
        return Mxfp4Tensor(self.blocks.to(device), self.scales.to(device), None if h is None else h.to(device))

    def contiguous(self) -> "Mxfp4Tensor":
        if self.blocks is None:
            return self  # the prepared form is built contiguous
        return Mxfp4Tensor(self.blocks.contiguous(), self.scales.contiguous(), self.hopper)

    def __getitem__(self, idx) -> "Mxfp4Tensor":
        """Expert slicing (`q[2:5]`); an int keeps the expert dimension (`q[3]` is `[1, rows, K]`)."""
        if isinstance(idx, int):
            idx = slice(idx, idx + 1 if idx != -1 else None)
        h = self.hopper
        if self.blocks is None:
            return Mxfp4Tensor(None, None, h[idx])
        return Mxfp4Tensor(self.blocks[idx], self.scales[idx], None if h is None else h[idx])

    def prepare_for(self, device=None, *, planes: int = 4, keep_canonical: bool = True) -> "Mxfp4Tensor":
        """Arrange the weights once for the Triton GEMM and return the tensor to use from then on.

        Builds `hopper` (`prepare_hopper`: values re-ordered within 64-element K blocks, scales
        transposed and, for scales up to `FOLD_MAX_SCALE`, stored as the bf16 factor the kernel
        multiplies by) unless it is already there. With `device` other than this tensor's, moves
        first and returns the moved copy; otherwise prepares in place and returns `self`. Call it
        at load time, not per forward: `fused_experts` / `expert_gemm` use the prepared form
        whenever it is present. `planes`: the arrangement of the values (`prepare_hopper`).

        `keep_canonical`: True (default) keeps `blocks` / `scales` next to the prepared form, so
        the device holds the weights twice. False returns a new tensor that holds the prepared
        form only (`blocks` / `scales` None; K must be a multiple of 64); drop your references to
        the canonical one and its memory is freed. Every GPU path of `fused_experts` /
        `expert_gemm` reads the prepared form; the ones that need the canonical bytes rebuild
        them per call (`canonical()`: the torch backend, `dequantize`) or refuse with ValueError
        (the `tl.dot_scaled` kernel, `mx_hopper=False`; the humming backend; the decode path's
        `MX_STEP` "bytes" / "words").
        """
        require_bool("keep_canonical", keep_canonical)
        q = self
        if device is not None and torch.device(device) != self.device:
            q = self.to(device)
        if q.hopper is None:
            if not keep_canonical and not prepared_stands_alone(q.shape[-1]):
                raise ValueError(f"keep_canonical=False needs K a multiple of {HOPPER_KB}, got K={q.shape[-1]}")
            object.__setattr__(q, "hopper", prepare_hopper(q, planes=planes))  # frozen: set once, before any use
        mark_sizes_static(q.hopper)
        if keep_canonical or q.blocks is None:
            return q
        return Mxfp4Tensor(None, None, q.hopper)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize_mxfp4(self, dtype)


class Mxfp4NotPreparedWarning(UserWarning):
    """An `Mxfp4Tensor` without its prepared form (`prepare_for()`) ran the expert GEMM on a Hopper
    GPU: the `tl.dot_scaled` kernel, which took 1.3-2.7x the time of the prepared one on the
    H200 (GPT-OSS and DeepSeek-V4 stages from 4 to 1024 rows per expert). Results are the same.
    Silence it with `warnings.simplefilter("ignore", Mxfp4NotPreparedWarning)`."""


# Devices already warned about by `warn_unprepared`. Python's default filter alone does not keep
# it to once: any change to the warning filters (torch and Triton enter `catch_warnings` often)
# clears its record of what was shown.
_WARNED_UNPREPARED: set = set()


def warn_unprepared(device: torch.device) -> None:
    """Warn, once per process and device, that a GEMM on `device` reads unprepared MXFP4 weights,
    on GPUs where the prepared kernel is the tuned one (compute capability 9.x)."""
    from padded_moe import _platform

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _WARNED_UNPREPARED and _platform.capability(index)[0] == 9:
        _WARNED_UNPREPARED.add(index)
        warnings.warn("MXFP4 weights without their prepared form run the slower tl.dot_scaled GEMM on this GPU "
                      "(1.3-2.7x the time): call `w = w.prepare_for()` once after loading each Mxfp4Tensor "
                      "(FusedMoE.load_experts and the transformers plug-in do it)", Mxfp4NotPreparedWarning,
                      stacklevel=2)


def _codes_in_place(x: torch.Tensor) -> torch.Tensor:
    """Nibble codes for `x` (already divided by the block scale): RNE on the E2M1 grid, saturating.
    Takes `x`'s magnitude in place (x is overwritten), so no second float copy is made."""
    neg = x < 0
    mag = x.abs_()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, mid in enumerate(_MIDPOINTS):
        up = mag > mid
        if i % 2 == 1:  # the tie goes up exactly when the upper code i+1 is even
            up |= mag == mid
        code += up.to(torch.uint8)
    return code | (neg.to(torch.uint8) << 3)


def quantize_mxfp4(w: torch.Tensor) -> Mxfp4Tensor:
    """Quantize float weights `[L, rows, K]` (K % 32 == 0) along K.

    Scale exponent `floor(log2(amax)) - 2` per 32-group (clamped to [-127, 127]; all-zero groups
    take the smallest scale), elements rounded to nearest even on the E2M1 grid and saturated at ±6.
    """
    require_tensor("w", w)
    require_dtype("w", w, FLOAT_DTYPES + (torch.float64,))
    require_rank("w", w, (3,))
    L, rows, K = w.shape
    if K % GROUP != 0:
        raise ValueError(f"w's last dimension K must be a multiple of {GROUP} for MXFP4, got {K}")
    # One expert at a time: the float64 working copy (and the finiteness mask) is one expert's
    # size, so quantizing a model-sized weight peaks at the output plus one expert, not 8x the input.
    blocks = torch.empty(L, rows, K // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(L, rows, K // GROUP, dtype=torch.uint8, device=w.device)
    for e in range(L):
        if not bool(torch.isfinite(w[e]).all()):
            raise ValueError(f"w must be finite to quantize to MXFP4 (found NaN or Inf in expert {e})")
        quantize_expert_into(w[e], blocks[e], scales[e])
    return Mxfp4Tensor(blocks, scales)


def quantize_expert_into(w: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """One expert of `quantize_mxfp4`, written in place: finite float `w [rows, K]` (K % 32 == 0;
    the caller checks both) into uint8 `blocks [rows, K/2]` and `scales [rows, K/32]` on w's device."""
    rows, K = w.shape
    g = w.to(torch.float64, copy=True).reshape(rows, K // GROUP, GROUP)  # divided in place below
    amax = torch.maximum(g.amax(dim=-1), g.amin(dim=-1).neg_())  # |g|'s max without a |g| copy
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-300))) - 2,
                      torch.full_like(amax, -127.0))
    exp = exp.clamp(-SCALE_BIAS, SCALE_BIAS)
    g.div_(torch.pow(2.0, exp).unsqueeze(-1))
    codes = _codes_in_place(g).reshape(rows, K)
    del g
    torch.bitwise_or(codes[:, 0::2], codes[:, 1::2] << 4, out=blocks)
    scales.copy_(exp + SCALE_BIAS)


def dequantize_mxfp4(q: Mxfp4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`[L, rows, K]` in `dtype`; computed in float32 (exact for every non-NaN code)."""
    if not isinstance(q, Mxfp4Tensor):
        raise TypeError(f"q must be an Mxfp4Tensor, got {type(q).__name__}")
    if dtype not in FLOAT_DTYPES + (torch.float64,):
        raise TypeError(f"dtype must be a float dtype, got {dtype}")
    q = q.canonical()
    L, rows, K = q.shape
    lo = (q.blocks & 0x0F).long()
    hi = (q.blocks >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).reshape(L, rows, K)
    vals = e2m1_lut(q.device)[codes].reshape(L, rows, K // GROUP, GROUP)
    s = q.scales.to(torch.int32)
    scale = torch.ldexp(torch.ones((), device=q.device), (s - SCALE_BIAS).float())
    scale = torch.where(s == SCALE_NAN, torch.full_like(scale, float("nan")), scale)
    return (vals * scale.unsqueeze(-1)).reshape(L, rows, K).to(dtype)


# ---------------------------------------------------------------------------------------------
# Prepared layout for the Triton GEMM (docs/architecture.md, "The Triton expert GEMM on Hopper")
# ---------------------------------------------------------------------------------------------


def _prepared_planes(blocks: torch.Tensor) -> int:
    """`HopperMxfp4.planes` of prepared blocks: int32 words hold 4 planes, bytes 2."""
    return 4 if blocks.dtype == torch.int32 else 2


def _prepared_k(blocks: torch.Tensor) -> int:
    """`HopperMxfp4.k_padded` of prepared blocks: 8 codes per int32 word, 2 per byte."""
    return blocks.shape[-1] * (8 if _prepared_planes(blocks) == 4 else 2)


@dataclass(frozen=True)
class HopperMxfp4:
    """The GEMM's arrangement of an `Mxfp4Tensor` `[L, rows, K]` (built by `prepare_hopper`).

    K is zero-padded to `k_padded`, a multiple of `HOPPER_KB` (padding: code 0 with scale 127).
    - `blocks`, one of two arrangements (`planes`):
      - 2 planes, `uint8 [L, rows, k_padded/2]`: in each K block of 64 elements starting at k0,
        byte j (0..31) of the block holds element k0+j in its low nibble and k0+32+j in its high
        nibble. A kernel gets two contiguous 32-column planes with one mask or one shift each, and
        each plane lies in one 32-element scale group.
      - 4 planes, `int32 [L, rows, k_padded/8]`: word 4g+c (c = 0..3) holds eight elements of
        the 32-element scale group g: its low 16 bits elements 32g+2c+8p (plane p = 0..3), its
        high 16 bits the element after each of those, bits placed where a bf16 wants them
        (`FOUR_PLANE_BITS`). Three planes come out with one shift and one mask each, the fourth
        from three pieces, each as a bf16 pair of neighbouring elements: the pair one thread holds
        in the MMA's register operand, so a tile upcasts straight into K order and one dot per K
        step covers it (no per-plane dots).
    - `scales [L, k_padded/32, rows]`: the E8M0 scales transposed, so a tile's scales of one
      group are one contiguous load over rows. uint8 E8M0 bytes, or, when `folded`, int16 holding
      the bf16 bits of 2^(s-1) (see `FOLD_MAX_SCALE`).
    """

    blocks: torch.Tensor
    scales: torch.Tensor
    k: int  # logical K (before padding)

    @classmethod
    def unpadded(cls, blocks: torch.Tensor, scales: torch.Tensor) -> "HopperMxfp4":
        """The prepared form of a weight whose K is a multiple of `HOPPER_KB` (no padding), from its
        two tensors alone (how a custom op's arguments carry it)."""
        return cls(blocks, scales, _prepared_k(blocks))

    @property
    def k_padded(self) -> int:
        return _prepared_k(self.blocks)

    @property
    def planes(self) -> int:
        """2 (bytes of two nibbles) or 4 (32-bit words of eight bit-placed codes): see above."""
        return _prepared_planes(self.blocks)

    @property
    def folded(self) -> bool:
        """Whether `scales` hold bf16 2^(s-1) (int16) rather than E8M0 bytes (uint8)."""
        return self.scales.dtype == torch.int16

    def to(self, device) -> "HopperMxfp4":
        return HopperMxfp4(self.blocks.to(device), self.scales.to(device), self.k)

    def __getitem__(self, idx) -> "HopperMxfp4":
        return HopperMxfp4(self.blocks[idx], self.scales[idx], self.k)


def mark_sizes_static(h: "HopperMxfp4") -> None:
    """Fix the sizes of a prepared arrangement for `torch.compile`. Weights held outside a module's
    parameters and buffers (a closure, a dict) get symbolic sizes under `dynamic=True`, and a first
    token count equal to one of them ties the two symbols (duck sizing): the next token count would
    recompile. Eager only (a no-op while tracing)."""
    if not torch.compiler.is_compiling():
        for t in (h.blocks, h.scales):
            torch._dynamo.mark_static(t)


def prepare_hopper(q: Mxfp4Tensor, fold: Optional[bool] = None, planes: int = 4) -> HopperMxfp4:
    """The `HopperMxfp4` arrangement of `q` (on q's device; the same values, see `unprepare_hopper`).

    `fold`: store the scales folded (`FOLD_MAX_SCALE`); None (default) folds when every scale
    allows it, which reads their maximum back to the host once — unless that read is not allowed
    here (CUDA-graph capture, `torch.compile` tracing, `torch.cuda.set_sync_debug_mode` set): then
    it keeps the bytes, which gives the same results, a little slower. True with a larger scale is
    a ValueError; False keeps the E8M0 bytes.

    `planes`: 4 (default) or 2, the arrangement of `blocks` (see `HopperMxfp4`). The 4-plane one
    is the faster on the H200 at every measured size (the GEMM runs one dot per K step on it); 2
    planes stay for the sweep-only `mx_wide` tiles and as the comparison."""
    if not isinstance(q, Mxfp4Tensor):
        raise TypeError(f"q must be an Mxfp4Tensor, got {type(q).__name__}")
    if fold is not None and not isinstance(fold, bool):
        raise TypeError(f"fold must be a bool or None, got {type(fold).__name__}")
    if planes not in (2, 4) or isinstance(planes, bool):
        raise ValueError(f"planes must be 2 or 4, got {planes!r}")
    q = q.canonical()
    L, rows, K = q.shape
    kp = -(-K // HOPPER_KB) * HOPPER_KB
    half = HOPPER_KB // 2
    # Allocated in its final shape (no view whose `_base` torch.compile's size guards could
    # specialise on) and filled one expert at a time, so the working copies (int64 codes for 4
    # planes) are one expert's size, not the whole weight's.
    blocks = torch.empty(L, rows, kp // 8 if planes == 4 else kp // 2,
                         dtype=torch.int32 if planes == 4 else torch.uint8, device=q.device)
    for e in range(L):
        b = q.blocks[e]
        codes = torch.nn.functional.pad(torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(rows, K), (0, kp - K))
        if planes == 2:
            codes = codes.view(rows, kp // HOPPER_KB, 2, half)  # [.., block, plane (lo/hi), j]; pad: code 0
            blocks[e] = (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(rows, kp // 2)
        else:
            # Element 32g + 8p + 2c + h: group g, plane p, word c of the group, half h of the word.
            codes = codes.view(rows, kp // GROUP, 4, 4, 2).to(torch.int64)  # [.., g, p, c, h]
            word = torch.zeros(rows, kp // GROUP, 4, dtype=torch.int64, device=q.device)  # [.., g, c]
            for p, places in enumerate(FOUR_PLANE_BITS):
                for h in (0, 1):
                    for bit, place in zip((3, 2, 1, 0), places):  # sign, e1, e0, m
                        word |= ((codes[..., p, :, h] >> bit) & 1) << (place + 16 * h)
            word = word.reshape(rows, kp // 8)
            blocks[e] = torch.where(word >= 1 << 31, word - (1 << 32), word)
    scales = torch.nn.functional.pad(q.scales, (0, (kp - K) // GROUP), value=SCALE_BIAS).transpose(1, 2)
    if fold is None:
        fold = _may_read_back(q.scales) and _max_scale(q) <= FOLD_MAX_SCALE
    elif fold and _max_scale(q) > FOLD_MAX_SCALE:
        raise ValueError(f"fold=True needs every scale <= {FOLD_MAX_SCALE}, got a maximum of {_max_scale(q)}")
    if fold:
        scales = ((scales.to(torch.int32) + (_BF16_EXP_BIAS - 1)) << 7).to(torch.int16)
    return HopperMxfp4(blocks.contiguous(), scales.contiguous(), K)


def _max_scale(q: Mxfp4Tensor) -> int:
    """The largest E8M0 scale of `q` (a read back to the host), 0 for an empty tensor."""
    return int(q.scales.max()) if q.scales.numel() else 0


def _may_read_back(t: torch.Tensor) -> bool:
    """Whether reading a value of `t` back to the host is allowed here (a CPU tensor, or a CUDA one
    outside graph capture, compiler tracing and sync-debug mode)."""
    if t.device.type != "cuda":
        return not torch.compiler.is_compiling()
    return not (torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling()
                or torch.cuda.get_sync_debug_mode() != 0)


def _hopper_codes(h: HopperMxfp4, b: torch.Tensor) -> torch.Tensor:
    """The e2m1 codes `uint8 [rows, k]` (one per byte, K order) of one expert's prepared blocks `b`."""
    rows, kp = b.shape[0], h.k_padded
    if h.planes == 2:
        b = b.view(rows, kp // HOPPER_KB, 1, HOPPER_KB // 2)
        return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(rows, kp)[:, :h.k]
    word = b.to(torch.int64).view(rows, kp // GROUP, 1, 4, 1) & 0xFFFFFFFF  # [.., g, p, c, h]
    planes = []
    for places in FOUR_PLANE_BITS:
        for half in (0, 1):
            code = torch.zeros_like(word)
            for bit, place in zip((3, 2, 1, 0), places):
                code |= ((word >> (place + 16 * half)) & 1) << bit
            planes.append(code)
    # [.., g, c, (p, h)] -> [.., g, p, c, h]
    codes = torch.cat(planes, dim=4).view(rows, kp // GROUP, 4, 4, 2).permute(0, 1, 3, 2, 4)
    return codes.reshape(rows, kp)[:, :h.k].to(torch.uint8)


def unprepare_hopper(h: HopperMxfp4) -> Mxfp4Tensor:
    """Inverse of `prepare_hopper`: the canonical `Mxfp4Tensor`."""
    if not isinstance(h, HopperMxfp4):
        raise TypeError(f"h must be a HopperMxfp4, got {type(h).__name__}")
    L, rows = h.blocks.shape[:2]
    blocks = torch.empty(L, rows, h.k // 2, dtype=torch.uint8, device=h.blocks.device)
    for e in range(L):  # one expert at a time: the int64 working copies stay one expert's size
        codes = _hopper_codes(h, h.blocks[e])
        torch.bitwise_or(codes[:, 0::2], codes[:, 1::2] << 4, out=blocks[e])
    scales = h.scales
    if h.folded:
        scales = ((scales.to(torch.int32) >> 7) - (_BF16_EXP_BIAS - 1)).to(torch.uint8)
    scales = scales.transpose(1, 2)[..., :h.k // GROUP]
    return Mxfp4Tensor(blocks.contiguous(), scales.contiguous())


# ---------------------------------------------------------------------------------------------
# Checkpoint converters
# ---------------------------------------------------------------------------------------------


def from_gpt_oss(blocks: torch.Tensor, scales: torch.Tensor) -> Mxfp4Tensor:
    """GPT-OSS `*_blocks [E, N, K/32, 16]` + `*_scales [E, N, K/32]` -> Mxfp4Tensor `[E, N, K]`.

    GPT-OSS already keeps K last with the even element in the low nibble, so this is a reshape.
    """
    require_tensor("blocks", blocks)
    require_tensor("scales", scales)
    require_dtype("blocks", blocks, (torch.uint8,))
    require_dtype("scales", scales, (torch.uint8,))
    if blocks.dim() != 4 or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"blocks must be [E, N, K/32, 16], got {tuple(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:3]):
        raise ValueError(f"scales must be [E, N, K/32] = {tuple(blocks.shape[:3])}, got {tuple(scales.shape)}")
    E, N, G, _ = blocks.shape
    return Mxfp4Tensor(blocks.reshape(E, N, G * (GROUP // 2)).contiguous(), scales.contiguous())


def to_gpt_oss(q: Mxfp4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `from_gpt_oss`: `(blocks [E, N, K/32, 16], scales [E, N, K/32])`."""
    if not isinstance(q, Mxfp4Tensor):
        raise TypeError(f"q must be an Mxfp4Tensor, got {type(q).__name__}")
    q = q.canonical()
    E, N, K = q.shape
    return q.blocks.reshape(E, N, K // GROUP, GROUP // 2).contiguous(), q.scales.contiguous()


def from_transposed(w: torch.Tensor, *, quantize: bool = False) -> Union[torch.Tensor, Mxfp4Tensor]:
    """Weights stored `[E, in, out]` (GPT-OSS's dequantized `gate_up_proj [E, K, 2N]`, `down_proj
    [E, N, K]`) -> our `[E, out, in]` layout, contiguous; optionally quantized to MXFP4 along `in`.
    """
    require_tensor("w", w)
    require_dtype("w", w, FLOAT_DTYPES + (torch.float64,))
    require_rank("w", w, (3,))
    wt = w.transpose(1, 2).contiguous()
    return quantize_mxfp4(wt) if quantize else wt
