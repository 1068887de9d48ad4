"""Where a call runs: Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1) or the torch path."""

from __future__ import annotations

import functools
import os

import torch


def interpreter_requested() -> bool:
    """True when the user asked Triton to interpret kernels on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def kernels_interpreted() -> bool:
    """Whether our kernel modules were (or will be) decorated for the interpreter.

    Triton chooses interpreter or compiler once, when `@triton.jit` runs at import; a
    later change of the variable does not convert already-imported kernels.
    """
    if not triton_available():
        return False
    from padded_moe.kernels import INTERPRETED

    return INTERPRETED


def use_triton(device: torch.device) -> bool:
    """Triton kernels serve CUDA tensors, and CPU tensors when TRITON_INTERPRET=1.

    The variable is read at every call so tests can switch a CPU run between the
    interpreted kernels and the torch path.
    """
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreter_requested() and kernels_interpreted()


@functools.lru_cache(maxsize=8)
def capability(device_index: int) -> tuple[int, int]:
    """The CUDA device's compute capability (major, minor)."""
    return torch.cuda.get_device_capability(device_index)


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# What an SM of compute capability 7.0 to 9.0 has for resident programs: 64K 32-bit registers,
# allocated per warp in units of 256; at most 32 programs; 1 KB of shared memory reserved per program.
_REGS_PER_SM, _REG_UNIT, _MAX_PROGRAMS_PER_SM, _SHARED_RESERVED = 65536, 256, 32, 1024


@functools.lru_cache(maxsize=64)
def programs_per_sm(device_index: int, num_warps: int, regs_per_thread: int, shared_bytes: int) -> int:
    """How many programs of `num_warps` warps, `regs_per_thread` registers and `shared_bytes` of
    shared memory an SM of this device holds at once (at least 1)."""
    props = torch.cuda.get_device_properties(device_index)
    warp = props.warp_size
    regs_per_warp = -(-max(regs_per_thread, 1) * warp // _REG_UNIT) * _REG_UNIT
    fits = [_MAX_PROGRAMS_PER_SM, props.max_threads_per_multi_processor // (num_warps * warp),
            _REGS_PER_SM // (regs_per_warp * num_warps)]
    if shared_bytes:
        fits.append(props.shared_memory_per_multiprocessor // (shared_bytes + _SHARED_RESERVED))
    return max(1, min(fits))


def program_cap(device: torch.device, per_sm: int = 8) -> int:
    """Upper bound on resident programs for grid-striding kernels (small under the interpreter)."""
    if device.type == "cuda":
        return num_sms(device.index if device.index is not None else torch.cuda.current_device()) * per_sm
    return 4
