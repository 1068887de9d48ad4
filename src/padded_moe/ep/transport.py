"""The transport interface of expert parallelism, its storage policies, and the registry.

A transport moves rows between the ranks of one `ExpertParallel`. The orchestrator
(`padded_moe.ep.engine`) needs only this from it:

- `name`, `rank`, `size` (this rank and the number of ranks), `default_device()`;
- `allocate(specs, device)`: every buffer of the buffer description (`padded_moe.ep.wire.
  ep_buffer_specs`), as tensors; the transport decides where the `exchanged` ones live (a put
  transport maps them into its peers' address space) and, through its storage policy, which of
  them share storage (see `Storage`);
- `exchange(stage, send, recv, ...)`: the rows of `send` chunk `d` (`[d*T, (d+1)*T)`) land in
  rank `d`'s `recv` chunk `rank`, for stage "dispatch" or "combine"; variants: `skip_own` (this
  rank's chunk need not move: the own-chunk overlap), or exact splits (`send_counts` /
  `recv_counts`: chunks back to back, graph_safe=False);
- `exchange_counts(counts)`: the per-peer row counts both ways (graph_safe=False);
- `overlaps_own_chunk`: whether the own-chunk path (side stream, own chunk kept home) may be used;
- `destinations(stage)`: None for a transport that moves rows itself in `exchange`. A transport
  whose kernels write straight into peers' receive buffers (`symm_mem`) returns a `PutTargets`:
  the per-peer addresses the pack / combine kernels write to and the flags of the device-side
  handshake that the receive / reduce kernels wait on; the engine then never calls `exchange`.

To add a transport: subclass `Transport`, give it a `name`, implement `exchange` and
`exchange_counts` (and `_allocate_storage` / `destinations` where the memory differs), and add a
`TransportEntry` to `TRANSPORTS` (its storage policy is what the planner sizes); `default_name`
decides when it becomes the default.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence

import torch

STAGES = ("dispatch", "combine")


@dataclass(frozen=True)
class PutTargets:
    """What the kernels of a put transport need for one stage (`Transport.destinations`).

    `table` int64 `[R]`: for chunk r, the byte address that stands for row 0 of a send buffer, so
    that send row `r*T + p` lands on peer r's receive row `rank*T + p`. `sig` int32 `[4]` (local):
    finished programs and call epochs per stage; `flag_table` int64 `[R]`: each peer's flags;
    `flags` int32 `[2, R]` (this rank's, written by the peers): the latest epoch each source
    published per stage."""

    table: torch.Tensor
    sig: torch.Tensor
    flag_table: torch.Tensor
    flags: torch.Tensor
    rank: int


@dataclass(frozen=True)
class Storage:
    """One allocation of a transport: `nbytes` bytes that the buffers named in `buffers` view from
    offset 0 (more than one only when a buffer's description allows it to reuse another's storage)."""

    name: str
    nbytes: int
    buffers: tuple
    exchanged: bool


def separate_storage(specs: Sequence) -> list:
    """One storage per buffer (no sharing)."""
    return [Storage(s.name, s.nbytes, (s.name,), s.exchanged) for s in specs]


def reuse_storage(specs: Sequence) -> list:
    """Every buffer whose description names a buffer it `reuses` views that buffer's storage
    (sized for the larger of the two); the rest get their own."""
    by_name = {s.name: s for s in specs}
    groups: dict = {}
    for s in specs:
        root = s.name
        while by_name[root].reuses is not None:
            root = by_name[root].reuses
            if root not in by_name:
                raise ValueError(f"buffer {s.name!r} reuses {root!r}, which is not in the description")
        groups.setdefault(root, []).append(by_name[s.name])
    return [Storage(root, max(m.nbytes for m in members), tuple(m.name for m in members),
                    any(m.exchanged for m in members))
            for root, members in groups.items()]


@dataclass(frozen=True)
class TransportEntry:
    """A registered transport: its name, where its class lives (imported on first use, so the
    planner reads the storage policy without importing any communication library), and the
    storage policy its `allocate` follows."""

    name: str
    target: str  # "module:Class"
    storage: Callable
    summary: str

    def load(self) -> type:
        module, _, cls = self.target.partition(":")
        return getattr(importlib.import_module(module), cls)


TRANSPORTS: dict = {
    # Collectives may overlay the combine rows on the dispatch rows: each direction's storage is
    # free again before the other stage writes it (see ep_buffer_specs).
    "nccl": TransportEntry("nccl", "padded_moe.ep.collectives:CollectiveTransport", reuse_storage,
                           "torch.distributed all_to_all (NCCL on GPUs, gloo on CPU); any ranks and nodes"),
    "inprocess": TransportEntry("inprocess", "padded_moe.ep.inprocess:InProcessTransport", reuse_storage,
                                "R ranks as threads of one process (a test double; no process group)"),
    "inprocess_put": TransportEntry("inprocess_put", "padded_moe.ep.inprocess:InProcessPutTransport",
                                    lambda specs: importlib.import_module("padded_moe.ep.symm_mem").put_storage(specs),
                                    "the put transport's kernels and layout on R in-process ranks (a test double)"),
    # One symmetric allocation holds both directions' receive rows and the flags; no send rows.
    "symm_mem": TransportEntry("symm_mem", "padded_moe.ep.symm_mem:SymmMemTransport",
                               lambda specs: importlib.import_module("padded_moe.ep.symm_mem").put_storage(specs),
                               "kernels write into the peers' receive rows over NVLink (PyTorch symmetric "
                               "memory); one node, CUDA"),
}


def transport_names() -> tuple:
    return tuple(TRANSPORTS)


def storage_plan(transport: str, specs: Sequence) -> list:
    """The storages `transport` allocates for the buffer description `specs` (the planner's view)."""
    return _entry(transport).storage(specs)


def default_name(device: Optional[torch.device] = None, group=None) -> str:
    """The transport `ExpertParallel(transport=None)` picks: "symm_mem" when every rank of an NCCL
    `group` is on this host and symmetric memory is available (deciding that is collective: it
    gathers the host names), else the collectives ("nccl"): across nodes, on CPU, and for the
    planner, which sees no group."""
    import torch.distributed as dist

    if (device is not None and device.type != "cuda") or not dist.is_initialized():
        return "nccl"
    from padded_moe.ep.symm_mem import available

    return "symm_mem" if available(group) else "nccl"


def _entry(name: str) -> TransportEntry:
    if not isinstance(name, str) or name not in TRANSPORTS:
        raise ValueError(f"transport must be one of {transport_names()} (or a Transport object), got {name!r}")
    return TRANSPORTS[name]


class Transport:
    """Base of every transport (see the module docstring for the contract)."""

    name: ClassVar[str] = ""
    # The own-chunk path keeps this rank's chunk out of the exchange and overlaps it with the
    # exchange of the others (a side stream on CUDA).
    overlaps_own_chunk: ClassVar[bool] = True

    rank: int
    size: int

    def default_device(self) -> torch.device:
        return torch.device("cpu")

    # ------------------------------------------------------------------ memory
    def storages(self, specs: Sequence) -> list:
        return TRANSPORTS[self.name].storage(specs)

    def allocate(self, specs: Sequence, device: torch.device) -> dict:
        """Every buffer of `specs` by name, viewed from this transport's storages and filled with
        its `fill` value (uninitialized when None)."""
        by_name = {s.name: s for s in specs}
        out = {}
        for st in self.storages(specs):
            raw = self._allocate_storage(st, device)
            for name in st.buffers:
                spec = by_name[name]
                t = raw[: spec.nbytes].view(spec.dtype).view(spec.shape)
                if spec.fill is not None:
                    t.fill_(spec.fill)
                out[name] = t
        return out

    def _allocate_storage(self, storage: Storage, device: torch.device) -> torch.Tensor:
        """uint8 `[nbytes]` for one storage (a put transport allocates `exchanged` ones where its
        peers can write)."""
        return torch.empty(storage.nbytes, dtype=torch.uint8, device=device)

    # ------------------------------------------------------------------ movement
    def destinations(self, stage: str) -> Optional[PutTargets]:
        """What the `stage` kernels need to write into the peers directly (`PutTargets`); None:
        `exchange` moves the rows."""
        return None

    def put_written(self, stage: str) -> None:
        """Called by the engine between a put stage's writing kernel and its reading kernel. The
        symmetric-memory transport has nothing to do (the kernels carry the handshake); the
        in-process double hands the turn to the other ranks there."""

    def exchange(self, stage: str, send: torch.Tensor, recv: torch.Tensor, *,
                 send_counts: Optional[list] = None, recv_counts: Optional[list] = None,
                 skip_own: bool = False) -> None:
        raise NotImplementedError(f"{type(self).__name__}.exchange")

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """int64 `[R]` sent counts → int64 `[R]` received counts (`recv[s]` = what rank s sends here)."""
        raise NotImplementedError(f"{type(self).__name__}.exchange_counts")


class PutTransport(Transport):
    """Base of the transports whose kernels write into the peers (`symm_mem` and its in-process
    double): `allocate` fills `_targets` (one `PutTargets` per stage); rows never move outside the
    kernels, so there is nothing to exchange and no own-chunk path."""

    overlaps_own_chunk: ClassVar[bool] = False  # every chunk, the own one too, is written by the pack
    _targets: dict

    def destinations(self, stage: str) -> Optional[PutTargets]:
        check_stage(stage)
        return self._targets[stage]

    def exchange(self, stage, send, recv, *, send_counts=None, recv_counts=None, skip_own=False) -> None:
        raise NotImplementedError(f"the {self.name} transport moves no rows itself: its pack and combine kernels "
                                  "write into the peers (see destinations)")

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"the {self.name} transport never needs exact counts: only real rows move")


def check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")


def check_exchange_args(transport: Transport, send, recv, send_counts, recv_counts, skip_own) -> None:
    if (send_counts is None) != (recv_counts is None):
        raise ValueError("send_counts and recv_counts go together (exact splits) or not at all")
    if send_counts is not None and skip_own:
        raise ValueError("skip_own is for fixed chunks; exact splits (send_counts) move only real rows")
    if send_counts is None and (send.shape[0] != recv.shape[0] or send.shape[0] % transport.size):
        raise ValueError(f"send and recv must have the same rows, a multiple of {transport.size} ranks; "
                         f"got {send.shape[0]} and {recv.shape[0]}")


def resolve_transport(transport: object, group, device: Optional[torch.device]) -> Transport:
    """`ExpertParallel(transport=...)`: None (the default for the device), a registered name, or a
    `Transport` object (used as it is; `group` is then not consulted)."""
    if isinstance(transport, Transport):
        return transport
    if transport is None:
        transport = default_name(device, group)
    entry = _entry(transport)
    cls = entry.load()
    return cls.from_group(group)
