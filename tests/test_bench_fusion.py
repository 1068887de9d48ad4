"""The epilogue benchmark (benchmarks/bench_fusion.py) reports the choice `fused_experts` makes by
default by watching the pipeline, and leaves the variable and the pipeline as it found them."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_fusion  # noqa: E402
from padded_moe import experts as ex  # noqa: E402
from padded_moe import fused_experts  # noqa: E402
from padded_moe.gemm import FUSE_ENV  # noqa: E402


@pytest.mark.parametrize("backend,want", [("triton", "epilogue"), ("torch", "two steps")])
def test_default_choice_is_observed_and_restores(monkeypatch, backend, want):
    from padded_moe._platform import kernels_interpreted

    if backend == "triton":
        if not kernels_interpreted():
            pytest.skip("the interpreted kernels are not in use")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(FUSE_ENV, "0")
    gen = torch.Generator().manual_seed(0)
    E, k, K, N, M = 4, 2, 32, 16, 6
    w13, w2 = torch.randn(E, 2 * N, K, generator=gen), torch.randn(E, K, N, generator=gen)
    x = torch.randn(M, K, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).int()
    real = ex.apply_moe_activation
    call = lambda: fused_experts(x, w13, w2, torch.rand(M, k, generator=gen), ids, activation="silu",  # noqa: E731
                                 backend=backend, layout="indexed")
    assert bench_fusion.default_choice(call) == want
    assert os.environ[FUSE_ENV] == "0" and ex.apply_moe_activation is real


def test_settings_name_one_epilogue_column_per_tile_arrangement():
    assert bench_fusion.settings("two_tiles") == [("epilogue", "1", "two_tiles"), ("two steps", "0", "two_tiles")]
    assert [name for name, _, _ in bench_fusion.settings("both")] == ["epilogue two_tiles", "epilogue one_tile",
                                                                      "two steps"]
    assert [tile for _, _, tile in bench_fusion.settings("both")[:2]] == ["two_tiles", "one_tile"]


def test_capture_with_sets_both_switches_during_capture_and_restores(monkeypatch):
    from padded_moe.kernels import gemm as kg

    seen, default = [], kg.GATE_UP_TMA
    other = "two_tiles" if default == "one_tile" else "one_tile"
    monkeypatch.setattr(bench_fusion, "captured", lambda call: seen.append((os.environ[FUSE_ENV], kg.GATE_UP_TMA)))
    monkeypatch.delenv(FUSE_ENV, raising=False)
    bench_fusion.capture_with("1", other, lambda: None)
    assert seen == [("1", other)]
    assert FUSE_ENV not in os.environ and kg.GATE_UP_TMA == default
