"""Launching a compiled Triton kernel without re-binding its arguments on every call.

`kernel[grid](*args, **constexprs)` makes Triton specialise every argument again (type, 16-byte
alignment of each pointer, properties of each int) to find the compiled binary: tens of µs of
host time per launch, several times a small kernel's device time, and the bulk of an eager MoE
call's host cost. `launch` does that once per caller-supplied key and then calls the compiled
binary's launcher directly.

The key is the caller's promise: equal keys must mean an identical specialisation. Callers build
it from values they hold anyway — every int argument's value, every tensor argument's dtype and
`data_ptr() % 16`, the constexprs and launch options — which is cheaper than Triton's per-argument
inspection. Under the interpreter, or when a launch hook is installed (profilers), every launch
takes Triton's own path.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from triton import knobs
from triton.runtime import driver

from padded_moe.kernels import INTERPRETED

_CACHE: dict = {}
_MAX_ENTRIES = 8192  # one entry per (kernel, shape key); cleared wholesale if a caller churns shapes


def launch(fn, grid: Sequence[int], key: tuple, args: tuple, constexprs: dict[str, Any], *,
           num_warps: int, num_stages: int | None = None) -> None:
    """`fn[grid](*args, **constexprs, num_warps=..., num_stages=...)`, fast after the first call
    with this `key`. `constexprs` must be the kernel's trailing parameters, in declaration order."""
    options = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    if INTERPRETED or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        fn[grid](*args, **constexprs, **options)
        return
    device = torch.cuda.current_device()
    full_key = (fn, device, key, num_warps, num_stages, *constexprs.values())
    kernel = _CACHE.get(full_key)
    if kernel is None:
        kernel = fn[grid](*args, **constexprs, **options)
        if kernel is not None and tuple(fn.arg_names[len(args):]) == tuple(constexprs):
            if len(_CACHE) >= _MAX_ENTRIES:
                _CACHE.clear()
            _CACHE[full_key] = kernel
        return
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    kernel.run(grid[0], g1, g2, driver.active.get_current_stream(device), kernel.function,
               kernel.packed_metadata, None, None, None, *args, *constexprs.values())


def _hooked(hook) -> bool:
    """Whether a launch hook is installed (a non-empty hook chain, or a plain callable)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def cached_entries() -> int:
    """How many (kernel, key) launches are cached (tests use it to see the fast path taken)."""
    return len(_CACHE)


def ptr_key(*tensors: torch.Tensor) -> tuple:
    """Dtype and 16-byte alignment of each tensor argument (what Triton specialises pointers on)."""
    return tuple((t.dtype, t.data_ptr() & 15) for t in tensors)
