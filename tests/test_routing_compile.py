"""The one-kernel routers (`padded_moe.kernels.topk`) compile for sm_90 on the forms their launchers
produce (Triton's own ptxas, no GPU): softmax first with and without renormalisation (Qwen3-MoE,
Mixtral) and top-k first (GPT-OSS), 8 to 1024 experts, with libdevice's exponential, no
register spills; and DeepSeek's biased routing with and without the group limit, each scoring. The arguments are captured from interpreted calls and specialised as the
launcher's first call would be, with the GPU's LIBDEVICE flag."""

from __future__ import annotations

import json

import torch
from helpers import (captured_launches, compile_for_sm90, launch_signature, launch_stats_script,
                     require_interpreted_kernels)

SCRIPT = launch_stats_script("padded_moe.kernels.topk", "_topk_router_kernel")

# (experts, k, logits dtype, topk_before_softmax, renormalize)
CASES = [(128, 8, torch.bfloat16, False, True), (8, 2, torch.bfloat16, False, True),
         (128, 4, torch.bfloat16, True, False), (1024, 6, torch.float32, False, False)]


def captured_launch(monkeypatch, num_experts, k, dtype, topk_before_softmax, renormalize) -> list:
    from padded_moe.routing import fused_topk

    (fn, args, constexprs, opt), = captured_launches(monkeypatch, lambda: fused_topk(
        torch.randn(5, num_experts).to(dtype), k, renormalize=renormalize, topk_before_softmax=topk_before_softmax,
        weights_dtype=torch.bfloat16, ids_dtype=torch.int64))
    sig, const, div16 = launch_signature(fn, args, dict(constexprs, LIBDEVICE=True))
    return [sig, const, div16, opt["num_warps"]]


def test_topk_router_kernel_compiles_for_sm90_without_spills(monkeypatch):
    require_interpreted_kernels(monkeypatch)
    cases = [captured_launch(monkeypatch, *c) for c in CASES]
    assert all(c[1]["LIBDEVICE"] for c in cases)
    results = compile_for_sm90(SCRIPT, json.dumps(cases))
    assert len(results) == len(CASES)
    assert all(r["spills"] == 0 for r in results), results


BIASED_SCRIPT = launch_stats_script("padded_moe.kernels.topk", "_biased_router_kernel")

# (experts, k, logits dtype, scoring, bias, groups, kept groups, ids dtype, bfloat16 steps): DeepSeek-V4,
# DeepSeek-V3 (as transformers' router through the plug-in: float32 logits, int64 indices), Kimi-K2-like,
# the widest row, DeepSeek-V4 as transformers' bfloat16 router through the plug-in (float32 bias, then a
# bfloat16 one: BF16_CHOICE)
BIASED_CASES = [(256, 6, torch.bfloat16, "sqrtsoftplus", True, 1, 1, torch.int32, None),
                (256, 8, torch.float32, "sigmoid", True, 8, 4, torch.int64, None),
                (384, 8, torch.bfloat16, "sigmoid", True, 1, 1, torch.int32, None),
                (1024, 8, torch.float32, "softmax", False, 16, 4, torch.int32, None),
                (256, 6, torch.bfloat16, "sqrtsoftplus", True, 1, 1, torch.int64, torch.float32),
                (256, 6, torch.bfloat16, "sigmoid", True, 1, 1, torch.int64, torch.bfloat16)]


def captured_biased_launch(monkeypatch, num_experts, k, dtype, scoring, has_bias, groups, kept, ids_dtype,
                           bf16_bias) -> list:
    from padded_moe.routing import biased_grouped_topk

    bias = torch.randn(num_experts).to(bf16_bias or torch.float32) if has_bias else None
    (fn, args, constexprs, opt), = captured_launches(monkeypatch, lambda: biased_grouped_topk(
        torch.randn(5, num_experts).to(dtype), bias, k, num_groups=groups, topk_groups=kept, scoring=scoring,
        ids_dtype=ids_dtype, weights_dtype=dtype if bf16_bias else torch.float32,
        compute_dtype=torch.bfloat16 if bf16_bias else None))
    sig, const, div16 = launch_signature(fn, args, dict(constexprs, LIBDEVICE=True))
    return [sig, const, div16, opt["num_warps"]]


def test_biased_router_kernel_compiles_for_sm90_without_spills(monkeypatch):
    require_interpreted_kernels(monkeypatch)
    cases = [captured_biased_launch(monkeypatch, *c) for c in BIASED_CASES]
    assert [c[1]["TOPK_GROUPS"] < c[1]["GROUPS"] for c in cases] == [False, True, False, True, False, False]
    assert [(c[1]["BF16_STEPS"], c[1]["BF16_CHOICE"]) for c in cases][-3:] == [(False, False), (True, False),
                                                                             (True, True)]
    results = compile_for_sm90(BIASED_SCRIPT, json.dumps(cases))
    assert len(results) == len(BIASED_CASES)
    assert all(r["spills"] == 0 for r in results), results


GATE_SCRIPT = launch_stats_script("padded_moe.kernels.topk", "_gate_kernel")


def test_gate_path_compiles_for_sm90_without_spills(monkeypatch):
    """A decode step's gate kernel (GPT-OSS: bias; DeepSeek-V4: 256 experts, 4096 wide; float32
    weights) and the router kernels finishing its sums, as the GPU's first calls specialise them."""
    from padded_moe.routing import gate_biased_topk, gate_softmax_topk, gate_sums

    require_interpreted_kernels(monkeypatch)
    gates, routers, biased = [], [], []
    for (E, D, dtype, bias) in ((128, 2880, torch.bfloat16, True), (256, 4096, torch.bfloat16, False),
                                (64, 512, torch.float32, False)):
        x, w = torch.randn(3, D).to(dtype), torch.randn(E, D).to(dtype)
        b = torch.randn(E).to(dtype) if bias else None
        with torch.no_grad():
            launches = captured_launches(monkeypatch, lambda: gate_softmax_topk(gate_sums(x, w, b), 4, False, True))
            launches += captured_launches(monkeypatch, lambda: gate_biased_topk(
                gate_sums(x, w, b), torch.randn(E), 6, 8, 4, "sigmoid", 2.5, True))
        for n, (fn, args, constexprs, opt) in enumerate(launches):
            gpu = dict(constexprs, FP32_DOT=dtype == torch.float32) if n % 2 == 0 else dict(constexprs, LIBDEVICE=True)
            sig, const, div16 = launch_signature(fn, args, gpu)
            (gates, routers, gates, biased)[n].append([sig, const, div16, opt["num_warps"]])
    assert all(c[1]["PARTS"] > 1 for c in routers + biased)
    for script, cases in ((GATE_SCRIPT, gates), (SCRIPT, routers), (BIASED_SCRIPT, biased)):
        results = compile_for_sm90(script, json.dumps(cases))
        assert len(results) == len(cases) and all(r["spills"] == 0 for r in results), results
