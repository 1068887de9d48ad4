"""GEMM1 with the activation in its epilogue (`expert_gemm(activation=...)`, spec 03 "Fusion").

The fused call must give, at every valid row, what GEMM1 into a buffer of the activation dtype
followed by `apply_moe_activation` gives (the epilogue rounds to that dtype first), on every
layout, weight format (float, MXFP4 canonical and prepared), activation, with and without biases;
rows the layout does not cover keep their SENTINEL, and padded input rows hold NaN. A float64
reference (GEMM in float64, spec 01's activation in float64) bounds both.

Bit for bit on a GPU (tests/test_gemm_gpu.py): each output element is accumulated in the same
order by both. Under the interpreter a tile's dot is a numpy matmul, whose summation order can
change with the column's position in the tile (the epilogue tile places a column's gate and up
rows elsewhere than the plain tile does), so there a float32 sum may differ in its last bit and,
rarely, a 16-bit rounding of it by one step: `assert_same_math` allows that and nothing more.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import REL_TOL, SENTINEL, rel_err
from test_gemm import LAYOUTS, edge_count_case, ids_with_counts, layout_activations, local_meta, prepared_only

from padded_moe.activation import ApplyMoEActivationConfig, MoEActivation, apply_moe_activation
from padded_moe.gemm import FUSE_ENV, expert_gemm
from padded_moe.layouts import GemmLayout, GroupedMaskedMeta, IndexedMeta
from padded_moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from padded_moe.torch_path import activation as torch_activation

try:  # import the kernels now, while conftest's TRITON_INTERPRET=1 is in force (see conftest)
    import padded_moe.kernels.gemm  # noqa: F401
except ImportError:
    pass

# Every kernel activation; situ needs its beta.
ACTIVATIONS = [a for a in MoEActivation if a is not MoEActivation.RELU2]
CONFIGS = {MoEActivation.SITU: ApplyMoEActivationConfig(situ_beta=4.0, situ_linear_beta=2.0),
           MoEActivation.SILU: ApplyMoEActivationConfig(clamp_limit=3.0)}


def require_interpreter(monkeypatch):
    from padded_moe._platform import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("interpreter-only check; tests/test_gemm_gpu.py covers the compiled kernels")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def out_rows(meta, a, width):
    if isinstance(meta, GroupedMaskedMeta):
        return (meta.num_local, meta.max_tokens_per_expert, width)
    if isinstance(meta, IndexedMeta):
        return (meta.num_tokens * meta.top_k, width)
    return (a.shape[0], width)


def written_rows(meta, a) -> torch.Tensor:
    """Mask over the flattened output rows GEMM1 writes for this layout."""
    n = math.prod(out_rows(meta, a, 1))
    m = torch.zeros(n, dtype=torch.bool)
    if isinstance(meta, IndexedMeta):
        ids = meta.sorted_ids[: int(meta.num_padded)].long()
        m[ids[ids < meta.num_tokens * meta.top_k]] = True
    elif isinstance(meta, GroupedMaskedMeta):
        T = meta.max_tokens_per_expert
        for e in range(meta.num_local):
            m[e * T: e * T + int(meta.counts[e])] = True
    else:
        m[: int(meta.offsets[-1])] = True
    return m


def two_step(a, w, meta, bias, act, cfg, config=None):
    """GEMM1 into a buffer of a's dtype, then the activation op: what the epilogue must equal."""
    from padded_moe.backends import get_backend

    n_out = w.shape[1]
    h = torch.full(out_rows(meta, a, n_out), SENTINEL, dtype=a.dtype)
    get_backend("triton").gemm(a, w, meta, stage="w13", bias=bias, out=h, config=config)
    width = n_out // 2 if act.is_gated else n_out
    y = torch.full(out_rows(meta, a, width), SENTINEL, dtype=a.dtype)
    apply_moe_activation(act, y, h, activation_config=cfg, valid_token_counts=meta.activation_counts)
    return y


def fused(a, w, meta, bias, act, cfg, config=None):
    from padded_moe.backends import get_backend
    from padded_moe.activation import ActivationEpilogue

    width = w.shape[1] // 2 if act.is_gated else w.shape[1]
    y = torch.full(out_rows(meta, a, width), SENTINEL, dtype=a.dtype)
    if config is None:
        res = expert_gemm(a, w, meta, stage="w13", bias=bias, out=y, backend="triton", activation=act,
                          activation_config=cfg)
        assert res is y
    else:
        get_backend("triton").gemm_activation(a, w, meta, bias=bias, out=y, config=config,
                                              epilogue=ActivationEpilogue.of(act, cfg))
    return y


def float64_reference(a, w64, bias, meta, act, cfg) -> torch.Tensor:
    """Float64 GEMM per valid row (zeros elsewhere), then spec 01's activation in float64."""
    from test_gemm import ref_rows

    ref = ref_rows(torch.nan_to_num(a.double(), nan=0.0), w64, None if bias is None else bias.double(), meta, "w13")
    rows = torch.zeros(math.prod(out_rows(meta, a, 1)), w64.shape[1], dtype=torch.float64)
    for r, v in ref.items():
        rows[r] = v
    p = cfg or ApplyMoEActivationConfig()
    from padded_moe.activation import _resolve

    q = _resolve(act, p)
    width = w64.shape[1] // 2 if act.is_gated else w64.shape[1]
    y = torch.zeros(rows.shape[0], width, dtype=torch.float64)
    torch_activation.apply_rows(act.value, act.is_gated, act.interleaved, y, rows,
                                dict(limit=q.limit, alpha=q.alpha, beta=q.beta, situ_beta=q.situ_beta,
                                     situ_lambda=q.situ_lambda))
    return y


def assert_same_math(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, up to the interpreter's last-bit differences in float32 sums (module docstring): in
    all by far less than a rounding step of the dtype, and in a 16-bit dtype at most 2% of the
    elements one step apart."""
    if torch.equal(got, want):
        return
    differ = (got != want).float().mean().item()
    err = rel_err(got, want)
    assert err < REL_TOL[got.dtype] / 8 and (got.dtype == torch.float32 or differ <= 0.02), \
        f"epilogue differs from GEMM1 + activation op: {differ:.1%} of elements, relative error {err:.3g}"


def check(a, w, w64, meta, bias, act, cfg, config=None):
    got = fused(a, w, meta, bias, act, cfg, config)
    want = two_step(a, w, meta, bias, act, cfg, config)
    flat_got, flat_want = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    m = written_rows(meta, a)
    assert (flat_got[~m] == SENTINEL).all(), "rows outside the layout were written"
    assert_same_math(flat_got[m], flat_want[m])
    if m.any():
        ref = float64_reference(a, w64, bias, meta, act, cfg)[m]
        err = rel_err(flat_got[m], ref)
        assert err < 2 * REL_TOL[a.dtype] + (0.02 if a.dtype == torch.bfloat16 else 0), f"relative error {err:.3g}"


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: a.value)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_every_activation_every_layout(monkeypatch, layout, act, gen):
    """bf16 weights with a bias: Nout = 40 rows (20 activation columns, not a multiple of the
    tile's 16), invalid ids, NaN in unread rows."""
    require_interpreter(monkeypatch)
    a, w, w64, meta = edge_count_case(layout, torch.bfloat16, gen, extra_invalid=2)
    bias = torch.randn(w.shape[0], w.shape[1], generator=gen).to(torch.bfloat16)
    check(a, w, w64, meta, bias, act, CONFIGS.get(act))


@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16, "mxfp4", "mxfp4-2planes", "mxfp4-4planes",
                                    "mxfp4-4planes-wshared"], ids=str)
@pytest.mark.parametrize("act", [MoEActivation.SILU, MoEActivation.SWIGLUOAI, MoEActivation.GELU_TANH_NO_MUL],
                         ids=lambda a: a.value)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_weight_formats(monkeypatch, layout, act, wdtype, gen):
    """Float weights, MXFP4 canonical (dequantized in registers) and both prepared arrangements
    (the Hopper kernel, its weight tile as either MMA operand; canonical bytes replaced by garbage
    so only the prepared form can match)."""
    from padded_moe.kernels import gemm as kg

    require_interpreter(monkeypatch)
    kind = "mxfp4" if str(wdtype).startswith("mxfp4") else wdtype
    a, w, w64, meta = edge_count_case(layout, kind, gen, extra_invalid=1)
    config = None
    if str(wdtype).startswith("mxfp4-"):
        w = prepared_only(w, planes=int(wdtype[6]))
        if wdtype.endswith("wshared"):
            config = dataclasses.replace(kg.INTERPRET_HOPPER_CONFIG, mx_w_shared=True)
    bias = torch.randn(w.shape[0], w.shape[1], generator=gen).to(a.dtype) if act.is_gated else None
    check(a, w, w64, meta, bias, act, None, config=config)


@pytest.mark.parametrize("gate_up", ["two_tiles", "one_tile"])
@pytest.mark.parametrize("act", [MoEActivation.SILU, MoEActivation.SWIGLUOAI], ids=lambda a: a.value)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_tma_weights(monkeypatch, layout, act, gate_up, gen):
    """TMA weight tiles: interleaved gate/up rows are one contiguous tile; gate-first halves are two
    tiles and two accumulators, or one tile from a 4-D descriptor (`GATE_UP_TMA`); the interpreter
    runs tensor descriptors."""
    from padded_moe.kernels import gemm as kg

    require_interpreter(monkeypatch)
    monkeypatch.setattr(kg, "GATE_UP_TMA", gate_up)
    a, w, w64, meta = edge_count_case(layout, torch.float32, gen, extra_invalid=2)
    bias = torch.randn(w.shape[0], w.shape[1], generator=gen)
    check(a, w, w64, meta, bias, act, None, config=dataclasses.replace(kg.INTERPRET_CONFIG, tma=True))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_mxfp4_gpt_oss_like_widths(monkeypatch, layout, gen):
    """swigluoai with biases on prepared MXFP4 weights whose K (160) is not a multiple of the
    64-element block and whose activation width (36) is not a multiple of the tile."""
    require_interpreter(monkeypatch)
    L, n, K, k = 5, 36, 160, 2
    w64 = torch.randn(L, 2 * n, K, generator=gen, dtype=torch.float64) / math.sqrt(K)
    q = quantize_mxfp4(w64)
    ids = ids_with_counts([3, 0, 17, 1, 9], k, gen, extra_invalid=2)
    meta = local_meta(layout, ids, L, t_max=20 if layout == GemmLayout.GROUPED_MASKED else None)
    a = layout_activations(layout, meta, ids.shape[0], k, K, gen, torch.bfloat16)
    bias = torch.randn(L, 2 * n, generator=gen).to(torch.bfloat16)
    check(a, prepared_only(q, 4), dequantize_mxfp4(q, torch.float64), meta, bias, MoEActivation.SWIGLUOAI, None)


def test_other_backends_run_two_steps(gen):
    """A backend that does not fuse (torch) runs GEMM1 then the activation op: same contract."""
    a, w, w64, meta = edge_count_case(GemmLayout.GROUPED_CONTIGUOUS, torch.float32, gen, extra_invalid=1)
    y = torch.full((a.shape[0], w.shape[1] // 2), SENTINEL)
    expert_gemm(a, w, meta, out=y, backend="torch", activation="silu")
    m = written_rows(meta, a)
    ref = float64_reference(a, w64, None, meta, MoEActivation.SILU, None)
    assert rel_err(y[m], ref[m]) < REL_TOL[torch.float32]
    assert (y[~m] == SENTINEL).all()


def test_errors(gen):
    a, w, w64, meta = edge_count_case(GemmLayout.GROUPED_CONTIGUOUS, torch.float32, gen, extra_invalid=0)
    with pytest.raises(ValueError, match="stage 'w13'"):
        expert_gemm(a[:, :w.shape[1] // 2].contiguous(), w.transpose(1, 2).contiguous()[:, :, :20], meta,
                    stage="w2", activation="silu")
    with pytest.raises(ValueError, match="activation_config needs activation"):
        expert_gemm(a, w, meta, activation_config=ApplyMoEActivationConfig())
    with pytest.raises(ValueError, match="out must be"):
        expert_gemm(a, w, meta, activation="silu", out=torch.empty(a.shape[0], w.shape[1]))
    with pytest.raises(ValueError, match="activation must be one of"):
        expert_gemm(a, w, meta, activation="swish")
    with pytest.raises(NotImplementedError, match="relu2"):
        expert_gemm(a, w, meta, activation="relu2")
    with pytest.raises(ValueError, match="rows must be even"):
        expert_gemm(a, w[:, :39].contiguous(), meta, activation="silu")


def test_config_too_narrow_for_a_gated_epilogue(monkeypatch, gen):
    from padded_moe.kernels import gemm as kg

    require_interpreter(monkeypatch)
    a, w, w64, meta = edge_count_case(GemmLayout.GROUPED_CONTIGUOUS, torch.float32, gen, extra_invalid=0)
    with pytest.raises(ValueError, match="config.BN must be an even number >= 32"):
        fused(a, w, meta, None, MoEActivation.SILU, None, config=dataclasses.replace(kg.INTERPRET_CONFIG, BN=16))


@pytest.mark.parametrize("weights", ["bf16", "mxfp4-prepared"])
@pytest.mark.parametrize("layout", ["indexed", "grouped_contiguous"])
def test_fused_experts_equal_with_and_without_the_epilogue(monkeypatch, layout, weights, gen):
    """`fused_experts` gives the same results with the epilogue and with
    PADDED_MOE_FUSE_ACTIVATION=0 (GEMM1, then the activation op)."""
    import padded_moe as pm

    require_interpreter(monkeypatch)
    M, k, L, K, n = 9, 2, 4, 64, 32
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    w13 = torch.randn(L, 2 * n, K, generator=gen, dtype=torch.float64) / 8
    w2 = torch.randn(L, K, n, generator=gen, dtype=torch.float64) / 5
    if weights == "bf16":
        w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    else:
        w13, w2 = quantize_mxfp4(w13).prepare_for(), quantize_mxfp4(w2).prepare_for()
    ids = torch.stack([torch.randperm(L, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    ids[2, 1] = -1
    tw = torch.rand(M, k, generator=gen)
    b13 = torch.randn(L, 2 * n, generator=gen).to(torch.bfloat16)
    kw = dict(activation="swigluoai", layout=layout, w13_bias=b13)
    monkeypatch.setenv(FUSE_ENV, "1")
    fused_out = pm.fused_experts(x, w13, w2, tw, ids, **kw)
    monkeypatch.setenv(FUSE_ENV, "0")
    plain_out = pm.fused_experts(x, w13, w2, tw, ids, **kw)
    assert torch.isfinite(fused_out).all()
    assert_same_math(fused_out, plain_out)


def test_fuse_mode_variable(monkeypatch):
    from padded_moe.gemm import fuse_activation_mode

    for value, mode in (("", "auto"), ("auto", "auto"), ("1", "on"), ("0", "off")):
        monkeypatch.setenv(FUSE_ENV, value)
        assert fuse_activation_mode() == mode
    monkeypatch.setenv(FUSE_ENV, "yes")
    with pytest.raises(ValueError, match="PADDED_MOE_FUSE_ACTIVATION must be one of"):
        fuse_activation_mode()


def test_measured_rule_follows_the_tile_width():
    """The epilogue is taken for tiles of up to EPILOGUE_MAX_BN weight rows (measured faster), not
    for the wide medium/prefill tiles (measured slower), nor for interleaved gate/up rows on the
    prepared-MXFP4 kernel's 16-row tiles; the interpreter's small tiles take it."""
    from padded_moe.kernels import gemm as kg

    dec, mx_dec = kg.TUNED[("bf16", "decode")], kg.TUNED[("mxfp4_hopper4", "decode")]
    assert kg.epilogue_pays(dec, 16, True) and kg.epilogue_pays(mx_dec, 16, False)
    assert kg.epilogue_pays(mx_dec, 32, True) and not kg.epilogue_pays(mx_dec, 16, True)
    assert not kg.epilogue_pays(kg.TUNED[("bf16", "prefill")], 128, False)
    # 256-row bf16 tiles: only gate-first rows read as one 4-D TMA tile measured faster.
    prefill = kg.TUNED[("bf16", "prefill")]
    assert prefill.BN > kg.EPILOGUE_MAX_BN
    assert kg.epilogue_pays(prefill, 128, False, "tma_one_tile")
    assert not any(kg.epilogue_pays(prefill, 128, False, r) for r in ("tma_two_tiles", "tma", "pointer"))
    assert not kg.epilogue_pays(kg.TUNED[("mxfp4_hopper4", "medium")], 128, False)
    assert kg.epilogue_pays(kg.TUNED_NARROW[("mxfp4_hopper4", "medium")], 64, False)
    assert kg.epilogue_pays(kg.INTERPRET_CONFIG, 16, True) and kg.epilogue_pays(kg.INTERPRET_HOPPER_CONFIG, 16, False)


@pytest.mark.parametrize("tokens,fused", [(8, False), (80, True)])
def test_fused_experts_follows_the_rule(monkeypatch, tokens, fused):
    """`fused_experts` asks the backend with the call's own tile: GPT-OSS-like interleaved rows on
    prepared MXFP4 keep the two steps on 16-row tiles and take the epilogue on 32-row ones
    (interpreter: the rule is evaluated on a stand-in for the GPU's decode config)."""
    import padded_moe as pm
    from padded_moe import experts as ex
    from padded_moe.kernels import gemm as kg

    require_interpreter(monkeypatch)
    monkeypatch.setattr(kg, "INTERPRET_HOPPER_CONFIG", dataclasses.replace(kg.INTERPRET_HOPPER_CONFIG, BM=32))
    calls = []
    real = ex.apply_moe_activation
    monkeypatch.setattr(ex, "apply_moe_activation", lambda *a, **k: calls.append(1) or real(*a, **k))
    L, K, n = 16, 64, 32
    gen = torch.Generator().manual_seed(0)
    w13 = quantize_mxfp4(torch.randn(L, 2 * n, K, generator=gen) / 8).prepare_for()
    w2 = quantize_mxfp4(torch.randn(L, K, n, generator=gen) / 5).prepare_for()
    x = torch.randn(tokens, K, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(L, generator=gen)[:4] for _ in range(tokens)]).to(torch.int32)
    pm.fused_experts(x, w13, w2, torch.rand(tokens, 4, generator=gen), ids, activation="swigluoai",
                     layout="indexed")
    assert (not calls) == fused


def test_gate_up_tma_setting_is_checked(monkeypatch, gen):
    from padded_moe.kernels import gemm as kg

    require_interpreter(monkeypatch)
    monkeypatch.setattr(kg, "GATE_UP_TMA", "both")
    a, w, w64, meta = edge_count_case(GemmLayout.GROUPED_CONTIGUOUS, torch.float32, gen, extra_invalid=0)
    with pytest.raises(ValueError, match="GATE_UP_TMA must be 'two_tiles' or 'one_tile'"):
        fused(a, w, meta, None, MoEActivation.SILU, None, config=dataclasses.replace(kg.INTERPRET_CONFIG, tma=True))


def test_weight_read_names_how_tiles_read_rows(monkeypatch):
    """One definition of the weight read serves the launch and the measured rule: TMA tiles for
    same-dtype canonical weights of a TMA config, gate-first halves as GATE_UP_TMA says, masked
    loads otherwise."""
    import dataclasses

    from padded_moe.kernels import gemm as kg

    cfg = dataclasses.replace(kg.TUNED[("bf16", "prefill")], tma=True)
    a = torch.randn(8, 64, dtype=torch.bfloat16)
    w = torch.randn(4, 96, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(kg, "GATE_UP_TMA", "one_tile")
    assert kg.weight_read(cfg, a, w, gated=True, interleaved=False) == "tma_one_tile"
    monkeypatch.setattr(kg, "GATE_UP_TMA", "two_tiles")
    assert kg.weight_read(cfg, a, w, gated=True, interleaved=False) == "tma_two_tiles"
    assert kg.weight_read(cfg, a, w, gated=True, interleaved=True) == "tma"
    assert kg.weight_read(cfg, a, w, gated=False, interleaved=False) == "tma"
    assert kg.weight_read(cfg, a, w.float(), gated=True, interleaved=False) == "pointer"
    assert kg.weight_read(dataclasses.replace(cfg, tma=False), a, w, gated=True, interleaved=False) == "pointer"
    assert kg.weight_read(cfg, a, w[::2], gated=True, interleaved=False) == "pointer"  # experts not one row run
