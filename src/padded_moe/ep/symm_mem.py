"""The symmetric-memory put transport: kernels write straight into the peers' receive rows.

One node, CUDA. The dispatch receive rows (wire rows) and the combine receive rows (`[R*T, K]` in
the model dtype) of every rank live in one allocation of PyTorch's symmetric memory (CUDA
backend), which maps each rank's allocation into every peer's address space over NVLink. The pack
kernel writes token t's row for peer r straight into peer r's dispatch receive chunk of this rank;
the combine kernels write the partial rows back into the token owner's combine receive chunk of
this rank. There are no send buffers (the engine's send views alias the receive rows; the
launchers only take their dtype and strides), nothing moves outside the kernels, and only real
rows move: padding rows of a chunk are never written.

The handshake is part of those kernels (`padded_moe.kernels.ep`, "put signalling"): the last
program of a writing kernel publishes a per-call epoch into every peer's flags (release, system
scope); the reading kernels (receive, reduce) first spin on their own flags (acquire). No host
barrier and no extra launch; graph capture records it like any kernel, and replays keep counting.

Why one handshake per direction is enough, with the buffers reused across calls (no double
buffering): a rank publishes its dispatch epoch n only after its reduction of call n - 1 (stream
order), and a peer's combine of call n, which writes into that rank's combine receive rows, runs
after the peer's receive waited for that epoch; so no combine row of call n - 1 is overwritten
before it was read. Likewise a rank publishes its combine epoch n only after its receive of call
n, and a peer's pack of call n + 1 follows the peer's reduction, which waited for that epoch; so
no dispatch row is overwritten before it was consumed. Every rank, idle ones included, runs every
signalling and waiting kernel (with at least one program), so the epochs stay in step.

A rank that stops calling (an exception on one rank) leaves its peers spinning: like a collective
whose peer never joins, the job has to be torn down.

NVLink multicast is never used (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set before allocation, and
no multimem operation is issued).
"""

from __future__ import annotations

import importlib
import os
import socket
from typing import Sequence

import torch
import torch.distributed as dist

from padded_moe._util import round_up
from padded_moe.ep.transport import PutTargets, PutTransport, Storage

ALIGN = 256          # every region of the symmetric allocation starts on a 256-byte boundary
FLAGS_BYTES = 256    # int32 flags [2 channels, R] per rank: up to 32 ranks
_SHARED = ("dispatch_recv", "dispatch_send", "combine_recv", "combine_send")


def put_storage(specs: Sequence) -> list:
    """The put transport's storages: one symmetric allocation for the receive rows of both
    directions and the flags (the send views alias the receive rows), and one per other buffer."""
    by_name = {s.name: s for s in specs}
    nbytes = round_up(by_name["dispatch_recv"].nbytes, ALIGN) + round_up(by_name["combine_recv"].nbytes, ALIGN)
    out = [Storage("symm_mem", nbytes + FLAGS_BYTES, _SHARED, True)]
    return out + [Storage(s.name, s.nbytes, (s.name,), s.exchanged) for s in specs if s.name not in _SHARED]


def put_layout(specs: Sequence, raw: torch.Tensor, ptrs: Sequence, rank: int, size: int) -> tuple:
    """Every buffer of `specs` for a put transport and its `PutTargets` per stage: the receive rows
    of both directions and the flags are views of `raw` (this rank's shared allocation, laid out as
    `put_storage` says; its flags are zeroed here), `ptrs` are the byte addresses of every rank's
    `raw` as this rank sees them; the other buffers are allocated on `raw`'s device."""
    by_name = {s.name: s for s in specs}
    storages = put_storage(specs)
    if raw.numel() != storages[0].nbytes:
        raise ValueError(f"raw must hold {storages[0].nbytes} bytes, got {raw.numel()}")
    device = raw.device
    out = {}
    for st in storages[1:]:
        spec = by_name[st.name]
        t = torch.empty(spec.nbytes, dtype=torch.uint8, device=device).view(spec.dtype).view(spec.shape)
        if spec.fill is not None:
            t.fill_(spec.fill)
        out[st.name] = t
    d, c = by_name["dispatch_recv"], by_name["combine_recv"]
    at_c = round_up(d.nbytes, ALIGN)
    at_f = at_c + round_up(c.nbytes, ALIGN)
    out["dispatch_recv"] = out["dispatch_send"] = raw[: d.nbytes].view(d.dtype).view(d.shape)
    out["combine_recv"] = out["combine_send"] = raw[at_c: at_c + c.nbytes].view(c.dtype).view(c.shape)
    flags = raw[at_f: at_f + 2 * size * 4].view(torch.int32)
    flags.zero_()
    sig = torch.zeros(4, dtype=torch.int32, device=device)
    T = d.shape[0] // size
    flag_table = torch.tensor([p + at_f for p in ptrs], dtype=torch.int64, device=device)

    def table(at: int, row_bytes: int) -> torch.Tensor:
        # Send row r*T + p of chunk r lands on peer r's receive row rank*T + p.
        return torch.tensor([ptrs[r] + at + (rank - r) * T * row_bytes for r in range(size)],
                            dtype=torch.int64, device=device)

    targets = {"dispatch": PutTargets(table(0, d.shape[1] * d.dtype.itemsize), sig, flag_table, flags, rank),
               "combine": PutTargets(table(at_c, c.shape[1] * c.dtype.itemsize), sig, flag_table, flags, rank)}
    return out, targets


def available(group) -> bool:
    """True when the put transport can run on `group`: NCCL on CUDA, every rank on this host, and a
    torch build with symmetric memory. Collective (it gathers the host names)."""
    if not dist.is_initialized() or dist.get_backend(group) != "nccl" or not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return False
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1 and len(hosts) <= torch.cuda.device_count() and 2 * len(hosts) * 4 <= FLAGS_BYTES


class SymmMemTransport(PutTransport):
    name = "symm_mem"

    def __init__(self, group=None):
        if not dist.is_initialized() or dist.get_backend(group) != "nccl":
            raise ValueError("transport='symm_mem' needs torch.distributed initialized with an NCCL group "
                             "(one CUDA device per rank); use transport='nccl'")
        self.group = group if group is not None else dist.group.WORLD
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if 2 * self.size * 4 > FLAGS_BYTES:
            raise ValueError(f"transport='symm_mem' supports up to {FLAGS_BYTES // 8} ranks, got {self.size}")
        self._targets: dict = {}

    @classmethod
    def from_group(cls, group) -> "SymmMemTransport":
        return cls(group)

    def default_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def allocate(self, specs: Sequence, device: torch.device) -> dict:
        if device.type != "cuda":
            raise ValueError(f"transport='symm_mem' needs a CUDA device, got {device}")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        if symm_mem.get_backend(device) is None:
            symm_mem.set_backend("CUDA")
        raw = symm_mem.empty(put_storage(specs)[0].nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(raw, self.group)
        out, self._targets = put_layout(specs, raw, [int(p) for p in handle.buffer_ptrs], self.rank, self.size)
        self._handle = handle  # keeps the peers' mappings alive
        torch.cuda.synchronize(device)
        handle.barrier(channel=0)  # every rank's flags are zero before anyone signals
        return out
