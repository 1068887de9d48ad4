"""The orchestrator of expert parallelism: `ExpertParallel`.

`dispatch` runs pack → exchange → receive, `combine` runs combine → exchange → reduce; the stages
are `padded_moe.ep.stages`, the exchanges go through one `Transport` (`padded_moe.ep.transport`),
and every buffer comes from the buffer description `padded_moe.ep.wire.ep_buffer_specs`, which the
transport allocates. See `padded_moe.ep` for the whole design.

Modes (both with fixed shapes for a fixed `T`, so dispatch → experts → combine captures in one
CUDA graph):

- flat: the receiver compacts the `R` chunks into `x [R*T, K]` whose rows `[0, valid_tokens)`
  are real; ids of rows `[valid_tokens, R*T)` are -1 and their weights 0. The experts run with
  `fused_experts(..., expert_map=ep.expert_map, valid_tokens=rb.valid_tokens)`, whose guard drops
  the -1 slots and whose layout counts stop at `valid_tokens`, so no padding row is computed.
  `combine` copies the expert output back into chunk order, returns it with the combine
  exchange, and the sender adds its `R` partial rows per token in float32.
- batched: the receiver scatters each (row, local expert) pair into per-expert slabs
  `x [L, R*T, K]` with `counts [L]` (a token routed twice to one expert occupies one row; both
  router weights are applied to it). Router weights are applied by `combine`, on the receiver,
  before the rows travel back.

Where it runs: on CUDA (and on CPU with `TRITON_INTERPRET=1`) the Triton kernels of
`padded_moe.kernels.ep`; otherwise the torch functions of `padded_moe.ep.stages` (the CPU/gloo
path and the tests' reference). Launches per call, graph-safe:

- dispatch: `_route_count_kernel` (per token block and peer, only above PACK_ONE_BLOCK_TOKENS
  tokens), `_pack_kernel` (owner, position in the chunk, row copy / fp8 quantization, meta, count,
  `token_rows`; zeroes the batched counts), the dispatch exchange, then `_recv_flat_kernel` or
  `_recv_batched_kernel`;
- combine: `_combine_flat_kernel` or `_combine_batched_kernel`, the combine exchange, `_reduce_kernel`.

Graph-safe, on the kernels' path with peers and `T >= EP_OVERLAP_MIN_TOKENS` (or with
`keep_own_chunk=True`), when the transport `overlaps_own_chunk`: this rank's own chunk never enters
the exchange. The pack skips it; the exchange (`skip_own=True`) is issued from a side stream.
Meanwhile the own tokens go straight from `hidden` to the receive side (fp8 rounding applied all
the same):
- batched: `_local_batched_kernel` puts them into the slabs as received rows `rank*T + t`. In
  combine, the peers' rows are weighed first, and while they travel the own rows are weighed into the
  combine send buffer's own chunk, where the reduction reads them;
- flat: `_local_flat_kernel` writes them to the front of the receive rows, and the peers' chunks
  are compacted after them. Combine returns only the peers' rows, and the reduction reads the own
  partials from the expert output.
The overlapped kernels run on a grid that leaves `EP_FREE_SMS` SMs idle (else NCCL's CTAs wait for
them to drain). The own tokens then come first among the received rows; every row's result is
unchanged (and on CUDA the batched order already follows the atomics).

`graph_safe=False` first exchanges the per-peer counts (one host sync, `transport.exchange_counts`)
and moves only real rows (uneven splits, chunks back to back); received rows are then already a
prefix in source-rank order, which is exactly the order the graph-safe compaction produces, and
both variants run the same kernels, so the results are identical.

A `ReceiveBuffer` and a `DispatchHandle` alias the persistent buffers: they are valid until the
next `dispatch`.

Under `torch.compile` each of `dispatch` and `combine` is one opaque custom op
(`padded_moe::ep_dispatch`, `padded_moe::ep_combine`), so the compiler never traces the exchange
(persistent buffers viewed with other dtypes, collectives, device flags). The dispatch op returns
copies of the receive buffer's tensors (an op cannot return views of memory it does not take as
an input); the handle it hands to `combine` names this object, which keeps the real handle between
the two ops. The copies cost one read and one write of the receive buffer per call; a layer that
runs dispatch → experts → combine as one op (`FusedMoE` with `expert_parallel=`) pays none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from padded_moe._ops import OpObjects, custom_op, register_fake
from padded_moe._platform import use_triton
from padded_moe._validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    require_bool,
    require_dtype,
    require_int,
    require_rank,
    require_same_device,
    require_shape,
    require_tensor,
)
from padded_moe.ep.stages import (
    combine_batched_rows,
    combine_flat_rows,
    local_batched,
    local_flat,
    pack_rows,
    peer_counts,
    receive_batched,
    receive_flat,
    reduce_partials,
)
from padded_moe.ep.tiles import _overlap_min_tokens
from padded_moe.ep.transport import Transport, resolve_transport
from padded_moe.ep.wire import FP8_WIRE_DTYPES, MODES, EPGeometry, WireFormat, ep_buffer_specs
from padded_moe.expert_map import ExpertMap


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
    """True when the expert backend quantizes its own activations (the backend flag `quantizes_inputs`).

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


def _exclusive_cumsum(values: list) -> list:
    out, total = [], 0
    for v in values:
        out.append(total)
        total += v
    return out


class ExpertParallel:
    """Dispatch tokens to the ranks owning their experts and combine the results (docs/usage.md,
    "Expert parallelism").

    Args: `group` (a process group, None = WORLD; used by the collectives transport), `num_experts`
    E, `top_k` k, `hidden_size` K, `max_tokens_per_rank` T (every `dispatch` takes `m <= T`
    tokens; `m` may differ per rank and be 0). `mode` "flat" or "batched"; `placement` of experts
    over ranks ("linear" or "round_robin"); `dtype` of hidden states and expert outputs;
    `graph_safe` (False: exact counts with one host sync); `dispatch_dtype` (None = `dtype`, or
    torch.float8_e4m3fn to send fp8 rows with per-128-channel scales; deferred to the backend in
    flat mode when the backend quantizes its own inputs); `backend` (name or object with
    `quantizes_inputs`, only used for that decision); `device` (default: the transport's, i.e.
    the current CUDA device for NCCL groups, else CPU); `transport` (None = the default:
    "symm_mem" when every rank of an NCCL group is on this host, else "nccl" — see
    `padded_moe.ep.transport.default_name`; a name of `padded_moe.ep.transport.TRANSPORTS`; or a
    `Transport` object, e.g. `InProcessWorld(R).transport(rank)`; this rank and the number of ranks
    come from it; with "symm_mem" graph_safe=False takes the graph-safe path, since only real rows
    move anyway, and there is no own-chunk path);
    `keep_own_chunk` (None = automatic: graph-safe, with peers, on the kernels' path and
    `T >= EP_OVERLAP_MIN_TOKENS`; True / False force the own-chunk path on / off).

    Only one dispatch may be in flight: a new `dispatch` overwrites the receive buffers.
    """

    def __init__(self, group, num_experts: int, top_k: int, hidden_size: int,
                 max_tokens_per_rank: int, *, mode: str = "flat", placement: str = "linear",
                 dtype: torch.dtype = torch.bfloat16, graph_safe: bool = True,
                 dispatch_dtype: Optional[torch.dtype] = None, backend: object = None,
                 device: Union[str, torch.device, None] = None, transport: object = None,
                 keep_own_chunk: Optional[bool] = None):
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
        if keep_own_chunk is not None and not isinstance(keep_own_chunk, bool):  # 1 == True: not enough
            raise TypeError(f"keep_own_chunk must be None or a bool, got {keep_own_chunk!r}")
        require_bool("graph_safe", graph_safe)
        self.num_experts = require_int("num_experts", num_experts)
        self.top_k = require_int("top_k", top_k)
        self.hidden_size = require_int("hidden_size", hidden_size)
        self.max_tokens_per_rank = require_int("max_tokens_per_rank", max_tokens_per_rank)
        requested = torch.device(device) if device is not None else None
        self.transport: Transport = resolve_transport(transport, group, requested)
        self.group = group
        self.mode = mode
        self.dtype = dtype
        self.graph_safe = graph_safe
        self.ep_size = self.transport.size
        self.ep_rank = self.transport.rank
        self.device = requested if requested is not None else self.transport.default_device()
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device} but CUDA is not available here")
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
        self._keeps_own_chunk = self._own_chunk_rule(keep_own_chunk)
        self._alloc_buffers()
        self.op_id = _EPS.add(self)  # the compiled dispatch / combine ops name this object
        self._op_handle: Optional[DispatchHandle] = None  # between those two ops

    @property
    def rank(self) -> int:
        """This rank (of `ep_size`), as the transport numbers it; the same as `ep_rank`."""
        return self.ep_rank

    @property
    def transport_name(self) -> str:
        return self.transport.name

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

    def _own_chunk_rule(self, forced: Optional[bool]) -> bool:
        """Whether graph-safe calls keep this rank's chunk out of the exchange (and overlap it).

        Automatic: on the kernels' path with peers and T >= EP_OVERLAP_MIN_TOKENS. The torch path
        (the reference) keeps the plain source-rank order of received rows, which graph_safe=False
        has too: CPU BLAS results may depend on a row's position."""
        if forced is None:
            return (self.graph_safe and self.ep_size > 1 and self.transport.overlaps_own_chunk
                    and use_triton(self.device) and self.max_tokens_per_rank >= _overlap_min_tokens())
        if forced and not self.graph_safe:
            raise ValueError("keep_own_chunk=True needs graph_safe=True (exact splits move only real rows)")
        if forced and not self.transport.overlaps_own_chunk:
            raise ValueError(f"keep_own_chunk=True: the {self.transport.name!r} transport has no own-chunk path")
        return forced

    def buffer_specs(self) -> tuple:
        """The buffer description this object allocated from (`padded_moe.ep.wire.ep_buffer_specs`)."""
        return ep_buffer_specs(self.geometry, self.mode, self.num_local)

    def _alloc_buffers(self) -> None:
        bufs = self._bufs = self.transport.allocate(self.buffer_specs(), self.device)
        self._send_wire, self._recv_wire = bufs["dispatch_send"], bufs["dispatch_recv"]
        self._comb_send, self._comb_recv = bufs["combine_send"], bufs["combine_recv"]
        self._token_rows = bufs["token_rows"]
        self._chunk_counts = bufs["chunk_counts"]
        self._route_counts = bufs["route_counts"]
        self._side_stream = torch.cuda.Stream(self.device) \
            if self.device.type == "cuda" and self._keeps_own_chunk else None
        # A put transport: the kernels write into the peers and carry the handshake.
        self._put = {stage: self.transport.destinations(stage) for stage in ("dispatch", "combine")}
        if self.mode == "flat":
            self._rb_x, self._rb_ids = bufs["rb_x"], bufs["rb_topk_ids"]
            self._rb_w, self._rb_valid = bufs["rb_topk_weights"], bufs["rb_valid_tokens"]
        else:
            self._slab, self._counts = bufs["rb_x"], bufs["rb_counts"]
            self._slot_rows, self._slot_weights = bufs["slot_rows"], bufs["slot_weights"]

    def buffers(self) -> dict:
        """Every persistent buffer by name (the names of `buffer_specs()`); buffers that share a
        storage (the transport's choice) are views of it."""
        return dict(self._bufs)

    def buffer_bytes(self) -> int:
        """Bytes of the distinct storages behind `buffers()` (what the planner reports)."""
        seen = {}
        for t in self._bufs.values():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

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
        if torch.compiler.is_compiling():
            parts = torch.ops.padded_moe.ep_dispatch(hidden, topk_ids, topk_weights, self.op_id, self.mode == "flat",
                                                     self.geometry.rows, self.num_local)
            handle = DispatchHandle(self, self.mode, m, self._token_rows)
            if self.mode == "flat":
                x, ids, weights, valid = parts
                return ReceiveBuffer("flat", x, topk_ids=ids, topk_weights=weights, valid_tokens=valid), handle
            return ReceiveBuffer("batched", parts[0], counts=parts[1]), handle
        if self._put["dispatch"] is not None:
            return self._dispatch_put(hidden, topk_ids, topk_weights, m)
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
            self.transport.exchange("dispatch", self._send_wire, self._recv_wire,
                                    send_counts=send_counts, recv_counts=recv_counts)
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

    def _dispatch_put(self, hidden, topk_ids, topk_weights, m):
        """Put transport: the pack writes every chunk into its peer's receive rows and signals;
        the receive waits for every peer's signal and reads all R chunks. graph_safe=False runs
        this same path: only real rows move anyway, so there is no count to exchange."""
        geo, batched, put = self.geometry, self.mode == "batched", self._put["dispatch"]
        pack_rows(hidden, topk_ids, topk_weights, self._owner, geo, self._send_wire, self._token_rows,
                  zero_counts=self._counts if batched else None, block_counts=self._route_counts, put=put)
        self.transport.put_written("dispatch")
        handle = DispatchHandle(self, self.mode, m, self._token_rows)
        if not batched:
            receive_flat(geo, self._recv_wire, self._chunk_counts, True, self._rb_x, self._rb_ids, self._rb_w,
                         self._rb_valid, wait=put)
            return ReceiveBuffer("flat", self._rb_x, topk_ids=self._rb_ids, topk_weights=self._rb_w,
                                 valid_tokens=self._rb_valid), handle
        receive_batched(geo, self._recv_wire, self._chunk_counts, True, self._map, self.num_local,
                        self._slab, self._counts, self._slot_rows, self._slot_weights, wait=put)
        x = self._slab[: self.num_local * geo.rows].view(self.num_local, geo.rows, self.hidden_size)
        return ReceiveBuffer("batched", x, counts=self._counts), handle

    def _exchange_own_kept(self, stage: str, send: torch.Tensor, recv: torch.Tensor) -> None:
        self.transport.exchange(stage, send, recv, skip_own=True)

    def _dispatch_overlapped(self, hidden, topk_ids, topk_weights) -> None:
        """Batched, graph-safe: pack the peers' chunks, and while they travel put this rank's own
        tokens into the slabs (`local_batched`); then scatter what arrived."""
        geo, rank = self.geometry, self.ep_rank
        pack_rows(hidden, topk_ids, topk_weights, self._owner, geo, self._send_wire, self._token_rows,
                  zero_counts=self._counts, rank=rank, block_counts=self._route_counts)
        self._overlap(
            lambda: self._exchange_own_kept("dispatch", self._send_wire, self._recv_wire),
            lambda: local_batched(hidden, topk_ids, topk_weights, geo, rank, self._map, self.num_local, self._slab,
                                  self._counts, self._slot_rows, self._slot_weights, self._token_rows,
                                  self._chunk_counts))
        receive_batched(geo, self._recv_wire, self._chunk_counts, True, self._map, self.num_local, self._slab,
                        self._counts, self._slot_rows, self._slot_weights, rank=rank)

    def _dispatch_flat_overlapped(self, hidden, topk_ids, topk_weights) -> None:
        """Flat, graph-safe: pack the peers' chunks, and while they travel put this rank's own
        tokens at the front of the receive rows (`local_flat`); then compact what arrived after them."""
        geo, rank = self.geometry, self.ep_rank
        pack_rows(hidden, topk_ids, topk_weights, self._owner, geo, self._send_wire, self._token_rows,
                  rank=rank, block_counts=self._route_counts)
        self._overlap(
            lambda: self._exchange_own_kept("dispatch", self._send_wire, self._recv_wire),
            lambda: local_flat(hidden, topk_ids, topk_weights, self._owner, geo, rank, self._rb_x, self._rb_ids,
                               self._rb_w, self._token_rows, self._chunk_counts, self._route_counts))
        receive_flat(geo, self._recv_wire, self._chunk_counts, True, self._rb_x, self._rb_ids, self._rb_w,
                     self._rb_valid, rank=rank)

    def _overlap(self, transfer, local) -> None:
        """`transfer` (an exchange) and `local` (kernels) at the same time: on CUDA the exchange
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

    def _exchange_counts(self, counts: torch.Tensor) -> tuple[list, list]:
        """graph_safe=False: per-peer row counts both ways (the one host synchronisation); the
        received counts also land in `chunk_counts` for the receive and combine steps."""
        recv = self.transport.exchange_counts(counts)
        self._chunk_counts.copy_(recv.to(torch.int32))
        both = torch.cat([counts.to(torch.int64), recv.to(torch.int64)]).tolist()
        return both[: self.ep_size], both[self.ep_size:]

    # ------------------------------------------------------------------ combine
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Return each rank's partial outputs to the token owners and sum them: `[m, K]`."""
        self._check_combine(expert_out, handle)
        if torch.compiler.is_compiling():
            return torch.ops.padded_moe.ep_combine(expert_out, handle.num_tokens, self.op_id)
        put = self._put["combine"]
        if put is not None:  # the combine kernel writes into the token owners and signals
            if self.mode == "flat":
                combine_flat_rows(self.geometry, self._chunk_counts, expert_out, self._comb_send, put=put)
            else:
                combine_batched_rows(self.geometry, self._chunk_counts, True, self._slot_rows, self._slot_weights,
                                     expert_out, self._comb_send, put=put)
            self.transport.put_written("combine")
            return self._reduce(handle)
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
        self.transport.exchange("combine", send, self._comb_recv,
                                send_counts=handle.recv_counts, recv_counts=handle.send_counts)
        return self._reduce(handle)

    def _combine_flat_own(self, expert_out, handle) -> torch.Tensor:
        """Flat, graph-safe, own chunk kept: only the peers' rows go back into chunk order and
        travel; the own rows stay in expert_out, where the reduction reads them (nothing to overlap)."""
        combine_flat_rows(self.geometry, self._chunk_counts, expert_out, self._comb_send, rank=self.ep_rank)
        self._exchange_own_kept("combine", self._comb_send, self._comb_recv)
        return self._reduce(handle, own_rows=expert_out)

    def _combine_overlapped(self, expert_out, handle) -> torch.Tensor:
        """Batched, graph-safe: weigh the peers' rows, and while they travel back weigh this rank's
        own (they stay in the combine send buffer, in a chunk nobody transfers); then reduce."""
        geo, rank = self.geometry, self.ep_rank
        combine_batched_rows(geo, self._chunk_counts, True, self._slot_rows, self._slot_weights, expert_out,
                             self._comb_send, rank=rank)
        self._overlap(
            lambda: self._exchange_own_kept("combine", self._comb_send, self._comb_recv),
            lambda: combine_batched_rows(geo, self._chunk_counts, True, self._slot_rows, self._slot_weights,
                                         expert_out, self._comb_send, rank=rank, own_only=True))
        return self._reduce(handle, own_rows=self._comb_send)

    def _reduce(self, handle, own_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`[m, K]`: each token's partials summed; `own_rows` holds this rank's own when it never travelled."""
        m = handle.num_tokens
        out = torch.empty(m, self.hidden_size, dtype=self.dtype, device=self.device)
        reduce_partials(self.geometry, self._comb_recv, handle.token_rows, m, out,
                        rank=self.ep_rank if own_rows is not None else -1, own_rows=own_rows,
                        wait=self._put["combine"])
        return out


# ---------------------------------------------------------------------------------------------
# The custom ops of a compiled dispatch / combine (see the module docstring).

_EPS = OpObjects("ExpertParallel")


def expert_parallel_of_op(op: str, op_id: int) -> "ExpertParallel":
    """The live `ExpertParallel` whose `op_id` a custom op `padded_moe::<op>` was given."""
    return _EPS.get(op_id, op)


def _receive_views(ep: ExpertParallel) -> list:
    """The receive buffer's tensors as a dispatch returns them, in the dispatch op's output order."""
    if ep.mode == "flat":
        return [ep._rb_x, ep._rb_ids, ep._rb_w, ep._rb_valid]
    rows = ep.geometry.rows
    return [ep._slab[: ep.num_local * rows].view(ep.num_local, rows, ep.hidden_size), ep._counts]


# The object's id, the mode and the sizes travel as arguments so that the fake implementation
# needs no object (under dynamic shapes the compiler may pass the id as a symbolic int).
@custom_op("padded_moe::ep_dispatch", mutates_args=())
def _ep_dispatch_op(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    ep_id: int, flat: bool, rows: int, num_local: int) -> list[torch.Tensor]:
    """`ExpertParallel.dispatch` of object `ep_id`, as the compiler sees it: copies of the receive
    buffer's tensors (flat: x, topk_ids, topk_weights, valid_tokens; batched: x, counts)."""
    ep = expert_parallel_of_op("ep_dispatch", ep_id)
    _, ep._op_handle = ep.dispatch(hidden, topk_ids, topk_weights)
    return [t.clone() for t in _receive_views(ep)]


@register_fake("padded_moe::ep_dispatch")
def _(hidden, topk_ids, topk_weights, ep_id, flat, rows, num_local):
    K, k = hidden.shape[1], topk_ids.shape[1]
    if flat:
        return [hidden.new_empty((rows, K)), hidden.new_empty((rows, k), dtype=torch.int32),
                hidden.new_empty((rows, k), dtype=torch.float32), hidden.new_empty((1,), dtype=torch.int32)]
    return [hidden.new_empty((num_local, rows, K)), hidden.new_empty((num_local,), dtype=torch.int32)]


@custom_op("padded_moe::ep_combine", mutates_args=())
def _ep_combine_op(expert_out: torch.Tensor, num_tokens: int, ep_id: int) -> torch.Tensor:
    """`ExpertParallel.combine` of object `ep_id` for the handle of its last dispatch op."""
    ep = expert_parallel_of_op("ep_combine", ep_id)
    handle, ep._op_handle = ep._op_handle, None
    if handle is None or handle.num_tokens != num_tokens:
        raise RuntimeError("padded_moe::ep_combine: every combine needs the dispatch before it on the same "
                           "ExpertParallel (one dispatch in flight), with the same token count")
    return ep.combine(expert_out, handle)


@register_fake("padded_moe::ep_combine")
def _(expert_out, num_tokens, ep_id):
    return expert_out.new_empty((num_tokens, expert_out.shape[-1]))
