"""How the library's custom ops are registered: `custom_op("padded_moe::name", mutates_args=...)`.

What `torch.compile` sees of a call is one opaque op with a fake implementation (shapes only).
Compiled graphs call these ops on every forward, so what the dispatcher runs around our function
is per-call host time. `torch.library.custom_op` wraps the function twice in Python (an autograd
kernel and a backend kernel that checks the outputs for aliasing): an op of `fused_experts`' two dozen
arguments costs about 17 µs per call that way against 5 µs registered directly (one CPU). Here
the function is registered directly as the op's kernel for every device
(`CompositeExplicitAutograd`), with the schema inferred from its annotations exactly as
`custom_op` would, and the fake implementation registered with `torch.library.register_fake`.

What this drops, and why that is safe for these ops: the aliasing check (each op returns a fresh
tensor or nothing, and mutates only what `mutates_args` declares) and an autograd kernel (the ops
have no backward either way; autograd's fallback handles inputs that require grad).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, Iterable

import torch

_NAMESPACE = "padded_moe"


def custom_op(qualname: str, *, mutates_args: Iterable[str] = ()) -> Callable:
    """Decorator: define `qualname` (in the `padded_moe` namespace) from the function's annotations
    and make the function its kernel on every device. The decorated name stays the plain function;
    `register_fake(qualname)` below gives the compiler its fake implementation."""
    namespace, _, name = qualname.partition("::")
    if namespace != _NAMESPACE or not name:
        raise ValueError(f"qualname must be '{_NAMESPACE}::<name>', got {qualname!r}")

    def register(fn: Callable) -> Callable:
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        torch.library.define(qualname, schema, lib=_library())
        torch.library.impl(qualname, "default", fn, lib=_library())
        return fn

    return register


def register_fake(qualname: str) -> Callable:
    """Decorator: the fake (meta) implementation of `qualname`, which the compiler traces instead."""

    def register(fn: Callable) -> Callable:
        torch.library.register_fake(qualname, fn, lib=_library())
        return fn

    return register


_LIB = None


def _library() -> torch.library.Library:
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library(_NAMESPACE, "FRAGMENT")
    return _LIB


class OpObjects:
    """Objects that an op's implementation needs (an `ExpertParallel`), by the int id the op takes
    instead: an op's arguments are tensors and numbers, not Python objects. The compiler
    specializes a graph on such an id, so only objects a model shares (one per model, not one per
    layer) are named this way. Weak references: an object that is gone leaves the table, and an op
    naming it raises."""

    def __init__(self, kind: str):
        self._kind = kind
        self._objects: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
        self._ids = itertools.count()

    def add(self, obj: object) -> int:
        i = next(self._ids)
        self._objects[i] = obj
        return i

    def get(self, i: int, op: str) -> object:
        obj = self._objects.get(i)
        if obj is None:
            raise RuntimeError(f"padded_moe::{op}: no live {self._kind} has id {i}")
        return obj
