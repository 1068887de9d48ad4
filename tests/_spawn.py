"""The multi-process harness of the distributed tests: `spawn_group(world, target, payload)`.

Spawns `world` processes that join one process group (gloo on CPU, NCCL with one GPU each), runs
`target(rank, world, payload)` in each and returns the per-rank results; a hang fails after a
timeout, after every child has printed the Python stacks of its threads to stderr (so a hang says
where it is). `PADDED_MOE_SPAWN_TIMEOUT` (seconds) overrides every group's timeout. Import as
`from _spawn import spawn_group` (tests/ is on sys.path).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Environment for every process we spawn (also GPU ones; see tests/test_distributed_gpu.py).
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "OMP_NUM_THREADS": "1"}
COLLECTIVE_TIMEOUT_S = 60
JOIN_TIMEOUT_S = 150


# ---------------------------------------------------------------------------- spawn harness
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, backend, target, payload, outdir, stacks_after):
    """Child process: join the group, run `target(rank, world, payload)`, save its result; print
    its threads' stacks if it is still running after `stacks_after` seconds."""
    os.environ.update(CHILD_ENV)
    faulthandler.dump_traceback_later(stacks_after, exit=False, file=sys.stderr)
    # CPU children run the library's torch path unless the payload asks for the interpreted Triton
    # kernels (one 2-rank run exercises them end to end; every scenario that way would cost minutes).
    interpret = isinstance(payload, dict) and payload.get("triton_interpret", False)
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        result = target(rank, world, payload)
        # Saved before the teardown: gloo's teardown has aborted a process now and then on a loaded
        # CPU ("terminate called without an active exception"), after the work was done.
        part = os.path.join(outdir, f"rank{rank}.part")
        torch.save(result, part)
        os.replace(part, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_group(world: int, target, payload, *, backend: str = "gloo", timeout: float = JOIN_TIMEOUT_S):
    """Run `target` on `world` spawned ranks; returns the per-rank results. Hangs fail."""
    os.environ.update(CHILD_ENV)  # inherited by the children from the start
    timeout = float(os.environ.get("PADDED_MOE_SPAWN_TIMEOUT") or timeout)
    stacks_after = max(1.0, timeout - min(15.0, timeout / 4))
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(world, free_port(), backend, target, payload, outdir, stacks_after),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{world}-rank group did not finish within {timeout} s")
        except mp.ProcessExitedException as e:
            # A process killed by a signal (not a Python exception) after every rank saved its
            # result died in the process-group teardown; the results are complete and checked.
            if e.signal_name is None or not all(os.path.exists(os.path.join(outdir, f"rank{r}.pt"))
                                                for r in range(world)):
                raise
            warnings.warn(f"{world}-rank group: {e} after every rank saved its result (teardown)")
        finally:
            for p in ctx.processes:  # only the processes spawned here
                if p.is_alive():
                    p.kill()
        return [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]
