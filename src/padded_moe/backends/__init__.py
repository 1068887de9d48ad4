"""GEMM backends behind one interface (see `padded_moe.backends.base`).

`get_backend(name)` returns a backend instance; `resolve_backend(name, device, layout, weight)`
implements `backend="auto"` (triton wherever `use_triton(device)`, torch otherwise) and refuses an
explicitly requested backend that cannot run here, naming it and why.
"""

from __future__ import annotations

import functools

import torch

from padded_moe.backends.base import GemmBackend

BACKENDS = ("auto", "triton", "torch", "humming", "cuda")


@functools.lru_cache(maxsize=None)
def get_backend(name: str) -> GemmBackend:
    if name == "triton":
        from padded_moe.backends.triton_backend import TritonBackend

        return TritonBackend()
    if name == "torch":
        from padded_moe.backends.torch_backend import TorchBackend

        return TorchBackend()
    if name == "humming":
        from padded_moe.backends.humming_backend import HummingBackend

        return HummingBackend()
    if name == "cuda":
        from padded_moe.backends.cuda_backend import CudaBackend

        return CudaBackend()
    raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")


def resolve_backend(name: str, device: torch.device, layout, weight) -> GemmBackend:
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, one of {BACKENDS}, got {type(name).__name__}")
    if name == "auto":
        triton = get_backend("triton")
        if triton.available(device) is None and triton.supports(layout, weight):
            return triton
        return get_backend("torch")
    backend = get_backend(name)
    why = backend.available(device)
    if why is not None:
        raise NotImplementedError(f"backend {name!r} is not available on {device}: {why}")
    if not backend.supports(layout, weight):
        if isinstance(weight, torch.Tensor):
            kind = str(weight.dtype).replace("torch.", "")
        else:
            kind = "Mxfp4Tensor" if weight.holds_canonical else "Mxfp4Tensor (prepared form only, no canonical bytes)"
        raise NotImplementedError(f"backend {name!r} does not support layout {layout.value} with {kind} weights")
    return backend


__all__ = ["BACKENDS", "GemmBackend", "get_backend", "resolve_backend"]
