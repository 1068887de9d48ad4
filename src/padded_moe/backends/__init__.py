"""GEMM backends behind one interface (see `padded_moe.backends.base`).

`get_backend(name)` returns a backend instance; `resolve_backend(name, device, layout, weight)`
implements `backend="auto"` (triton wherever `use_triton(device)`, torch otherwise) and refuses an
explicitly requested backend that cannot run here, naming it and why. `auto_native` is the one
place where "auto" leaves the Triton kernels: `fused_experts`, given neither a layout nor a backend,
runs the native grouped GEMM (GROUPED_CONTIGUOUS, backend "cuda") for the bf16 expert shapes and rows
per expert where it measured faster on whole calls (`AUTO_NATIVE_ROWS`), and for prepared MXFP4
weights of the shapes and rows per expert in `AUTO_RS_ROWS` (the RS kernel). The environment variable
`PADDED_MOE_GEMM_BACKEND` (read at every call, `effective_backend`) turns `"auto"` into the backend it
names, for runs that cannot pass `backend=` (a benchmark harness, a serving engine's config).
"""

from __future__ import annotations

import functools
import os

import torch

from padded_moe.backends.base import GemmBackend
from padded_moe.mxfp4 import Mxfp4Tensor

BACKENDS = ("auto", "triton", "torch", "humming", "cuda")
BACKEND_ENV = "PADDED_MOE_GEMM_BACKEND"
# `auto_native`: for an expert shape (hidden size K, intermediate size N: `w2` is [E, K, N]), the rows
# per local expert (tokens x k over the local experts, from shapes), low bound included, high
# excluded, where the native grouped GEMM runs "auto" calls; a shape not listed keeps Triton.
# Measured on whole bf16 calls (benchmarks/bench_native_gemm.py, one H100, native configuration 0
# against Triton on INDEXED, 64 to 320 rows per expert): the native kernel's warpgroups skip rows in
# steps of 64 and read an expert's weight tile once for up to 256 rows, where Triton's 128-row tiles
# pad each expert to a multiple of 128 and read the weights once per m-tile; with full tiles
# Triton's reach more of the dense rate. Per shape:
# - DeepSeek-V4 (4096, 2048): 1.07x at 64 rows, 1.12x at 96, 1.18x at 112, 1.28x at 128, 1.26x at 160,
#   1.06-1.31x at 192 (three runs, two H100s); 0.81x at 256, 0.76x at 320.
# - GPT-OSS in bf16 (2880, 2880): 0.98x at 64, 1.23x at 128, 0.98x at 192, 0.82x at 256: the band is
#   kept around the one win (112 and 159 not measured).
# - Mixtral (4096, 14336): 1.08x at 64, 0.98x at 96, 1.03x at 128, 0.97x at 192, 0.83x at 256.
# - Qwen3-MoE (2048, 768): 0.97x at 128, 0.92x at 192, 0.77x at 256: not listed.
AUTO_NATIVE_ROWS = {
    (4096, 2048): (64, 256),
    (2880, 2880): (112, 160),
    (4096, 14336): (64, 80),
}
# `auto_native` for MXFP4 weights in their prepared form (`grouped.takes_rs`): the RS kernel (its
# consumers upcast into wgmma's register operand, 256 or 320 of an expert's rows per tile) on
# GROUPED_CONTIGUOUS, per expert shape (K, N) within a band of rows per local expert (low included,
# high excluded), as AUTO_NATIVE_ROWS. Measured on whole calls (H100, bench_native_gemm.py, INDEXED
# Triton time / this; the same path differs by up to 5-8% between variants of one run):
# - DeepSeek-V4 (4096, 2048): 1.08-1.15x at 144 and 1.09-1.13x at 192 rows per expert, 0.86x at 96.
# - GPT-OSS (2880, 2880), swigluoai in the RS kernel's epilogue: 1.07-1.15x at 192, 1.08-1.10x at 256
#   (320-row chunks there: half the experts hold 257-305 rows; their last box in 16-row pieces,
#   `grouped.RS_TAIL_PIECES`), 0.93-0.97x at 128. Its GEMMs alone at 256: 1.13-1.19x with 320-row
#   chunks (scripts/mx_rs_probe.py).
AUTO_RS_ROWS = {
    (4096, 2048): (144, 256),
    (2880, 2880): (192, 320),
}


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
    """Whether `fused_experts` with its layout and backend left to it runs the native grouped GEMM,
    on a GPU the native kernel is built for (its library built, or buildable, here): bf16 weights
    with an activation its epilogue applies and rows per local expert (`num_slots` = tokens x k
    over `num_local`) within the band `AUTO_NATIVE_ROWS` gives the experts' shape; or MXFP4
    weights that both run the RS kernel (`grouped.takes_rs`), any `MoEActivation`, and rows
    per local expert within the band `AUTO_RS_ROWS` gives the experts' shape. Shapes only, so a
    captured graph or a compiled graph keeps the choice."""
    if num_local < 1 or device.type != "cuda" or activation is None:
        return False
    if isinstance(w13, Mxfp4Tensor) or isinstance(w2, Mxfp4Tensor):
        from padded_moe.kernels.native.grouped import takes_rs

        band = AUTO_RS_ROWS.get((w2.shape[1], w2.shape[2]))
        return (band is not None and takes_rs(w13) and takes_rs(w2)
                and band[0] * num_local <= num_slots < band[1] * num_local
                and get_backend("cuda").available(device) is None)
    if not AUTO_NATIVE_ROWS:
        return False
    for w in (w13, w2):
        if type(w) not in (torch.Tensor, torch.nn.Parameter) or w.dtype != torch.bfloat16:
            return False
    band = AUTO_NATIVE_ROWS.get((w2.shape[1], w2.shape[2]))
    if band is None:
        return False
    low, high = band
    if not low * num_local <= num_slots < high * num_local:
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


__all__ = ["AUTO_NATIVE_ROWS", "AUTO_RS_ROWS", "BACKENDS", "BACKEND_ENV", "GemmBackend", "auto_native",
           "effective_backend", "get_backend", "resolve_backend"]
