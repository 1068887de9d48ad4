"""The tile A/B benchmark (benchmarks/bench_tiles_ab.py) times the candidate it names: on the CPU,
the table patch reaches `pick_config` for wide and narrow blocks and is undone afterwards."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_tiles_ab  # noqa: E402
from padded_moe import experts as ex  # noqa: E402
from padded_moe.kernels import gemm as kg  # noqa: E402
from padded_moe.mxfp4 import quantize_mxfp4  # noqa: E402


def test_table_entry_reaches_pick_config_and_is_restored():
    key = ("mxfp4_hopper4", "medium")
    wide, narrow = kg.TUNED[key], kg.TUNED_NARROW[key]
    cand = kg.GemmConfig(128, 64, 128, 8, 4, 3, mx_hopper=True)
    pick = lambda b: kg.pick_config(300, True, False, hopper=True, planes=4, block_rows=b)  # noqa: E731
    with pytest.raises(RuntimeError):
        with bench_tiles_ab.table_entry(key, cand):
            assert pick(128) == cand and pick(64) == cand
            assert not ex._launch_plans().enabled
            raise RuntimeError("a failing capture still restores the table")
    assert pick(128) == wide and pick(64) == narrow
    assert ex._launch_plans().enabled


def test_table_kind_and_candidates():
    q = quantize_mxfp4(torch.randn(2, 64, 64))
    assert bench_tiles_ab.table_kind_of(torch.randn(2, 4, 4)) == "bf16"
    assert bench_tiles_ab.table_kind_of(q) == "mxfp4"
    assert bench_tiles_ab.table_kind_of(q.prepare_for()) == "mxfp4_hopper4"
    pool = bench_tiles_ab.candidate_pool("mxfp4_hopper4")
    assert all(c.short() in pool for c in kg.SWEEP_MXFP4_HOPPER["decode"])
    assert kg.TUNED_NARROW[("mxfp4_hopper4", "medium")].short() in pool
