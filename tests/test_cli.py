"""The `padded-moe` command: --version, demo (in process and as `python -m padded_moe`), build-native."""

import os
import subprocess
import sys

import pytest

from padded_moe import __version__
from padded_moe.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_demo_runs_and_checks_against_reference(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU demo a user sees: torch paths
    assert main(["demo", "--device", "cpu", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "all checks passed" in out and "flat" in out and "batched" in out


def test_module_entry_point():
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run([sys.executable, "-m", "padded_moe", "--version"], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0 and __version__ in result.stdout


def test_unknown_preset_is_a_clear_error(capsys):
    assert main(["demo", "--preset", "no-such-model", "--device", "cpu"]) == 2
    assert "preset must be one of" in capsys.readouterr().out


def test_build_native_reports_each_library_and_fails_when_one_cannot_be_built(capsys, monkeypatch, tmp_path):
    from padded_moe.kernels import native

    results = [("mx_decode", tmp_path / "a.so", 1.25, None), ("grouped_gemm", tmp_path / "b.so", 0.5, "nvcc failed (1)")]
    monkeypatch.setattr(native, "build_all", lambda: results)
    assert main(["build-native"]) == 1
    out, err = capsys.readouterr()
    assert f"mx_decode: {tmp_path / 'a.so'} (1.2 s)" in out and "grouped_gemm: not built: nvcc failed (1)" in err
    monkeypatch.setattr(native, "build_all", lambda: results[:1])
    assert main(["build-native"]) == 0


def test_build_all_loads_every_library(monkeypatch):
    from padded_moe.kernels import native

    loaded = []
    for lib in native.LIBRARIES:
        monkeypatch.setattr(lib, "failure", lambda lib=lib: loaded.append(lib.name))
    assert [r[0] for r in native.build_all()] == [lib.name for lib in native.LIBRARIES] == loaded
    assert {lib.name for lib in native.LIBRARIES} == {"mx_decode", "grouped_gemm"}
