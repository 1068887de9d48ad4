"""GEMM backends behind one interface (see `padded_moe.backends.base`).

`get_backend(name)` returns a backend instance; `resolve_backend(name, device, layout, weight)`
implements `backend="auto"` (triton wherever `use_triton(device)`, torch otherwise) and refuses an
explicitly requested backend that cannot run here, naming it and why. `auto_native` is the one
place where "auto" leaves the Triton kernels: `fused_experts`, given neither a layout nor a backend,
runs the native grouped GEMM (GROUPED_CONTIGUOUS, backend "cuda") from the rows per expert where it
measured faster on whole calls (`AUTO_NATIVE_ROWS`). The environment variable
`PADDED_MOE_GEMM_BACKEND` (read at every call, `effective_backend`) turns `"auto"` into the backend it
names, for runs that cannot pass `backend=` (a benchmark harness, a serving engine's config).
"""

from __future__ import annotations

import functools
import os

import torch

from padded_moe.backends.base import GemmBackend

BACKENDS = ("auto", "triton", "torch", "humming", "cuda")
BACKEND_ENV = "PADDED_MOE_GEMM_BACKEND"
# `auto_native`: the rows per local expert (tokens x k over the local experts, from shapes), low
# bound included, high excluded, where the native grouped GEMM runs "auto" calls; None: never.
# Measured on whole bf16 calls at 8192 tokens (benchmarks/bench_native_gemm.py, H100s): faster than
# the Triton path at 192 rows per expert (DeepSeek-V4: 1.06x, 1.26x and 1.31x in three runs; 128-row
# Triton tiles compute 256 rows for 192, the native kernel's warpgroups skip in steps of 64), slower
# at 512 (Qwen3-MoE: 0.76-0.85x) and 2048 (Mixtral: 0.76-0.88x), where the tiles are full and
# Triton's reach more of the dense rate. The band stays near the one measured win; its edges are
# not measured.
AUTO_NATIVE_ROWS = (160, 256)


def effective_backend(name: str) -> str:
    """`name`, except that "auto" becomes the backend `PADDED_MOE_GEMM_BACKEND` names (unset, empty or
    "auto": "auto"); any other value of the variable is a ValueError naming it and the choices."""
    if name != "auto":
        return name
    env = os.environ.get(BACKEND_ENV, "").strip().lower()
    if env in ("", "auto"):
        return "auto"
    if env not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {', '.join(BACKENDS)} (or unset), got {env!r}")
    return env


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


def auto_native(device: torch.device, w13, w2, activation, num_slots: int, num_local: int) -> bool:
    """Whether `fused_experts` with its layout and backend left to it runs the native grouped GEMM:
    bf16 weights on a GPU the native kernel is built for (its library built, or buildable, here),
    an activation its epilogue applies, and rows per local expert (`num_slots` = tokens x k over
    `num_local`) within `AUTO_NATIVE_ROWS`. Shapes only, so a captured graph or a compiled graph
    keeps the choice."""
    if AUTO_NATIVE_ROWS is None or num_local < 1:
        return False
    low, high = AUTO_NATIVE_ROWS
    if not low * num_local <= num_slots < high * num_local:
        return False
    if device.type != "cuda" or activation is None:
        return False
    for w in (w13, w2):
        if type(w) not in (torch.Tensor, torch.nn.Parameter) or w.dtype != torch.bfloat16:
            return False
    native = get_backend("cuda")
    return native.fuses(activation) and native.available(device) is None


def resolve_backend(name: str, device: torch.device, layout, weight) -> GemmBackend:
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str, one of {BACKENDS}, got {type(name).__name__}")
    name = effective_backend(name)
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


__all__ = ["AUTO_NATIVE_ROWS", "BACKENDS", "BACKEND_ENV", "GemmBackend", "auto_native", "effective_backend",
           "get_backend", "resolve_backend"]
