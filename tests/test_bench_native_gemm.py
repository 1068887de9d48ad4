"""benchmarks/bench_native_gemm.py on the CPU: its helpers, and that it refuses to run without a GPU
(the timing itself needs one)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_native_gemm  # noqa: E402


def test_rel_diff():
    ref = torch.randn(16, 8)
    assert bench_native_gemm.rel_diff(ref.clone(), ref) == 0.0
    assert abs(bench_native_gemm.rel_diff(ref * 1.01, ref) - 0.01) < 1e-6


def test_alternate_takes_each_graphs_median(monkeypatch):
    times = iter([3.0, 10.0, 1.0, 30.0, 2.0, 20.0])
    monkeypatch.setattr(bench_native_gemm, "bench_us", lambda fn, **kw: next(times))
    graphs = {"a": type("G", (), {"replay": None})(), "b": type("G", (), {"replay": None})()}
    assert bench_native_gemm.alternate(graphs, rounds=3) == {"a": 2.0, "b": 20.0}


def test_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench_native_gemm.py"])
    with pytest.raises(SystemExit, match="needs a GPU"):
        bench_native_gemm.main()


def test_forced_config_sets_the_configuration_and_the_walk():
    from padded_moe.kernels.native import grouped

    before = grouped.default_config, grouped.DYNAMIC_WALK
    with bench_native_gemm.forced_config(3, True, False):
        assert grouped.default_config(1.0, False) == 3 and grouped.DYNAMIC_WALK is True
        assert grouped.ROWS_EVICT_LAST is False
    assert grouped.ROWS_EVICT_LAST is True
    with bench_native_gemm.forced_config(None, None):
        assert (grouped.default_config, grouped.DYNAMIC_WALK) == before
    assert (grouped.default_config, grouped.DYNAMIC_WALK) == before


def test_variants_selected_by_name_with_the_base_always_timed():
    bf16, mx = bench_native_gemm.call_variants(False), bench_native_gemm.call_variants(True)
    # MXFP4: no wide tiles or counter walks of the bf16 kernel; the RS kernel with its gated epilogue,
    # chunk sizes, whole partial boxes, its counter walk and GEMM1's gathered rows forced
    extras = ("", ", chunks256", ", chunks320", ", whole boxes", ", dynamic", ", whole boxes, dynamic",
              ", dynamic, gather")
    rs_only = {f"grouped, cuda{fused}{extra}" for fused in ("", ", fused") for extra in extras}
    rs_only.remove("grouped, cuda")
    assert set(mx) - set(bf16) == rs_only and "grouped, cuda c3 dyn" not in mx
    assert "grouped, cuda, fused" not in bf16 and "grouped, cuda, gather" in bf16
    assert bench_native_gemm.select_variants(bf16, set()) == bf16
    picked = bench_native_gemm.select_variants(bf16, {"auto", "grouped, cuda c0"})
    assert list(picked) == ["indexed, Triton", "auto", "grouped, cuda c0"]
    assert list(bench_native_gemm.select_variants(mx, {"auto", "grouped, cuda c3"})) == ["indexed, Triton", "auto"]
    # humming-kernels: MXFP4 weights only, and only where the package is installed
    mx_h = bench_native_gemm.call_variants(True, humming=True)
    assert set(mx_h) - set(mx) == {"grouped, humming"}
    assert "grouped, humming" not in bench_native_gemm.call_variants(False, humming=True)
    assert list(bench_native_gemm.select_variants(mx_h, {"grouped, humming"})) == ["indexed, Triton", "grouped, humming"]


def test_unknown_variants_fail_before_any_gpu_work(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_native_gemm.py", "--variants", "auto,grouped, Triton"])
    with pytest.raises(SystemExit, match="unknown"):
        bench_native_gemm.main()


def test_rs_switches_leave_auto_at_the_library_defaults():
    from padded_moe.kernels.native import grouped

    defaults = (grouped.RS_EPILOGUE, grouped.RS_EPILOGUE_SPLIT, grouped.RS_WIDE)
    for name in ("auto", "indexed, Triton", "grouped, Triton"):
        with bench_native_gemm.rs_switches(name):
            assert (grouped.RS_EPILOGUE, grouped.RS_EPILOGUE_SPLIT, grouped.RS_WIDE) == defaults
    def state():
        return (grouped.RS_EPILOGUE, grouped.RS_EPILOGUE_SPLIT, grouped.RS_WIDE, grouped.RS_TAIL_PIECES,
                grouped.RS_DYNAMIC, grouped.RS_GATHER and grouped.GATHER_BF16)

    with bench_native_gemm.rs_switches("grouped, cuda"):
        assert state() == (False, False, None, True, False, False)
    with bench_native_gemm.rs_switches("grouped, cuda, fused, chunks320"):
        assert state() == (True, True, True, True, False, False)
    with bench_native_gemm.rs_switches("grouped, cuda, chunks256"):
        assert state() == (False, False, False, True, False, False)
    with bench_native_gemm.rs_switches("grouped, cuda, fused, whole boxes, dynamic"):
        assert state() == (True, True, None, False, True, False)
    with bench_native_gemm.rs_switches("grouped, cuda, dynamic, gather"):
        assert state() == (False, False, None, True, True, True)
    assert (grouped.RS_EPILOGUE, grouped.RS_EPILOGUE_SPLIT, grouped.RS_WIDE) == defaults
