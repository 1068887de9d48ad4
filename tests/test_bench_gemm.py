"""The GEMM benchmark's sweep (benchmarks/bench_gemm.py) never lets a candidate with wrong results win.

Runs on the CPU: unit checks of the candidate filter, then a tiny `--mxfp4-hopper` run under the
interpreter in which every swept call is corrupted on purpose, so the check must reject it.
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_gemm  # noqa: E402
from padded_moe.kernels import gemm as kg  # noqa: E402


def test_result_error_flags_non_finite_and_far_results():
    want = torch.randn(8, 16)
    assert bench_gemm.result_error(want.clone(), want) is None
    bad = want.clone()
    bad[3, 4] = float("nan")
    assert bench_gemm.result_error(bad, want) == "1 non-finite values"
    assert bench_gemm.result_error(want * 1.1, want).startswith("relative error 0.1")


def test_wrong_candidate_is_never_timed_and_cannot_win(monkeypatch):
    monkeypatch.setattr(bench_gemm, "timed", lambda fn, dev: 1.0 if fn() == "fast-but-wrong" else 2.0)
    right, wrong = kg.GemmConfig(16, 32, 64, 1, 4, 1), kg.GemmConfig(32, 32, 64, 1, 4, 1)
    store = {}
    bench_gemm.time_candidates(store, "mxfp4_hopper/decode", [wrong, right], torch.device("cpu"),
                               lambda c: "fast-but-wrong" if c == wrong else "ok",
                               check=lambda c: "relative error 3" if c == wrong else None)
    assert list(store["mxfp4_hopper/decode"]) == [right.short()]
    assert store["wrong"] == {"mxfp4_hopper/decode": [f"{wrong.short()}: relative error 3"]}
    bench_gemm.report_sweep(store)
    assert store["winners"] == {"mxfp4_hopper/decode": right.short()}


def hopper_args(**kw):
    """`run_hopper`'s arguments as `main` parses them for a tiny run, with `kw` replaced."""
    base = dict(tiny=True, models="gpt-oss", rows="1", no_sweep=False, sweep_planes="2,4", humming=False,
                sweep_layouts="indexed", sweep_configs="")
    return bench_gemm.argparse.Namespace(**(base | kw))


def test_tiny_hopper_sweep_rejects_corrupted_results(monkeypatch, tmp_path):
    """Every swept call (those that pass a config) leaves NaN in its output: the check must see it
    on the first layout it tries and exclude the candidate, so no regime gets a winner."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real = bench_gemm.get_backend("triton")

    class Corrupting:
        def gemm(self, a, w, meta, *, out, config=None, **kw):
            res = real.gemm(a, w, meta, out=out, config=config, **kw)
            if config is not None:
                out.view(-1, out.shape[-1])[0, 0] = float("nan")
            return res

    monkeypatch.setattr(bench_gemm, "get_backend", lambda name: Corrupting())
    args = hopper_args()
    results = bench_gemm.run_hopper(args)
    for key in ("mxfp4_hopper/decode", "mxfp4_hopper4/decode"):  # both prepared arrangements
        wrong = results["sweep"]["wrong"][key]
        assert len(wrong) == 2 and all("grouped_contiguous: 1 non-finite values" in w for w in wrong), wrong
    assert results["sweep"]["winners"] == {}


def test_tiny_hopper_sweep_gives_each_arrangement_its_own_weights(monkeypatch):
    """The 2-plane sweep (`mxfp4_hopper/...`) must run on weights prepared with 2 planes and the
    4-plane one on 4-plane weights: prepared weights name their arrangement, they do not default."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real = bench_gemm.get_backend("triton")
    seen = []

    class Spy:
        def gemm(self, a, w, meta, *, out, config=None, **kw):
            if config is not None:
                seen.append(w.hopper.planes)
            return real.gemm(a, w, meta, out=out, config=config, **kw)

    monkeypatch.setattr(bench_gemm, "get_backend", lambda name: Spy())
    args = hopper_args()
    results = bench_gemm.run_hopper(args)
    assert seen and set(seen) == {2, 4}, seen
    assert seen[0] == 2  # `--sweep-planes 2,4`: each stage's 2-plane sweep comes first
    assert not any(results["hopper_rows"][0]["wrong"].values())


def test_hopper_candidates_narrowed_by_name():
    """`--sweep-configs` keeps exactly the named candidates of the regime (in the table's order), and
    only those that run on the arrangement; no names keep them all."""
    four = [c for c in kg.SWEEP_MXFP4_HOPPER["decode"] if c.planes_ok(4)]
    wide = next(c for c in kg.SWEEP_MXFP4_HOPPER["decode"] if not c.planes_ok(4))
    names = [four[2].short(), four[0].short(), wide.short()]
    args = hopper_args(tiny=False, sweep_configs=",".join(names))
    assert bench_gemm.hopper_candidates(args, "decode", 4) == [four[0], four[2]]
    assert bench_gemm.hopper_candidates(hopper_args(tiny=False), "decode", 4) == four
    assert bench_gemm.hopper_candidates(hopper_args(tiny=False, sweep_configs="BM7"), "decode", 4) == []


def test_tiny_hopper_sweep_on_named_layouts(monkeypatch):
    """`--sweep-layouts` times each candidate on every named layout under its own key (INDEXED keeps
    the table's key, so it is not swept unless named), and the report reads the three-part keys."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    timed_layouts = set()
    backend = bench_gemm.get_backend("triton")
    real_gemm = backend.gemm

    def spy(a, w, meta, **kw):
        if kw.get("config") is not None:
            timed_layouts.add(meta.layout.value)
        return real_gemm(a, w, meta, **kw)

    monkeypatch.setattr(backend, "gemm", spy)
    results = bench_gemm.run_hopper(hopper_args(sweep_planes="4", sweep_layouts="grouped_contiguous,grouped_masked"))
    keys = {k for k in results["sweep"] if k not in ("wrong", "winners")}
    assert keys == {"mxfp4_hopper4/decode/grouped_contiguous", "mxfp4_hopper4/decode/grouped_masked"}, keys
    assert set(results["sweep"]["winners"]) == keys
    # every layout ran a candidate (its check covers all three before any is timed)
    assert timed_layouts == {"indexed", "grouped_contiguous", "grouped_masked"}
