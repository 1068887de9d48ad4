"""The wire format, the EP geometry and the one buffer description of expert parallelism.

`WireFormat` is the byte layout of one dispatched row; `EPGeometry` the sizes every stage shares;
`ep_buffer_specs` lists every persistent buffer one rank needs (name, shape, dtype, whether a
transport exchanges it with peers). Transports allocate from that list (`Transport.allocate`) and
the planner sizes it (`padded_moe.planner`), so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from padded_moe.ep.tiles import route_block_columns

MODES = ("flat", "batched")
FP8_WIRE_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128  # elements per fp8 scale (DeepEP's per-128-channel scaling)
ROW_ALIGN = 64   # wire row bytes: every view's row stride stays a multiple of 16 elements


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def fp8_scale_columns(hidden_size: int) -> int:
    """int32 meta columns holding fp8 scales: one per 128 channels (one per row if K % 128)."""
    return hidden_size // FP8_BLOCK if hidden_size % FP8_BLOCK == 0 else 1


def meta_columns(top_k: int, hidden_size: int, fp8_wire: bool) -> int:
    """int32 columns a meta row uses: k ids, k weights (bit-cast), the chunk count, fp8 scales."""
    return 2 * top_k + 1 + (fp8_scale_columns(hidden_size) if fp8_wire else 0)


@dataclass(frozen=True)
class WireFormat:
    """Byte layout of one wire row: `x` (`hidden_size` elements of the wire dtype, padded to 16
    bytes), then int32 meta columns (`ids [0, k)`, `weights [k, 2k)`, count at `2k`, fp8 scales
    from `2k+1`), padded so `row_bytes` is a multiple of 64."""

    hidden_size: int
    top_k: int
    dtype: torch.dtype
    fp8: bool = False

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.fp8 else self.dtype

    @property
    def x_bytes(self) -> int:
        return _round_up(self.hidden_size * _itemsize(self.wire_dtype), 16)

    @property
    def row_bytes(self) -> int:
        return _round_up(self.x_bytes + 4 * meta_columns(self.top_k, self.hidden_size, self.fp8), ROW_ALIGN)

    @property
    def buffer_row_bytes(self) -> int:
        """Bytes per row of a transport buffer: a wire row, or a combine row in `dtype`."""
        return max(self.row_bytes, self.hidden_size * _itemsize(self.dtype))

    @property
    def count_col(self) -> int:
        return 2 * self.top_k

    @property
    def scale_col(self) -> int:
        return 2 * self.top_k + 1

    @property
    def scale_group(self) -> int:
        """Channels per fp8 scale (K when there is one scale per row)."""
        return FP8_BLOCK if self.hidden_size % FP8_BLOCK == 0 else self.hidden_size

    def wire_rows(self, buf: torch.Tensor, rows: int) -> torch.Tensor:
        """The first `rows` wire rows `[rows, row_bytes]` uint8 of a transport buffer."""
        return buf.view(-1)[: rows * self.row_bytes].view(rows, self.row_bytes)

    def combine_rows(self, buf: torch.Tensor, rows: int) -> torch.Tensor:
        """`[rows, K]` in `dtype` over the same storage (contiguous)."""
        n = rows * self.hidden_size * _itemsize(self.dtype)
        return buf.view(-1)[:n].view(self.dtype).view(rows, self.hidden_size)

    def views(self, wire: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x in the wire dtype, meta as int32, meta as float32): strided views of `wire`."""
        K, es = self.hidden_size, _itemsize(self.wire_dtype)
        x = wire[:, : K * es].view(self.wire_dtype)
        meta = wire[:, self.x_bytes:]
        return x, meta.view(torch.int32), meta.view(torch.float32)

    def x_bytes_view(self, wire: torch.Tensor) -> torch.Tensor:
        """The x region as raw bytes (fp8 rows are moved as uint8 on the torch path)."""
        return wire[:, : self.hidden_size * _itemsize(self.wire_dtype)]


@dataclass(frozen=True)
class EPGeometry:
    """Sizes shared by every stage: `R` ranks, `T` rows per chunk, `E` global experts, the wire."""

    ep_size: int
    max_tokens: int
    num_experts: int
    wire: WireFormat

    @property
    def rows(self) -> int:
        return self.ep_size * self.max_tokens


# ---------------------------------------------------------------------------------------- buffers
@dataclass(frozen=True)
class BufferSpec:
    """One persistent buffer of a rank: `name` (the key of `ExpertParallel.buffers()`), `label`
    (the planner's row), shape and dtype, `exchanged` (peers' data lands in it or leaves from it:
    a transport may place it in memory its peers can reach), `fill` (initial value, None =
    uninitialized), `reuses` (the name of an exchanged buffer whose storage this one may share:
    that buffer's contents are dead by the time this one is written)."""

    name: str
    label: str
    shape: tuple
    dtype: torch.dtype
    exchanged: bool = False
    fill: Optional[Union[int, float]] = None
    reuses: Optional[str] = None
    note: str = ""

    @property
    def nbytes(self) -> int:
        n = _itemsize(self.dtype)
        for s in self.shape:
            n *= s
        return n


def ep_buffer_specs(geo: EPGeometry, mode: str, num_local: int) -> tuple:
    """Every persistent buffer of one rank for `geo` in `mode` with `num_local` local experts.

    Exchanged: the dispatch send / receive rows (wire rows, x + meta in-band) and the combine send
    / receive rows (`[R*T, K]` in `dtype`). A combine buffer may reuse its dispatch buffer's
    storage: the dispatch send rows are free once the dispatch exchange ran, and the dispatch
    receive rows are dead once the receive stage copied them out (no combine stage reads them).
    The rest is this rank's own bookkeeping: `token_rows [R, T]` (sender side: the combine row of
    token t's partial from peer r, or the pad value `R*T`), `chunk_counts [R]`, the pack's route
    counts, and the receive buffer of the mode (flat: x, ids, weights, valid_tokens; batched:
    slabs plus one dump row, counts, each slot's slab row and router weight).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    w, R, T, rows = geo.wire, geo.ep_size, geo.max_tokens, geo.rows
    K, k, dtype = w.hidden_size, w.top_k, w.dtype
    wire_note = f"{w.row_bytes} B wire rows"
    out = [
        BufferSpec("dispatch_send", "dispatch send (x + meta in-band)", (rows, w.row_bytes), torch.uint8,
                   exchanged=True, note=wire_note),
        BufferSpec("dispatch_recv", "dispatch recv (x + meta in-band)", (rows, w.row_bytes), torch.uint8,
                   exchanged=True, note=wire_note),
        BufferSpec("combine_send", "combine send", (rows, K), dtype, exchanged=True, reuses="dispatch_send"),
        BufferSpec("combine_recv", "combine recv", (rows, K), dtype, exchanged=True, reuses="dispatch_recv"),
        BufferSpec("token_rows", "combine token rows", (R, T), torch.int32, fill=rows),
        BufferSpec("chunk_counts", "received chunk counts", (R,), torch.int32, fill=0),
        BufferSpec("route_counts", "pack route counts", (R, route_block_columns(T)), torch.int32, fill=0,
                   note="per peer, per token block"),
    ]
    if mode == "flat":
        out += [BufferSpec("rb_x", "receive x", (rows, K), dtype),
                BufferSpec("rb_topk_ids", "receive topk_ids", (rows, k), torch.int32, fill=-1),
                BufferSpec("rb_topk_weights", "receive topk_weights", (rows, k), torch.float32, fill=0),
                BufferSpec("rb_valid_tokens", "receive valid_tokens", (1,), torch.int32, fill=0)]
    else:
        # Slabs plus one dump row that absorbs the torch path's writes of non-local slots.
        out += [BufferSpec("rb_x", "receive x slabs (+dump row)", (num_local * rows + 1, K), dtype,
                           note="L x R*T rows"),
                BufferSpec("rb_counts", "receive counts", (num_local,), torch.int32, fill=0),
                BufferSpec("slot_rows", "combine slot rows", (rows, k), torch.int32, fill=-1),
                BufferSpec("slot_weights", "combine slot weights", (rows, k), torch.float32, fill=0)]
    return tuple(out)


# ---------------------------------------------------------------------------------------- fp8
def _quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows → (float8_e4m3fn bytes uint8 [n, K], float32 scales [n, S]) with per-block amax/448."""
    n, K = x.shape
    S = fp8_scale_columns(K)
    blocks = x.float().view(n, S, K // S)
    scales = blocks.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scales.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.view(n, K).view(torch.uint8), scales


def _dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, K = q.shape
    S = scales.shape[1]
    vals = q.view(torch.float8_e4m3fn).float().view(n, S, K // S) * scales.unsqueeze(-1)
    return vals.view(n, K).to(dtype)
