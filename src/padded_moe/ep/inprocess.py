"""An in-process transport: R ranks as R threads of one process (a test double, no process group).

    world = InProcessWorld(3)
    outs = world.run(lambda rank, transport: step(ExpertParallel(None, ..., transport=transport)))

Each rank runs the real `ExpertParallel` code with its own `InProcessTransport`; `exchange`
copies the peers' chunks by rank, exactly as the collectives move them. One thread runs at a
time: a rank holds the world's baton except while it waits for its peers inside an exchange, so
a run is deterministic and the Triton interpreter (whose patching is process-wide) never runs
two kernels at once.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

from padded_moe.ep.transport import PutTransport, Transport, check_exchange_args, check_stage

WAIT_TIMEOUT_S = 120.0


class InProcessWorld:
    """The shared state of `size` in-process ranks: a barrier, the baton and one posting slot per rank."""

    def __init__(self, size: int, device: torch.device | str = "cpu", *, put: bool = False):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        self.size = size
        self.put = bool(put)
        self.device = torch.device(device)
        self._barrier = threading.Barrier(size)
        self._baton = threading.Lock()
        self._local = threading.local()
        self._slots: list = [None] * size

    def transport(self, rank: int) -> "InProcessTransport":
        """Rank `rank`'s transport: the collectives' double, or with `put=True` the put transport's
        (its kernels write into the other ranks' tensors, which share this process's memory)."""
        return (InProcessPutTransport if self.put else InProcessTransport)(self, rank)

    def run(self, fn: Callable, timeout: float = WAIT_TIMEOUT_S) -> list:
        """`fn(rank, transport)` on every rank, one thread each; the per-rank results in rank order.
        The first exception of any rank is raised here (the others are released from their waits)."""
        results: list = [None] * self.size
        errors: list = [None] * self.size
        self._barrier.reset()  # a failed earlier run leaves it broken

        def body(rank):
            self._baton.acquire()
            self._local.held = True
            try:
                results[rank] = fn(rank, self.transport(rank))
            except BaseException as exc:  # noqa: BLE001 - re-raised by run()
                errors[rank] = exc
                self._barrier.abort()
            finally:
                self._local.held = False
                self._baton.release()

        threads = [threading.Thread(target=body, args=(r,), name=f"inprocess-rank{r}", daemon=True)
                   for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if any(t.is_alive() for t in threads):
            self._barrier.abort()
            raise TimeoutError(f"in-process ranks did not finish within {timeout} s")
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                     next((e for e in errors if e is not None), None))
        if first is not None:
            raise first
        return results

    def _sync(self) -> None:
        """Wait for every rank (the baton is handed on meanwhile)."""
        held = getattr(self._local, "held", False)
        if held:
            self._baton.release()
        try:
            self._barrier.wait(WAIT_TIMEOUT_S)
        finally:
            if held:
                self._baton.acquire()

    def _all_gather(self, rank: int, value) -> list:
        """Every rank's `value`, by rank (two waits: nobody reads before all posted, nobody posts
        again before all read)."""
        self._slots[rank] = value
        self._sync()
        got = list(self._slots)
        self._sync()
        return got


class InProcessTransport(Transport):
    """Rank `rank` of an `InProcessWorld`: the exchanges copy chunks between the ranks' tensors."""

    name = "inprocess"
    overlaps_own_chunk = True

    def __init__(self, world: InProcessWorld, rank: int):
        if not isinstance(world, InProcessWorld):
            raise TypeError(f"world must be an InProcessWorld, got {type(world).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world.size:
            raise ValueError(f"rank must be an int in [0, {world.size}), got {rank!r}")
        self.world = world
        self.rank = rank
        self.size = world.size

    @classmethod
    def from_group(cls, group) -> "InProcessTransport":
        raise ValueError("transport='inprocess' needs its world: pass "
                         "transport=InProcessWorld(size).transport(rank) (see padded_moe.ep.inprocess)")

    def default_device(self) -> torch.device:
        return self.world.device

    def exchange(self, stage: str, send: torch.Tensor, recv: torch.Tensor, *,
                 send_counts: Optional[list] = None, recv_counts: Optional[list] = None,
                 skip_own: bool = False) -> None:
        check_stage(stage)
        check_exchange_args(self, send, recv, send_counts, recv_counts, skip_own)
        R, rank = self.size, self.rank
        # Everyone reads every sender's rows before anyone writes its send rows again.
        self.world._slots[rank] = (send, send_counts)
        self.world._sync()
        if send_counts is None:
            T = send.shape[0] // R
            for s in range(R):
                if skip_own and s == rank:
                    continue
                src = self.world._slots[s][0]
                recv[s * T:(s + 1) * T].copy_(src[rank * T:(rank + 1) * T])
        else:
            off = 0
            for s in range(R):
                src, counts = self.world._slots[s]
                start, n = sum(counts[:rank]), counts[rank]
                if n != recv_counts[s]:
                    raise ValueError(f"rank {rank} expected {recv_counts[s]} rows from rank {s}, which sends {n}")
                recv[off:off + n].copy_(src[start:start + n])
                off += n
        self.world._sync()

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.to(torch.int64)
        got = self.world._all_gather(self.rank, counts.clone())
        return torch.stack([g[self.rank] for g in got])


class InProcessPutTransport(PutTransport, InProcessTransport):
    """Rank `rank` of an `InProcessWorld(put=True)`: the symmetric-memory transport's layout, tables,
    kernels and handshake, with the ranks' shared allocations as plain tensors of one process (on
    CPU the kernels run in the Triton interpreter). `put_written` is where a rank hands the turn on
    (the world runs one rank at a time), so a reading kernel finds its peers' flags already set:
    the handshake's epochs and addresses are exercised, its waiting is not."""

    name = "inprocess_put"

    def allocate(self, specs, device: torch.device) -> dict:
        from padded_moe.ep.symm_mem import put_layout, put_storage

        raw = torch.empty(put_storage(specs)[0].nbytes, dtype=torch.uint8, device=device)
        ptrs = self.world._all_gather(self.rank, raw.data_ptr())
        out, self._targets = put_layout(specs, raw, ptrs, self.rank, self.size)
        self._raw = raw
        self.world._sync()  # every rank's flags are zero before anyone signals
        return out

    def put_written(self, stage: str) -> None:
        check_stage(stage)
        self.world._sync()
