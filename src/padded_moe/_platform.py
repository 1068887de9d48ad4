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
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def program_cap(device: torch.device, per_sm: int = 8) -> int:
    """Upper bound on resident programs for grid-striding kernels (small under the interpreter)."""
    if device.type == "cuda":
        return num_sms(device.index if device.index is not None else torch.cuda.current_device()) * per_sm
    return 4
