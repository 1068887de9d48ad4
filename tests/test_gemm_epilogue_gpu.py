"""GEMM1 with the activation in its epilogue on an H200-class GPU (see tests/test_gemm_epilogue.py).

On the GPU the epilogue must equal GEMM1 into a bf16 buffer followed by the activation op bit for
bit: both accumulate each element in the same order and round it to bf16 once before the
activation. Model shapes, every layout, every regime's tuned tile, bf16 weights (TMA tiles: one for
interleaved gate/up rows; for gate-first halves two, or one from a 4-D descriptor with
`GATE_UP_TMA = "one_tile"`) and MXFP4 (dot_scaled on the canonical bytes, the Hopper kernel on the
prepared form), with a float64 reference bounding the result.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import SENTINEL, rel_err
from test_gemm_gpu import DEV, LAYOUTS, inputs_for, make_weight, out_for, rows_of, weight_cache

from padded_moe.activation import (ActivationEpilogue, ApplyMoEActivationConfig, MoEActivation, _resolve,
                                   apply_moe_activation)
from padded_moe.backends import get_backend
from padded_moe.kernels import gemm as kg
from padded_moe.layouts import GemmLayout, build_layout
from padded_moe.mxfp4 import dequantize_mxfp4

pytestmark = pytest.mark.gpu

# (name, L, K, N, k, M tokens, activation, bias): DeepSeek-V4, GPT-OSS, Qwen3-MoE, Mixtral widths.
SHAPES = [
    ("dsv4", 256, 4096, 2048, 6, 64, "silu", False),
    ("gpt_oss", 128, 2880, 2880, 4, 64, "swigluoai", True),
    ("qwen3", 128, 2048, 768, 8, 64, "silu", False),
    ("mixtral", 8, 4096, 14336, 2, 48, "silu", False),
]
REGIMES = ["decode", "small", "medium", "prefill"]


@pytest.fixture(scope="module")
def weights():
    return weight_cache(one_at_a_time=True)


def case(shape, layout, wdtype, weights, seed=7):
    name, L, K, N, k, M, act, with_bias = shape
    w = weights(name, L, 2 * N, K, wdtype)
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = torch.randint(-1, L + 2, (M, k), generator=g, device=DEV, dtype=torch.int32)
    meta = build_layout(layout, ids, L)
    a = inputs_for(layout, meta, "w13", K, M, k, seed)
    bias = torch.randn(L, 2 * N, device=DEV, generator=g).bfloat16() if with_bias else None
    return w, meta, a, bias, MoEActivation(act)


def run_both(layout, w, meta, a, bias, act, cfg, act_cfg=None):
    """(epilogue output, GEMM1 + activation op output), both SENTINEL-filled before."""
    be = get_backend("triton")
    n_out = w.shape[1]
    width = n_out // 2 if act.is_gated else n_out
    fused = out_for(layout, meta, a, width)
    be.gemm_activation(a, w, meta, bias=bias, out=fused, config=cfg, epilogue=ActivationEpilogue.of(act, act_cfg))
    h = out_for(layout, meta, a, n_out)
    be.gemm(a, w, meta, stage="w13", bias=bias, out=h, config=cfg)
    plain = out_for(layout, meta, a, width)
    apply_moe_activation(act, plain, h, activation_config=act_cfg, valid_token_counts=meta.activation_counts)
    torch.cuda.synchronize()
    return fused, plain


def check(layout, w, meta, a, bias, act, fused, plain, w_ref=None):
    width = fused.shape[-1]
    flat_f, flat_p = fused.reshape(-1, width), plain.reshape(-1, width)
    e, ar, cr = rows_of(meta, "w13", None)
    written = torch.zeros(flat_f.shape[0], dtype=torch.bool, device=DEV)
    written[cr] = True
    assert (flat_f[~written] == SENTINEL).all(), "rows outside the layout were written"
    assert torch.equal(flat_f[cr], flat_p[cr]), \
        f"epilogue != GEMM1 + activation op at {(flat_f[cr] != flat_p[cr]).sum().item()} elements"
    # float64 reference on a few experts (GEMM in float64, the activation in float32 on it)
    from padded_moe.torch_path import activation as ta

    wr = w if w_ref is None else w_ref
    a2 = a.reshape(-1, a.shape[-1])
    num = den = 0.0
    for ex in torch.unique(e).tolist()[:6]:
        sel = e == ex
        w64 = dequantize_mxfp4(wr[ex], torch.float64)[0] if not isinstance(wr, torch.Tensor) else wr[ex].double()
        h = a2[ar[sel]].double() @ w64.T
        if bias is not None:
            h += bias[ex].double()
        ref = torch.empty(h.shape[0], width, dtype=torch.float32, device=DEV)
        p = _resolve(act, ApplyMoEActivationConfig())
        params = dict(limit=p.limit, alpha=p.alpha, beta=p.beta, situ_beta=p.situ_beta, situ_lambda=p.situ_lambda)
        ta.apply_rows(act.value, act.is_gated, act.interleaved, ref, h, params)
        num += (flat_f[cr[sel]].double() - ref.double()).norm().item() ** 2
        den += ref.double().norm().item() ** 2
        assert torch.isfinite(flat_f[cr[sel]]).all()
    assert math.sqrt(num / max(den, 1e-30)) < 2e-2


@pytest.mark.parametrize("gate_up", ["two_tiles", "one_tile"])
@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_bf16_model_shapes(shape, layout, regime, gate_up, weights, monkeypatch):
    """`gate_up`: how TMA tiles read gate-first rows (`kernels.gemm.GATE_UP_TMA`)."""
    cfg = kg.TUNED[("bf16", regime)]
    if gate_up == "one_tile" and not (cfg.tma and shape[6] == "silu"):
        pytest.skip("GATE_UP_TMA applies to TMA tiles of gate-first rows")
    monkeypatch.setattr(kg, "GATE_UP_TMA", gate_up)
    w, meta, a, bias, act = case(shape, layout, "bf16", weights)
    fused, plain = run_both(layout, w, meta, a, bias, act, cfg)
    check(layout, w, meta, a, bias, act, fused, plain)


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("wdtype", ["mxfp4", "mxfp4_hopper"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1]], ids=lambda s: s[0])
def test_mxfp4_model_shapes(shape, wdtype, layout, regime, weights):
    w, meta, a, bias, act = case(shape, layout, wdtype, weights)
    kind = kg.table_kind(True, wdtype == "mxfp4_hopper", 4)
    fused, plain = run_both(layout, w, meta, a, bias, act, kg.TUNED[(kind, regime)])
    check(layout, w, meta, a, bias, act, fused, plain)


@pytest.mark.parametrize("act", ["gelu_tanh", "swiglustep", "situ", "silu_no_mul", "relu2_no_mul"])
def test_other_activations(act, weights):
    """The rest of spec 01's activations on the prefill tile (TMA, two accumulators where gated)."""
    shape = ("qwen3", 128, 2048, 768, 8, 256, act, True)
    w, meta, a, bias, a_enum = case(shape, GemmLayout.GROUPED_CONTIGUOUS, "bf16", weights)
    cfg = ApplyMoEActivationConfig(situ_beta=4.0) if act == "situ" else None
    if not a_enum.is_gated:
        w = w[:, :768].contiguous()
        bias = bias[:, :768].contiguous()
    fused, plain = run_both(GemmLayout.GROUPED_CONTIGUOUS, w, meta, a, bias, a_enum, kg.TUNED[("bf16", "prefill")],
                            cfg)
    e, ar, cr = rows_of(meta, "w13", None)
    flat_f, flat_p = fused.reshape(-1, fused.shape[-1]), plain.reshape(-1, plain.shape[-1])
    assert torch.equal(flat_f[cr], flat_p[cr])
    assert rel_err(flat_f[cr].float(), flat_p[cr].float()) == 0.0


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_epilogue_small_sanitizer(layout, monkeypatch):
    """Small and quick, for `compute-sanitizer --tool memcheck`: every epilogue route (pointer
    weights, TMA one tile, TMA two tiles or one 4-D tile for gate-first rows, MXFP4 dot_scaled,
    prepared MXFP4) on ragged counts with K = 160 and 100 activation columns (partial n-tiles)."""
    L, K, N, M, k = 4, 160, 100, 37, 2
    g = torch.Generator(device=DEV).manual_seed(37)
    ids = torch.randint(-1, L + 1, (M, k), generator=g, device=DEV, dtype=torch.int32)
    meta = build_layout(layout, ids, L)
    bias = torch.randn(L, 2 * N, device=DEV, generator=g).bfloat16()
    for wdtype, cfgs in (("bf16", [kg.TUNED[("bf16", "decode")], kg.TUNED[("bf16", "prefill")]]),
                         ("mxfp4", [kg.TUNED[("mxfp4", "decode")]]),
                         ("mxfp4_hopper", [kg.TUNED[("mxfp4_hopper4", "decode")],
                                           kg.TUNED[("mxfp4_hopper4", "prefill")]])):
        w = make_weight(L, 2 * N, K, wdtype, 31)
        for cfg in cfgs:
            for act in (MoEActivation.SILU, MoEActivation.SWIGLUOAI):
                for gate_up in ("two_tiles", "one_tile") if cfg.tma else ("two_tiles",):
                    monkeypatch.setattr(kg, "GATE_UP_TMA", gate_up)
                    a = inputs_for(layout, meta, "w13", K, M, k, 41)
                    fused, plain = run_both(layout, w, meta, a, bias, act, cfg)
                    check(layout, w, meta, a, bias, act, fused, plain)
