"""Replaying an eager call's kernel launches without redoing its host work.

An eager `fused_experts` call spends most of its host time deciding things that depend only on
the call's signature (shapes, dtypes, options): argument checks, layout buffers, tile configs,
grids, each kernel's specialisation. `LaunchPlans` records the Triton launches (and native kernel
launches, `padded_moe.kernels.native`, which take the same shape) and allocations of
a call and, once two consecutive recorded calls of one signature agree, replays them for every
later call of that signature: the new call's tensors take the place of the recorded ones, every
other argument is as recorded.

Why a replay equals a fresh call:
- the caller's key holds every value its host code reads: shapes, strides, dtypes, devices,
  pointer alignments, options, the stream, and the addresses of the long-lived tensors it reads
  (weights), so a call with an equal key would make the same decisions;
- a launch argument that points into a call input is rebound to the new input at the same byte
  offset; one that points into memory allocated during the call is rebound to a fresh allocation
  of the same shape; any other pointer belongs to a long-lived tensor (weights, a cached workspace)
  and is kept, with a weak reference to the storage that tensor's memory belongs to: once it is
  freed (a workspace replaced by a bigger one, a model deleted) the plan is dropped, so a kept
  pointer never outlives its memory. The storage, not the tensor: a per-call view of a weight (a
  dtype view of another element size keeps no `_base`) dies after every call while its memory
  lives on;
- the recorded call may do nothing on the device but those launches and allocations: a dispatch
  mode watches it, and any other operation (a copy, a fill, a torch kernel) makes the key
  unplannable for good;
- two consecutive recordings must agree (same kernels, grids, scalars, kept pointers, rebinding,
  allocations), which rules out a cache being filled during the first one or anything else that
  differs between calls.
The caller decides when a plan may be used at all (CUDA tensors, no graph capture, no compiler,
no launch hooks); see `padded_moe.experts`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from triton.tools.tensor_descriptor import TensorDescriptor

from padded_moe.kernels import _launch

_aten = torch.ops.aten
_ALLOCATIONS = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
                _aten.new_empty.default, _aten.new_empty_strided.default}
# Operations that make no device work (metadata only).
_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.as_strided.default, _aten.slice.Tensor,
          _aten.select.int, _aten.alias.default, _aten.t.default, _aten.transpose.int, _aten.permute.default,
          _aten.unsqueeze.default, _aten.squeeze.dim, _aten.squeeze.default, _aten.squeeze.dims,
          _aten.expand.default, _aten.detach.default, _aten.split.Tensor, _aten.unbind.int,
          _aten.view.dtype, _aten._reshape_alias.default}
# Composite operations seen undecomposed in some contexts (inside a custom op): metadata only when
# the result shares the input's memory, a copy otherwise.
_MAYBE_VIEWS = {_aten.reshape.default, _aten.flatten.using_ints, _aten.contiguous.default, _aten.narrow.default,
                _aten.unflatten.int, _aten.view_as.default, _aten.reshape_as.default, _aten.expand_as.default}

_MAX_KEYS = 512  # plans and pending recordings each; cleared wholesale past this (shape churn)
_MAX_ATTEMPTS = 4  # recordings of one key that may disagree before the key is given up
_ALIGN = 256  # bytes: each allocation's offset in a replay's shared buffer (TMA wants 16)


class LaunchPlan:
    """The launches of one recorded call. `run(inputs)` replays them for new inputs of the same
    signature and returns the call's result (a fresh tensor)."""

    __slots__ = ("device", "result_spec", "offsets", "workspace_bytes", "launches", "kept")

    def __init__(self, device: int, num_inputs: int, allocs: list, launches: list, result: int, kept: list):
        self.device = device
        # Of the allocations the replay makes (`(shape, stride, dtype, device)` each, role order
        # after the inputs), the result is a tensor of its own; every other one is only ever a
        # pointer handed to a launch, so they share one byte buffer per call (one allocation
        # instead of several), each at a 256-byte aligned offset. The buffer is freed when `run`
        # returns, as the separate tensors were: the launches are already queued on the stream.
        self.result_spec = allocs[result - num_inputs]
        self.offsets: list = []  # per allocation role: byte offset in the buffer, None for the result
        size = 0
        for n, (shape, stride, dtype, _) in enumerate(allocs):
            if num_inputs + n == result:
                self.offsets.append(None)
                continue
            self.offsets.append(size)
            size += -(-_extent(shape, stride) * dtype.itemsize // _ALIGN) * _ALIGN
        self.workspace_bytes = size
        self.launches = launches  # (run, g0, g1, g2, function, metadata, template, holes)
        self.kept = kept  # weak references to the storages whose pointers the launches keep

    def alive(self) -> bool:
        """Whether every storage a kept pointer points into still exists."""
        for ref in self.kept:
            if ref() is None:
                return False
        return True

    def run(self, inputs: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
        bases = [0 if t is None else t.data_ptr() for t in inputs]
        shape, stride, dtype, dev = self.result_spec
        out = torch.empty_strided(shape, stride, dtype=dtype, device=dev)
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=dev) if self.workspace_bytes else None
        o = out.data_ptr()
        w = 0 if workspace is None else workspace.data_ptr()
        bases.extend(o if off is None else w + off for off in self.offsets)
        stream = _launch.current_stream(self.device)
        for run, g0, g1, g2, function, metadata, template, holes in self.launches:
            args = template
            if holes:
                args = list(template)
                for i, role, offset, desc in holes:
                    p = bases[role] + offset
                    args[i] = p if desc is None else _rebased(desc, p)
            run(g0, g1, g2, stream, function, metadata, None, None, None, *args)
        return out

    def signature(self) -> tuple:
        """What two recordings must share to be the same plan."""
        return (self.device, self.result_spec, tuple(self.offsets),
                tuple((id(r), g0, g1, g2, tuple(_comparable(a) for a in t), tuple(_comparable_hole(h) for h in hs))
                      for r, g0, g1, g2, _, _, t, hs in self.launches))


def _comparable(a: object) -> object:
    """A template entry as a value two recordings can compare (a descriptor by what it describes)."""
    if isinstance(a, TensorDescriptor):
        return ("desc", a.base.data_ptr(), a.base.dtype, tuple(a.shape), tuple(a.strides), tuple(a.block_shape),
                a.padding)
    return a


def _comparable_hole(hole: tuple) -> tuple:
    i, role, offset, desc = hole
    return i, role, offset, None if desc is None else _comparable(desc)[2:]


def _rebased(desc: TensorDescriptor, ptr: int) -> TensorDescriptor:
    """`desc` over the address `ptr` (same element type). No re-validation: the recorded
    descriptor passed Triton's checks, and the new address keeps the recorded one's alignment (an
    input's alignment is part of the key; allocations and offsets are 256-byte aligned)."""
    new = object.__new__(TensorDescriptor)
    new.__dict__.update(desc.__dict__)
    new.base = _Address(ptr, desc.base.dtype)
    return new


class _Address:
    """A tensor descriptor's base as the launcher reads it (an address and an element type),
    without keeping the tensor alive."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


class _Watch(TorchDispatchMode):
    """Logs allocations in order with the launches (`_launch.recording`), and whether any other
    device work happened."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events
        self.other: Optional[str] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.events.append(("alloc", out))
        elif func not in _VIEWS and not (func in _MAYBE_VIEWS and _aliases(out, args[0])) and self.other is None:
            self.other = str(func)
        return out


def _aliases(out: object, src: object) -> bool:
    return isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor) \
        and out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()


def _span(t: torch.Tensor) -> int:
    """Bytes from `t.data_ptr()` to one past its last element."""
    return _extent(t.shape, t.stride()) * t.element_size()


def _extent(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from the first to one past the last of a strided layout (0 when empty)."""
    if 0 in shape:
        return 0
    return sum((n - 1) * s for n, s in zip(shape, stride)) + 1


def _build(device: int, inputs: Sequence[Optional[torch.Tensor]], events: list, result: object) -> Optional[LaunchPlan]:
    """The plan of one recorded call, or None if it cannot be replayed."""
    if not isinstance(result, torch.Tensor):
        return None
    ranges = [(t.data_ptr(), _span(t)) if t is not None else (0, 0) for t in inputs]
    allocs: list = []  # tensors allocated during the call, in order
    launches = []
    refs: dict = {}  # id -> weak reference of each storage a kept pointer points into
    for kind, item in events:
        if kind == "alloc":
            allocs.append(item)
            continue
        if item is None:  # a launch that the fast path cannot repeat (interpreter, hook, uncacheable)
            return None
        kernel, grid, args = item
        template, holes = [], []
        for i, a in enumerate(args):
            if isinstance(a, TensorDescriptor):
                # The launcher builds the TMA descriptor from `base.data_ptr()` on every launch:
                # the plan keeps the description over an address (no reference to the tensor),
                # rebuilt with the new address where the base is an input or an allocation.
                base = a.base
                if not isinstance(base, torch.Tensor):
                    return None
                p = base.data_ptr()
                desc = _rebased(a, p)
                role = _locate(base, ranges, allocs, refs)
                if role is None:
                    template.append(desc)
                else:
                    template.append(None)
                    holes.append((i, role[0], p - role[1], desc))
                continue
            if not isinstance(a, torch.Tensor):
                if not (a is None or isinstance(a, (int, float, str))):  # an object that may hold a pointer
                    return None
                template.append(a)
                continue
            p = a.data_ptr()
            role = _locate(a, ranges, allocs, refs)
            if role is None:
                template.append(p)
            else:
                r, base = role
                template.append(0)
                holes.append((i, r, p - base, None))
        launches.append((kernel.run, grid[0], grid[1], grid[2], kernel.function, kernel.packed_metadata,
                         tuple(template), tuple(holes)))
    # Keep only the allocations a launch or the result uses; renumber their roles.
    used = {h[1] for *_, holes in launches for h in holes}
    # The result is the latest allocation at its address (the object itself may differ: the
    # dispatch mode sees the tensor before the Python wrapper the caller gets).
    res = next((len(inputs) + j for j in range(len(allocs) - 1, -1, -1)
                if allocs[j].data_ptr() == result.data_ptr() and allocs[j].shape == result.shape
                and allocs[j].stride() == result.stride() and allocs[j].dtype == result.dtype), None)
    if res is None:
        return None
    used.add(res)
    kept = [j for j in range(len(allocs)) if len(inputs) + j in used]
    renumber = {len(inputs) + j: len(inputs) + n for n, j in enumerate(kept)}
    renumber.update({r: r for r in range(len(inputs))})
    launches = [(*head, tuple((i, renumber[r], off, d) for i, r, off, d in holes)) for *head, holes in launches]
    specs = [(tuple(allocs[j].shape), tuple(allocs[j].stride()), allocs[j].dtype, allocs[j].device) for j in kept]
    return LaunchPlan(device, len(inputs), specs, launches, renumber[res], list(refs.values()))


def _locate(t: torch.Tensor, ranges: list, allocs: list, refs: dict) -> Optional[tuple[int, int]]:
    """`_role` of `t`'s address; for a kept pointer (None) a weak reference to the storage that
    holds the memory goes into `refs` (torch keeps one Python object per live storage)."""
    role = _role(t.data_ptr(), ranges, allocs)
    if role is None:
        storage = t.untyped_storage()
        refs.setdefault(id(storage), weakref.ref(storage))
    return role


def _role(p: int, ranges: list, allocs: list) -> Optional[tuple[int, int]]:
    """`(role, base)` of the input or call-time allocation that pointer `p` lies in (the latest
    allocation covering it: an earlier one at that address was freed before it), or None."""
    for r, (base, span) in enumerate(ranges):
        if base <= p < base + span:
            return r, base
    for j in range(len(allocs) - 1, -1, -1):
        t = allocs[j]
        base = t.data_ptr()
        if base <= p < base + t.untyped_storage().nbytes():
            return len(ranges) + j, base
    return None


class LaunchPlans:
    """Plans by caller key (see the module docstring)."""

    _NO_PLAN = object()

    def __init__(self, enabled: bool = True):
        self.enabled = enabled  # False: every call runs in full, nothing is recorded
        self._plans: dict = {}
        self._pending: dict = {}  # key -> (attempts, last recording's plan or None)
        self._lock = threading.Lock()

    def get(self, key) -> Optional[LaunchPlan]:
        """The plan for `key` if there is one and every tensor it keeps a pointer into is alive.
        None while a recording is open (a planned call inside another one, e.g. `fused_experts`
        inside `FusedMoE.forward`): the outer recording must see the inner call's launches, which
        a replay does not report."""
        plan = self._plans.get(key) if self.enabled and not _launch.recording_active() else None
        if plan is None or plan is self._NO_PLAN:
            return None
        if not plan.alive():
            with self._lock:
                self._plans.pop(key, None)
            return None
        return plan

    def call(self, key, device: int, inputs: Sequence[Optional[torch.Tensor]], fn: Callable[[], torch.Tensor]):
        """`fn()` (the full call) for a key without a plan: plain the first time (caches fill),
        recorded after that until two recordings agree or the key is given up."""
        if not self.enabled or self._plans.get(key) is self._NO_PLAN or _launch.recording_active():
            return fn()  # inside an open recording: the outer one records this call's launches
        state = self._pending.get(key)
        if state is None:
            self._remember(self._pending, key, (0, None))
            return fn()
        events: list = []
        with _launch.recording(events), _Watch(events) as watch:
            result = fn()
        plan = None if watch.other else _build(device, inputs, events, result)
        attempts, previous = state
        with self._lock:
            if plan is None or attempts >= _MAX_ATTEMPTS:
                self._pending.pop(key, None)
                self._remember(self._plans, key, self._NO_PLAN)
            elif previous is not None and previous.signature() == plan.signature():
                self._pending.pop(key, None)
                self._remember(self._plans, key, plan)
            else:
                self._remember(self._pending, key, (attempts + 1, plan))
        return result

    def clear(self) -> None:
        """Forget every plan and recording."""
        with self._lock:
            self._plans.clear()
            self._pending.clear()

    def __len__(self) -> int:
        return sum(p is not self._NO_PLAN for p in self._plans.values())

    @staticmethod
    def _remember(table: dict, key, value) -> None:
        if key not in table and len(table) >= _MAX_KEYS:
            table.clear()
        table[key] = value
