"""Native (CUDA C++) kernels: built with nvcc at first use, loaded through ctypes.

A kernel lives here only where a Triton kernel cannot reach the speed the hardware allows (today:
the MXFP4 decode GEMM2, `mx_decode.cu`, whose reasons its header gives). Every native kernel has a
Triton twin that stays the default wherever the native one is unavailable.

Building. The first call that wants a native kernel compiles `mx_decode.cu` (with `mx_words.cuh`)
for sm_90 with nvcc (a few seconds) into a shared library under the cache directory and loads it;
later processes load the cached library (named by a hash of the sources and the flags) without
nvcc. nvcc is
`PADDED_MOE_NVCC` if set, else `bin/nvcc` under PyTorch's CUDA home (`CUDA_HOME`), else the one on
`PATH`. The cache directory is `PADDED_MOE_CACHE_DIR` if set, else `padded_moe/` under
`XDG_CACHE_HOME` (default `~/.cache`). The library links the CUDA runtime statically and exports
plain C entry points, so it does not depend on the PyTorch build it runs beside.

A failed build (no nvcc, a compiler error) is remembered for the process: `load_failure()`
says why, and callers take their Triton kernels.

Launching. `NativeLaunch` has the shape of a compiled Triton kernel's launcher (`run(grid..,
stream, function, metadata, hooks.., *args)`), so `padded_moe.kernels._launch.launch_native`
records it for launch plans exactly as it records Triton launches, and a plan replays it with the
new call's pointers.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

NVCC_ENV = "PADDED_MOE_NVCC"
CACHE_ENV = "PADDED_MOE_CACHE_DIR"
SOURCE = Path(__file__).with_name("mx_decode.cu")
HEADERS = (Path(__file__).with_name("mx_words.cuh"),)  # included by SOURCE: part of the build's identity
# sm_90 machine code only: the kernels use Hopper's bf16x2 multiply and were measured there.
CAPABILITY = (9, 0)
FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-Xcompiler", "-fPIC", "-shared")
BUILD_TIMEOUT_S = 600

# Output rows per GEMM2 program (`mx_decode.cu`'s kRows): the grid's first dimension is K over this.
W2_ROWS = 16
# Element-type codes of the kernels' `*_kind` arguments (`mx_decode.cu`).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None
_failure: Optional[str] = None


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here (the message says why)."""


def nvcc_path() -> Optional[str]:
    """The nvcc that builds the kernels (see the module docstring), or None."""
    explicit = os.environ.get(NVCC_ENV)
    if explicit:
        return explicit
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # pragma: no cover - a torch without cpp_extension
        CUDA_HOME = None
    if CUDA_HOME:
        candidate = Path(CUDA_HOME) / "bin" / "nvcc"
        if candidate.exists():
            return str(candidate)
    return shutil.which("nvcc")


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "padded_moe"


def library_path() -> Path:
    """Where the built library for this source and these flags lives (built or not)."""
    text = SOURCE.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
    digest = hashlib.sha256(text + "\0".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / f"mx_decode-{digest}.so"


def build(path: Path) -> None:
    """Compile the source into `path` (atomically: a temporary file renamed into place, so a
    concurrent process sees either no library or a whole one)."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise NativeUnavailable(f"nvcc not found (set {NVCC_ENV}, CUDA_HOME, or put nvcc on PATH)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([nvcc, *FLAGS, "-I", str(SOURCE.parent), "-o", tmp, str(SOURCE)], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise NativeUnavailable(f"nvcc failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"nvcc could not run: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:
    P, L, I = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
    lib.pmoe_w2_num_configs.restype = I
    lib.pmoe_w2_split.argtypes = [I]
    lib.pmoe_w2_split.restype = I
    lib.pmoe_error_string.argtypes = [I]
    lib.pmoe_error_string.restype = ctypes.c_char_p
    lib.pmoe_mx_w2_combine.restype = I
    lib.pmoe_mx_w2_combine.argtypes = [
        I, I, I, P,  # config, grid x, grid y, stream
        P, L,  # h, stride
        P, L, L,  # words, expert / row strides
        P, L, L, L,  # scales, expert / row / group strides
        P, L, I,  # bias, expert stride, kind
        P, L, L, I,  # router weights, strides, kind
        P, L, L, I,  # ids, strides, int64?
        P, P, I,  # expert map, valid_tokens, int64?
        P, L,  # out, row stride
        I, I, I, I, I, I,  # K, N, KP, E, L, top_k
    ]


def library() -> ctypes.CDLL:
    """The loaded native library, built first if the cache lacks it. Raises `NativeUnavailable`
    (and keeps raising it for this process) where that fails."""
    global _library, _failure
    if _library is not None:
        return _library
    with _lock:
        if _library is not None:
            return _library
        if _failure is not None:
            raise NativeUnavailable(_failure)
        try:
            path = library_path()
            if not path.exists():
                build(path)
            lib = ctypes.CDLL(str(path))
            _declare(lib)
        except NativeUnavailable as exc:
            _failure = str(exc)
            raise
        except OSError as exc:
            _failure = f"could not load the native library: {exc}"
            raise NativeUnavailable(_failure) from exc
        _library = lib
        return lib


def unsupported_device(device: torch.device) -> Optional[str]:
    """None where `device` is one the native kernels are built for, else why not."""
    if device.type != "cuda":
        return f"native kernels need a CUDA device, got {device.type}"
    from padded_moe import _platform

    cap = _platform.capability(device.index if device.index is not None else torch.cuda.current_device())
    if cap != CAPABILITY:
        return f"native kernels are built for compute capability {CAPABILITY}, the device has {cap}"
    return None


def load_failure() -> Optional[str]:
    """None once the library is loaded (built first if the cache lacks it), else why it cannot be."""
    try:
        library()
    except NativeUnavailable as exc:
        return str(exc)
    return None


class NativeLaunch:
    """A native kernel entry point with a Triton launcher's call shape (see the module docstring).
    `run(g0, g1, g2, stream, function, metadata, enter_hook, exit_hook, hook_args, config, *args)`:
    tensors among `args` are passed as their addresses, None as a null pointer."""

    function = None
    packed_metadata = None

    def __init__(self, entry: str):
        self.entry = entry
        self._fn = getattr(library(), entry)
        self.run = self._run  # one bound method for the object's life: plans compare it by identity

    def _run(self, g0, g1, g2, stream, _function, _metadata, _enter, _exit, _hook_args, *args):
        values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        config, rest = values[0], values[1:]
        code = self._fn(config, g0, g1, stream, *rest)
        if code != 0:
            reason = library().pmoe_error_string(code).decode()
            raise RuntimeError(f"native kernel {self.entry} failed to launch: {reason} ({code})")


_launches: dict = {}


def entry(name: str) -> NativeLaunch:
    """The launcher of native entry point `name` (one object per name and process)."""
    launcher = _launches.get(name)
    if launcher is None:
        launcher = _launches.setdefault(name, NativeLaunch(name))
    return launcher


def w2_split(config: int) -> int:
    """Warps per slot of GEMM2 configuration `config` (its K split)."""
    split = library().pmoe_w2_split(config)
    if split <= 0:
        raise ValueError(f"unknown native GEMM2 configuration {config}")
    return split


def w2_num_configs() -> int:
    return library().pmoe_w2_num_configs()
