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
    (["--tree-a", "."], "--tree-b are required"),
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


def test_worker_command_parses_as_a_worker(tmp_path):
    """The driver starts each worker with this script's own parser: the worker's command line
    must parse, as a worker, with the driver's layer and token arguments."""
    driver = bench_trees_ab.parser().parse_args(
        ["--tree-a", "x", "--tree-b", "y", "--preset", "dsv4-flash", "--tokens", "1,16"])
    cmd = bench_trees_ab.worker_command(driver, tmp_path / "a.pt")
    assert cmd[1] == bench_trees_ab.__file__
    worker = bench_trees_ab.parser().parse_args(cmd[2:])
    assert worker.worker and worker.save == str(tmp_path / "a.pt")
    assert (worker.preset, worker.weights, worker.tokens) == ("dsv4-flash", "mxfp4", "1,16")


FAKE_WORKER = r"""
import json, os, sys, torch
save, scale = sys.argv[1], float(sys.argv[2])
tree_src = os.environ["PYTHONPATH"].split(os.pathsep)[0]
print("a line of the library's own output before ready")
out = torch.arange(8.0).reshape(2, 4)
torch.save({1: out * scale, 16: out}, save)
print("ready", os.path.join(tree_src, "padded_moe", "__init__.py"), flush=True)
n = 0
while sys.stdin.readline().strip() == "time":
    n += 1
    print("noise between replies")
    print(json.dumps({"1": 10.0 * scale + n, "16": 20.0}), flush=True)
"""


def test_driver_alternates_workers_and_reports(monkeypatch, tmp_path, capsys):
    """The driver against two stand-in workers speaking its protocol (ready, then one JSON line of
    times per `time`, other output passed through): every round reaches both, and the report rows
    hold their medians, ratio and output check."""
    import _common

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    trees = []
    for name in ("a", "b"):
        (tmp_path / name / "src" / "padded_moe").mkdir(parents=True)
        (tmp_path / name / "src" / "padded_moe" / "__init__.py").write_text("")
        trees.append(str(tmp_path / name))
    scales = iter(["1.0", "2.0"])
    monkeypatch.setattr(bench_trees_ab, "worker_command",
                        lambda args, save: [sys.executable, str(script), str(save), next(scales)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_common, "device_line", lambda: "cpu (test)")
    out = tmp_path / "report"
    monkeypatch.setattr(sys, "argv", ["bench_trees_ab.py", "--tree-a", trees[0], "--tree-b", trees[1],
                                      "--rounds", "3", "--out", str(out)])
    bench_trees_ab.main()
    import json

    rows = json.loads((out / "bench_trees_ab.json").read_text())["rows"]
    # a: 10 + n, b: 20 + n over rounds n = 1..3 -> medians 12 and 22; at 16 tokens 20 and 20
    assert rows[0][:4] == [1, 12.0, 22.0, round(22 / 12, 3)] and rows[0][-1] == "WRONG"
    assert rows[1][:4] == [16, 20.0, 20.0, 1.0] and rows[1][-1] == "bitwise"
    assert "noise between replies" in capsys.readouterr().out


def test_a_worker_importing_another_tree_is_refused(monkeypatch, tmp_path):
    """A worker whose padded_moe came from elsewhere (an installed copy ahead of PYTHONPATH) would
    time the wrong code: the driver stops."""
    script = tmp_path / "fake_worker.py"
    script.write_text('print("ready /somewhere/else/padded_moe/__init__.py", flush=True)\n')
    (tmp_path / "a" / "src" / "padded_moe").mkdir(parents=True)
    (tmp_path / "a" / "src" / "padded_moe" / "__init__.py").write_text("")
    monkeypatch.setattr(bench_trees_ab, "worker_command", lambda args, save: [sys.executable, str(script)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "argv", ["bench_trees_ab.py", "--tree-a", str(tmp_path / "a"), "--tree-b",
                                      str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="imported padded_moe from"):
        bench_trees_ab.main()
