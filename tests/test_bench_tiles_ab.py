"""The tile A/B benchmark (benchmarks/bench_tiles_ab.py) times the candidate it names: on the CPU,
the table patch reaches `pick_config` for wide and narrow blocks and is undone afterwards."""

from __future__ import annotations

import os
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


def test_persistent_twin_keeps_each_entry_tile():
    """The table entry with `persistent` flipped flips it in the narrow-block entry too, which
    keeps its own tile; the pool knows both forms."""
    import dataclasses

    key = ("mxfp4_hopper4", "medium")
    wide, narrow = kg.TUNED[key], kg.TUNED_NARROW[key]
    twin = dataclasses.replace(wide, persistent=True)
    pick = lambda b: kg.pick_config(300, True, False, hopper=True, planes=4, block_rows=b)  # noqa: E731
    with bench_tiles_ab.table_entry(key, twin):
        assert pick(128) == twin and pick(64) == dataclasses.replace(narrow, persistent=True)
    assert pick(128) == wide and pick(64) == narrow
    assert twin.short() in bench_tiles_ab.candidate_pool("mxfp4_hopper4")


def test_half_tail_twin_keeps_each_entry_tile():
    """The table entry with `half_tail` flipped flips it in the narrow-block entry too (its own tile)."""
    import dataclasses

    key = ("mxfp4_hopper4", "medium")
    wide, narrow = kg.TUNED[key], kg.TUNED_NARROW[key]
    twin = dataclasses.replace(wide, half_tail=not wide.half_tail)
    pick = lambda b: kg.pick_config(300, True, False, hopper=True, planes=4, block_rows=b)  # noqa: E731
    with bench_tiles_ab.table_entry(key, twin):
        assert pick(128) == twin and pick(64) == dataclasses.replace(narrow, half_tail=twin.half_tail)
    assert pick(128) == wide and pick(64) == narrow
    assert kg.GemmConfig.from_short(twin.short()) == twin


def test_table_kind_and_candidates():
    q = quantize_mxfp4(torch.randn(2, 64, 64))
    assert bench_tiles_ab.table_kind_of(torch.randn(2, 4, 4)) == "bf16"
    assert bench_tiles_ab.table_kind_of(q) == "mxfp4"
    assert bench_tiles_ab.table_kind_of(q.prepare_for()) == "mxfp4_hopper4"
    pool = bench_tiles_ab.candidate_pool("mxfp4_hopper4")
    assert all(c.short() in pool for c in kg.SWEEP_MXFP4_HOPPER["decode"])
    assert kg.TUNED_NARROW[("mxfp4_hopper4", "medium")].short() in pool
    assert bench_tiles_ab.candidate_pool("mxfp4").keys() >= {c.short() for c in kg.SWEEP_MXFP4["small"]}


def test_indexed_regime_of_the_gpt_oss_calls_the_docs_name():
    # 128 tokens: 4 mean rows per expert (decode); 1024: 32 in 64-row blocks (small); 8192: 256 in
    # 128-row blocks (medium); DeepSeek-V4 at 1024: 24 in 32-row blocks (decode), at 2048: 48 in
    # 64-row blocks (small), at 3072: 72 in 128-row blocks (medium).
    assert bench_tiles_ab.indexed_regime(128, 4, 128) == (4.0, 16, "decode")
    assert bench_tiles_ab.indexed_regime(1024, 4, 128) == (32.0, 64, "small")
    assert bench_tiles_ab.indexed_regime(8192, 4, 128) == (256.0, 128, "medium")
    assert bench_tiles_ab.indexed_regime(1024, 6, 256) == (24.0, 32, "decode")
    assert bench_tiles_ab.indexed_regime(2048, 6, 256) == (48.0, 64, "small")
    assert bench_tiles_ab.indexed_regime(3072, 6, 256) == (72.0, 128, "medium")


def test_fuse_activation_setting_is_restored(monkeypatch):
    from padded_moe.gemm import FUSE_ENV, fuse_activation_mode

    monkeypatch.delenv(FUSE_ENV, raising=False)
    with bench_tiles_ab.fuse_activation("1"):
        assert fuse_activation_mode() == "on"
    assert FUSE_ENV not in os.environ
    monkeypatch.setenv(FUSE_ENV, "0")
    with bench_tiles_ab.fuse_activation(None):
        assert fuse_activation_mode() == "off"
    with bench_tiles_ab.fuse_activation("1"):
        assert fuse_activation_mode() == "on"
    assert fuse_activation_mode() == "off"


def test_two_plane_twin_swaps_in_and_out_with_the_same_results():
    """`--planes both`: the twin holds the same canonical bytes in the 2-plane arrangement, and
    `layer_weights` puts it in place for a call and restores the layer's own after (also on error)."""
    from padded_moe.layer import FusedMoE

    layer = FusedMoE.from_preset("tiny", weight_format="mxfp4", dtype=torch.float32)
    layer.randomize(seed=0, std=0.1)
    own = dict(zip(("w13", "w2"), layer.expert_weights()))
    twin = bench_tiles_ab.two_plane_twin(layer._mxfp4)
    for name, q in own.items():
        assert q.hopper.planes == 4 and twin[name].hopper.planes == 2
        assert torch.equal(twin[name].blocks, q.blocks) and torch.equal(twin[name].scales, q.scales)
    x = torch.randn(5, layer.hidden_size)
    tw, ids = layer.route(layer.gate(x), None)
    base = layer.experts(x, tw, ids)
    with pytest.raises(RuntimeError):
        with bench_tiles_ab.layer_weights(layer, twin):
            assert layer.expert_weights()[0] is twin["w13"]
            assert torch.allclose(layer.experts(x, tw, ids), base, rtol=1e-5, atol=1e-6)
            raise RuntimeError("restored on error too")
    assert layer.expert_weights()[0] is own["w13"] and layer.expert_weights()[1] is own["w2"]


def test_candidate_names_give_any_tile_and_a_row_block():
    """`NAME@B`: a tile no table lists (by its short name) and the INDEXED block it runs with."""
    pool = bench_tiles_ab.candidate_pool("mxfp4_hopper4")
    big = kg.GemmConfig(256, 128, 64, 8, 8, 3, mx_hopper=True, mx_ptx=True)
    assert big.short() not in pool
    assert bench_tiles_ab.parse_candidate(big.short() + "@256", pool) == (big, 256)
    table = kg.TUNED[("mxfp4_hopper4", "medium")]
    assert bench_tiles_ab.parse_candidate(table.short(), pool) == (table, None)
    pers = kg.GemmConfig(128, 256, 64, 8, 8, 4, tma=True, persistent=True)
    assert kg.GemmConfig.from_short(pers.short()) == pers
    for bad in ("BM256_BN128", "BM256_BN128_BK64_G8_w8_s3_hop_xyz", big.short() + "@100", big.short() + "@x"):
        with pytest.raises(SystemExit):
            bench_tiles_ab.parse_candidate(bad, pool)


def test_indexed_block_reaches_the_layout_builder_and_is_restored():
    from padded_moe.layouts import GemmLayout, build_layout

    ids = torch.randint(0, 8, (64, 2), dtype=torch.int32)
    default = build_layout(GemmLayout.INDEXED, ids, 8).block_m
    with bench_tiles_ab.indexed_block(256):
        assert build_layout(GemmLayout.INDEXED, ids, 8).block_m == 256
    with bench_tiles_ab.indexed_block(None):
        assert build_layout(GemmLayout.INDEXED, ids, 8).block_m == default
    assert build_layout(GemmLayout.INDEXED, ids, 8).block_m == default != 256


def test_the_table_entry_keeps_the_narrow_block_entry():
    """Naming the table entry times the table as it is (a narrow block still takes
    `TUNED_NARROW`'s tile); any other candidate replaces the narrow-block entry for its turn too."""
    key = ("mxfp4_hopper4", "medium")
    entry, narrow = kg.TUNED[key], kg.TUNED_NARROW[key]
    pick = lambda b: kg.pick_config(192, True, False, hopper=True, planes=4, block_rows=b)  # noqa: E731
    with bench_tiles_ab.table_entry(key, entry):
        assert pick(128) == entry and pick(64) == narrow
    cand = kg.GemmConfig(128, 128, 64, 8, 8, 4, mx_hopper=True, mx_ptx=True)
    with bench_tiles_ab.table_entry(key, cand):
        assert pick(128) == cand and pick(64) == cand
    assert pick(128) == entry and pick(64) == narrow
