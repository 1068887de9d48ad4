"""benchmarks/bench_hf_mxfp4.py runs on the CPU: tiny widths, padded_moe's torch path. The numbers
mean nothing here; the test proves the script writes the checkpoint, loads it both ways, fills
every cell with a finite positive time, and that the MXFP4 model holds fewer experts bytes than
the dequantized one, so a GPU run of the real widths does not fail on plumbing."""

from __future__ import annotations

import math
import pathlib
import sys

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_hf_mxfp4  # noqa: E402


def test_tiny_run_fills_every_cell(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the torch path (conftest turns the interpreter on)
    got = bench_hf_mxfp4.main(["--device", "cpu", "--tiny", "--iters", "1", "--warmup", "0", "--decode-steps", "1",
                               "--work", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")])
    for run in bench_hf_mxfp4.RUNS:
        for column in bench_hf_mxfp4.COLUMNS:
            value = got["results"][run][column]
            assert math.isfinite(value) and value > 0, (run, column)
    gib = got["experts_gib"]
    # e2m1 + E8M0 (+ folded scales) against bf16: well under half the bytes
    assert 0 < gib["mxfp4_padded_moe"] < 0.5 * gib["bf16_grouped_mm"]
    assert got["logit_errors"]["bf16_padded_moe"][1] < 1e-2
    assert (tmp_path / "out" / "report.md").read_text().count("|") > 10
