"""Native (CUDA C++) kernels: built with nvcc at first use, loaded through ctypes.

A kernel lives here where Triton cannot express what it does, each source its own library
(`NativeLibrary`): `DECODE`, the MXFP4 decode GEMM2 (`mx_decode.cu`), and `GROUPED`, the
warp-specialized grouped GEMM of backend "cuda" (`grouped_gemm.cu`); each header says why. Every
native kernel has a Triton twin that stays the default wherever the native one is unavailable or
was not measured faster.

Building. The first call that wants a library's kernel compiles its source (with its headers)
for sm_90 (`GROUPED`: sm_90a, for wgmma) with nvcc into a shared library under the cache directory
and loads it; later processes load the cached library (named by a hash of the sources and the
flags) without nvcc. nvcc optimizes the kernels on every CPU of the machine (`-split-compile 0`;
else it compiles the grouped library's kernels one after another, well over a minute). Processes
that want the same library at once (the ranks of one machine) build it once: the first takes a
lock file beside the library, the others wait for it and load its result. `padded-moe
build-native` builds both libraries ahead of the first call (no GPU needed). nvcc is
`PADDED_MOE_NVCC` if set, else `bin/nvcc` under PyTorch's CUDA home (`CUDA_HOME`), else the one on
`PATH`. The cache directory is `PADDED_MOE_CACHE_DIR` if set, else `padded_moe/` under
`XDG_CACHE_HOME` (default `~/.cache`). The library links the CUDA runtime statically and exports
plain C entry points, so it does not depend on the PyTorch build it runs beside.

A failed build (no nvcc, a compiler error) is remembered for the process: `failure()` says why
(`load_failure()` for the decode library), and callers take their Triton kernels.

Launching. `NativeLaunch` has the shape of a compiled Triton kernel's launcher (`run(grid..,
stream, function, metadata, hooks.., *args)`), so `padded_moe.kernels._launch.launch_native`
records it for launch plans exactly as it records Triton launches, and a plan replays it with the
new call's pointers.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch

NVCC_ENV = "PADDED_MOE_NVCC"
CACHE_ENV = "PADDED_MOE_CACHE_DIR"
BUILD_TIMEOUT_S = 600
_COMMON_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared", "-split-compile", "0")
# sm_90 machine code only: the decode kernels use Hopper's bf16x2 multiply and were measured there.
CAPABILITY = (9, 0)

# Output rows per GEMM2 program (`mx_decode.cu`'s kRows): the grid's first dimension is K over this.
W2_ROWS = 16
# Element-type codes of the kernels' `*_kind` arguments (`mx_decode.cu`, `grouped_gemm.cu`).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


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


class NativeLibrary:
    """One source file built into one shared library: where it is cached, building it, loading it
    once per process (a failure is remembered, see the module docstring), and its entry points."""

    def __init__(self, name: str, source: Path, headers: tuple, arch_flags: tuple, declare):
        self.name = name
        self.source = source
        self.headers = headers  # included by the source: part of the build's identity
        self.flags = (*_COMMON_FLAGS[:2], *arch_flags, *_COMMON_FLAGS[2:])
        self._declare = declare
        self._lock = threading.Lock()
        self._lib: Optional[ctypes.CDLL] = None
        self._failure: Optional[str] = None
        self._launches: dict = {}

    def path(self) -> Path:
        """Where the built library for this source and these flags lives (built or not)."""
        text = self.source.read_bytes() + b"".join(h.read_bytes() for h in self.headers)
        digest = hashlib.sha256(text + "\0".join(self.flags).encode()).hexdigest()[:16]
        return cache_dir() / f"{self.name}-{digest}.so"

    def build(self, path: Path) -> None:
        """Compile the source into `path` (atomically: a temporary file renamed into place, so a
        concurrent process sees either no library or a whole one)."""
        nvcc = nvcc_path()
        if nvcc is None:
            raise NativeUnavailable(f"nvcc not found (set {NVCC_ENV}, CUDA_HOME, or put nvcc on PATH)")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            done = subprocess.run([nvcc, *self.flags, "-I", str(self.source.parent), "-o", tmp, str(self.source)],
                                  capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise NativeUnavailable(f"nvcc failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
            os.replace(tmp, path)
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeUnavailable(f"nvcc could not run: {exc}") from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _build_once(self, path: Path) -> None:
        """Build `path` unless another process does: under an exclusive lock on a file beside it,
        built only if it is still missing once the lock is held."""
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            lock = open(path.with_suffix(".lock"), "a")
        except OSError as exc:
            raise NativeUnavailable(f"cannot open the build lock beside {path}: {exc}") from exc
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not path.exists():
                self.build(path)

    def load(self) -> ctypes.CDLL:
        """The loaded library, built first if the cache lacks it. Raises `NativeUnavailable` (and
        keeps raising it for this process) where that fails."""
        if self._lib is not None:
            return self._lib
        with self._lock:
            if self._lib is not None:
                return self._lib
            if self._failure is not None:
                raise NativeUnavailable(self._failure)
            try:
                path = self.path()
                if not path.exists():
                    self._build_once(path)
                lib = ctypes.CDLL(str(path))
                self._declare(lib)
            except NativeUnavailable as exc:
                self._failure = str(exc)
                raise
            except OSError as exc:
                self._failure = f"could not load the native library {self.name}: {exc}"
                raise NativeUnavailable(self._failure) from exc
            self._lib = lib
            return lib

    def failure(self) -> Optional[str]:
        """None once the library is loaded (built first if the cache lacks it), else why it cannot be."""
        try:
            self.load()
        except NativeUnavailable as exc:
            return str(exc)
        return None

    def entry(self, name: str) -> "NativeLaunch":
        """The launcher of entry point `name` (one object per name and process)."""
        launcher = self._launches.get(name)
        if launcher is None:
            launcher = self._launches.setdefault(name, NativeLaunch(self, name))
        return launcher


class NativeLaunch:
    """A native kernel entry point with a Triton launcher's call shape (see the module docstring).
    `run(g0, g1, g2, stream, function, metadata, enter_hook, exit_hook, hook_args, config, *args)`:
    tensors among `args` are passed as their addresses, None as a null pointer."""

    function = None
    packed_metadata = None

    def __init__(self, owner: NativeLibrary, entry: str):
        self.owner = owner
        self.entry = entry
        self._fn = getattr(owner.load(), entry)
        self.run = self._run  # one bound method for the object's life: plans compare it by identity

    def _run(self, g0, g1, g2, stream, _function, _metadata, _enter, _exit, _hook_args, *args):
        values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        config, rest = values[0], values[1:]
        code = self._fn(config, g0, g1, stream, *rest)
        if code != 0:
            reason = self.owner.load().pmoe_error_string(code).decode()
            raise RuntimeError(f"native kernel {self.entry} failed to launch: {reason} ({code})")


P, LL, I, F = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_float


def _declare_common(lib: ctypes.CDLL) -> None:
    lib.pmoe_error_string.argtypes = [I]
    lib.pmoe_error_string.restype = ctypes.c_char_p


def _declare_decode(lib: ctypes.CDLL) -> None:
    _declare_common(lib)
    lib.pmoe_w2_num_configs.restype = I
    lib.pmoe_w2_split.argtypes = [I]
    lib.pmoe_w2_split.restype = I
    lib.pmoe_mx_w2_combine.restype = I
    lib.pmoe_mx_w2_combine.argtypes = [
        I, I, I, P,  # config, grid x, grid y, stream
        P, LL,  # h, stride
        P, LL, LL,  # words, expert / row strides
        P, LL, LL, LL,  # scales, expert / row / group strides
        P, LL, I,  # bias, expert stride, kind
        P, LL, LL, I,  # router weights, strides, kind
        P, LL, LL, I,  # ids, strides, int64?
        P, P, I,  # expert map, valid_tokens, int64?
        P, LL,  # out, row stride
        I, I, I, I, I, I,  # K, N, KP, E, L, top_k
    ]


def _declare_grouped(lib: ctypes.CDLL) -> None:
    _declare_common(lib)
    lib.pmoe_mx_rs_gemm.restype = I
    lib.pmoe_mx_rs_gemm.argtypes = [
        I, I, I, P,  # stages, grid x, grid y, stream
        P, LL, LL, I, I, I,  # a, slab / row strides, slabs, rows per slab, K
        P, LL, LL,  # words, expert / row strides (int32 elements)
        P, LL, LL,  # scales, expert / group strides (int16 elements)
        I, I, I,  # L, w rows, KP
        P, P,  # offsets (int64) or counts (int32)
        P, LL, I,  # bias, expert stride, kind
        P, LL, LL,  # out, slab / row strides
        I, I,  # walk order (1 column tiles first, 0 chunks first), persistent (1) or one CTA per tile (0)
        I,  # 64-row boxes of a chunk (4 or 5)
        I, I, I,  # epilogue mode (plain, gated halves or gated pairs), activation id, has limit
        F, F, F,  # limit, alpha, beta
        I, P,  # the last box in 16-row pieces (1) or whole (0); tile counter (dynamic walk) or null
        P, I, I,  # gathered rows: slot per row (int32) or null, slots per token, token rows of a
    ]
    lib.pmoe_gg_num_configs.restype = I
    lib.pmoe_gg_block_n.argtypes = [I]
    lib.pmoe_gg_block_n.restype = I
    lib.pmoe_gg_pass_rows.argtypes = [I]
    lib.pmoe_gg_pass_rows.restype = I
    lib.pmoe_gg_max_experts.restype = I
    lib.pmoe_grouped_gemm.restype = I
    lib.pmoe_grouped_gemm.argtypes = [
        I, I, I, P,  # config, grid x, grid y, stream
        P, LL, LL, I, I,  # a, slab / row strides, slabs, rows per slab
        P, LL, LL, I, I,  # w, expert / row strides, L, w rows
        P, P,  # offsets (int64) or counts (int32)
        P, LL, I,  # bias, expert stride, kind
        P, LL, LL,  # out, slab / row strides
        I, I,  # K, N (output columns)
        I, I, I,  # epilogue mode, activation id, has limit
        F, F, F,  # limit, alpha, beta
        I, P, P,  # weight kind (0 bf16, 1 MXFP4), MXFP4 codes, scales
        LL, LL, LL, LL,  # codes' expert / row strides, scales' expert / row strides (bytes)
        P,  # tile counter (the dynamic walk) or null
        I,  # A's rows evict last (1) or normal (0) in L2
        I,  # which TMA loads carry their L2 policy: 1 the weight tile's, 2 A's rows' (a mask)
        P, I, I,  # gathered rows: slot per row (int32) or null, slots per token, token rows of a
    ]


_HERE = Path(__file__).parent
# The decode path's MXFP4 GEMM2 (see `mx_decode.cu`).
DECODE = NativeLibrary("mx_decode", _HERE / "mx_decode.cu", (_HERE / "mx_words.cuh",),
                       ("-gencode=arch=compute_90,code=sm_90",), _declare_decode)
# The warp-specialized grouped GEMM (see `grouped_gemm.cu`): wgmma and setmaxnreg need sm_90a.
GROUPED = NativeLibrary("grouped_gemm", _HERE / "grouped_gemm.cu", (_HERE / "mx_words.cuh",),
                        ("-gencode=arch=compute_90a,code=sm_90a",), _declare_grouped)


LIBRARIES = (DECODE, GROUPED)


def build_all() -> list:
    """Build (or find in the cache) and load every native library: per library, its name, where
    it lives, the seconds it took and None, or why it cannot be built or loaded."""
    results = []
    for lib in LIBRARIES:
        t0 = time.perf_counter()
        failure = lib.failure()
        results.append((lib.name, lib.path(), time.perf_counter() - t0, failure))
    return results


def library() -> ctypes.CDLL:
    """The loaded decode library (`DECODE.load()`)."""
    return DECODE.load()


def load_failure() -> Optional[str]:
    """None once the decode library is loaded, else why it cannot be."""
    return DECODE.failure()


def entry(name: str) -> NativeLaunch:
    """The launcher of the decode library's entry point `name`."""
    return DECODE.entry(name)


def unsupported_device(device: torch.device) -> Optional[str]:
    """None where `device` is one the native kernels are built for, else why not."""
    if device.type != "cuda":
        return f"native kernels need a CUDA device, got {device.type}"
    from padded_moe import _platform

    cap = _platform.capability(device.index if device.index is not None else torch.cuda.current_device())
    if cap != CAPABILITY:
        return f"native kernels are built for compute capability {CAPABILITY}, the device has {cap}"
    return None


def w2_split(config: int) -> int:
    """Warps per slot of GEMM2 configuration `config` (its K split)."""
    split = library().pmoe_w2_split(config)
    if split <= 0:
        raise ValueError(f"unknown native GEMM2 configuration {config}")
    return split


def w2_num_configs() -> int:
    return library().pmoe_w2_num_configs()
