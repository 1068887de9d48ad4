"""Expert layouts: metadata objects, builders, permute / unpermute, layout selection.

The metadata dataclasses below are the interface shared with `padded_moe.gemm` and
`padded_moe.experts`; see docs/architecture.md for the meaning of every field.

Every builder is graph-safe on CUDA: no host reads, shapes depend only on `M`, `k`, `L`, `block_m`
and `T_max`, and with a `PermuteScratch` nothing is allocated in steady state.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field, replace
from typing import ClassVar, Optional, Union

import torch

from padded_moe import layout_codes
from padded_moe._platform import use_triton
from padded_moe._util import cdiv, even_split, next_pow2, round_up
from padded_moe._validation import require_bool, require_int, require_rank, require_shape, require_tensor
from padded_moe.expert_map import (Experts, ExpertMap, check_topk_ids, check_valid_tokens,
                                   resolve_experts)


class GemmLayout(enum.Enum):
    """The GEMM layouts (docs/usage.md, "GEMM layouts"): `.value` is the name callers pass (and
    humming's `gemm_type`); `.code` is the integer the kernels and the torch path compare against."""

    INDEXED = "indexed"
    GROUPED_CONTIGUOUS = "grouped_contiguous"
    GROUPED_MASKED = "grouped_masked"

    @property
    def code(self) -> int:
        return getattr(layout_codes, self.name)


@dataclass(frozen=True)
class LayoutMetaBase:
    """Fields every layout shares, and what callers ask a layout instead of testing its class:
    `code`, `gemm_args` (the metadata as the GEMM kernels take it), the GEMM's shape rules, and
    the permuted-buffer geometry `permute` / `unpermute` use. Defaults below are the flat `[M*k, .]`
    row buffers; a layout overrides what differs."""

    num_tokens: int
    top_k: int
    num_local: int
    slot_expert: torch.Tensor
    activation_counts: torch.Tensor
    # Keyword-only, so every layout's own fields keep their positions after the shared ones.
    # `valid_tokens`: the tensor given to build_layout (unpermute leaves rows at/after it alone);
    # `scratch`: set when built with one (permute then writes into its buffer).
    valid_tokens: Optional[torch.Tensor] = field(default=None, kw_only=True)
    scratch: Optional["PermuteScratch"] = field(default=None, repr=False, compare=False, kw_only=True)
    # `expected_m`: about how many rows each local expert receives (a caller's hint, e.g. where
    # the buffer has room for far more rows than it holds); None: unknown. It picks the GEMM tile.
    expected_m: Optional[float] = field(default=None, kw_only=True)

    # Metadata tensors a GEMM reads, checked by `expert_gemm` (index dtype, device, contiguity).
    GEMM_FIELDS: ClassVar[tuple[str, ...]] = ()
    # Whether `permute` copies rows (INDEXED does not: GEMM1 gathers token rows on load).
    PERMUTES: ClassVar[bool] = True
    # Whether a GEMM's `a` / `out` may be a capacity buffer with more than M*k rows.
    CAPACITY_ROWS: ClassVar[bool] = False

    @property
    def code(self) -> int:
        return self.layout.code

    @property
    def num_slots(self) -> int:
        return self.num_tokens * self.top_k

    def rows_per_expert(self) -> float:
        """Host-side estimate that picks a GEMM tuning regime: the mean from shapes, or `expected_m`
        where given (at most that mean, which counts every slot of the buffer)."""
        mean = self.num_slots / max(self.num_local, 1)
        return mean if self.expected_m is None else min(float(self.expected_m), mean)

    def gemm_args(self, stage: str) -> dict:
        """Keyword arguments of `padded_moe.kernels.gemm.launch` (the torch path reads the same):
        the layout code, its metadata tensors (None where the layout has none) and its ints."""
        return dict(layout=self.code, sorted_ids=None, block_expert=None, num_padded=None, block_m=1,
                    a_div=1, mk=self.num_slots, offsets=None, counts=None, t_max=1,
                    rows_per_expert=self.rows_per_expert())

    def check_gemm_fields(self) -> None:
        """Consistency of the layout's own fields (ValueError naming the field)."""

    def gemm_out_shape(self, a: torch.Tensor, stage: str, n_out: int) -> tuple[int, ...]:
        """Check `a` for this layout and stage; return the shape `out` must have."""
        require_rank("a", a, (2,))
        return (a.shape[0], n_out)

    def rows_shape(self, K: int) -> tuple[int, ...]:
        """Shape of the permuted activations and of the expert outputs `unpermute` reads."""
        return (self.num_slots, K)

    @property
    def row_limit(self) -> int:
        """Rows of the permuted buffer; a slot row `>= row_limit` marks a dropped slot."""
        return self.num_slots

    @property
    def slab_rows(self) -> int:
        """Rows per slab of the permuted buffer (a flat buffer is one slab)."""
        return self.num_slots

    @property
    def slot_rows(self) -> Optional[torch.Tensor]:
        """Slot -> row of the permuted buffer (`[M*k]`), or None when row = slot."""
        return self.inv


@dataclass(frozen=True)
class IndexedMeta(LayoutMetaBase):
    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    layout: GemmLayout = GemmLayout.INDEXED

    GEMM_FIELDS: ClassVar[tuple[str, ...]] = ("sorted_ids", "block_expert", "num_padded")
    PERMUTES: ClassVar[bool] = False

    @property
    def slot_rows(self) -> Optional[torch.Tensor]:
        return None

    def rows_per_expert(self) -> float:
        # A kernel tile never spans two blocks, so the tile (the tuning regime) must cover a
        # whole block: a block wider than the tile would be computed as several tiles, each
        # reading the expert's weights.
        return max(self.num_slots / max(self.num_local, 1), float(self.block_m))

    @classmethod
    def _from_buffers(cls, common: dict, bufs: dict, block_m: int, t_max: int) -> "IndexedMeta":
        return cls(**common, activation_counts=bufs["act_count"], sorted_ids=bufs["sorted_ids"],
                   block_expert=bufs["block_expert"], num_padded=bufs["num_padded"], block_m=block_m)

    @staticmethod
    def _placed_positions(num_slots: int, capacity: int) -> int:
        return capacity  # every sorted_ids position: padding rows get the sentinel

    def gemm_args(self, stage: str) -> dict:
        return {**super().gemm_args(stage), "sorted_ids": self.sorted_ids, "block_expert": self.block_expert,
                "num_padded": self.num_padded, "block_m": self.block_m,
                "a_div": self.top_k if stage == "w13" else 1}

    def check_gemm_fields(self) -> None:
        if self.block_m < 1:
            raise ValueError(f"layout_meta.block_m must be >= 1, got {self.block_m}")
        if self.sorted_ids.numel() != self.block_expert.numel() * self.block_m:
            raise ValueError(
                f"layout_meta.sorted_ids must hold len(block_expert) * block_m = "
                f"{self.block_expert.numel()} * {self.block_m} ids, got {self.sorted_ids.numel()}")
        require_shape("layout_meta.num_padded", self.num_padded, (1,))

    def gemm_out_shape(self, a: torch.Tensor, stage: str, n_out: int) -> tuple[int, ...]:
        require_rank("a", a, (2,))
        rows = self.num_tokens if stage == "w13" else self.num_slots
        if a.shape[0] != rows:
            what = "M (tokens)" if stage == "w13" else "M*k (slots)"
            raise ValueError(f"a must have {what} = {rows} rows for INDEXED stage {stage!r}, got {a.shape[0]}")
        return (self.num_slots, n_out)


@dataclass(frozen=True)
class GroupedContiguousMeta(LayoutMetaBase):
    offsets: torch.Tensor
    inv: torch.Tensor
    src: torch.Tensor
    layout: GemmLayout = GemmLayout.GROUPED_CONTIGUOUS

    GEMM_FIELDS: ClassVar[tuple[str, ...]] = ("offsets",)
    # Every valid row is < offsets[L] <= M*k, so buffers sized for a larger call serve too.
    CAPACITY_ROWS: ClassVar[bool] = True

    @classmethod
    def _from_buffers(cls, common: dict, bufs: dict, block_m: int, t_max: int) -> "GroupedContiguousMeta":
        L = common["num_local"]
        return cls(**common, activation_counts=bufs["offsets"][L:], offsets=bufs["offsets"], inv=bufs["inv"],
                   src=bufs["src"])

    @staticmethod
    def _placed_positions(num_slots: int, capacity: int) -> int:
        return num_slots  # every row of `src`: rows past offsets[L] get the sentinel

    def gemm_args(self, stage: str) -> dict:
        return {**super().gemm_args(stage), "offsets": self.offsets}

    def check_gemm_fields(self) -> None:
        require_shape("layout_meta.offsets", self.offsets, (self.num_local + 1,))

    def gemm_out_shape(self, a: torch.Tensor, stage: str, n_out: int) -> tuple[int, ...]:
        require_rank("a", a, (2,))
        if a.shape[0] < self.num_slots:
            raise ValueError(f"a must have at least M*k = {self.num_slots} rows for GROUPED_CONTIGUOUS, "
                             f"got {a.shape[0]}")
        return (a.shape[0], n_out)


@dataclass(frozen=True)
class GroupedMaskedMeta(LayoutMetaBase):
    counts: torch.Tensor
    inv: torch.Tensor
    overflow: torch.Tensor
    max_tokens_per_expert: int
    layout: GemmLayout = GemmLayout.GROUPED_MASKED

    GEMM_FIELDS: ClassVar[tuple[str, ...]] = ("counts",)

    def rows_per_expert(self) -> float:
        # The expected rows per slab where known (`expected_m`, else the mean of a layout built from
        # slots), never past the capacity; else the capacity, the one bound a batched buffer has.
        # The GEMM takes its tile from it (`kernels.gemm.default_config`); rows past it still run.
        expected = self.expected_m
        if expected is None and self.num_slots > 0:
            expected = self.num_slots / max(self.num_local, 1)
        T = float(self.max_tokens_per_expert)
        return T if expected is None else min(float(expected), T)

    @classmethod
    def _from_buffers(cls, common: dict, bufs: dict, block_m: int, t_max: int) -> "GroupedMaskedMeta":
        return cls(**common, activation_counts=bufs["counts"], counts=bufs["counts"], inv=bufs["inv"],
                   overflow=bufs["overflow"], max_tokens_per_expert=t_max)

    @staticmethod
    def _placed_positions(num_slots: int, capacity: int) -> int:
        return 0  # rows are only ever addressed through `inv`; nothing to fill per position

    def gemm_args(self, stage: str) -> dict:
        return {**super().gemm_args(stage), "counts": self.counts, "t_max": self.max_tokens_per_expert}

    def check_gemm_fields(self) -> None:
        require_shape("layout_meta.counts", self.counts, (self.num_local,))

    def gemm_out_shape(self, a: torch.Tensor, stage: str, n_out: int) -> tuple[int, ...]:
        T = self.max_tokens_per_expert
        require_rank("a", a, (3,))
        if tuple(a.shape[:2]) != (self.num_local, T):
            raise ValueError(f"a must be [L, T_max, K] = [{self.num_local}, {T}, K] for GROUPED_MASKED, "
                             f"got {tuple(a.shape)}")
        return (self.num_local, T, n_out)

    def rows_shape(self, K: int) -> tuple[int, ...]:
        return (self.num_local, self.max_tokens_per_expert, K)

    @property
    def row_limit(self) -> int:
        return self.num_local * self.max_tokens_per_expert

    @property
    def slab_rows(self) -> int:
        return max(self.max_tokens_per_expert, 1)


LayoutMeta = Union[IndexedMeta, GroupedContiguousMeta, GroupedMaskedMeta]
# The metadata class of each layout (its `layout` field's default).
_META = {cls.layout: cls for cls in (IndexedMeta, GroupedContiguousMeta, GroupedMaskedMeta)}

# ----------------------------------------------------------------------------------------------
# Layout selection
# ----------------------------------------------------------------------------------------------

LAYOUT_ENV = "PADDED_MOE_GEMM_LAYOUT"
_NAMES = {
    "auto": None,
    "indexed": GemmLayout.INDEXED,
    "grouped_contiguous": GemmLayout.GROUPED_CONTIGUOUS,
    "grouped": GemmLayout.GROUPED_CONTIGUOUS,
    "grouped_masked": GemmLayout.GROUPED_MASKED,
    "batched": GemmLayout.GROUPED_MASKED,
}
_CHOICES = "auto, indexed, grouped_contiguous (alias grouped), grouped_masked (alias batched)"


def _parse_layout(value: object, source: str, fmt: str) -> Optional[GemmLayout]:
    """A GemmLayout, or None for auto; ValueError naming the value, the format and the choices."""
    if isinstance(value, GemmLayout):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{source} must be a str or GemmLayout, got {type(value).__name__}")
    key = value.strip().lower()
    if key not in _NAMES:
        raise ValueError(f"{source}={value!r} is not a GEMM layout (format: {fmt}); choose one of {_CHOICES}")
    return _NAMES[key]


def select_gemm_layout(*, expert_parallel: bool, batched_format: bool,
                       override: Union[str, GemmLayout, None] = None) -> GemmLayout:
    """The GEMM layout for a call: batched → GROUPED_MASKED; standard → INDEXED, or
    GROUPED_CONTIGUOUS with expert parallelism. `override` (else env PADDED_MOE_GEMM_LAYOUT; unset or
    empty means auto) forces a layout; an illegal one for the format is a ValueError, never a fallback."""
    for name, flag in (("expert_parallel", expert_parallel), ("batched_format", batched_format)):
        require_bool(name, flag)
    fmt = "batched" if batched_format else "standard"
    if override is not None:
        chosen = _parse_layout(override, "override", fmt)
    else:
        env = os.environ.get(LAYOUT_ENV, "")
        chosen = _parse_layout(env, LAYOUT_ENV, fmt) if env.strip() else None
        override = env
    if chosen is None:
        if batched_format:
            return GemmLayout.GROUPED_MASKED
        return GemmLayout.GROUPED_CONTIGUOUS if expert_parallel else GemmLayout.INDEXED
    legal = (GemmLayout.GROUPED_MASKED,) if batched_format else (GemmLayout.INDEXED, GemmLayout.GROUPED_CONTIGUOUS)
    if chosen not in legal:
        names = ", ".join(["auto"] + [g.value for g in legal])
        raise ValueError(f"GEMM layout {override!r} is not legal for the {fmt} format; legal choices: {names}")
    return chosen


# ----------------------------------------------------------------------------------------------
# Buffer sizes (shared by the fresh path and PermuteScratch)
# ----------------------------------------------------------------------------------------------

def _chunk(num_slots: int) -> int:
    # Slots per counting program: bigger chunks keep the single-program scan short at large M*k.
    return 128 if num_slots <= 16384 else 256


def _num_chunks(num_slots: int) -> int:
    return cdiv(num_slots, _chunk(num_slots))


def _max_chunks(max_slots: int) -> int:
    return max(cdiv(min(max_slots, 16384), 128), cdiv(max_slots, 256))


def indexed_capacity(num_slots: int, num_local: int, block_m: int) -> int:
    """Length of `sorted_ids`: every expert may waste up to block_m-1 padding rows."""
    return round_up(num_slots + num_local * (block_m - 1), block_m)


# From this many mean rows per expert on, INDEXED blocks hold 128 rows, so the GEMM takes its
# 128-row tiles (a kernel tile never spans two blocks), and every layout's GEMM is in the medium
# regime (`kernels.gemm.regime`). Below it a 64-row block holds nearly all of an expert's rows;
# from it on most experts spill past 64 rows, and a second 64-row tile reads (and, for prepared
# MXFP4, upcasts) the expert's weights again. Whole `fused_experts` calls on the H200, 128-row
# blocks with the medium tile against 64-row blocks (time ratio, alternating graph replays):
# bf16 DeepSeek-V4 1.08 at 48 mean rows, 0.87 at 72, 0.79 at 96, 0.80 at 112, 0.83 at 128, 1.01 at
# 144, 0.99 at 192; Qwen3-MoE 0.93 at 72, 0.88 at 96, 0.93 at 112 and 128, 0.98 at 144, 0.93 at 192;
# Mixtral 0.85 at 72, 0.84 at 96, 0.82 at 112, 0.86 at 128, 1.04 at 144, 0.98 at 192. Prepared
# MXFP4 DeepSeek-V4 1.41 at 48, 0.98 at 66, 0.90 at 72, 0.84 at 80, 0.81 at 96, 0.97 at 144, 0.89
# at 192; GPT-OSS 1.14 at 64, 0.99 at 68, 0.90 at 72, 0.85 at 80, 0.84 at 96, 0.85 at 112, 0.97 at
# 128, 0.86 at 192.
BLOCK_128_MEAN_ROWS = 72


def default_block_m(num_slots: int, num_local: int) -> int:
    """INDEXED row block when the caller gives none: the smallest of 16/32/64 that holds the mean
    rows per expert plus their square root (64 where none does), or 128 from `BLOCK_128_MEAN_ROWS`
    mean rows on. Never
    decreases as `num_slots` grows (a scratch sized for its largest call has room for every
    smaller one).

    Routed counts scatter around the mean by about its square root, and an expert past its block
    gets a second, nearly empty one that reads (and, for MXFP4, upcasts) its weights again: on the
    H200 a block with that margin made whole calls 5-22% faster at 16 and 32 mean rows (GPT-OSS
    MXFP4, Qwen3-MoE, Mixtral) than the smallest block holding the mean; twice the margin was 23%
    slower at 24 mean rows (DeepSeek-V4 MXFP4)."""
    mean = num_slots / max(num_local, 1)
    if mean >= BLOCK_128_MEAN_ROWS:
        return 128
    need = mean + math.sqrt(mean)
    return 16 if need <= 16 else 32 if need <= 32 else 64


# int32 buffers: name -> size as a function of (S, L, cap, nblocks, nchunks)
_I32_BUFFERS = (
    ("slot_expert", lambda S, L, cap, nb, nc: S),
    ("rank", lambda S, L, cap, nb, nc: S),
    ("inv", lambda S, L, cap, nb, nc: S),
    ("src", lambda S, L, cap, nb, nc: S),
    ("chunk_cnt", lambda S, L, cap, nb, nc: nc * L),
    ("chunk_base", lambda S, L, cap, nb, nc: nc * L),
    ("counts", lambda S, L, cap, nb, nc: L),
    ("offs32", lambda S, L, cap, nb, nc: L + 1),
    ("sorted_ids", lambda S, L, cap, nb, nc: cap),
    ("block_expert", lambda S, L, cap, nb, nc: nb),
    ("num_padded", lambda S, L, cap, nb, nc: 1),
    ("act_count", lambda S, L, cap, nb, nc: 1),
    ("overflow", lambda S, L, cap, nb, nc: 1),
)


# Every view starts on a 16-byte boundary: other backends (humming's INDEXED kernel) read the
# metadata with vector loads, which fault on a misaligned address.
_ALIGN_I32 = 4


def _aligned(n: int) -> int:
    return round_up(n, _ALIGN_I32)


def _carve(i32: torch.Tensor, i64: torch.Tensor, S: int, L: int, cap: int, nb: int, nc: int) -> dict:
    """Views of the int32 arena (and the int64 offsets) sized for one call; each view is contiguous
    and 16-byte aligned."""
    bufs, at = {}, 0
    for name, size in _I32_BUFFERS:
        n = size(S, L, cap, nb, nc)
        bufs[name] = i32[at:at + n]
        at += _aligned(n)
    bufs["offsets"] = i64[:L + 1]
    return bufs


def _arena_size(S: int, L: int, cap: int, nb: int, nc: int) -> int:
    return sum(_aligned(size(S, L, cap, nb, nc)) for _, size in _I32_BUFFERS)


class PermuteScratch:
    """Every buffer `build_layout` / `permute` needs for up to `max_tokens` tokens, allocated once.

    Metadata returned with a scratch are views of its buffers: the next `build_layout` with the same
    scratch overwrites them (as does the next `permute` for the permuted activations). The permuted
    activation buffer is allocated on the first `permute` for a (layout, K, dtype), or up front when
    `hidden_size` and `dtype` are given.
    """

    def __init__(self, max_tokens: int, k: int, num_experts: int, num_local: int,
                 device: Union[str, torch.device], *, block_m: Optional[int] = None,
                 max_tokens_per_expert: Optional[int] = None, hidden_size: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None):
        self.max_tokens = require_int("max_tokens", max_tokens, 0)
        self.top_k = require_int("k", k, 1)
        self.num_experts = require_int("num_experts", num_experts, 1)
        self.num_local = require_int("num_local", num_local, 0)
        if num_local > num_experts:
            raise ValueError(f"num_local must be <= num_experts={num_experts}, got {num_local}")
        self.device = torch.device(device)
        S = self.max_tokens * self.top_k
        # Without a block_m each call gets `default_block_m` of its own slots (`block_for`): a
        # scratch sized for prefill must not force prefill's big blocks onto decode-sized calls.
        # The reserved capacity is that of the largest block any call up to max_tokens can get.
        self.fixed_block_m = block_m is not None
        self.block_m = _check_block_m(block_m) if block_m is not None else default_block_m(S, num_local)
        self.max_tokens_per_expert = (require_int("max_tokens_per_expert", max_tokens_per_expert, 0)
                                      if max_tokens_per_expert is not None else S)
        self.max_slots = S
        self.capacity = indexed_capacity(S, num_local, self.block_m)
        self.max_chunks = _max_chunks(S)
        n = _arena_size(S, num_local, self.capacity, self.capacity // self.block_m, self.max_chunks)
        self._i32 = torch.empty(n, dtype=torch.int32, device=self.device)
        self._i64 = torch.empty(num_local + 1, dtype=torch.int64, device=self.device)
        # "cuda" and "cuda:0" name one device but compare unequal: keep the resolved one.
        self.device = self._i32.device
        self._views: dict = {}
        self._act: dict = {}
        self._workspace: dict = {}
        if hidden_size is not None or dtype is not None:
            if hidden_size is None or dtype is None:
                raise ValueError("hidden_size and dtype must be given together to preallocate the permuted buffer")
            for layout in (GemmLayout.GROUPED_CONTIGUOUS, GemmLayout.GROUPED_MASKED):
                self.permute_buffer(layout, require_int("hidden_size", hidden_size, 1), dtype)

    def block_for(self, num_slots: int) -> int:
        """The INDEXED block of a call of `num_slots` rows: the scratch's `block_m` if the caller
        fixed one, else `default_block_m` of the call's own slots (at most `block_m`)."""
        return self.block_m if self.fixed_block_m else default_block_m(num_slots, self.num_local)

    def buffers(self, M: int, k: int, num_experts: int, num_local: int, block_m: int, device) -> dict:
        """Views for one call (cached per shape), after checking the call fits."""
        if device != self.device:
            raise ValueError(f"scratch is on {self.device} but topk_ids is on {device}")
        if (k, num_experts, num_local) != (self.top_k, self.num_experts, self.num_local):
            raise ValueError(
                f"scratch was made for k={self.top_k}, num_experts={self.num_experts}, num_local={self.num_local}; "
                f"got k={k}, num_experts={num_experts}, num_local={num_local}")
        if M > self.max_tokens:
            raise ValueError(f"scratch reserves {self.max_tokens} tokens ({self.max_slots} rows at k={k}) "
                             f"but topk_ids has {M} tokens ({M * k} rows)")
        S = M * k
        cap = indexed_capacity(S, num_local, block_m)
        if cap > self.capacity:
            raise ValueError(f"scratch reserves {self.capacity} INDEXED rows (block_m={self.block_m}) but "
                             f"block_m={block_m} with {S} rows needs {cap}")
        key = (S, cap, block_m)
        views = self._views.get(key)
        if views is None:
            need = _arena_size(S, num_local, cap, cap // block_m, _num_chunks(S))
            if need > self._i32.numel():
                raise ValueError(f"scratch reserves {self._i32.numel()} int32 metadata entries (block_m={self.block_m}) "
                                 f"but block_m={block_m} with {S} rows needs {need}")
            views = _carve(self._i32, self._i64, S, num_local, cap, cap // block_m, _num_chunks(S))
            self._views[key] = views
        return views

    def permute_buffer(self, layout: GemmLayout, hidden_size: int, dtype: torch.dtype,
                       numel: Optional[int] = None) -> torch.Tensor:
        """The flat permuted activation buffer for `layout`: room for `[max_tokens*k, K]` or, for
        GROUPED_MASKED, `[L, T_max, K]`; `numel` (a call's buffer) is checked to fit."""
        masked = layout == GemmLayout.GROUPED_MASKED
        rows = self.num_local * self.max_tokens_per_expert if masked else self.max_slots
        if numel is not None and numel > rows * hidden_size:
            raise ValueError(f"scratch reserves {rows} permuted rows of {hidden_size} "
                             f"(max_tokens_per_expert={self.max_tokens_per_expert}), asked for {numel} elements")
        key = (masked, hidden_size, dtype)
        buf = self._act.get(key)
        if buf is None:
            buf = torch.empty(rows * hidden_size, dtype=dtype, device=self.device)
            self._act[key] = buf
        return buf

    def workspace(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A `shape` view of the buffer `name` (one per name and dtype), grown on first use; the
        expert pipeline keeps its intermediates here (`padded_moe.experts.expert_workspace`)."""
        numel = math.prod(shape)
        key = (name, dtype)
        buf = self._workspace.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self._workspace[key] = buf
        return buf[:numel].view(shape)

    def __repr__(self) -> str:
        return (f"PermuteScratch(max_tokens={self.max_tokens}, k={self.top_k}, num_experts={self.num_experts}, "
                f"num_local={self.num_local}, device={self.device}, block_m={self.block_m}, "
                f"max_tokens_per_expert={self.max_tokens_per_expert})")


def _check_block_m(block_m: object) -> int:
    require_int("block_m", block_m, 1)
    if block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    return block_m


# ----------------------------------------------------------------------------------------------
# build_layout
# ----------------------------------------------------------------------------------------------

def _as_layout(layout: object) -> GemmLayout:
    if isinstance(layout, GemmLayout):
        return layout
    if isinstance(layout, str):
        parsed = _parse_layout(layout, "layout", "any")
        if parsed is not None:
            return parsed
    raise TypeError(f"layout must be a GemmLayout (or one of its names), got {layout!r}")


def build_layout(layout: Union[GemmLayout, str], topk_ids: torch.Tensor, experts: Experts, *,
                 block_m: Optional[int] = None, max_tokens_per_expert: Optional[int] = None,
                 valid_tokens: Optional[torch.Tensor] = None,
                 scratch: Optional[PermuteScratch] = None, drop_overflow: bool = False,
                 expected_m: Optional[int] = None) -> LayoutMeta:
    """Sanitize `topk_ids [M, k]` (int32/int64, global ids) and build `layout`'s metadata.

    `experts`: ExpertMap or int E. `block_m` (INDEXED; power of two, default `scratch.block_for`
    or `default_block_m` of the call's `M*k` slots), `max_tokens_per_expert` (GROUPED_MASKED `T_max`, default
    `scratch.max_tokens_per_expert` or `M*k`) are ignored by the other layouts. A GROUPED_MASKED
    `T_max` below `M*k` (the most slots one expert can receive, duplicate ids included) is refused
    unless `drop_overflow=True`: slots past an expert's `T_max` are then dropped (zero contribution)
    and counted in `meta.overflow`. `valid_tokens`: int32
    `[1]` device tensor; rows at/after it are dropped whatever their ids. Slots keep increasing slot
    order within an expert on every path (bitwise-identical metadata on torch and Triton).
    `expected_m` (an int >= 0; the grouped layouts): about how many rows each local expert
    receives, where the ids hold far more slots than are valid (padding, `valid_tokens`); the GEMMs
    take their tiles from it instead of from `M*k`. INDEXED sizes its tiles with its row blocks
    (`block_m`) and refuses it.
    """
    layout = _as_layout(layout)
    check_topk_ids(topk_ids)
    num_experts, num_local, emap = resolve_experts(experts)
    check_valid_tokens(valid_tokens, topk_ids)
    if scratch is not None and not isinstance(scratch, PermuteScratch):
        raise TypeError(f"scratch must be a PermuteScratch, got {type(scratch).__name__}")
    table = emap.map_for(topk_ids.device) if emap is not None else None
    return build_layout_resolved(layout, topk_ids, num_experts, num_local, table, block_m=block_m,
                                 max_tokens_per_expert=max_tokens_per_expert, valid_tokens=valid_tokens,
                                 scratch=scratch, drop_overflow=drop_overflow, expected_m=expected_m)


def build_layout_resolved(layout: Union[GemmLayout, str], topk_ids: torch.Tensor, num_experts: int, num_local: int,
                          table: Optional[torch.Tensor], *, block_m: Optional[int] = None,
                          max_tokens_per_expert: Optional[int] = None,
                          valid_tokens: Optional[torch.Tensor] = None,
                          scratch: Optional[PermuteScratch] = None, drop_overflow: bool = False,
                          expected_m: Optional[int] = None) -> LayoutMeta:
    """`build_layout` after its checks, with the experts already resolved to `(E, L, map table or
    None)` on the ids' device: the entry the custom ops use, since an ExpertMap cannot cross one
    (they pass the layout as its `.value`)."""
    layout = _as_layout(layout)
    check_expected_m(expected_m, layout)
    M, k = topk_ids.shape
    S, L = M * k, num_local
    if block_m is not None:
        bm = _check_block_m(block_m)
    else:
        bm = scratch.block_for(S) if scratch is not None else default_block_m(S, L)
    if max_tokens_per_expert is not None:
        t_max = require_int("max_tokens_per_expert", max_tokens_per_expert, 0)
    else:
        t_max = scratch.max_tokens_per_expert if scratch is not None else M * k
    if layout is GemmLayout.GROUPED_MASKED:
        _check_capacity(t_max, M, k, drop_overflow)
    cap = indexed_capacity(S, L, bm)
    if scratch is not None:
        bufs = scratch.buffers(M, k, num_experts, num_local, bm, topk_ids.device)
    else:
        nc = _num_chunks(S)
        i32 = torch.empty(_arena_size(S, L, cap, cap // bm, nc), dtype=torch.int32, device=topk_ids.device)
        i64 = torch.empty(L + 1, dtype=torch.int64, device=topk_ids.device)
        bufs = _carve(i32, i64, S, L, cap, cap // bm, nc)
    if use_triton(topk_ids.device):
        _build_triton(layout, topk_ids, num_experts, L, table, valid_tokens, bufs, block_m=bm, t_max=t_max)
    else:
        from padded_moe.torch_path.layouts import build_torch

        build_torch(layout.code, topk_ids, num_experts, L, table, valid_tokens, bufs, block_m=bm, t_max=t_max)
    common = dict(num_tokens=M, top_k=k, num_local=L, slot_expert=bufs["slot_expert"],
                  valid_tokens=valid_tokens, scratch=scratch)
    meta = _META[layout]._from_buffers(common, bufs, bm, t_max)
    return meta if expected_m is None else replace(meta, expected_m=float(expected_m))


def check_expected_m(expected_m: object, layout: GemmLayout) -> None:
    """`expected_m`: None, or an int >= 0 for a grouped layout (INDEXED's blocks size its tiles)."""
    if expected_m is None:
        return
    require_int("expected_m", expected_m, 0)
    if layout is GemmLayout.INDEXED:
        raise ValueError("expected_m sizes the tiles of the grouped layouts; INDEXED sizes them with its row "
                         "blocks (block_m): pass layout='grouped_contiguous', or no expected_m")


def _check_capacity(t_max: int, M: int, k: int, drop_overflow: object) -> None:
    """Losing tokens is opt-in: whether routes overflow is only known on the device, and reading
    that back would cost a host sync per call, so a capacity that *could* overflow needs consent."""
    require_bool("drop_overflow", drop_overflow)
    if t_max < M * k and not drop_overflow:
        raise ValueError(
            f"max_tokens_per_expert={t_max} is below M*k={M * k}, the most slots one expert can receive, "
            "so routed tokens could be dropped; pass max_tokens_per_expert >= M*k, or drop_overflow=True "
            "to accept dropping them (meta.overflow counts the dropped slots)")


# Calls of up to this many slots (tokens × k, at most one counting chunk) build their layout in one
# program (`_build_one_chunk_kernel`) instead of three launches.
ONE_PROGRAM_SLOTS = 128


def _build_triton(layout: GemmLayout, topk_ids, num_experts, L, table, valid_tokens, bufs, *, block_m, t_max) -> None:
    from padded_moe.kernels import layouts as K
    from padded_moe.kernels._launch import launch, ptr_key

    M, k = topk_ids.shape
    S = M * k
    code = layout.code
    chunk, nc = _chunk(S), _num_chunks(S)
    l_pad = next_pow2(max(L, 1))
    has_vt = valid_tokens is not None
    vt = valid_tokens if has_vt else bufs["act_count"]  # any valid pointer; never read when HAS_VT=False
    ids_map = table if table is not None else bufs["counts"]  # likewise, when HAS_MAP=False
    pblk = 1024
    cap = bufs["sorted_ids"].numel()
    n_pos = cdiv(_META[layout]._placed_positions(S, cap), pblk)
    search_steps = max(1, l_pad.bit_length())
    if 0 < S <= ONE_PROGRAM_SLOTS:
        one_chunk = max(16, next_pow2(S))
        ptrs = (topk_ids, ids_map, vt, bufs["slot_expert"], bufs["rank"], bufs["chunk_cnt"], bufs["chunk_base"],
                bufs["counts"], bufs["offs32"], bufs["offsets"], bufs["num_padded"], bufs["act_count"],
                bufs["overflow"], bufs["inv"], bufs["src"], bufs["sorted_ids"], bufs["block_expert"])
        ints = (S, num_experts, L, M, t_max, cap, n_pos)
        strides = (topk_ids.stride(0), topk_ids.stride(1))
        launch(K._build_one_chunk_kernel, (1,), strides + ints + ptr_key(*ptrs[:3]),
               ptrs[:1] + strides + ptrs[1:] + ints,
               dict(LAYOUT=code, BLOCK_M=block_m, TOP_K=k, HAS_MAP=table is not None, HAS_VT=has_vt,
                    CHUNK=one_chunk, L_PAD=l_pad, BIN_TILE=min(l_pad, 8192 // one_chunk), PBLK=pblk,
                    SEARCH_STEPS=search_steps), num_warps=4)
        return
    if nc > 0:
        ptrs = (topk_ids, ids_map, vt, bufs["slot_expert"], bufs["rank"], bufs["chunk_cnt"])
        ints = (topk_ids.stride(0), topk_ids.stride(1), S, num_experts, L)
        launch(K._count_kernel, (nc,), ints + ptr_key(*ptrs), ptrs[:1] + ints[:2] + ptrs[1:] + ints[2:],
               dict(TOP_K=k, HAS_MAP=table is not None, HAS_VT=has_vt, CHUNK=chunk, L_PAD=l_pad,
                    BIN_TILE=min(l_pad, 8192 // chunk)),
               num_warps=8 if chunk > 128 else 4)
    nb_tile = max(1, min(next_pow2(max(nc, 1)), 8192 // l_pad))
    # Arena views are 16-byte aligned by construction: only vt (caller's, or the arena) varies.
    ptrs = (bufs["chunk_cnt"], bufs["chunk_base"], bufs["counts"], bufs["offs32"], bufs["offsets"],
            bufs["num_padded"], bufs["act_count"], bufs["overflow"], vt)
    ints = (nc, L, M, t_max)
    launch(K._scan_kernel, (1,), ints + ptr_key(vt), ptrs + ints,
           dict(LAYOUT=code, BLOCK_M=block_m, TOP_K=k, HAS_VT=has_vt, L_PAD=l_pad, NB_TILE=nb_tile), num_warps=8)
    if nc + n_pos > 0:
        ptrs = (bufs["slot_expert"], bufs["rank"], bufs["chunk_base"], bufs["counts"], bufs["offs32"],
                bufs["inv"], bufs["src"], bufs["sorted_ids"], bufs["block_expert"])
        ints = (S, L, nc, t_max, cap)
        launch(K._place_kernel, (nc + n_pos,), ints, ptrs + ints,
               dict(LAYOUT=code, BLOCK_M=block_m, CHUNK=max(chunk, 1), PBLK=pblk,
                    SEARCH_STEPS=search_steps), num_warps=4)


# ----------------------------------------------------------------------------------------------
# permute / unpermute
# ----------------------------------------------------------------------------------------------

def _check_meta(meta: object) -> LayoutMeta:
    if not isinstance(meta, LayoutMetaBase):
        raise TypeError(f"layout_meta must come from build_layout, got {type(meta).__name__}")
    return meta


def _check_device_and_last_dim(name: str, t: torch.Tensor, meta: LayoutMeta) -> None:
    if t.device != meta.slot_expert.device:
        raise ValueError(f"{name} must be on layout_meta's device {meta.slot_expert.device}, got {t.device}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {tuple(t.stride())}")


def _check_rows(name: str, t: object, rows: int, meta: LayoutMeta) -> torch.Tensor:
    """A token-row tensor `[rows, K]` (hidden states, unpermute's output)."""
    require_tensor(name, t)
    require_rank(name, t, (2,))
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows for this layout_meta, got shape {tuple(t.shape)}")
    _check_device_and_last_dim(name, t, meta)
    return t


def _check_layout_rows(name: str, t: object, meta: LayoutMeta, K: int) -> torch.Tensor:
    """A buffer in the layout's row order: exactly `meta.rows_shape(K)`."""
    require_tensor(name, t)
    want = meta.rows_shape(K)
    if tuple(t.shape) != want:
        raise ValueError(f"{name} must have shape {want} for this {meta.layout.value} layout_meta, "
                         f"got {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    _check_device_and_last_dim(name, t, meta)
    return t


def _block_k(K: int, elem_size: int) -> tuple[int, int]:
    # 16 KB of registers per tile at most (8 KB for bf16 K=4096 in one tile); 8 warps for wide rows.
    block = min(next_pow2(max(K, 1)), 8192 // max(elem_size, 1))
    return block, (8 if block >= 2048 else 4)


def _striding_grid(num_tokens: int, fn, key: tuple, args: tuple, constexprs: dict, warps: int,
                   maxnreg: Optional[int] = None) -> int:
    """Programs of a kernel that strides over tokens: all resident at once (the compiled kernel's
    occupancy), as many tokens each, never more programs than tokens."""
    from padded_moe.kernels._launch import resident_programs

    if num_tokens <= 0:
        return 1
    return even_split(num_tokens, resident_programs(fn, key, args, constexprs, num_warps=warps, maxnreg=maxnreg))


def _slab_strides(t: torch.Tensor, meta: LayoutMeta) -> tuple[int, int]:
    """(slab stride, row stride) of a buffer of `meta.rows_shape`: a flat buffer is one slab."""
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (0, t.stride(0))


def permute(hidden: torch.Tensor, layout_meta: LayoutMeta, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GEMM1's input for the layout: INDEXED → `hidden` itself (GEMM1 gathers on load);
    GROUPED_CONTIGUOUS → `[M*k, K]` with slot `s`'s token row at `inv[s]` (rows `>= offsets[L]`
    untouched); GROUPED_MASKED → `[L, T_max, K]` (rows past each count untouched).
    `out` (or the metadata's scratch buffer) receives the rows; otherwise a new tensor is returned."""
    meta = _check_meta(layout_meta)
    M, k = meta.num_tokens, meta.top_k
    _check_rows("hidden", hidden, M, meta)
    if not meta.PERMUTES:
        return hidden
    K = hidden.shape[1]
    shape = meta.rows_shape(K)
    if out is None:
        if meta.scratch is not None:
            flat = meta.scratch.permute_buffer(meta.layout, K, hidden.dtype, math.prod(shape))
            out = flat[: math.prod(shape)].view(shape)
        else:
            out = torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
    else:
        _check_layout_rows("out", out, meta, K)
    if out.dtype != hidden.dtype:
        raise ValueError(f"out must have dtype {hidden.dtype} and {K} columns, got {out.dtype} with shape {tuple(out.shape)}")
    if M == 0 or meta.row_limit == 0 or K == 0:
        return out
    if use_triton(hidden.device):
        _permute_triton(hidden, out, meta)
    else:
        from padded_moe.torch_path.layouts import permute_torch

        rows = out.view(-1, K) if out.is_contiguous() else None
        if rows is None:
            raise ValueError("out must be contiguous on the CPU path")
        permute_torch(hidden, meta.inv, k, rows, meta.row_limit)
    return out


def _permute_triton(hidden, out, meta: LayoutMeta) -> None:
    from padded_moe.kernels._launch import launch, ptr_key
    from padded_moe.kernels.layouts import _permute_kernel

    M, k, K = meta.num_tokens, meta.top_k, hidden.shape[1]
    s0, s1 = _slab_strides(out, meta)
    block_k, warps = _block_k(K, hidden.element_size())
    ptrs = (hidden, out, meta.inv)
    ints = (hidden.stride(0), s0, s1, M, K, meta.row_limit, meta.slab_rows)
    key, args = ints + ptr_key(*ptrs), (hidden, ints[0], out, s0, s1, meta.inv) + ints[3:]
    constexprs = dict(TOP_K=k, K_PAD=next_pow2(k), BLOCK_K=block_k)
    grid = (_striding_grid(M, _permute_kernel, key, args, constexprs, warps),)
    launch(_permute_kernel, grid, key, args, constexprs, num_warps=warps)


def unpermute(out: torch.Tensor, expert_out: torch.Tensor, topk_weights: torch.Tensor,
              layout_meta: LayoutMeta) -> torch.Tensor:
    """`out[t] = Σ_j w[t,j] · Y[row(t,j)]` over kept slots, fp32 accumulation, for `t < valid_tokens`.

    `expert_out`: `[M*k, K]` (INDEXED: slot order; GROUPED_CONTIGUOUS: permuted rows) or
    `[L, T_max, K]` (GROUPED_MASKED). Dropped rows are never read (they may hold NaN); a token whose
    slots are all dropped gets zeros; rows of `out` at/after `valid_tokens` are not written. Returns `out`.
    """
    meta = _check_meta(layout_meta)
    M, k, L = meta.num_tokens, meta.top_k, meta.num_local
    _check_rows("out", out, M, meta)
    K = out.shape[1]
    _check_layout_rows("expert_out", expert_out, meta, K)
    require_tensor("topk_weights", topk_weights)
    if tuple(topk_weights.shape) != (M, k) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be a float tensor of shape {(M, k)}, got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    if topk_weights.device != out.device:
        raise ValueError(f"topk_weights must be on {out.device}, got {topk_weights.device}")
    if M == 0 or K == 0:
        return out
    rows, row_limit = meta.slot_rows, meta.row_limit
    if use_triton(out.device):
        _unpermute_triton(out, expert_out, topk_weights, meta)
    else:
        from padded_moe.torch_path.layouts import unpermute_torch

        if rows is None:
            rows2 = torch.arange(M * k, device=out.device).view(M, k)
            kept = (meta.slot_expert < L).view(M, k)
        else:
            rows2 = rows.view(M, k)
            kept = rows2 < row_limit
        unpermute_torch(out, expert_out.reshape(-1, K), topk_weights, rows2, kept, meta.valid_tokens)
    return out


# Registers per thread the unpermute kernel may use, for top-k up to UNPERMUTE_MAXNREG_TOP_K. Left
# free, the compiler hoists the loads of a token's k slot rows together when the rows are the
# slots themselves (INDEXED): 48 registers at k = 8, so 5 programs of 8 warps per SM on an H200,
# against the 8 of the variant that reads row indices first (32 registers). 32 fits 8 per SM with
# no spills (ptxas, sm_90) on either variant up to k = 8; from k = 10 the cap spills, so wider
# top-k keeps the compiler's choice.
UNPERMUTE_MAXNREG = 32
UNPERMUTE_MAXNREG_TOP_K = 8


def _unpermute_triton(out, expert_out, weights, meta: LayoutMeta) -> None:
    from padded_moe.kernels._launch import launch, ptr_key
    from padded_moe.kernels.layouts import _unpermute_kernel

    M, k, K = meta.num_tokens, meta.top_k, out.shape[1]
    s0, s1 = _slab_strides(expert_out, meta)
    rows, vt = meta.slot_rows, meta.valid_tokens
    block_k, warps = _block_k(K, 4)
    rows_arg = rows if rows is not None else meta.slot_expert
    vt_arg = vt if vt is not None else meta.slot_expert
    ints = (s0, s1, meta.slab_rows, weights.stride(0), weights.stride(1), out.stride(0), M, K, meta.num_local,
            meta.row_limit)
    args = (expert_out, s0, s1, meta.slab_rows, weights, ints[3], ints[4], out, ints[5],
            rows_arg, meta.slot_expert, vt_arg) + ints[6:]
    key = ints + ptr_key(expert_out, weights, out, rows_arg, meta.slot_expert, vt_arg)
    constexprs = dict(TOP_K=k, HAS_ROWS=rows is not None, HAS_VT=vt is not None, BLOCK_K=block_k)
    maxnreg = UNPERMUTE_MAXNREG if k <= UNPERMUTE_MAXNREG_TOP_K else None
    grid = (_striding_grid(M, _unpermute_kernel, key, args, constexprs, warps, maxnreg),)
    launch(_unpermute_kernel, grid, key, args, constexprs, num_warps=warps, maxnreg=maxnreg)


__all__ = [
    "GemmLayout", "LayoutMetaBase", "IndexedMeta", "GroupedContiguousMeta", "GroupedMaskedMeta", "LayoutMeta",
    "ExpertMap", "PermuteScratch", "build_layout", "permute", "unpermute", "select_gemm_layout",
    "default_block_m", "indexed_capacity", "LAYOUT_ENV",
]
