"""Expert parallelism over torch.distributed (spec 04): dispatch → local experts → combine.

Transport: `all_to_all_single` only (NCCL on GPUs, gloo on CPU), **one collective per direction**.
Every rank reserves, per peer, a chunk of `T = max_tokens_per_rank` rows of one raw uint8 buffer
`[R*T, row_bytes]`. A token goes to peer `d` once if at least one of its slots lives on `d`; its
row in chunk `d` carries, in-band, the hidden state (`K` elements of the wire dtype) followed by
int32 "meta" columns: the k global ids (-1 for slots owned elsewhere), the k router weights
(float32 bit-cast to int32), the chunk's valid-row count (column `2k`, written on the chunk's
first row even when the chunk is empty) and, for an fp8 wire, the per-128-channel float32 scales.
`row_bytes` is a multiple of 64 (`WireFormat`); the code works on strided views of the same bytes
(`x = buf[:, :K*es].view(wire dtype)`, `meta = buf[:, x_bytes:].view(int32 / float32)`). Valid rows
are compacted to the front of each chunk; the receiver trusts the count, never the padding rows.

Combine sends expert outputs back in `dtype` through `[R*T, K]` views that alias the dispatch
buffers' storage (each buffer holds `R*T * max(row_bytes, K*dtype size)` bytes): the send buffer is
free once the dispatch all_to_all has run, and the receive buffer is only overwritten by the
combine all_to_all (no combine kernel reads it). What combine needs later lives in small persistent
buffers: `token_rows [R, T]` (sender side: the combine-receive row of token t's partial from peer
r, or the pad value `R*T`), `chunk_counts [R]` (receiver side: valid rows per source rank) and,
batched, `slot_rows` / `slot_weights [R*T, k]` (each slot's slab row and router weight).

Modes (both with fixed shapes for a fixed `T`, so dispatch → experts → combine captures in one
CUDA graph):

- flat: the receiver compacts the `R` chunks into `x [R*T, K]` whose rows `[0, valid_tokens)`
  are real; ids of rows `[valid_tokens, R*T)` are -1 and their weights 0. The experts run with
  `fused_experts(..., expert_map=ep.expert_map, valid_tokens=rb.valid_tokens)`, whose guard drops
  the -1 slots and whose layout counts stop at `valid_tokens`, so no padding row is computed.
  `combine` copies the expert output back into chunk order, returns it with one all_to_all, and
  the sender adds its `R` partial rows per token in float32.
- batched: the receiver scatters each (row, local expert) pair into per-expert slabs
  `x [L, R*T, K]` with `counts [L]` (a token routed twice to one expert occupies one row; both
  router weights are applied to it). Router weights are applied by `combine`, on the receiver,
  before the rows travel back.

Where it runs: on CUDA (and on CPU with `TRITON_INTERPRET=1`) the Triton kernels of
`padded_moe.kernels.ep`; otherwise the torch functions below (the CPU/gloo path and the tests'
reference). Launches per call, graph-safe:

- dispatch: `_route_count_kernel` (per token block and peer, only above PACK_ONE_BLOCK_TOKENS
  tokens), `_pack_kernel` (owner, position in the chunk, row copy / fp8 quantization, meta, count,
  `token_rows`; zeroes the batched counts), one all_to_all, then `_recv_flat_kernel` or
  `_recv_batched_kernel`;
- combine: `_combine_flat_kernel` or `_combine_batched_kernel`, one all_to_all, `_reduce_kernel`.

Graph-safe, on the kernels' path with peers and `T >= EP_OVERLAP_MIN_TOKENS`: this rank's own
chunk never enters the all_to_all. The pack skips it; NCCL gets per-peer views with an empty own
chunk, issued from a side stream. Meanwhile the own tokens go straight from `hidden` to the receive
side (fp8 rounding applied all the same):
- batched: `_local_batched_kernel` puts them into the slabs as received rows `me*T + t`. In combine,
  the peers' rows are weighed first, and while they travel the own rows are weighed into the
  combine send buffer's own chunk, where the reduction reads them;
- flat: `_local_flat_kernel` writes them to the front of the receive rows, and the peers' chunks
  are compacted after them. Combine returns only the peers' rows, and the reduction reads the own
  partials from the expert output.
The overlapped kernels run on a grid that leaves `EP_FREE_SMS` SMs idle (else NCCL's CTAs wait for
them to drain). The own tokens then come first among the received rows; every row's result is
unchanged (and on CUDA the batched order already follows the atomics).

`graph_safe=False` first exchanges the per-peer counts (one host sync, one more small collective)
and moves only real rows (uneven splits, chunks back to back); received rows are then already a
prefix in source-rank order, which is exactly the order the graph-safe compaction produces, and
both variants run the same kernels, so the results are identical.

Buffers are reserved once at construction (`ExpertParallel.buffers()` lists them; the planner
sizes the same set). A `ReceiveBuffer` and a `DispatchHandle` alias them: they are valid until the
next `dispatch`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from padded_moe._platform import num_sms, use_triton
from padded_moe._validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    require_dtype,
    require_int,
    require_rank,
    require_same_device,
    require_shape,
    require_tensor,
)
from padded_moe.expert_map import ExpertMap, sanitize_torch

MODES = ("flat", "batched")
FP8_WIRE_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128  # elements per fp8 scale (DeepEP's per-128-channel scaling)
ROW_ALIGN = 64   # wire row bytes: every view's row stride stays a multiple of 16 elements


@dataclass
class ReceiveBuffer:
    """What one rank's local experts compute on (views of the ExpertParallel's buffers).

    flat: `x [R*T, K]`, `topk_ids int32 [R*T, k]` (global ids of local slots, -1 elsewhere and on
    padding rows), `topk_weights float32 [R*T, k]`, `valid_tokens int32 [1]` (device). Rows come
    in source-rank order, except that this rank's own tokens come first when it keeps its chunk
    out of the all_to_all (graph-safe, T >= EP_OVERLAP_MIN_TOKENS); nothing downstream depends on
    the order.
    batched: `x [L, R*T, K]`, `counts int32 [L]` (expert `e`'s rows `[0, counts[e])` are real).
    """

    mode: str
    x: torch.Tensor
    topk_ids: Optional[torch.Tensor] = None
    topk_weights: Optional[torch.Tensor] = None
    valid_tokens: Optional[torch.Tensor] = None
    counts: Optional[torch.Tensor] = None


@dataclass
class DispatchHandle:
    """What `combine` needs to route partial outputs back (views of persistent buffers)."""

    owner: "ExpertParallel"
    mode: str
    num_tokens: int
    # Sender side: row of the combine receive buffer holding peer r's partial sum for token t,
    # or the pad value `R*T` when token t sent nothing to r. int32 [R, T] (columns [0, m) used).
    token_rows: torch.Tensor
    # graph_safe=False: exact per-peer row counts (host ints).
    send_counts: Optional[list] = None
    recv_counts: Optional[list] = None


def _backend_quantizes_inputs(backend: object) -> bool:
    """True when the expert backend quantizes its own activations (spec 03 `quantizes_inputs`).

    `backend` is None/"auto" (our own kernels: bf16 activations), a name known to
    `padded_moe.backends.get_backend`, or any object with a `quantizes_inputs` attribute.
    """
    if backend is None or backend == "auto":
        return False
    if isinstance(backend, str):
        from padded_moe.backends import get_backend

        backend = get_backend(backend)  # ValueError naming the legal names for an unknown one
    if not hasattr(backend, "quantizes_inputs"):
        raise TypeError(
            f"backend must be None, a backend name or an object with a `quantizes_inputs` attribute, "
            f"got {type(backend).__name__}")
    return bool(backend.quantizes_inputs)


def _default_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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


# ============================================================================================
# Stages. Each has a torch implementation (CPU/gloo path, reference of the tests) and a Triton
# one (CUDA, or CPU under the interpreter); `ExpertParallel` calls the dispatcher functions.
# ============================================================================================

@dataclass(frozen=True)
class EPTile:
    """Launch shape of one EP kernel on CUDA: rows per program, warps, and the programs per SM the
    K split aims for (more programs put more bytes in flight when T is small); for the kernels
    that overlap a collective, the most programs per SM the grid may have."""
    rows: int
    num_warps: int = 4
    per_sm: int = 4


# Per stage, for the H200 (benchmarks/bench_ep_kernels.py sweeps alternatives on one GPU;
# `bench_ep.py --tile STAGE=R,W,S --profile` times one in the two-GPU run).
# combine_batched: 4 rows and 8 programs per SM took 31.7 µs at T=1024 in the sweep, where the
# 8-row tile had taken 50.9 µs in the profile of bench_ep (2026-11-30). reduce: 4 rows, 8 per
# SM 6.2 µs vs 7.3-7.6 for 8 rows / 4 per SM (bench_ep --profile, T=1024, third session); in the same
# probe no other candidate beat the table (recv_batched 1/2/4 rows, 4/8 warps: 13.7-15.0 µs).
# local_batched and combine_own (the own chunk's combine) run while the all_to_all is in flight.
# With a full-machine grid they took every SM first and NCCL's kernel only started as they drained
# (bench_ep --timeline: no overlap); one program per SM on every SM did not help either (NCCL's
# CTAs did not share an SM with ours). So their grid leaves EP_FREE_SMS SMs idle for NCCL's CTAs
# and loops over the row blocks. 66 = half of the H200's 132 SMs; in the probes (notes.md runs
# 21-22) 50 and 66 free SMs were within 2 µs of each other with the 8-16-warp tiles below, and
# 16/32/48/66 gave 196-222 µs in no clear order with 4-warp tiles. A GPU with fewer SMs keeps
# half of them free.
EP_FREE_SMS = 66
# The pack packs up to this many tokens in one block per peer (no route-count kernel).
PACK_ONE_BLOCK_TOKENS = 32
# Both modes keep their own chunk out of the all_to_all (and overlap it) from this many
# max_tokens_per_rank on. Below that, the plain sequence (fewer launches) was faster in batched
# mode, in steady-state graph replays:
# - T=16 / 128: 39-40 / 59 µs either way, but the plain sequence's ratio to the raw all_to_all was
#   higher (0.75 vs 0.64 and 0.87 vs 0.81);
# - T=1024: the overlap saved 14 µs (168 vs 182 µs) in batched mode and 5-7 µs (142-146 vs
#   148-151) in flat mode.
# 512 sits between the measured sizes (not measured itself); flat's overlap was not measured below
# 1024. The environment variable PADDED_MOE_EP_OVERLAP_MIN_TOKENS overrides it at construction.
EP_OVERLAP_MIN_TOKENS = 512
EP_TILES: dict = {
    "pack": EPTile(8), "recv_flat": EPTile(8), "recv_batched": EPTile(2),
    "combine_flat": EPTile(8), "combine_batched": EPTile(4, 4, 8), "reduce": EPTile(4, 4, 8),
    "local_batched": EPTile(8, 16, 1), "combine_own": EPTile(16, 16, 1), "local_flat": EPTile(8, 16, 1),
}
INTERPRET_TILE = EPTile(16)  # the interpreter prefers few, large programs


def _tile(stage: str, device: torch.device) -> EPTile:
    return EP_TILES[stage] if device.type == "cuda" else INTERPRET_TILE


def _k_tiles(device: torch.device, K: int, elem_size: int, row_programs: int, *,
             group: int = 0, split: bool = True, per_sm: int = 4) -> tuple[int, int, int]:
    """(BK, K_PER_PROG, KS): columns per inner step, per program, programs along K.

    On CUDA, K is split across programs until the grid has ~4 programs per SM (small T still
    spreads its bytes over the machine); fp8 slices are one scale block (`group`) wide.
    """
    if group:
        bk = group
    else:
        bk = min(_next_pow2(max(K, 1)), (1024 // elem_size) if device.type == "cuda" else 256)
    if not split or device.type != "cuda":
        return bk, _cdiv(K, bk) * bk, 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ks = max(1, min(_cdiv(K, bk), (per_sm * num_sms(idx)) // max(row_programs, 1)))
    kpp = _cdiv(_cdiv(K, ks), bk) * bk
    return bk, kpp, _cdiv(K, kpp)


def _overlap_min_tokens() -> int:
    """EP_OVERLAP_MIN_TOKENS, or the PADDED_MOE_EP_OVERLAP_MIN_TOKENS environment variable."""
    raw = os.environ.get("PADDED_MOE_EP_OVERLAP_MIN_TOKENS")
    if raw is None:
        return EP_OVERLAP_MIN_TOKENS
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"PADDED_MOE_EP_OVERLAP_MIN_TOKENS must be an integer, got {raw!r}") from None


def _capped_grid(device: torch.device, row_programs: int, k_programs: int = 1) -> int:
    """Row programs for a kernel that overlaps a collective: at most one program per SM outside
    the `EP_FREE_SMS` left to the collective (at most half the SMs on a smaller GPU), with
    `k_programs` along K, the programs looping over the row blocks; uncapped off CUDA."""
    if device.type != "cuda":
        return row_programs
    idx = device.index if device.index is not None else torch.cuda.current_device()
    sms = num_sms(idx)
    return max(1, min(row_programs, (sms - min(EP_FREE_SMS, sms // 2)) // max(k_programs, 1)))


def _fp8_tiles(geo: EPGeometry, device, row_programs, elem_size, split=True, per_sm=4):
    """K tiling for a kernel that reads or writes an fp8 wire (a slice never straddles a scale)."""
    w = geo.wire
    if not w.fp8:
        return _k_tiles(device, w.hidden_size, elem_size, row_programs, split=split, per_sm=per_sm)
    if w.scale_group == w.hidden_size:  # one scale per row: the kernel loops over all of K itself
        return _k_tiles(device, w.hidden_size, 1, row_programs, split=False)
    return _k_tiles(device, w.hidden_size, 1, row_programs, group=FP8_BLOCK, split=split, per_sm=per_sm)


def _unit_stride_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its rows have unit stride (the kernels' assumption), else a contiguous copy."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _slot_owner_torch(topk_ids: torch.Tensor, owner: torch.Tensor, E: int, R: int) -> torch.Tensor:
    """Owning rank of each slot (int64); R for invalid ids. Range check before the table read."""
    in_range = (topk_ids >= 0) & (topk_ids < E)
    safe = torch.where(in_range, topk_ids, torch.zeros((), dtype=topk_ids.dtype, device=topk_ids.device))
    own = owner[safe.long()].long()
    return torch.where(in_range, own, torch.full_like(own, R))


def peer_counts(topk_ids: torch.Tensor, owner: torch.Tensor, geo: EPGeometry) -> torch.Tensor:
    """int64 [R]: how many tokens go to each peer (graph_safe=False sizes its splits with it)."""
    R = geo.ep_size
    own = _slot_owner_torch(topk_ids, owner, geo.num_experts, R)
    peers = torch.arange(R, device=topk_ids.device).view(R, 1, 1)
    return (own.unsqueeze(0) == peers).any(-1).sum(1)


# ---------------------------------------------------------------------------------------- pack
def pack_rows(hidden, topk_ids, topk_weights, owner, geo: EPGeometry, send_wire, token_rows,
              send_base: Optional[torch.Tensor] = None, zero_counts: Optional[torch.Tensor] = None, *,
              skip_peer: int = -1, block_counts: Optional[torch.Tensor] = None) -> None:
    """Fill the send rows: chunk r holds the tokens with a slot on peer r, compacted, with their
    peer-masked ids, weights (, fp8 scales) and (graph-safe: `send_base` None) the count column of
    row r*T; `token_rows[r, t]` = send row of (t, r) or R*T. With `send_base` ([R] int32) chunks start
    at `send_base[r]` (exact splits) and no count is written. `zero_counts`: the batched counts,
    zeroed here so the receive kernels can count with atomics. `skip_peer` >= 0: that peer's chunk
    (this rank's own, handled by `local_batched`) is not packed and its `token_rows` row is left
    as it is. `block_counts` int32 `[R, >= cdiv(m, tile rows)]`: scratch of the Triton path
    (allocated when None; `ExpertParallel` passes a persistent one, see `route_block_columns`)."""
    if use_triton(hidden.device):
        _pack_triton(hidden, topk_ids, topk_weights, owner, geo, send_wire, token_rows, send_base, zero_counts,
                     skip_peer, block_counts)
    else:
        _pack_torch(hidden, topk_ids, topk_weights, owner, geo, send_wire, token_rows, send_base, skip_peer)
        if zero_counts is not None:
            zero_counts.zero_()


def _pack_torch(hidden, topk_ids, topk_weights, owner, geo, send_wire, token_rows, send_base, skip_peer=-1) -> None:
    R, T, k, rows, w = geo.ep_size, geo.max_tokens, geo.wire.top_k, geo.rows, geo.wire
    dev = hidden.device
    m = hidden.shape[0]
    x, meta_i, meta_f = w.views(send_wire)
    own = _slot_owner_torch(topk_ids, owner, geo.num_experts, R)               # [m, k] in [0, R]
    to_peer = (own.unsqueeze(0) == torch.arange(R, device=dev).view(R, 1, 1)).any(-1)   # [R, m]
    pos = torch.cumsum(to_peer, dim=1) - 1                                       # row inside the chunk
    base = send_base.long() if send_base is not None else torch.arange(R, device=dev) * T
    tr = torch.where(to_peer, base.view(R, 1) + pos, torch.full_like(pos, rows))  # [R, m]
    packed = [r for r in range(R) if r != skip_peer]
    token_rows[packed, :m] = tr[packed].to(torch.int32)
    if send_base is None:  # the chunk's count, in-band on its first row (also when it is 0)
        meta_i[torch.arange(R, device=dev) * T, w.count_col] = to_peer.sum(1).to(torch.int32)
    if m == 0:
        return
    # Invert token_rows: which token (and for which peer) fills each send row; unsent pairs land
    # on the dump slot `rows`. Rows no token fills are written too (never read by the receiver).
    flat = tr.reshape(-1)
    src_tok = torch.zeros(rows + 1, dtype=torch.int64, device=dev)
    src_tok.scatter_(0, flat, torch.arange(m, device=dev).repeat(R))
    row_peer = torch.full((rows + 1,), -1, dtype=torch.int64, device=dev)
    row_peer.scatter_(0, flat, torch.arange(R, device=dev).repeat_interleave(m))
    src_tok, row_peer = src_tok[:rows], row_peer[:rows]
    keep = own.index_select(0, src_tok) == row_peer.unsqueeze(1)                # [rows, k]
    ids = topk_ids.index_select(0, src_tok)
    # ids kept are in [0, E): narrowing to int32 after the mask is safe.
    meta_i[:, :k] = torch.where(keep, ids, torch.full_like(ids, -1)).to(torch.int32)
    wts = topk_weights.index_select(0, src_tok).to(torch.float32)
    meta_f[:, k:2 * k] = torch.where(keep, wts, torch.zeros_like(wts))
    rows_x = hidden.index_select(0, src_tok)
    if w.fp8:
        q, scales = _quantize_fp8(rows_x)
        w.x_bytes_view(send_wire).copy_(q)
        meta_f[:, w.scale_col:w.scale_col + scales.shape[1]] = scales
    else:
        x.copy_(rows_x)


def route_block_columns(max_tokens: int) -> int:
    """Columns of the pack's per-block route counts for up to `max_tokens` tokens (the smallest
    pack tile of any device sets the number of blocks)."""
    return max(1, _cdiv(max_tokens, min(EP_TILES["pack"].rows, INTERPRET_TILE.rows)))


def _pack_triton(hidden, topk_ids, topk_weights, owner, geo, send_wire, token_rows, send_base, zero_counts,
                 skip_peer, block_counts):
    from padded_moe.kernels.ep import _pack_kernel, _route_count_kernel

    R, T, w, dev = geo.ep_size, geo.max_tokens, geo.wire, hidden.device
    m, K, k = hidden.shape[0], w.hidden_size, w.top_k
    peers = R - (1 if skip_peer >= 0 else 0)
    if peers == 0:  # a world of one that keeps its chunk: nothing to pack
        if zero_counts is not None:
            zero_counts.zero_()
        return
    hidden = _unit_stride_rows(hidden)
    x, meta_i, meta_f = w.views(send_wire)
    kp = _next_pow2(k)
    tile, bt, nb, nb_max, routed = _pack_blocks(m, T, dev)
    if routed:
        if block_counts is None:
            block_counts = torch.empty(R, nb_max, dtype=torch.int32, device=dev)
        if block_counts.shape[0] != R or block_counts.shape[1] < nb_max or block_counts.dtype != torch.int32:
            raise ValueError(f"block_counts must be int32 [{R}, >= {nb_max}], got {block_counts.dtype} "
                             f"{list(block_counts.shape)}")
        _route_count_kernel[(nb,)](topk_ids, topk_ids.stride(0), topk_ids.stride(1), owner, block_counts,
                                   m, geo.num_experts, block_counts.stride(0), R=R, TOP_K=k, KP=kp, BT=bt,
                                   num_warps=tile.num_warps)
    else:
        block_counts = token_rows  # any valid pointer: not read
    bk, kpp, ks = _fp8_tiles(geo, dev, peers * nb, hidden.element_size(), per_sm=tile.per_sm)
    zero = zero_counts if zero_counts is not None else token_rows  # any valid pointer when unused
    base = send_base if send_base is not None else token_rows
    _pack_kernel[(peers * nb, ks)](
        hidden, hidden.stride(0), topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        topk_weights, topk_weights.stride(0), topk_weights.stride(1), owner,
        x, x.stride(0), meta_i, meta_f, meta_i.stride(0), token_rows, base, block_counts,
        zero, zero_counts.numel() if zero_counts is not None else 0,
        m, T, geo.num_experts, K, kpp, nb, block_counts.stride(0), skip_peer,
        R=R, TOP_K=k, KP=kp, BT=bt, BK=bk, NBP=_next_pow2(nb_max),
        COUNT_COL=w.count_col, SCALE_COL=w.scale_col, HAS_BASE=send_base is not None, FP8=w.fp8,
        ROW_SCALE=w.fp8 and w.scale_group == K, ZERO=zero_counts is not None, ROUTED=routed,
        num_warps=tile.num_warps)


# ---------------------------------------------------------------------------------------- receive
def _received_counts_torch(geo, meta_i, chunk_counts, in_band: bool, skip_peer: int = -1) -> torch.Tensor:
    """int64 [R] valid rows per source chunk, clamped to [0, T]; in-band ones are stored too
    (except `skip_peer`'s, whose chunk never arrived: its count is `chunk_counts`' own)."""
    R, T = geo.ep_size, geo.max_tokens
    if in_band:
        cnt = meta_i[torch.arange(R, device=meta_i.device) * T, geo.wire.count_col].long().clamp(0, T)
        if skip_peer >= 0:
            cnt[skip_peer] = chunk_counts[skip_peer].long().clamp(0, T)
        chunk_counts.copy_(cnt.to(torch.int32))
    else:
        cnt = chunk_counts.long().clamp(0, T)
    return cnt


def _valid_recv_rows_torch(geo, cnt, graph_safe: bool) -> torch.Tensor:
    """bool [R*T]: which rows of the receive buffer hold a real token."""
    T = geo.max_tokens
    i = torch.arange(geo.rows, device=cnt.device)
    if graph_safe:
        return (i % T) < cnt[i // T]
    return i < cnt.sum()


def _decode_rows_torch(geo, wire, src) -> torch.Tensor:
    """Received rows `src` in `dtype` (dequantized when the wire is fp8)."""
    w = geo.wire
    if w.fp8:
        q = w.x_bytes_view(wire).index_select(0, src)
        _, _, meta_f = w.views(wire)
        scales = meta_f[:, w.scale_col:w.scale_col + fp8_scale_columns(w.hidden_size)].index_select(0, src)
        return _dequantize_fp8(q, scales, w.dtype)
    x, _, _ = w.views(wire)
    return x.index_select(0, src)


def receive_flat(geo: EPGeometry, recv_wire, chunk_counts, in_band: bool, rb_x, rb_ids, rb_w, rb_valid, *,
                 own: int = -1) -> None:
    """Compact the R received chunks: rows `[0, valid)` of rb_x / rb_ids / rb_w are the real rows in
    source-rank order; ids -1 and weights 0 on rows `[valid, R*T)` (their x is not written).
    Counts: the in-band column (`in_band`, stored into `chunk_counts`) or `chunk_counts` (exact
    splits: chunks back to back). `own` >= 0: that chunk never travelled; `local_flat` already put
    its rows first (count in `chunk_counts[own]`), the others follow by rank."""
    if use_triton(recv_wire.device):
        _receive_flat_triton(geo, recv_wire, chunk_counts, in_band, rb_x, rb_ids, rb_w, rb_valid, own)
    else:
        _receive_flat_torch(geo, recv_wire, chunk_counts, in_band, rb_x, rb_ids, rb_w, rb_valid, own)


def _compaction_order(R: int, own: int) -> list:
    """Chunks in compaction order: `own` first (when >= 0), then the others by rank."""
    return ([own] if own >= 0 else []) + [r for r in range(R) if r != own]


def _receive_flat_torch(geo, recv_wire, chunk_counts, in_band, rb_x, rb_ids, rb_w, rb_valid, own=-1) -> None:
    R, T, k, rows = geo.ep_size, geo.max_tokens, geo.wire.top_k, geo.rows
    _, meta_i, meta_f = geo.wire.views(recv_wire)
    cnt = _received_counts_torch(geo, meta_i, chunk_counts, in_band, own)
    dev = cnt.device
    order = torch.tensor(_compaction_order(R, own), device=dev)
    cnt_o = cnt[order]
    incl = torch.cumsum(cnt_o, 0)
    pre_o, total = incl - cnt_o, incl[-1]
    d = torch.arange(rows, device=dev)
    slot = torch.searchsorted(incl, d, right=True).clamp(max=R - 1)             # order slot of compacted row d
    r_of = order[slot]
    # Where chunk r sits in the receive buffer: at r*T, or back to back (exact splits, rank order).
    base = torch.arange(R, device=dev) * T if in_band else torch.cumsum(cnt, 0) - cnt
    valid = d < total
    copy = valid & (r_of != own)
    src = torch.where(copy, base[r_of] + d - pre_o[slot], torch.zeros_like(d))
    v = copy.unsqueeze(1)
    rb_x.copy_(torch.where(v, _decode_rows_torch(geo, recv_wire, src), rb_x))
    ids = meta_i[:, :k].index_select(0, src)
    rb_ids.copy_(torch.where(v, ids, torch.where(valid.unsqueeze(1), rb_ids, torch.full_like(ids, -1))))
    wts = meta_f[:, k:2 * k].index_select(0, src)
    rb_w.copy_(torch.where(v, wts, torch.where(valid.unsqueeze(1), rb_w, torch.zeros_like(wts))))
    rb_valid.copy_(total.view(1).to(torch.int32))


def _receive_flat_triton(geo, recv_wire, chunk_counts, in_band, rb_x, rb_ids, rb_w, rb_valid, own) -> None:
    from padded_moe.kernels.ep import _recv_flat_kernel

    R, T, w, dev = geo.ep_size, geo.max_tokens, geo.wire, recv_wire.device
    x, meta_i, meta_f = w.views(recv_wire)
    tile = _tile("recv_flat", dev)
    bt = tile.rows
    nb = _cdiv(T, bt)
    bk, kpp, ks = _fp8_tiles(geo, dev, R * nb, rb_x.element_size(), per_sm=tile.per_sm)
    _recv_flat_kernel[(R * nb, ks)](
        x, x.stride(0), meta_i, meta_f, meta_i.stride(0), chunk_counts,
        rb_x, rb_x.stride(0), rb_ids, rb_ids.stride(0), rb_w, rb_w.stride(0), rb_valid,
        T, w.hidden_size, kpp, nb, own,
        R=R, RP=_next_pow2(R), TOP_K=w.top_k, KP=_next_pow2(w.top_k), BT=bt, BK=bk,
        COUNT_COL=w.count_col, SCALE_COL=w.scale_col, IN_BAND=in_band, FP8=w.fp8,
        ROW_SCALE=w.fp8 and w.scale_group == w.hidden_size, GROUP=w.scale_group if w.fp8 else 1,
        num_warps=tile.num_warps)


def local_flat(hidden, topk_ids, topk_weights, owner, geo: EPGeometry, me: int, rb_x, rb_ids, rb_w, token_rows,
               chunk_counts, block_counts: Optional[torch.Tensor] = None) -> None:
    """Flat mode's own tokens straight into the receive rows (they never travel): the tokens with a
    slot on rank `me` take rows `[0, count)` in token order (chunk `me` comes first in the
    compaction), ids masked to `me` (-1 elsewhere) and their weights; `token_rows[me, t]` = that
    row (the expert output's row the reduction reads; the pad `R*T` when token t has no slot here),
    `chunk_counts[me]` = the count. An fp8 wire's rounding is applied all the same. Triton path:
    `block_counts` are the route counts `pack_rows` just wrote (same blocks)."""
    if use_triton(hidden.device):
        _local_flat_triton(hidden, topk_ids, topk_weights, owner, geo, me, rb_x, rb_ids, rb_w, token_rows,
                           chunk_counts, block_counts)
        return
    m, dev = hidden.shape[0], hidden.device
    mine = _slot_owner_torch(topk_ids, owner, geo.num_experts, geo.ep_size) == me      # [m, k]
    sent = mine.any(1)
    pos = torch.cumsum(sent.long(), 0) - 1
    chunk_counts[me] = int(sent.sum())
    token_rows[me, :m] = torch.where(sent, pos, torch.full_like(pos, geo.rows)).to(torch.int32)
    rows = pos[sent]
    x = hidden[sent]
    if geo.wire.fp8 and x.shape[0]:
        q, scales = _quantize_fp8(x)
        x = _dequantize_fp8(q, scales, hidden.dtype)
    rb_x[rows] = x.to(rb_x.dtype)
    rb_ids[rows] = torch.where(mine, topk_ids, torch.full_like(topk_ids, -1))[sent].to(torch.int32)
    rb_w[rows] = torch.where(mine, topk_weights.float(), torch.zeros((), device=dev))[sent]


def _pack_blocks(m: int, T: int, device) -> tuple:
    """(tile, rows per block, blocks, blocks for T, routed): the pack's token blocks, shared by
    `local_flat` (which reads the same route counts)."""
    tile = _tile("pack", device)
    routed = m > PACK_ONE_BLOCK_TOKENS
    # Up to PACK_ONE_BLOCK_TOKENS tokens: one block per peer, positions from its own cumsum, no
    # route-count launch (at T=16 that launch and its gap were ~1.7 of ~35 µs).
    bt = tile.rows if routed else max(tile.rows, _next_pow2(max(m, 1)))
    nb = max(1, _cdiv(m, bt))
    return tile, bt, nb, max(nb, _cdiv(T, bt)), routed


def _local_flat_triton(hidden, topk_ids, topk_weights, owner, geo, me, rb_x, rb_ids, rb_w, token_rows, chunk_counts,
                       block_counts) -> None:
    from padded_moe.kernels.ep import _local_flat_kernel

    w, dev = geo.wire, hidden.device
    m, K = hidden.shape[0], w.hidden_size
    hidden = _unit_stride_rows(hidden)
    _, bt, nb, nb_max, routed = _pack_blocks(m, geo.max_tokens, dev)
    if routed and block_counts is None:
        raise ValueError("local_flat: block_counts (the route counts of pack_rows) is needed above "
                         f"{PACK_ONE_BLOCK_TOKENS} tokens")
    tile = _tile("local_flat", dev)
    if w.fp8 and w.scale_group != K:
        bk = FP8_BLOCK
    else:
        bk = min(_next_pow2(max(K, 1)), (1024 // rb_x.element_size()) if dev.type == "cuda" else 256)
    bc = block_counts if routed else token_rows
    _local_flat_kernel[(_capped_grid(dev, nb),)](
        hidden, hidden.stride(0), topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        topk_weights, topk_weights.stride(0), topk_weights.stride(1), owner, bc,
        rb_x, rb_x.stride(0), rb_ids, rb_ids.stride(0), rb_w, rb_w.stride(0), token_rows, chunk_counts,
        me, m, geo.max_tokens, geo.num_experts, K, nb, bc.stride(0), geo.rows,
        TOP_K=w.top_k, KP=_next_pow2(w.top_k), BT=bt, BK=bk, NBP=_next_pow2(nb_max), ROUTED=routed,
        FP8=w.fp8, ROW_SCALE=w.fp8 and w.scale_group == K, num_warps=tile.num_warps)


def receive_batched(geo: EPGeometry, recv_wire, chunk_counts, in_band: bool, expert_table, num_local: int,
                    slab, counts, slot_rows, slot_weights, *, skip_peer: int = -1) -> None:
    """Scatter every (received row, local expert) pair into the expert's slab (`slab` rows
    `e*R*T + pos`, one row per (token, expert) even when ids repeat), counting on from `counts`
    (zero before the first writer: the pack step zeroes it), and record each slot's slab row in
    `slot_rows` (-1 for non-local slots) and its router weight in `slot_weights` (0 there); rows of
    padding are untouched. `skip_peer` >= 0: that chunk is not read (`local_batched` did it)."""
    if use_triton(recv_wire.device):
        _receive_batched_triton(geo, recv_wire, chunk_counts, in_band, expert_table, slab, counts, slot_rows,
                                slot_weights, skip_peer)
    else:
        _receive_batched_torch(geo, recv_wire, chunk_counts, in_band, expert_table, num_local, slab, counts,
                               slot_rows, slot_weights, skip_peer)


def _append_to_slabs_torch(local, x_rows, L, slab, counts, slot_rows, slot_weights, weights, rows_of) -> None:
    """torch path of the slab scatter: `local` [n, k] local expert per slot (L = not local),
    `x_rows` [n, K] the rows, written at `rows_of` [n] of slot_rows / slot_weights."""
    slab_rows = slab.shape[0] - 1 if L == 0 else (slab.shape[0] - 1) // L
    keep = local < L
    slot_weights[rows_of] = torch.where(keep, weights.float(), torch.zeros((), device=weights.device))
    if L == 0:
        slot_rows[rows_of] = -1
        return
    present = torch.zeros(local.shape[0], L + 1, dtype=torch.int32, device=local.device)
    present.scatter_(1, local, 1)       # one row per (token, expert) even if ids repeat
    present = present[:, :L]
    pos = counts.view(1, L) + torch.cumsum(present, 0, dtype=torch.int32) - 1   # [n, L]
    counts += present.sum(0, dtype=torch.int32)
    slot_pos = pos.gather(1, local.clamp(max=L - 1)).long()
    srow = torch.where(keep, local * slab_rows + slot_pos, torch.full_like(local, -1))
    slot_rows[rows_of] = srow.to(torch.int32)
    dump = L * slab_rows
    for j in range(local.shape[1]):  # k row copies; non-local slots land on the dump row
        slab.index_copy_(0, torch.where(keep[:, j], srow[:, j], dump), x_rows)


def _receive_batched_torch(geo, recv_wire, chunk_counts, in_band, expert_table, L, slab, counts, slot_rows,
                           slot_weights, skip_peer=-1):
    k, rows, T, dev = geo.wire.top_k, geo.rows, geo.max_tokens, recv_wire.device
    _, meta_i, meta_f = geo.wire.views(recv_wire)
    cnt = _received_counts_torch(geo, meta_i, chunk_counts, in_band, skip_peer)
    valid = _valid_recv_rows_torch(geo, cnt, in_band)
    if skip_peer >= 0:
        valid &= torch.arange(rows, device=dev) // T != skip_peer
    src = torch.nonzero(valid).flatten()
    ids = meta_i[:, :k].index_select(0, src)
    local = sanitize_torch(ids, geo.num_experts, L, expert_table, None).long()  # [n, k], L = dropped
    _append_to_slabs_torch(local, _decode_rows_torch(geo, recv_wire, src), L, slab, counts, slot_rows,
                           slot_weights, meta_f[:, k:2 * k].index_select(0, src), src)


def _receive_batched_triton(geo, recv_wire, chunk_counts, in_band, expert_table, slab, counts, slot_rows,
                            slot_weights, skip_peer):
    from padded_moe.kernels.ep import _recv_batched_kernel

    R, T, w, dev = geo.ep_size, geo.max_tokens, geo.wire, recv_wire.device
    peers = R - (1 if skip_peer >= 0 else 0)
    if peers == 0:
        return
    x, meta_i, meta_f = w.views(recv_wire)
    tile = _tile("recv_batched", dev)  # no split along K (positions come from atomics)
    bt = tile.rows
    nb = _cdiv(T, bt)
    bk, _, _ = _fp8_tiles(geo, dev, peers * nb, slab.element_size(), split=False)
    _recv_batched_kernel[(peers * nb,)](
        x, x.stride(0), meta_i, meta_f, meta_i.stride(0), chunk_counts, expert_table,
        slab, slab.stride(0), counts, slot_rows, slot_weights, slot_rows.stride(0),
        T, geo.num_experts, w.hidden_size, nb, geo.rows, skip_peer,
        R=R, RP=_next_pow2(R), TOP_K=w.top_k, KP=_next_pow2(w.top_k), BT=bt, BK=bk,
        COUNT_COL=w.count_col, SCALE_COL=w.scale_col, IN_BAND=in_band, FP8=w.fp8,
        ROW_SCALE=w.fp8 and w.scale_group == w.hidden_size, GROUP=w.scale_group if w.fp8 else 1,
        num_warps=tile.num_warps)


def local_batched(hidden, topk_ids, topk_weights, geo: EPGeometry, me: int, expert_table, num_local: int,
                  slab, counts, slot_rows, slot_weights, token_rows, chunk_counts) -> None:
    """This rank's own tokens straight into its slabs, as if they were chunk `me` of the receive
    buffer with token t at row `me*T + t` (they never travel): the slab scatter of
    `receive_batched` (counting on from `counts`), `slot_rows / slot_weights[me*T + t]`,
    `token_rows[me, t]` (`me*T + t`, or the pad `R*T` when token t has no local slot) and
    `chunk_counts[me] = m`. An fp8 wire's rounding is applied all the same (e4m3(x/s)·s), so a
    result never depends on where its expert lives."""
    if use_triton(hidden.device):
        _local_batched_triton(hidden, topk_ids, topk_weights, geo, me, expert_table, slab, counts, slot_rows,
                              slot_weights, token_rows, chunk_counts)
    else:
        _local_batched_torch(hidden, topk_ids, topk_weights, geo, me, expert_table, num_local, slab, counts,
                             slot_rows, slot_weights, token_rows, chunk_counts)


def _local_batched_torch(hidden, topk_ids, topk_weights, geo, me, expert_table, L, slab, counts, slot_rows,
                         slot_weights, token_rows, chunk_counts) -> None:
    m, T, dev = hidden.shape[0], geo.max_tokens, hidden.device
    chunk_counts[me] = m
    if m == 0:
        return
    local = sanitize_torch(topk_ids, geo.num_experts, L, expert_table, None).long()   # [m, k], L = dropped
    t = torch.arange(m, device=dev)
    token_rows[me, :m] = torch.where((local < L).any(1), me * T + t, geo.rows).to(torch.int32)
    x = hidden
    if geo.wire.fp8:
        q, scales = _quantize_fp8(hidden)
        x = _dequantize_fp8(q, scales, hidden.dtype)
    _append_to_slabs_torch(local, x.to(slab.dtype), L, slab, counts, slot_rows, slot_weights, topk_weights,
                           me * T + t)


def _local_batched_triton(hidden, topk_ids, topk_weights, geo, me, expert_table, slab, counts, slot_rows,
                          slot_weights, token_rows, chunk_counts) -> None:
    from padded_moe.kernels.ep import _local_batched_kernel

    w, dev = geo.wire, hidden.device
    m, K = hidden.shape[0], w.hidden_size
    hidden = _unit_stride_rows(hidden)
    tile = _tile("local_batched", dev)
    bt = tile.rows
    if w.fp8 and w.scale_group != K:
        bk = FP8_BLOCK
    else:
        bk = min(_next_pow2(max(K, 1)), (1024 // slab.element_size()) if dev.type == "cuda" else 256)
    nb = max(1, _cdiv(m, bt))
    _local_batched_kernel[(_capped_grid(dev, nb),)](
        hidden, hidden.stride(0), topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        topk_weights, topk_weights.stride(0), topk_weights.stride(1), expert_table,
        slab, slab.stride(0), counts, slot_rows, slot_weights, slot_rows.stride(0),
        token_rows, chunk_counts, me, m, geo.max_tokens, geo.num_experts, K, geo.rows, geo.rows, nb,
        TOP_K=w.top_k, KP=_next_pow2(w.top_k), BT=bt, BK=bk, FP8=w.fp8,
        ROW_SCALE=w.fp8 and w.scale_group == K, num_warps=tile.num_warps)


# ---------------------------------------------------------------------------------------- combine
def combine_flat_rows(geo: EPGeometry, chunk_counts, expert_out, comb_send, *, own: int = -1) -> None:
    """Graph-safe flat combine: `comb_send[r*T + p] = expert_out[start_r + p]` for `p < count_r`
    (compacted rows back into chunk order; other rows untouched). `own` >= 0: that chunk came
    first in the compaction and stays where it is (the reduction reads it from `expert_out`)."""
    if use_triton(expert_out.device):
        from padded_moe.kernels.ep import _combine_flat_kernel

        expert_out = _unit_stride_rows(expert_out)

        R, T, K, dev = geo.ep_size, geo.max_tokens, geo.wire.hidden_size, expert_out.device
        chunks = R - (1 if own >= 0 else 0)
        if chunks == 0:
            return
        tile = _tile("combine_flat", dev)
        bt = tile.rows
        nb = _cdiv(T, bt)
        bk, kpp, ks = _k_tiles(dev, K, expert_out.element_size(), chunks * nb, per_sm=tile.per_sm)
        _combine_flat_kernel[(chunks * nb, ks)](
            expert_out, expert_out.stride(0), chunk_counts, comb_send, comb_send.stride(0),
            T, K, kpp, nb, own, R=R, RP=_next_pow2(R), BT=bt, BK=bk, num_warps=tile.num_warps)
        return
    R, T = geo.ep_size, geo.max_tokens
    cnt = chunk_counts.long().clamp(0, T)
    order = torch.tensor(_compaction_order(R, own), device=cnt.device)
    pre = torch.empty_like(cnt)
    pre[order] = torch.cumsum(cnt[order], 0) - cnt[order]
    i = torch.arange(geo.rows, device=cnt.device)
    r, p = i // T, i % T
    valid = (p < cnt[r]) & (r != own)
    src = torch.where(valid, pre[r] + p, torch.zeros_like(p))
    comb_send.copy_(torch.where(valid.unsqueeze(1), expert_out.index_select(0, src), comb_send))


def combine_batched_rows(geo: EPGeometry, chunk_counts, graph_safe: bool, slot_rows, slot_weights,
                         expert_out, comb_send, *, skip_peer: int = -1, only_peer: int = -1) -> None:
    """Batched combine, receiver side: `comb_send[i] = Σ_j slot_weights[i,j] · Y[slot_rows[i,j]]`
    over the local slots of every valid received row `i` (fp32). `skip_peer` / `only_peer` >= 0:
    every chunk but that one / that chunk alone (the overlapped combine does its own chunk while
    the others travel)."""
    if use_triton(expert_out.device):
        _combine_batched_triton(geo, chunk_counts, graph_safe, slot_rows, slot_weights, expert_out, comb_send,
                                skip_peer, only_peer)
        return
    k, K, rows, T = geo.wire.top_k, geo.wire.hidden_size, geo.rows, geo.max_tokens
    cnt = chunk_counts.long().clamp(0, T)
    valid = _valid_recv_rows_torch(geo, cnt, graph_safe)
    chunk = torch.arange(rows, device=valid.device) // T  # graph-safe rows; exact mode never selects
    if skip_peer >= 0:
        valid &= chunk != skip_peer
    if only_peer >= 0:
        valid &= chunk == only_peer
    flat = expert_out.reshape(-1, K)
    acc = torch.zeros(rows, K, dtype=torch.float32, device=expert_out.device)
    if flat.shape[0]:
        for j in range(k):
            sr = slot_rows[:, j].long()
            keep = (valid & (sr >= 0)).unsqueeze(1)
            y = flat.index_select(0, torch.where(keep[:, 0], sr, 0)).float() * slot_weights[:, j:j + 1]
            # where, not a multiply by 0: rows past a count may hold NaN and must not leak.
            acc += torch.where(keep, y, torch.zeros((), device=acc.device))
    comb_send.copy_(torch.where(valid.unsqueeze(1), acc.to(comb_send.dtype), comb_send))


def _combine_batched_triton(geo, chunk_counts, graph_safe, slot_rows, slot_weights, expert_out, comb_send,
                            skip_peer, only_peer) -> None:
    from padded_moe.kernels.ep import _combine_batched_kernel

    expert_out = _unit_stride_rows(expert_out)
    R, T, w, dev = geo.ep_size, geo.max_tokens, geo.wire, expert_out.device
    chunks = 1 if only_peer >= 0 else R - (1 if skip_peer >= 0 else 0)
    if chunks == 0:
        return
    own = only_peer >= 0  # the overlapped call: a capped grid (see EP_TILES)
    tile = _tile("combine_own" if own else "combine_batched", dev)
    bt = tile.rows
    nb = _cdiv(T, bt)
    bk, kpp, ks = _k_tiles(dev, w.hidden_size, expert_out.element_size(), chunks * nb, per_sm=tile.per_sm)
    grid0 = _capped_grid(dev, chunks * nb, ks) if own else chunks * nb
    _combine_batched_kernel[(grid0, ks)](
        expert_out, expert_out.stride(0), expert_out.stride(1), expert_out.shape[1], chunk_counts,
        slot_rows, slot_weights, slot_rows.stride(0), comb_send, comb_send.stride(0),
        T, w.hidden_size, kpp, nb, chunks * nb, skip_peer, only_peer,
        R=R, RP=_next_pow2(R), TOP_K=w.top_k, BT=bt, BK=bk, GRAPH_SAFE=graph_safe,
        num_warps=tile.num_warps)


def reduce_partials(geo: EPGeometry, comb_recv, token_rows, m: int, out, *, self_rank: int = -1,
                    own_rows: Optional[torch.Tensor] = None) -> None:
    """Sender side: `out[t] = Σ_r partial_r[token_rows[r, t]]` over peers that got token t (fp32);
    partials come from `comb_recv`, except this rank's own (`self_rank` >= 0), which never
    travelled: rows of `own_rows` (batched: the combine send buffer; flat: the expert output)."""
    R, rows, K = geo.ep_size, geo.rows, geo.wire.hidden_size
    if self_rank >= 0 and own_rows is None:
        raise ValueError("reduce_partials: self_rank >= 0 needs own_rows (where that partial stayed)")
    if m == 0:
        return
    if use_triton(out.device):
        from padded_moe.kernels.ep import _reduce_kernel

        dev = out.device
        tile = _tile("reduce", dev)
        bt = tile.rows
        nb = _cdiv(m, bt)
        bk, kpp, ks = _k_tiles(dev, K, out.element_size(), nb, per_sm=tile.per_sm)
        own = _unit_stride_rows(own_rows) if own_rows is not None else comb_recv
        _reduce_kernel[(nb, ks)](comb_recv, comb_recv.stride(0), own, own.stride(0), token_rows, token_rows.stride(0),
                                 out, out.stride(0), m, K, kpp, rows, self_rank, R=R, BT=bt, BK=bk,
                                 num_warps=tile.num_warps)
        return
    tr = token_rows[:, :m].long()
    keep = (tr >= 0) & (tr < rows)
    idx = torch.where(keep, tr, torch.zeros_like(tr))
    parts = torch.stack([(own_rows if r == self_rank else comb_recv).index_select(0, idx[r]) for r in range(R)])
    out.copy_(torch.where(keep.unsqueeze(-1), parts.float(), torch.zeros((), device=out.device)).sum(0))


class ExpertParallel:
    """Dispatch tokens to the ranks owning their experts and combine the results (spec 04).

    Args: `group` (a process group, None = WORLD), `num_experts` E, `top_k` k, `hidden_size` K,
    `max_tokens_per_rank` T (every `dispatch` takes `m <= T` tokens; `m` may differ per rank and
    be 0). `mode` "flat" or "batched"; `placement` of experts over ranks ("linear" or
    "round_robin"); `dtype` of hidden states and expert outputs; `graph_safe` (False: exact
    counts with one host sync); `dispatch_dtype` (None = `dtype`, or torch.float8_e4m3fn to send
    fp8 rows with per-128-channel scales; deferred to the backend in flat mode when the backend
    quantizes its own inputs); `backend` (name or object with `quantizes_inputs`, only used for
    that decision); `device` (default: the current CUDA device for NCCL groups, else CPU).

    Only one dispatch may be in flight: a new `dispatch` overwrites the receive buffers.
    """

    def __init__(self, group, num_experts: int, top_k: int, hidden_size: int,
                 max_tokens_per_rank: int, *, mode: str = "flat", placement: str = "linear",
                 dtype: torch.dtype = torch.bfloat16, graph_safe: bool = True,
                 dispatch_dtype: Optional[torch.dtype] = None, backend: object = None,
                 device: Union[str, torch.device, None] = None):
        # The unsupported combination is refused first, before any other check (conventions).
        fp8_requested = dispatch_dtype in FP8_WIRE_DTYPES
        quantizing_backend = _backend_quantizes_inputs(backend)
        if mode == "batched" and fp8_requested and quantizing_backend:
            raise NotImplementedError(
                f"ExpertParallel(mode='batched', dispatch_dtype={dispatch_dtype}) with backend "
                f"{backend!r}: the low-latency (batched) dispatch quantizes activations to fp8 before "
                f"sending, but this backend quantizes its own inputs (quantizes_inputs=True), and "
                f"low-latency dispatch does not support deferred input quantization. Use mode='flat' "
                f"(it sends {dtype} rows and lets the backend quantize after the exchange).")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
        if dispatch_dtype not in (None, dtype, *FP8_WIRE_DTYPES):
            raise ValueError(
                f"dispatch_dtype must be None, dtype ({dtype}) or one of {FP8_WIRE_DTYPES}, got {dispatch_dtype}")
        self.num_experts = require_int("num_experts", num_experts)
        self.top_k = require_int("top_k", top_k)
        self.hidden_size = require_int("hidden_size", hidden_size)
        self.max_tokens_per_rank = require_int("max_tokens_per_rank", max_tokens_per_rank)
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallel needs torch.distributed to be initialized "
                               "(dist.init_process_group) before construction")
        self.group = group
        self.mode = mode
        self.dtype = dtype
        self.graph_safe = bool(graph_safe)
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.device = torch.device(device) if device is not None else _default_device(group)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" != "cuda:0" in comparisons
            self.device = torch.device("cuda", torch.cuda.current_device())
        # flat mode + a quantizing backend: deferred quantization, so the wire keeps `dtype`.
        self.fp8_wire = fp8_requested and not (mode == "flat" and quantizing_backend)
        self.wire_dtype = torch.float8_e4m3fn if self.fp8_wire else dtype
        self.wire = WireFormat(self.hidden_size, self.top_k, dtype, self.fp8_wire)
        self.geometry = EPGeometry(self.ep_size, self.max_tokens_per_rank, num_experts, self.wire)

        self.expert_map = ExpertMap(num_experts, self.ep_rank, self.ep_size, placement, device=self.device)
        self.num_local = self.expert_map.num_local
        self._owner = self._owner_table(num_experts, self.ep_size, placement).to(self.device)
        self._map = self.expert_map.map_for(self.device)
        self._alloc_buffers()

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _owner_table(num_experts: int, ep_size: int, placement: str) -> torch.Tensor:
        """int32 [E]: the rank owning each global expert (every rank builds the same table)."""
        owner = torch.full((num_experts,), -1, dtype=torch.int32)
        for r in range(ep_size):
            owned = ExpertMap(num_experts, r, ep_size, placement).map >= 0
            owner[owned] = r
        if bool((owner < 0).any()):  # pragma: no cover - ExpertMap covers every expert
            raise RuntimeError("expert placement left experts without an owner")
        return owner

    def _alloc_buffers(self) -> None:
        R, T, K, k = self.ep_size, self.max_tokens_per_rank, self.hidden_size, self.top_k
        L, dev, rows = self.num_local, self.device, self.ep_size * self.max_tokens_per_rank
        self._bufs: dict[str, torch.Tensor] = {}

        def buf(name, shape, dtype, fill=None):
            t = torch.empty(shape, dtype=dtype, device=dev) if fill is None else \
                torch.full(shape, fill, dtype=dtype, device=dev)
            self._bufs[name] = t
            return t

        # One raw buffer per direction: wire rows (x + in-band meta) for dispatch, [rows, K] `dtype`
        # rows for combine over the same storage (free again once the dispatch all_to_all ran).
        tb = self.wire.buffer_row_bytes
        self._send = buf("send", (rows, tb), torch.uint8)
        self._recv = buf("recv", (rows, tb), torch.uint8)
        self._send_wire = self.wire.wire_rows(self._send, rows)
        self._recv_wire = self.wire.wire_rows(self._recv, rows)
        self._comb_send = self.wire.combine_rows(self._send, rows)
        self._comb_recv = self.wire.combine_rows(self._recv, rows)
        self._token_rows = buf("token_rows", (R, T), torch.int32, fill=rows)
        self._chunk_counts = buf("chunk_counts", (R,), torch.int32, fill=0)
        self._route_counts = buf("route_counts", (R, route_block_columns(T)), torch.int32, fill=0)
        # Graph-safe on the kernels' path, with peers: this rank's own chunk never travels
        # (local_batched / local_flat fill the receive side while the peers' chunks are in flight),
        # so the exchanges take per-peer views. The torch path (the reference) keeps the plain
        # source-rank order of received rows, which graph_safe=False has too: CPU BLAS results may
        # depend on a row's position.
        self._keeps_own_chunk = self.graph_safe and R > 1 and use_triton(dev) and T >= _overlap_min_tokens()
        me = self.ep_rank

        def peer_views(full):
            return [c if d != me else c[:0] for d, c in enumerate(full.split(T))]

        self._send_chunks, self._recv_chunks = peer_views(self._send_wire), peer_views(self._recv_wire)
        self._comb_send_chunks, self._comb_recv_chunks = peer_views(self._comb_send), peer_views(self._comb_recv)
        self._side_stream = torch.cuda.Stream(self.device) if dev.type == "cuda" and self._keeps_own_chunk else None
        if self.mode == "flat":
            self._rb_x = buf("rb_x", (rows, K), self.dtype)
            self._rb_ids = buf("rb_topk_ids", (rows, k), torch.int32, fill=-1)
            self._rb_w = buf("rb_topk_weights", (rows, k), torch.float32, fill=0)
            self._rb_valid = buf("rb_valid_tokens", (1,), torch.int32, fill=0)
        else:
            # Slabs plus one dump row that absorbs the torch path's writes of non-local slots.
            self._slab = buf("rb_x", (L * rows + 1, K), self.dtype)
            self._counts = buf("rb_counts", (L,), torch.int32, fill=0)
            self._slot_rows = buf("slot_rows", (rows, k), torch.int32, fill=-1)
            self._slot_weights = buf("slot_weights", (rows, k), torch.float32, fill=0)

    def buffers(self) -> dict:
        """Every persistent buffer this object reserved, by name (the planner sizes the same set)."""
        return dict(self._bufs)

    def buffer_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._bufs.values())

    # ------------------------------------------------------------------ checks
    def _check_dispatch(self, hidden, topk_ids, topk_weights) -> int:
        require_tensor("hidden", hidden)
        require_tensor("topk_ids", topk_ids)
        require_tensor("topk_weights", topk_weights)
        if hidden.dtype != self.dtype:
            raise TypeError(f"hidden must have the ExpertParallel dtype {self.dtype}, got {hidden.dtype}")
        require_dtype("topk_ids", topk_ids, INDEX_DTYPES)
        require_dtype("topk_weights", topk_weights, FLOAT_DTYPES)
        require_rank("hidden", hidden, (2,))
        m = hidden.shape[0]
        require_shape("hidden", hidden, (m, self.hidden_size))
        require_shape("topk_ids", topk_ids, (m, self.top_k))
        require_shape("topk_weights", topk_weights, (m, self.top_k))
        if m > self.max_tokens_per_rank:
            raise ValueError(
                f"hidden has {m} tokens, more than max_tokens_per_rank={self.max_tokens_per_rank} "
                f"reserved by this ExpertParallel")
        if hidden.device != self.device:
            raise ValueError(f"hidden must be on the ExpertParallel device {self.device}, got {hidden.device}")
        require_same_device("topk_ids", topk_ids, "hidden", hidden)
        require_same_device("topk_weights", topk_weights, "hidden", hidden)
        return m

    def _check_combine(self, expert_out, handle) -> None:
        if not isinstance(handle, DispatchHandle) or handle.owner is not self:
            raise TypeError("handle must be the DispatchHandle returned by this ExpertParallel's dispatch")
        require_tensor("expert_out", expert_out)
        if expert_out.dtype != self.dtype:
            raise TypeError(f"expert_out must have the ExpertParallel dtype {self.dtype}, got {expert_out.dtype}")
        rows = self.ep_size * self.max_tokens_per_rank
        want = (rows, self.hidden_size) if self.mode == "flat" else (self.num_local, rows, self.hidden_size)
        require_shape("expert_out", expert_out, want)
        if expert_out.device != self.device:
            raise ValueError(f"expert_out must be on {self.device}, got {expert_out.device}")

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> tuple[ReceiveBuffer, DispatchHandle]:
        """Send every token to the ranks owning their experts; collective (every rank calls it)."""
        m = self._check_dispatch(hidden, topk_ids, topk_weights)
        geo = self.geometry
        send_counts = recv_counts = send_base = None
        if not self.graph_safe:
            send_counts, recv_counts = self._exchange_counts(peer_counts(topk_ids, self._owner, geo))
            send_base = torch.tensor(_exclusive_cumsum(send_counts), dtype=torch.int32, device=self.device)
        batched = self.mode == "batched"
        handle = DispatchHandle(self, self.mode, m, self._token_rows,
                                send_counts=send_counts, recv_counts=recv_counts)
        if self._keeps_own_chunk and not batched:
            self._dispatch_flat_overlapped(hidden, topk_ids, topk_weights)
            return ReceiveBuffer("flat", self._rb_x, topk_ids=self._rb_ids, topk_weights=self._rb_w,
                                 valid_tokens=self._rb_valid), handle
        if self._keeps_own_chunk:
            self._dispatch_overlapped(hidden, topk_ids, topk_weights)
        else:
            pack_rows(hidden, topk_ids, topk_weights, self._owner, geo, self._send_wire, self._token_rows,
                      send_base, zero_counts=self._counts if batched else None, block_counts=self._route_counts)
            self._all_to_all(self._recv_wire, self._send_wire, send_counts, recv_counts)
        if not batched:
            receive_flat(geo, self._recv_wire, self._chunk_counts, self.graph_safe,
                         self._rb_x, self._rb_ids, self._rb_w, self._rb_valid)
            return ReceiveBuffer("flat", self._rb_x, topk_ids=self._rb_ids, topk_weights=self._rb_w,
                                 valid_tokens=self._rb_valid), handle
        if not self._keeps_own_chunk:
            receive_batched(geo, self._recv_wire, self._chunk_counts, self.graph_safe, self._map, self.num_local,
                            self._slab, self._counts, self._slot_rows, self._slot_weights)
        x = self._slab[: self.num_local * geo.rows].view(self.num_local, geo.rows, self.hidden_size)
        return ReceiveBuffer("batched", x, counts=self._counts), handle

    def _dispatch_overlapped(self, hidden, topk_ids, topk_weights) -> None:
        """Batched, graph-safe: pack the peers' chunks, and while they travel put this rank's own
        tokens into the slabs (`local_batched`); then scatter what arrived."""
        geo, me = self.geometry, self.ep_rank
        pack_rows(hidden, topk_ids, topk_weights, self._owner, geo, self._send_wire, self._token_rows,
                  zero_counts=self._counts, skip_peer=me, block_counts=self._route_counts)
        self._overlap(
            lambda: self._exchange_peer_chunks(self._recv_chunks, self._send_chunks, self._recv_wire, self._send_wire),
            lambda: local_batched(hidden, topk_ids, topk_weights, geo, me, self._map, self.num_local, self._slab,
                                  self._counts, self._slot_rows, self._slot_weights, self._token_rows,
                                  self._chunk_counts))
        receive_batched(geo, self._recv_wire, self._chunk_counts, True, self._map, self.num_local, self._slab,
                        self._counts, self._slot_rows, self._slot_weights, skip_peer=me)

    def _dispatch_flat_overlapped(self, hidden, topk_ids, topk_weights) -> None:
        """Flat, graph-safe: pack the peers' chunks, and while they travel put this rank's own
        tokens at the front of the receive rows (`local_flat`); then compact what arrived after them."""
        geo, me = self.geometry, self.ep_rank
        pack_rows(hidden, topk_ids, topk_weights, self._owner, geo, self._send_wire, self._token_rows,
                  skip_peer=me, block_counts=self._route_counts)
        self._overlap(
            lambda: self._exchange_peer_chunks(self._recv_chunks, self._send_chunks, self._recv_wire, self._send_wire),
            lambda: local_flat(hidden, topk_ids, topk_weights, self._owner, geo, me, self._rb_x, self._rb_ids,
                               self._rb_w, self._token_rows, self._chunk_counts, self._route_counts))
        receive_flat(geo, self._recv_wire, self._chunk_counts, True, self._rb_x, self._rb_ids, self._rb_w,
                     self._rb_valid, own=me)

    def _overlap(self, transfer, local) -> None:
        """`transfer` (a collective) and `local` (kernels) at the same time: on CUDA the collective
        is issued from a side stream, which the current stream joins afterwards (capturable in a
        CUDA graph); elsewhere one after the other."""
        if self._side_stream is None:
            transfer()
            local()
            return
        main = torch.cuda.current_stream(self.device)
        self._side_stream.wait_stream(main)
        with torch.cuda.stream(self._side_stream):
            transfer()
        local()
        main.wait_stream(self._side_stream)

    def _exchange_peer_chunks(self, recv_chunks, send_chunks, recv_full, send_full) -> None:
        """Graph-safe exchange of every chunk but one's own: NCCL gets per-peer views with an empty
        own chunk (it moves nothing to itself); gloo, which has no list all_to_all, moves the whole
        buffers (the own chunk's bytes then arrive but are never read)."""
        if self.ep_size == 1:
            return
        if dist.get_backend(self.group) == "nccl":
            dist.all_to_all(recv_chunks, send_chunks, group=self.group)
        else:
            dist.all_to_all_single(recv_full, send_full, group=self.group)

    def _exchange_counts(self, counts: torch.Tensor) -> tuple[list, list]:
        """graph_safe=False: per-peer row counts both ways (the one host synchronisation); the
        received counts also land in `chunk_counts` for the receive and combine steps."""
        counts = counts.to(torch.int64).contiguous()
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        self._chunk_counts.copy_(recv.to(torch.int32))
        both = torch.cat([counts, recv]).tolist()
        return both[: self.ep_size], both[self.ep_size:]

    def _all_to_all(self, recv: torch.Tensor, send: torch.Tensor, send_counts, recv_counts) -> None:
        """One all_to_all of row chunks: fixed `T`-row chunks, or the exact splits."""
        if send_counts is None:
            dist.all_to_all_single(recv, send, group=self.group)
            return
        dist.all_to_all_single(recv[: sum(recv_counts)], send[: sum(send_counts)], recv_counts, send_counts,
                               group=self.group)

    # ------------------------------------------------------------------ combine
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Return each rank's partial outputs to the token owners and sum them: `[m, K]`."""
        self._check_combine(expert_out, handle)
        if self._keeps_own_chunk:
            if self.mode == "flat":
                return self._combine_flat_own(expert_out, handle)
            return self._combine_overlapped(expert_out, handle)
        geo = self.geometry
        exact = handle.send_counts is not None
        if self.mode == "flat":
            if exact:  # received rows were already the prefix: return them as they are
                send = expert_out[: sum(handle.recv_counts)].contiguous()
            else:
                combine_flat_rows(geo, self._chunk_counts, expert_out, self._comb_send)
                send = self._comb_send
        else:
            combine_batched_rows(geo, self._chunk_counts, not exact, self._slot_rows, self._slot_weights,
                                 expert_out, self._comb_send)
            send = self._comb_send
        # The sender's combine rows mirror its dispatch rows, so the splits swap.
        self._all_to_all(self._comb_recv, send, handle.recv_counts, handle.send_counts)
        return self._reduce(handle)

    def _combine_flat_own(self, expert_out, handle) -> torch.Tensor:
        """Flat, graph-safe, own chunk kept: only the peers' rows go back into chunk order and
        travel; the own rows stay in expert_out, where the reduction reads them (nothing to overlap)."""
        combine_flat_rows(self.geometry, self._chunk_counts, expert_out, self._comb_send, own=self.ep_rank)
        self._exchange_peer_chunks(self._comb_recv_chunks, self._comb_send_chunks, self._comb_recv, self._comb_send)
        return self._reduce(handle, own_rows=expert_out)

    def _combine_overlapped(self, expert_out, handle) -> torch.Tensor:
        """Batched, graph-safe: weigh the peers' rows, and while they travel back weigh this rank's
        own (they stay in the combine send buffer, in a chunk nobody transfers); then reduce."""
        geo, me = self.geometry, self.ep_rank
        combine_batched_rows(geo, self._chunk_counts, True, self._slot_rows, self._slot_weights, expert_out,
                             self._comb_send, skip_peer=me)
        self._overlap(
            lambda: self._exchange_peer_chunks(self._comb_recv_chunks, self._comb_send_chunks, self._comb_recv,
                                               self._comb_send),
            lambda: combine_batched_rows(geo, self._chunk_counts, True, self._slot_rows, self._slot_weights,
                                         expert_out, self._comb_send, only_peer=me))
        return self._reduce(handle, own_rows=self._comb_send)

    def _reduce(self, handle, own_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`[m, K]`: each token's partials summed; `own_rows` holds this rank's own when it never travelled."""
        m = handle.num_tokens
        out = torch.empty(m, self.hidden_size, dtype=self.dtype, device=self.device)
        reduce_partials(self.geometry, self._comb_recv, handle.token_rows, m, out,
                        self_rank=self.ep_rank if own_rows is not None else -1, own_rows=own_rows)
        return out


def _exclusive_cumsum(values: list) -> list:
    out, total = [], 0
    for v in values:
        out.append(total)
        total += v
    return out


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
