"""The native-kernel loader (`padded_moe.kernels.native`) and the decode path's choice of it, on the
CPU: where the library is built and cached, what happens without nvcc, the C entry points of a
real build (where this machine has nvcc), and that a native launch is recorded for launch plans.
The kernel itself runs in tests/test_decode_gpu.py."""

import ctypes

import pytest
import torch

from padded_moe import decode as dec
from padded_moe import launch_plan
from padded_moe.kernels import native
from padded_moe.mxfp4 import quantize_mxfp4


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """A loader with nothing loaded or remembered, caching under tmp_path."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    for lib in (native.DECODE, native.GROUPED):
        monkeypatch.setattr(lib, "_lib", None)
        monkeypatch.setattr(lib, "_failure", None)
        monkeypatch.setattr(lib, "_launches", {})
    return tmp_path


def test_library_path_is_in_the_cache_dir_and_named_by_the_source(fresh_loader, monkeypatch, tmp_path):
    path = native.DECODE.path()
    assert path.parent == fresh_loader and path.suffix == ".so"
    assert native.GROUPED.path() != path
    changed = tmp_path / "changed.cu"
    changed.write_bytes(native.DECODE.source.read_bytes() + b"\n// another build\n")
    monkeypatch.setattr(native.DECODE, "source", changed)
    assert native.DECODE.path() != path
    monkeypatch.delenv(native.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_dir() == tmp_path / "xdg" / "padded_moe"


def test_without_nvcc_the_failure_is_reported_and_remembered(fresh_loader, monkeypatch):
    asked = []
    monkeypatch.setattr(native, "nvcc_path", lambda: asked.append(1))
    with pytest.raises(native.NativeUnavailable, match="nvcc not found"):
        native.library()
    assert native.load_failure().startswith("nvcc not found")
    assert len(asked) == 1, "a failed build must not be retried in the same process"
    assert not list(fresh_loader.glob("*.so"))


def test_a_compiler_error_is_reported(fresh_loader, monkeypatch, tmp_path):
    if native.nvcc_path() is None:
        pytest.skip("no nvcc on this machine")
    broken = tmp_path / "broken.cu"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native.DECODE, "source", broken)
    with pytest.raises(native.NativeUnavailable, match="nvcc failed"):
        native.library()
    assert not list(fresh_loader.glob("*.so")), "a failed build left a library behind"


def test_a_library_another_process_is_building_is_waited_for_not_built_again(fresh_loader, monkeypatch):
    """While the lock beside the library is held (as a rank building it holds it), a load waits;
    once the holder leaves the library in place and lets go, the waiter builds nothing."""
    import fcntl
    import threading

    built = []
    monkeypatch.setattr(native.DECODE, "build", lambda path: built.append(path))
    path = native.DECODE.path()
    path.parent.mkdir(parents=True, exist_ok=True)
    holder = open(path.with_suffix(".lock"), "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    waiter = threading.Thread(target=native.DECODE._build_once, args=(path,))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive(), "the load did not wait for the lock"
    path.write_bytes(b"built by the holder")
    holder.close()  # releases the lock
    waiter.join(timeout=10)
    assert not waiter.is_alive() and built == []
    path.unlink()
    native.DECODE._build_once(path)  # nobody holds the lock and nothing is there: this one builds
    assert built == [path]


def test_the_flags_compile_on_every_cpu():
    assert native.GROUPED.flags[-2:] == native.DECODE.flags[-2:] == ("-split-compile", "0")


def test_nvcc_path_prefers_the_environment(monkeypatch):
    monkeypatch.setenv(native.NVCC_ENV, "/opt/somewhere/nvcc")
    assert native.nvcc_path() == "/opt/somewhere/nvcc"


def test_built_library_entry_points(fresh_loader):
    """A real build with this machine's nvcc (skipped without one): the C entry points answer
    without a GPU, and a second load takes the cached library."""
    if native.nvcc_path() is None:
        pytest.skip("no nvcc on this machine")
    lib = native.library()
    assert native.DECODE.path().exists()
    assert native.w2_num_configs() == 6
    assert [native.w2_split(c) for c in range(6)] == [1, 2, 1, 2, 4, 4]
    with pytest.raises(ValueError, match="configuration 7"):
        native.w2_split(7)
    assert lib.pmoe_error_string(-3).decode() == "top_k x split warps above 16"
    assert native.entry("pmoe_mx_w2_combine") is native.entry("pmoe_mx_w2_combine")


def test_built_grouped_library_entry_points(fresh_loader):
    """The grouped GEMM's library (sm_90a) builds with this machine's nvcc and its C entry points
    answer without a GPU; a call with neither or both of offsets and counts is refused before
    anything is launched."""
    if native.nvcc_path() is None:
        pytest.skip("no nvcc on this machine")
    lib = native.GROUPED.load()
    assert native.GROUPED.path().exists() and native.GROUPED.path() != native.DECODE.path()
    from padded_moe.kernels.native import grouped

    assert lib.pmoe_gg_num_configs() == len(grouped.CONFIGS)
    assert [lib.pmoe_gg_block_n(c) for c in range(len(grouped.CONFIGS))] == [c[2] for c in grouped.CONFIGS]
    assert lib.pmoe_gg_block_n(len(grouped.CONFIGS)) == 0
    configs = range(len(grouped.CONFIGS) + 1)  # and one past the last: 0
    assert [lib.pmoe_gg_pass_rows(c) for c in configs] == [grouped.chunk_rows(c) for c in configs[:-1]] + [0]
    assert lib.pmoe_gg_max_experts() == grouped.MAX_LOCAL_EXPERTS
    code = lib.pmoe_grouped_gemm(0, 1, 1, None, None, 0, 0, 1, 1, None, 0, 0, 1, 128, None, None, None, 0, 0, None, 0,
                                 0, 64, 128, 0, -1, 0, 0.0, 1.0, 0.0, 0, None, None, 0, 0, 0, 0, None, 1, 3, None, 1,
                                 0)
    assert lib.pmoe_error_string(code).decode() == "exactly one of offsets and counts must be given"
    offsets = ctypes.c_void_p(8)  # never read: the arguments are refused first
    code = lib.pmoe_grouped_gemm(0, 1, 1, None, None, 0, 0, 1, 1, None, 0, 0, 1, 128, offsets, None, None, 0, 0, None,
                                 0, 0, 64, 128, 0, -1, 0, 0.0, 1.0, 0.0, 1, None, None, 0, 0, 0, 0, None, 1, 3, None, 1,
                                 0)
    assert lib.pmoe_error_string(code).decode() == "MXFP4 weights need their codes and scales and K a multiple of 32"
    # gathered rows with MXFP4 weights in the producer-upcast kernel: refused
    code = lib.pmoe_grouped_gemm(0, 1, 1, None, None, 0, 0, 1, 1, None, 0, 0, 1, 128, offsets, None, None, 0, 0, None,
                                 0, 0, 64, 128, 0, -1, 0, 0.0, 1.0, 0.0, 1, None, None, 0, 0, 0, 0, None, 1, 3, offsets,
                                 2, 5)
    assert lib.pmoe_error_string(code).decode().startswith("gathered rows need bf16 or RS weights, offsets")
    counts = ctypes.c_void_p(8)  # the RS kernel: gathered rows of a batched (counts) buffer, refused
    code = lib.pmoe_mx_rs_gemm(4, 1, 1, None, None, 0, 64, 1, 1, 64, None, 0, 0, None, 0, 0, 1, 128, 64, None, counts,
                               None, 0, 0, None, 0, 0, 1, 1, 4, 0, -1, 0, 0.0, 1.0, 0.0, 1, None, offsets, 2, 5)
    assert lib.pmoe_error_string(code).decode().startswith("gathered rows need bf16 or RS weights, offsets")
    code = lib.pmoe_grouped_gemm(0, 1, 1, None, None, 0, 0, 1, 1, None, 0, 0, 1, 128, offsets, None, None, 0, 0, None,
                                 0, 0, 64, 128, 0, -1, 0, 0.0, 1.0, 0.0, 0, None, None, 0, 0, 0, 0, None, 2, 3, None, 1,
                                 0)
    assert lib.pmoe_error_string(code).decode() == "the L2 policy of A's rows must be 0 (normal) or 1 (evict last)"
    for mask in (-1, 4):
        code = lib.pmoe_grouped_gemm(0, 1, 1, None, None, 0, 0, 1, 1, None, 0, 0, 1, 128, offsets, None, None, 0, 0,
                                     None, 0, 0, 64, 128, 0, -1, 0, 0.0, 1.0, 0.0, 0, None, None, 0, 0, 0, 0, None, 1,
                                     mask, None, 1, 0)
        assert lib.pmoe_error_string(code).decode() == (
            "the load-policy mask must be 0-3 (1: the weight tile's loads carry their L2 policy, 2: A's rows')")
    assert native.GROUPED.entry("pmoe_grouped_gemm") is native.GROUPED.entry("pmoe_grouped_gemm")


def _prepared(E=4, rows=64, cols=64):
    return quantize_mxfp4(torch.randn(E, rows, cols) * 0.1).prepare_for()


def test_native_choice_setting_is_validated(monkeypatch):
    w2 = _prepared()
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    h = torch.randn(4, 64, dtype=torch.bfloat16)
    tw = torch.rand(1, 4)
    monkeypatch.setattr(dec, "MX_W2", "fast")
    with pytest.raises(ValueError, match="MX_W2 must be one of auto, triton, cuda"):
        dec.native_w2_config(x, h, w2, dec._weight_parts(w2), tw, None, None, 4)
    monkeypatch.setattr(dec, "MX_W2", "triton")
    assert dec.native_w2_config(x, h, w2, dec._weight_parts(w2), tw, None, None, 4) is None


def test_auto_takes_triton_where_the_native_kernel_cannot_run_and_cuda_says_why(monkeypatch):
    """On the CPU (and for float weights) "auto" is the Triton kernel, silently; "cuda" is an error
    naming what is missing."""
    w2 = _prepared()
    monkeypatch.setitem(dec.NATIVE_W2_MEASURED, (64, 64, 4), 0)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    h = torch.randn(4, 64, dtype=torch.bfloat16)
    tw = torch.rand(1, 4)
    monkeypatch.setattr(dec, "MX_W2", "auto")
    assert dec.native_w2_config(x, h, w2, dec._weight_parts(w2), tw, None, None, 4) is None
    dense = torch.randn(4, 64, 64, dtype=torch.bfloat16)
    assert dec.native_w2_config(x, h, dense, dec._weight_parts(dense), tw, None, None, 4) is None
    monkeypatch.setattr(dec, "MX_W2", "cuda")
    with pytest.raises(NotImplementedError, match="bf16 activations on a CUDA device"):
        dec.native_w2_config(x, h, w2, dec._weight_parts(w2), tw, None, None, 4)


def test_a_native_launch_is_recorded_for_launch_plans():
    """`launch_native`'s event has the shape `launch_plan` builds replays from: the input and the
    call's allocation become holes rebound on replay, ints stay as recorded."""

    class Fake:
        function = None
        packed_metadata = None

        def __init__(self):
            self.run = self._run

        def _run(self, *args):
            pass

    fake = Fake()
    x = torch.zeros(4, 8)
    out = torch.empty(4, 8)
    events = [("alloc", out), ("launch", (fake, (3, 2, 1), (1, x, 8, out, None)))]
    plan = launch_plan._build(0, [x], events, out)
    assert plan is not None
    (run, g0, g1, g2, function, metadata, template, holes), = plan.launches
    assert run == fake.run and (g0, g1, g2) == (3, 2, 1) and function is None
    assert template[0] == 1 and template[2] == 8 and template[4] is None
    assert [(i, role) for i, role, _, _ in holes] == [(1, 0), (3, 1)]


def test_auto_leaves_unmeasured_shapes_to_triton_without_building(fresh_loader, monkeypatch):
    """A shape the table has no measurement for stays on the Triton kernel under "auto", and the
    native library is not even built for it."""
    monkeypatch.setattr(dec, "MX_W2", "auto")
    monkeypatch.setattr(native, "library", lambda: pytest.fail("auto built the library for an unmeasured shape"))
    w2 = _prepared(rows=96)
    assert (96, 64, 4) not in dec.NATIVE_W2_MEASURED
    x = torch.randn(1, 96, dtype=torch.bfloat16)
    assert dec.native_w2_config(x, torch.randn(4, 64, dtype=torch.bfloat16), w2, dec._weight_parts(w2), torch.rand(1, 4),
                                None, None, 4) is None
