"""The scratch planner (spec 04): its numbers are the bytes the EP path really allocates."""

from __future__ import annotations

import argparse

import pytest
import torch

from padded_moe import planner

SHAPES = dict(num_experts=10, top_k=3, hidden_size=32, intermediate_size=16)


def _tensor_bytes(obj, seen=None) -> int:
    """Bytes of every distinct tensor storage reachable from obj's attributes, dicts, lists."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return sum(_tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


@pytest.mark.parametrize("world", [2, 4])
def test_ep_buffers_match_what_expert_parallel_allocates(world):
    """Spawned gloo ranks report ExpertParallel.buffer_bytes(); rank 0 is the busiest (linear)."""
    from test_distributed import cases_for, group_results

    results = group_results(world)
    for case in cases_for(world):
        r = results[0][case["name"]]
        assert "error" not in r, r.get("error")
        pl = planner.plan(SHAPES, world, case["T"], 1000.0, mode=case["mode"], dtype=case["dtype"],
                          dispatch_dtype=case["dispatch_dtype"])
        assert pl.bytes_of("ep") == r["buffer_bytes"], case["name"]




@pytest.mark.parametrize("mode", ["flat", "batched"])
def test_planner_equals_allocations_of_the_whole_layer(one_rank_group, mode, gen, monkeypatch):
    """EP buffers + fused_experts' scratch workspace (flat) on one rank, measured byte for byte.
    The planner sizes the worst case, GEMM1 and the activation as two steps (a GEMM1 with the
    activation in its epilogue allocates no GEMM1 output), so the call runs them so."""
    from padded_moe.gemm import FUSE_ENV

    monkeypatch.setenv(FUSE_ENV, "0")
    experts = pytest.importorskip("padded_moe.experts")
    from padded_moe.distributed import ExpertParallel
    from padded_moe.layouts import PermuteScratch

    E, k, K, N, T = 10, 3, 32, 16, 6
    ep = ExpertParallel(None, E, k, K, T, mode=mode, dtype=torch.float32)
    pl = planner.plan(SHAPES, 1, T, 1000.0, mode=mode, dtype=torch.float32, weight_format="bf16")
    assert pl.bytes_of("ep") == ep.buffer_bytes()
    got = {b.name: b for b in pl.buffers}
    assert got["receive x" if mode == "flat" else "receive x slabs (+dump row)"].nbytes == \
        ep.buffers()["rb_x"].untyped_storage().nbytes()
    if mode == "batched":
        return
    w13 = torch.randn(E, 2 * N, K, generator=gen)
    w2 = torch.randn(E, K, N, generator=gen)
    x = torch.randn(T, K, generator=gen)
    ids = torch.rand(T, E, generator=gen).argsort(1)[:, :k].int()
    rb, h = ep.dispatch(x, ids, torch.rand(T, k, generator=gen))
    scratch = PermuteScratch(T, k, E, ep.num_local, "cpu")
    experts.fused_experts(rb.x, w13, w2, rb.topk_weights, rb.topk_ids, activation="silu",
                          expert_map=ep.expert_map, valid_tokens=rb.valid_tokens, scratch=scratch)
    assert pl.bytes_of("experts") == _tensor_bytes(scratch)
    assert pl.bytes_of("weights") == w13.nbytes + w2.nbytes


def test_gemm_rows_are_sized_from_all_ranks():
    """Flat mode: the GEMM buffers hold R*T*k rows, not T*k (the under-sizing of the seed)."""
    R, T = 4, 512
    pl = planner.plan("kimi-k3-like", R, T, 139.0)
    rows = {b.name: b.shape[0] for b in pl.buffers}
    assert rows["permuted A"] == rows["GEMM1 out"] == rows["GEMM2 out"] == R * T * 8
    assert rows["receive x"] == R * T


def test_largest_fitting_t_is_the_boundary():
    pl = planner.plan("kimi-k3-like", 4, 2048, 24.0, mode="batched")
    assert not pl.fits
    t = pl.max_tokens_that_fit
    assert 512 <= t < 2048
    assert planner.plan("kimi-k3-like", 4, t, 24.0, mode="batched").fits
    assert not planner.plan("kimi-k3-like", 4, t + 1, 24.0, mode="batched").fits


def test_mxfp4_weights_are_a_quarter_plus_scales_once_or_twice():
    """0.5 byte per element + 2 bytes per 32 elements (the prepared arrangement's scales are bf16
    factors), held once as `FusedMoE` holds them (dsv4-flash's K and N are whole 64-element blocks:
    no padding); with `keep_canonical`, plus the canonical 0.5 + 1 per 32. A preset whose width is
    not whole blocks is counted with its canonical bytes either way, as FusedMoE keeps them."""
    bf = planner.plan("dsv4-flash", 2, 64, 139.0, weight_format="bf16").weights_bytes
    once = planner.plan("dsv4-flash", 2, 64, 139.0, weight_format="mxfp4").weights_bytes
    twice = planner.plan("dsv4-flash", 2, 64, 139.0, weight_format="mxfp4", keep_canonical=True).weights_bytes
    elements = bf // 2
    assert once == elements // 2 + 2 * (elements // 32)
    assert twice == once + elements // 2 + elements // 32
    padded = {"num_experts": 8, "top_k": 2, "hidden_size": 96, "intermediate_size": 64}
    assert planner.plan(padded, 1, 8, 1.0, weight_format="mxfp4").weights_bytes == \
        planner.plan(padded, 1, 8, 1.0, weight_format="mxfp4", keep_canonical=True).weights_bytes
    with pytest.raises(TypeError, match="keep_canonical must be a bool"):
        planner.plan("dsv4-flash", 2, 64, 139.0, weight_format="mxfp4", keep_canonical=1)


def _cli(argv):
    parser = argparse.ArgumentParser()
    planner.add_arguments(parser)
    return planner.run_cli(parser.parse_args(argv))


def test_cli_kimi_4_ranks_512_fits_2048_does_not(capsys):
    base = ["--preset", "kimi-k3-like", "--ranks", "4", "--gpu-mem", "24", "--mode", "batched"]
    assert _cli(base + ["--max-tokens", "512"]) == 0
    out = capsys.readouterr().out
    assert "Fits" in out and "GEMM1 out" in out
    assert _cli(base + ["--max-tokens", "2048"]) == 1
    out = capsys.readouterr().out
    t = planner.plan("kimi-k3-like", 4, 2048, 24.0, mode="batched").max_tokens_that_fit
    assert "Does not fit" in out and f"the largest T that fits is {t}" in out


def test_cli_json_and_bad_arguments(capsys):
    import json

    assert _cli(["--preset", "tiny", "--ranks", "2", "--max-tokens", "16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["total_bytes"] == sum(b["bytes"] for b in data["buffers"])
    assert _cli(["--preset", "tiny", "--ranks", "0"]) == 2
    assert "ranks must be >= 1" in capsys.readouterr().out


def test_plan_argument_errors():
    with pytest.raises(ValueError, match="preset must be one of"):
        planner.plan("nope", 2, 16, 10.0)
    with pytest.raises(ValueError, match="mode"):
        planner.plan("tiny", 2, 16, 10.0, mode="ll")
    with pytest.raises(ValueError, match="missing"):
        planner.plan({"num_experts": 8}, 2, 16, 10.0)
    with pytest.raises(TypeError, match="max_tokens"):
        planner.plan("tiny", 2, 16.0, 10.0)
