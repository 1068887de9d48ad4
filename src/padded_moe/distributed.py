"""Expert parallelism over torch.distributed (spec 04): dispatch → local experts → combine.

Transport: `all_to_all_single` only (NCCL on GPUs, gloo on CPU; gloo supports it, even and
uneven splits, in the torch versions we support). Every rank reserves, per peer, a chunk of
`T = max_tokens_per_rank` rows. A token goes to peer `d` once if at least one of its slots lives
on `d`; its row in chunk `d` carries the hidden state plus a small int32 "meta" row: the k global
ids (-1 for slots owned elsewhere), the k router weights (bit-cast to int32) and, for fp8 wire
format, the per-block scales. Valid rows are compacted to the front of each chunk, so a row is
padding exactly when all of its ids are -1.

Modes (both with fixed shapes for a fixed `T`, so dispatch → experts → combine captures in one
CUDA graph):

- flat: the receiver compacts the `R` chunks into `x [R*T, K]` whose rows `[0, valid_tokens)`
  are real (a device prefix sum + index gather, no host sync). The experts run with
  `fused_experts(..., expert_map=ep.expert_map, valid_tokens=rb.valid_tokens)`, whose guard
  drops the -1 slots and whose layout counts stop at `valid_tokens`, so no padding row is computed.
  `combine` gathers the expert output back into chunk order, returns it with one all_to_all, and
  the sender adds its `R` partial sums per token in float32.
- batched: the receiver scatters each (row, local expert) pair into per-expert slabs
  `x [L, R*T, K]` with `counts [L]` (a token routed twice to one expert occupies one row; both
  router weights are applied to it). Router weights are applied by `combine`.

`graph_safe=False` first exchanges the per-peer counts (one host sync) and moves only real rows
(uneven splits); received rows are then already a prefix in source-rank order, which is exactly
the order the graph-safe compaction produces, so the results are identical.

Buffers are reserved once at construction (`ExpertParallel.buffers()` lists them; the planner
sizes the same set). A `ReceiveBuffer` aliases them: it is valid until the next `dispatch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

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


@dataclass
class ReceiveBuffer:
    """What one rank's local experts compute on (views of the ExpertParallel's buffers).

    flat: `x [R*T, K]`, `topk_ids int32 [R*T, k]` (global ids of local slots, -1 elsewhere and on
    padding rows), `topk_weights float32 [R*T, k]`, `valid_tokens int32 [1]` (device).
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
    """What `combine` needs to route partial outputs back; small index tensors, fresh per call."""

    owner: "ExpertParallel"
    mode: str
    num_tokens: int
    # Sender side: row of the combine receive buffer holding peer d's partial sum for token t,
    # or the zero pad row `R*T` when token t sent nothing to d. int64 [R, m].
    token_rows: torch.Tensor
    # Receiver side, flat + graph-safe: for each chunk-order row, its compacted row (0 for padding).
    uncompact: Optional[torch.Tensor] = None
    # Receiver side, batched: slab row (e*R*T + pos) of every received slot, or L*R*T when the
    # slot is not local; `slot_keep` marks the local ones; `weights` their router weights.
    slot_rows: Optional[torch.Tensor] = None
    slot_keep: Optional[torch.Tensor] = None
    weights: Optional[torch.Tensor] = None
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


def fp8_scale_columns(hidden_size: int) -> int:
    """int32 meta columns holding fp8 scales: one per 128 channels (one per row if K % 128)."""
    return hidden_size // FP8_BLOCK if hidden_size % FP8_BLOCK == 0 else 1


def meta_columns(top_k: int, hidden_size: int, fp8_wire: bool) -> int:
    """int32 columns of a meta row: k ids, k weights (bit-cast), fp8 scales when quantizing."""
    return 2 * top_k + (fp8_scale_columns(hidden_size) if fp8_wire else 0)


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

        self.expert_map = ExpertMap(num_experts, self.ep_rank, self.ep_size, placement, device=self.device)
        self.num_local = self.expert_map.num_local
        self._owner = self._owner_table(num_experts, self.ep_size, placement).to(self.device)
        self._map = self.expert_map.map_for(self.device)
        self._alloc_buffers()

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _owner_table(num_experts: int, ep_size: int, placement: str) -> torch.Tensor:
        """int64 [E]: the rank owning each global expert (every rank builds the same table)."""
        owner = torch.full((num_experts,), -1, dtype=torch.int64)
        for r in range(ep_size):
            owned = ExpertMap(num_experts, r, ep_size, placement).map >= 0
            owner[owned] = r
        if bool((owner < 0).any()):  # pragma: no cover - ExpertMap covers every expert
            raise RuntimeError("expert placement left experts without an owner")
        return owner

    def _alloc_buffers(self) -> None:
        R, T, K, k = self.ep_size, self.max_tokens_per_rank, self.hidden_size, self.top_k
        L, dev, rows = self.num_local, self.device, self.ep_size * self.max_tokens_per_rank
        wire = torch.uint8 if self.fp8_wire else self.dtype  # fp8 travels as bytes (gloo/NCCL)
        cols = meta_columns(k, K, self.fp8_wire)
        self._bufs: dict[str, torch.Tensor] = {}

        def buf(name, shape, dtype, fill=None):
            t = torch.empty(shape, dtype=dtype, device=dev) if fill is None else \
                torch.full(shape, fill, dtype=dtype, device=dev)
            self._bufs[name] = t
            return t

        self._send_x = buf("send_x", (rows, K), wire)
        # One extra "pad" row: padding rows of the compacted receive buffer copy it, and combine's
        # sender reads it (zero) for peers a token was not sent to.
        self._recv_x = buf("recv_x", (rows + 1, K), wire, fill=0)
        self._send_meta = buf("send_meta", (rows, cols), torch.int32)
        self._recv_meta = buf("recv_meta", (rows + 1, cols), torch.int32, fill=0)
        self._recv_meta[rows, :k] = -1
        if self.fp8_wire:
            # Expert outputs travel back in `dtype`, so combine needs its own pair of buffers.
            self._comb_send = buf("combine_send", (rows, K), self.dtype)
            self._comb_recv = buf("combine_recv", (rows + 1, K), self.dtype, fill=0)
        else:
            self._comb_send, self._comb_recv = self._send_x, self._recv_x  # free after dispatch
        if self.mode == "flat":
            self._rb_x = buf("rb_x", (rows, K), self.dtype)
            self._rb_ids = buf("rb_topk_ids", (rows, k), torch.int32)
            self._rb_w = buf("rb_topk_weights", (rows, k), torch.float32)
            self._rb_valid = buf("rb_valid_tokens", (1,), torch.int32, fill=0)
        else:
            # Slabs plus one dump row that absorbs writes of non-local slots.
            self._slab = buf("rb_x", (L * rows + 1, K), self.dtype)
            self._counts = buf("rb_counts", (L,), torch.int32, fill=0)
            if self.fp8_wire:
                self._staging = buf("dequant_staging", (rows, K), self.dtype)

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
        """Send every token to the ranks owning its experts; collective (every rank calls it)."""
        m = self._check_dispatch(hidden, topk_ids, topk_weights)
        R, T = self.ep_size, self.max_tokens_per_rank
        owner = self._slot_owner(topk_ids)                                        # [m, k] in [0, R]
        sends = owner.unsqueeze(0) == torch.arange(R, device=self.device).view(R, 1, 1)  # [R, m, k]
        to_peer = sends.any(-1)                                                   # [R, m]
        pos = torch.cumsum(to_peer, dim=1) - 1                                    # row inside the chunk
        send_counts = recv_counts = None
        if self.graph_safe:
            base = torch.arange(R, device=self.device) * T
        else:
            send_counts, recv_counts = self._exchange_counts(to_peer.sum(1))
            base = torch.tensor(_exclusive_cumsum(send_counts), device=self.device)
        pad = R * T
        token_rows = torch.where(to_peer, base.view(R, 1) + pos, torch.full_like(pos, pad))  # [R, m]
        self._pack(hidden, topk_ids, topk_weights, owner, token_rows, m)
        self._exchange(self._send_x, self._recv_x, self._send_meta, self._recv_meta,
                       send_counts, recv_counts)
        handle = DispatchHandle(self, self.mode, m, token_rows,
                                send_counts=send_counts, recv_counts=recv_counts)
        if self.mode == "flat":
            rb = self._receive_flat(handle)
        else:
            rb = self._receive_batched(handle)
        return rb, handle

    def _slot_owner(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Owning rank of each slot; R for invalid ids. Range check before the table read."""
        E, R = self.num_experts, self.ep_size
        in_range = (topk_ids >= 0) & (topk_ids < E)
        safe = torch.where(in_range, topk_ids, torch.zeros((), dtype=topk_ids.dtype, device=topk_ids.device))
        owner = self._owner[safe.long()]
        return torch.where(in_range, owner, torch.full_like(owner, R))

    def _exchange_counts(self, counts: torch.Tensor) -> tuple[list, list]:
        """graph_safe=False: per-peer row counts both ways (the one host synchronisation)."""
        counts = counts.to(torch.int64).contiguous()
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        both = torch.cat([counts, recv]).tolist()
        return both[: self.ep_size], both[self.ep_size:]

    def _pack(self, hidden, topk_ids, topk_weights, owner, token_rows, m) -> None:
        """Fill the send buffers: chunk rows hold a token, its peer-masked ids, weights (, scales)."""
        R, T, k = self.ep_size, self.max_tokens_per_rank, self.top_k
        rows, dev = R * T, self.device
        meta = self._send_meta
        if m == 0:  # nothing to send: every row is padding (ids -1); x rows are never read
            meta[:, :k].fill_(-1)
            meta[:, k:].fill_(0)
            return
        # Invert token_rows: which token (and for which peer) fills each send row.
        flat_rows = token_rows.reshape(-1)
        src_tok = torch.zeros(rows + 1, dtype=torch.int64, device=dev)
        src_tok.scatter_(0, flat_rows, torch.arange(m, device=dev).repeat(R))
        row_peer = torch.full((rows + 1,), -1, dtype=torch.int64, device=dev)
        row_peer.scatter_(0, flat_rows, torch.arange(R, device=dev).repeat_interleave(m))
        src_tok, row_peer = src_tok[:rows], row_peer[:rows]  # drop the dump slot
        keep = owner.index_select(0, src_tok) == row_peer.unsqueeze(1)          # [rows, k]
        ids = topk_ids.index_select(0, src_tok)
        # ids kept are in [0, E): narrowing to int32 after the mask is safe.
        meta[:, :k] = torch.where(keep, ids, torch.full_like(ids, -1)).to(torch.int32)
        w = topk_weights.index_select(0, src_tok).to(torch.float32)
        meta[:, k:2 * k] = torch.where(keep, w, torch.zeros_like(w)).view(torch.int32)
        if self.fp8_wire:
            q, scales = _quantize_fp8(hidden.index_select(0, src_tok))
            self._send_x.copy_(q)
            meta[:, 2 * k:] = scales.view(torch.int32)
        else:
            torch.index_select(hidden, 0, src_tok, out=self._send_x)

    def _exchange(self, send_x, recv_x, send_meta, recv_meta, send_counts, recv_counts) -> None:
        """all_to_all of the row chunks (x and meta): fixed chunks, or exact splits."""
        rows, g = self.ep_size * self.max_tokens_per_rank, self.group
        if send_counts is None:
            dist.all_to_all_single(recv_x[:rows], send_x[:rows], group=g)
            if send_meta is not None:
                dist.all_to_all_single(recv_meta[:rows], send_meta[:rows], group=g)
            return
        n_send, n_recv = sum(send_counts), sum(recv_counts)
        dist.all_to_all_single(recv_x[:n_recv], send_x[:n_send], recv_counts, send_counts, group=g)
        if send_meta is not None:
            dist.all_to_all_single(recv_meta[:n_recv], send_meta[:n_send], recv_counts, send_counts, group=g)
            # Rows past what arrived are padding: make their ids -1 so the receive code below
            # treats them exactly like the padding of graph-safe chunks.
            recv_meta[n_recv:rows, : self.top_k].fill_(-1)

    def _decode_rows(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """out[i] = received row src[i] in `dtype` (dequantized when the wire is fp8)."""
        if self.fp8_wire:
            k = self.top_k
            q = self._recv_x.index_select(0, src)
            scales = self._recv_meta[:, 2 * k:].index_select(0, src).view(torch.float32)
            out.copy_(_dequantize_fp8(q, scales, self.dtype))
        else:
            torch.index_select(self._recv_x, 0, src, out=out)

    def _receive_flat(self, handle: DispatchHandle) -> ReceiveBuffer:
        """Compact the R received chunks so real rows form the prefix [0, valid_tokens)."""
        rows, k, dev = self.ep_size * self.max_tokens_per_rank, self.top_k, self.device
        ids = self._recv_meta[:rows, :k]
        valid = (ids >= 0).any(1)                                                  # [rows]
        dest = torch.cumsum(valid, 0) - 1
        src = torch.full((rows + 1,), rows, dtype=torch.int64, device=dev)     # default: pad row
        src.scatter_(0, torch.where(valid, dest, torch.full_like(dest, rows)),
                     torch.arange(rows, device=dev))
        src = src[:rows]
        self._decode_rows(src, self._rb_x)
        torch.index_select(self._recv_meta[:, :k], 0, src, out=self._rb_ids)
        torch.index_select(self._recv_meta[:, k:2 * k].view(torch.float32), 0, src, out=self._rb_w)
        self._rb_valid.copy_(valid.sum().view(1))
        handle.uncompact = torch.where(valid, dest, torch.zeros_like(dest))
        return ReceiveBuffer("flat", self._rb_x, topk_ids=self._rb_ids, topk_weights=self._rb_w,
                             valid_tokens=self._rb_valid)

    def _receive_batched(self, handle: DispatchHandle) -> ReceiveBuffer:
        """Scatter every (row, local expert) pair into that expert's slab; counts per expert."""
        R, T, k, L = self.ep_size, self.max_tokens_per_rank, self.top_k, self.num_local
        rows, dev = R * T, self.device
        ids = self._recv_meta[:rows, :k]
        local = sanitize_torch(ids, self.num_experts, L, self._map, None).long()  # [rows, k], L = dropped
        present = torch.zeros(rows, L + 1, dtype=torch.int32, device=dev)
        present.scatter_(1, local, 1)       # one row per (token, expert) even if ids repeat
        present = present[:, :L]
        pos = torch.cumsum(present, 0, dtype=torch.int32) - 1                      # [rows, L]
        self._counts.copy_(present.sum(0, dtype=torch.int32))
        keep = local < L
        slot_pos = pos.gather(1, local.clamp(max=max(L - 1, 0))).long()
        dump = L * rows
        slot_rows = torch.where(keep, local * rows + slot_pos, torch.full_like(local, dump))
        if self.fp8_wire:
            self._decode_rows(torch.arange(rows, device=dev), self._staging)
            x_rows = self._staging
        else:
            x_rows = self._recv_x[:rows]
        for j in range(k):  # k row copies; non-local slots land on the dump row
            self._slab.index_copy_(0, slot_rows[:, j], x_rows)
        handle.slot_rows, handle.slot_keep = slot_rows, keep
        handle.weights = self._recv_meta[:rows, k:2 * k].view(torch.float32).clone()
        x = self._slab[:dump].view(L, rows, self.hidden_size)
        return ReceiveBuffer("batched", x, counts=self._counts)

    # ------------------------------------------------------------------ combine
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Return each rank's partial outputs to the token owners and sum them: `[m, K]`."""
        self._check_combine(expert_out, handle)
        R, T, K = self.ep_size, self.max_tokens_per_rank, self.hidden_size
        rows = R * T
        exact = handle.send_counts is not None
        n_back = sum(handle.recv_counts) if exact else rows  # rows this rank returns
        if self.mode == "flat":
            if exact:  # received rows were already the prefix: return them as they are
                send = expert_out[:n_back]
            else:
                send = torch.index_select(expert_out, 0, handle.uncompact, out=self._comb_send)
        else:
            send = self._comb_send[:n_back]
            send.copy_(self._weighted_partials(expert_out, handle, n_back))
        if exact:
            n_recv = sum(handle.send_counts)
            dist.all_to_all_single(self._comb_recv[:n_recv], send, handle.send_counts,
                                   handle.recv_counts, group=self.group)
        else:
            dist.all_to_all_single(self._comb_recv[:rows], send, group=self.group)
        m = handle.num_tokens
        if m == 0:
            return torch.empty(0, K, dtype=self.dtype, device=self.device)
        # Peers a token skipped point at the zero pad row; sum the R partials in float32.
        parts = self._comb_recv.index_select(0, handle.token_rows.reshape(-1)).view(R, m, K)
        return parts.sum(0, dtype=torch.float32).to(self.dtype)

    def _weighted_partials(self, expert_out, handle, n) -> torch.Tensor:
        """Batched mode: Σ_j w[r,j]·Y[slot(r,j)] over local slots, fp32, for received rows [0, n)."""
        flat = expert_out.reshape(-1, self.hidden_size)
        last = flat.shape[0] - 1
        acc = torch.zeros(n, self.hidden_size, dtype=torch.float32, device=self.device)
        for j in range(self.top_k):
            rows_j = handle.slot_rows[:n, j].clamp(max=max(last, 0))
            y = flat.index_select(0, rows_j).float() * handle.weights[:n, j:j + 1]
            # where, not a multiply by 0: rows past a count may hold NaN and must not leak.
            acc += torch.where(handle.slot_keep[:n, j:j + 1], y, torch.zeros((), device=self.device))
        return acc


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
