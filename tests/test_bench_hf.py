"""The end-to-end HF benchmark (benchmarks/bench_hf.py) runs every column on the CPU.

Tiny shapes, padded_moe's torch path: the numbers mean nothing here; the test proves the script
builds each model, switches implementations, fills every cell with a finite positive time, and
computes the logits check, so a GPU run of the real shapes does not fail on plumbing.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_hf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-hf")
    mp = pytest.MonkeyPatch()
    # conftest turns the Triton interpreter on for CPU machines; the smoke run is the torch path.
    mp.setenv("TRITON_INTERPRET", "0")
    try:
        report = bench_hf.main(["--device", "cpu", "--tiny", "--iters", "1", "--out", str(out)])
    finally:
        mp.undo()
    return report, out


# transformers 5.25's DeepSeek-V4 has no static-cache decode step (its compressed attention's cache),
# so the graph columns are NaN for it, with a note saying why; every other model must time them.
NOT_CAPTURABLE = {"DeepSeek-V4-Flash-like"}


def test_every_model_and_column_has_finite_positive_times(tiny_run):
    report, _ = tiny_run
    assert [r["key"] for r in report["rows"]] == list(bench_hf.MODELS)
    assert report["columns"] == list(bench_hf.COLUMNS)
    for row in report["rows"]:
        assert set(row["times_ms"]) == set(bench_hf.COLUMNS)
        for col, times in row["times_ms"].items():
            assert set(times) == set(bench_hf.IMPLS), (row["model"], col)
            if col.startswith("graph_") and row["model"] in NOT_CAPTURABLE:
                assert all(math.isnan(t) for t in times.values()), (row["model"], col, times)
                assert any(n.startswith(row["model"]) and "not capturable" in n for n in report["notes"])
                continue
            assert all(math.isfinite(t) and t > 0 for t in times.values()), (row["model"], col, times)
            assert math.isfinite(row["speedup"][col]) and row["speedup"][col] > 0


def test_logits_check_is_computed(tiny_run):
    report, _ = tiny_run
    for row in report["rows"]:
        check = row["logits"]
        assert check["padded_moe_calls_per_forward"] >= 1
        for impl in ("padded_moe", "grouped_mm", "eager", "batched_mm"):
            assert 0 < check[f"{impl}_vs_fp32_median"] < 0.1, (row["model"], impl, check)
            assert check[f"{impl}_vs_fp32_max"] >= check[f"{impl}_vs_fp32_median"]
        for name in ("eager_vs_grouped_mm", "grouped_mm_vs_fp32", "padded_moe_vs_grouped_mm", "hf_spread"):
            assert 0 <= check[f"{name}_median"] <= check[f"{name}_p90"] < 0.1, (row["model"], name, check)
        assert check["within_spread"], (row["model"], check)


def test_reports_written_with_every_column(tiny_run):
    report, out = tiny_run
    data = json.loads((out / "hf_e2e.json").read_text())
    assert data["columns"] == list(bench_hf.COLUMNS)
    md = (out / "hf_e2e.md").read_text()
    header = md.splitlines()[4]
    for label in bench_hf.column_labels(bench_hf.TINY).values():
        assert label in header
    assert "logits vs grouped_mm" in header
    for name, _ in bench_hf.MODELS.values():
        assert name in md


@pytest.mark.parametrize("argv, match", [
    (["--device", "cpu", "--tiny", "--models", "llama"], "--models"),
    (["--device", "cpu", "--tiny", "--columns", "prefill_b2"], "--columns"),
    (["--device", "cpu"], "--tiny"),
    (["--device", "tpu", "--tiny"], "--device"),
    (["--device", "cpu", "--tiny", "--iters", "0"], "--iters"),
    (["--device", "cpu", "--tiny", "--decode", "MX_W2"], "--decode"),
    (["--device", "cpu", "--tiny", "--decode", "NO_SUCH=1"], "--decode"),
    (["--device", "cpu", "--tiny", "--decode", "DECODE_MAX_TOKENS=8"], "--decode"),
])
def test_bad_arguments_raise_value_error(argv, match):
    with pytest.raises(ValueError, match=match):
        bench_hf.main(argv)


def test_decode_setting_is_applied(monkeypatch):
    from padded_moe import decode as dec

    monkeypatch.setattr(dec, "MX_W2", "auto")
    args = bench_hf.parse_args(["--device", "cpu", "--tiny", "--decode", "MX_W2=triton"])
    bench_hf.validate(args)
    assert dec.MX_W2 == "triton"
