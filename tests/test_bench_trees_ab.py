"""benchmarks/bench_trees_ab.py on the CPU: the comparison of the two trees' outputs and times, and
its refusals (the timing itself needs a GPU)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_trees_ab  # noqa: E402


def test_compare_rows_reports_bits_ratio_and_wrong_outputs():
    ref = torch.randn(4, 8)
    nan = ref.clone()
    nan[2, 3] = float("nan")
    outs = {"a": {1: ref, 16: ref, 128: ref, 1024: nan},
            "b": {1: ref.clone(), 16: ref * 1.001, 128: ref * 1.5, 1024: nan}}
    times = {"a": {T: [10.0, 12.0, 11.0] for T in outs["a"]}, "b": {T: [9.0, 8.0, 30.0] for T in outs["a"]}}
    rows = bench_trees_ab.compare_rows(outs, times)
    assert [r[0] for r in rows] == [1, 16, 128, 1024]
    assert [r[-1] for r in rows] == ["bitwise", "ok", "WRONG", "WRONG"]
    assert rows[0][1:6] == [11.0, 9.0, round(9.0 / 11.0, 3), 10.0, 8.0]


@pytest.mark.parametrize("argv, match", [
    (["--tree-a", ".", "--tree-b", ".", "--rounds", "0"], "--rounds"),
    (["--tree-a", ".", "--tree-b", "."], "needs a GPU"),
])
def test_refusals(monkeypatch, argv, match):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench_trees_ab.py", *argv])
    with pytest.raises(SystemExit, match=match):
        bench_trees_ab.main()


def test_a_tree_without_the_package_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "argv", ["bench_trees_ab.py", "--tree-a", str(tmp_path), "--tree-b", "."])
    with pytest.raises(SystemExit, match="holds no src/padded_moe"):
        bench_trees_ab.main()
