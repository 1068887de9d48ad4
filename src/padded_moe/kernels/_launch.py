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

import threading
from contextlib import contextmanager
from typing import Any, Sequence

import torch
from triton import knobs
from triton.runtime import driver

from padded_moe.kernels import INTERPRETED

_CACHE: dict = {}
_MAX_ENTRIES = 8192  # one entry per (kernel, shape key); cleared wholesale if a caller churns shapes
_RECORD = threading.local()  # .events: the list a `recording` block appends launches to


@contextmanager
def recording(events: list):
    """Within this block (this thread) every `launch` also appends `("launch", (kernel, grid,
    args))` to `events` — `kernel` the compiled kernel, `grid` three ints, `args` the arguments
    the launcher takes after its fixed ones — or `("launch", None)` for a launch that cannot be
    repeated without Triton's own path (interpreter, launch hooks, a kernel the cache refuses).
    `padded_moe.launch_plan` builds replays from it."""
    previous = getattr(_RECORD, "events", None)
    _RECORD.events = events
    try:
        yield events
    finally:
        _RECORD.events = previous


def recording_active() -> bool:
    """Whether a `recording` block is open on this thread."""
    return getattr(_RECORD, "events", None) is not None


def fast_path() -> bool:
    """Whether launches take the cached path (compiled kernels, no launch hook installed)."""
    return not (INTERPRETED or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook))


def current_stream(device: int) -> int:
    """The raw CUDA stream launches on `device` go to now."""
    return driver.active.get_current_stream(device)


def _grid3(grid: Sequence[int]) -> tuple[int, int, int]:
    """A 1-, 2- or 3-D grid as the launcher's three dimensions."""
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


def launch(fn, grid: Sequence[int], key: tuple, args: tuple, constexprs: dict[str, Any], *,
           num_warps: int, num_stages: int | None = None, maxnreg: int | None = None) -> None:
    """`fn[grid](*args, **constexprs, num_warps=..., num_stages=...)`, fast after the first call
    with this `key`. `constexprs` must be the kernel's trailing parameters, in declaration order."""
    options = _options(num_warps, num_stages, maxnreg)
    events = getattr(_RECORD, "events", None)
    if not fast_path():
        _check_order(fn, args, constexprs)
        fn[grid](*args, **constexprs, **options)
        if events is not None:
            events.append(("launch", None))
        return
    device = torch.cuda.current_device()
    full_key = cache_key(fn, device, key, constexprs, num_warps, num_stages, maxnreg)
    kernel = _CACHE.get(full_key)
    g3 = _grid3(grid)
    if kernel is None:
        _check_order(fn, args, constexprs)
        kernel = fn[grid](*args, **constexprs, **options)
        cacheable = kernel is not None
        if cacheable:
            if len(_CACHE) >= _MAX_ENTRIES:
                _CACHE.clear()
            _CACHE[full_key] = kernel
        if events is not None:
            events.append(("launch", (kernel, g3, (*args, *constexprs.values())) if cacheable else None))
        return
    full_args = (*args, *constexprs.values())
    kernel.run(g3[0], g3[1], g3[2], current_stream(device), kernel.function,
               kernel.packed_metadata, None, None, None, *full_args)
    if events is not None:
        events.append(("launch", (kernel, g3, full_args)))


def launch_native(kernel, grid: Sequence[int], args: tuple) -> None:
    """Launch a native kernel (`padded_moe.kernels.native.NativeLaunch`) on the current stream,
    recorded like a Triton launch so that launch plans replay it."""
    g3 = _grid3(grid)
    kernel.run(g3[0], g3[1], g3[2], current_stream(torch.cuda.current_device()), None, None, None, None, None, *args)
    events = getattr(_RECORD, "events", None)
    if events is not None:
        events.append(("launch", (kernel, g3, tuple(args))))


_RESIDENT: dict = {}


def resident_programs(fn, key: tuple, args: tuple, constexprs: dict[str, Any], *, num_warps: int,
                      num_stages: int | None = None, maxnreg: int | None = None) -> int:
    """How many programs of `fn`, compiled as `launch` would compile it for these arguments, the
    current device holds at once: the grid of a grid-striding kernel that runs in one wave. A
    fixed number of programs per SM does not know the kernel's registers: a 45-register kernel of
    4 warps fits 10 per SM on an H200, so a grid sized for 16 per SM runs a second, partial wave
    (its programs start when the first ones are done, and the kernel ends on a tail). Under the
    interpreter, `_platform.program_cap`'s small number."""
    from padded_moe import _platform

    if INTERPRETED:
        return _platform.program_cap(torch.device("cpu"))
    device = torch.cuda.current_device()
    full_key = cache_key(fn, device, key, constexprs, num_warps, num_stages, maxnreg)
    n = _RESIDENT.get(full_key)
    if n is None:
        _check_order(fn, args, constexprs)
        kernel = fn.warmup(*args, grid=(1,), **constexprs, **_options(num_warps, num_stages, maxnreg))  # compiles only
        kernel._init_handles()  # loads it: the register count comes from the loaded function
        n = _platform.num_sms(device) * _platform.programs_per_sm(device, num_warps, kernel.n_regs,
                                                                   kernel.metadata.shared)
        if len(_RESIDENT) >= _MAX_ENTRIES:
            _RESIDENT.clear()
        _RESIDENT[full_key] = n
    return n


def _options(num_warps: int, num_stages: int | None, maxnreg: int | None = None) -> dict:
    """Triton's launch options; those left at None keep Triton's defaults."""
    options = {"num_warps": num_warps, "num_stages": num_stages, "maxnreg": maxnreg}
    return {k: v for k, v in options.items() if v is not None}


def cache_key(fn, device: int, key: tuple, constexprs: dict[str, Any], num_warps: int,
              num_stages: int | None = None, maxnreg: int | None = None) -> tuple:
    """What identifies one compiled kernel of `fn` in `launch`'s cache (and `resident_programs`')."""
    return (fn, device, key, num_warps, num_stages, maxnreg, *constexprs.values())


def _check_order(fn, args: tuple, constexprs: dict) -> None:
    """The fast path passes `constexprs` by position after `args`: a launcher that names them in
    another order than the kernel declares them is a bug, not a reason to launch slowly."""
    want = tuple(fn.arg_names[len(args):])
    if want != tuple(constexprs):
        raise TypeError(f"{getattr(fn, '__name__', fn)}: constexprs must follow the kernel's parameters "
                        f"{want}, got {tuple(constexprs)}")


def _hooked(hook) -> bool:
    """Whether a launch hook is installed (a non-empty hook chain, or a plain callable)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def cached_entries() -> int:
    """How many (kernel, key) launches are cached (tests use it to see the fast path taken)."""
    return len(_CACHE)


def ptr_key(*tensors: torch.Tensor) -> tuple:
    """Dtype and 16-byte alignment of each tensor argument (what Triton specialises pointers on)."""
    return tuple((t.dtype, t.data_ptr() & 15) for t in tensors)
