"""Spec 01: the count-aware activation on the torch path and through the interpreted kernels."""

import math

import pytest
import torch

from helpers import REL_TOL, SENTINEL, rel_err
from padded_moe.activation import (
    ApplyMoEActivationConfig,
    MoEActivation,
    activation_supported,
    apply_moe_activation,
    masked_activation_supported,
)
from padded_moe.reference.moe import activation_f64

SUPPORTED = [a for a in MoEActivation if a is not MoEActivation.RELU2]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Kimi-K3's situ parameters; other activations ignore them (spec 01: unused fields are ignored).
CONFIG = ApplyMoEActivationConfig(situ_beta=4.0, situ_linear_beta=25.0)
D = 513  # odd width: no tile divides it
T = 37  # more rows than one row block times the interpreter's program cap


def ref_kwargs(cfg: ApplyMoEActivationConfig) -> dict:
    return dict(limit=cfg.clamp_limit, alpha=cfg.alpha, beta=cfg.beta, situ_beta=cfg.situ_beta,
                situ_lambda=cfg.situ_linear_beta)


def make_input(act, lead, d, dtype, gen):
    width = 2 * d if act.is_gated else d
    # Scale 4 so clamps (L = 7 for swigluoai) and saturations are exercised.
    return (torch.randn(*lead, width, generator=gen) * 4).to(dtype)


def poison_padding(x: torch.Tensor, counts) -> torch.Tensor:
    """NaN into every row at or past its count (those rows must never be read)."""
    x = x.clone()
    x3 = x.unsqueeze(0) if x.dim() == 2 else x
    for e, c in enumerate(counts):
        x3[e, max(0, min(c, x3.shape[1])):] = float("nan")
    return x


def check_rows(out, x, act, counts, cfg, dtype):
    """Valid rows match the float64 reference; padded rows still hold the sentinel bit for bit."""
    out3 = out.unsqueeze(0) if out.dim() == 2 else out
    x3 = x.unsqueeze(0) if x.dim() == 2 else x
    for e, c in enumerate(counts):
        n = max(0, min(c, x3.shape[1]))
        if n:
            ref = activation_f64(act.value, x3[e, :n], **ref_kwargs(cfg))
            err = rel_err(out3[e, :n], ref)
            assert err <= REL_TOL[dtype], f"expert {e}: rel err {err:.2e} for {act.value} {dtype}"
        assert (out3[e, n:] == SENTINEL).all(), f"expert {e}: padded rows were written"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", SUPPORTED, ids=lambda a: a.value)
def test_plain_matches_float64(cpu_path, act, dtype, gen):
    x = make_input(act, (T,), D, dtype, gen)
    out = torch.full((T, D), SENTINEL, dtype=dtype)
    assert apply_moe_activation(act, out, x, activation_config=CONFIG) is out
    check_rows(out, x, act, [T], CONFIG, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", SUPPORTED, ids=lambda a: a.value)
def test_flat_counts(cpu_path, act, dtype, gen):
    for count in (0, 1, T // 2, T, T + 5, -3):
        x = poison_padding(make_input(act, (T,), D, dtype, gen), [count])
        out = torch.full((T, D), SENTINEL, dtype=dtype)
        counts = torch.tensor([count], dtype=torch.int32)
        apply_moe_activation(act, out, x, activation_config=CONFIG, valid_token_counts=counts)
        check_rows(out, x, act, [count], CONFIG, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", SUPPORTED, ids=lambda a: a.value)
def test_batched_counts(cpu_path, act, dtype, gen):
    rows = 9
    counts_list = [0, 1, rows // 2, rows, rows + 4, -1]
    x = poison_padding(make_input(act, (len(counts_list), rows), D, dtype, gen), counts_list)
    out = torch.full((len(counts_list), rows, D), SENTINEL, dtype=dtype)
    counts = torch.tensor(counts_list, dtype=torch.int64)
    apply_moe_activation(act, out, x, activation_config=CONFIG, valid_token_counts=counts)
    check_rows(out, x, act, counts_list, CONFIG, dtype)


@pytest.mark.parametrize("act", [MoEActivation.SILU, MoEActivation.SWIGLUOAI], ids=lambda a: a.value)
def test_batched_without_counts_means_all_rows(cpu_path, act, gen):
    x = make_input(act, (3, 5), 40, torch.float32, gen)
    out = torch.full((3, 5, 40), SENTINEL)
    apply_moe_activation(act, out, x)
    check_rows(out, x, act, [5, 5, 5], ApplyMoEActivationConfig(), torch.float32)


@pytest.mark.parametrize("cfg", [
    ApplyMoEActivationConfig(clamp_limit=10.0),  # DeepSeek-V4
    ApplyMoEActivationConfig(clamp_limit=2.0, alpha=1.5, beta=0.5),
    ApplyMoEActivationConfig(alpha=1.5),  # either parameter alone leaves plain silu's kernel branch
    ApplyMoEActivationConfig(beta=0.25),
])
def test_silu_with_clamp_and_params(cpu_path, cfg, gen):
    act = MoEActivation.SILU
    x = make_input(act, (T,), 64, torch.float32, gen) * 4
    out = torch.full((T, 64), SENTINEL)
    apply_moe_activation(act, out, x, activation_config=cfg)
    check_rows(out, x, act, [T], cfg, torch.float32)


@pytest.mark.parametrize("limit", [0.5, 3.0, math.inf])
def test_swiglustep_limits(cpu_path, limit, gen):
    act = MoEActivation.SWIGLUSTEP
    cfg = ApplyMoEActivationConfig(clamp_limit=limit)
    x = make_input(act, (T,), 64, torch.float32, gen)
    out = torch.full((T, 64), SENTINEL)
    apply_moe_activation(act, out, x, activation_config=cfg)
    check_rows(out, x, act, [T], cfg, torch.float32)


def test_situ_without_linear_beta(cpu_path, gen):
    act = MoEActivation.SITU
    cfg = ApplyMoEActivationConfig(situ_beta=2.0)
    x = make_input(act, (T,), 64, torch.float32, gen)
    out = torch.full((T, 64), SENTINEL)
    apply_moe_activation(act, out, x, activation_config=cfg)
    check_rows(out, x, act, [T], cfg, torch.float32)


@pytest.mark.parametrize("act", [MoEActivation.SILU, MoEActivation.SWIGLUOAI, MoEActivation.RELU2_NO_MUL],
                         ids=lambda a: a.value)
def test_masked_and_unmasked_agree_bitwise(cpu_path, act, gen):
    x = make_input(act, (T,), 96, torch.bfloat16, gen)
    plain = torch.full((T, 96), SENTINEL, dtype=torch.bfloat16)
    flat = plain.clone()
    apply_moe_activation(act, plain, x)
    apply_moe_activation(act, flat, x, valid_token_counts=torch.tensor([T]))
    assert torch.equal(plain, flat)


def test_strided_rows_are_honoured(cpu_path, gen):
    """Row strides may be arbitrary as long as the last dim is contiguous."""
    act = MoEActivation.SILU
    big = torch.randn(T, 3 * 64, generator=gen)
    x = big[:, :128]  # row stride 192, width 128
    out_big = torch.full((T, 100), SENTINEL)
    out = out_big[:, 10:74]
    apply_moe_activation(act, out, x)
    check_rows(out, x, act, [T], ApplyMoEActivationConfig(), torch.float32)
    assert (out_big[:, :10] == SENTINEL).all() and (out_big[:, 74:] == SENTINEL).all()


def test_relu2_no_mul_never_mutates_input(cpu_path, gen):
    x = torch.randn(T, 64, generator=gen)
    before = x.clone()
    apply_moe_activation("relu2_no_mul", torch.empty(T, 64), x)
    assert torch.equal(x, before)


def test_empty_buffers_are_fine(cpu_path):
    apply_moe_activation("silu", torch.empty(0, 8), torch.empty(0, 16), valid_token_counts=torch.tensor([3]))
    apply_moe_activation("silu", torch.empty(0, 4, 8), torch.empty(0, 4, 16),
                         valid_token_counts=torch.empty(0, dtype=torch.int32))


# ----- the enum and the config ----------------------------------------------------------------


def test_enum_properties():
    assert MoEActivation.SILU.is_gated and not MoEActivation.SILU_NO_MUL.is_gated
    assert MoEActivation.GELU_TANH.without_mul() is MoEActivation.GELU_TANH_NO_MUL
    assert MoEActivation.RELU2_NO_MUL.without_mul() is MoEActivation.RELU2_NO_MUL
    assert MoEActivation.from_str("gelu_pytorch_tanh") is MoEActivation.GELU_TANH
    assert MoEActivation.from_str("SiLU") is MoEActivation.SILU
    with pytest.raises(NotImplementedError):
        MoEActivation.SITU.without_mul()
    with pytest.raises(ValueError, match="swiglustep"):
        MoEActivation.from_str("swish")
    assert not activation_supported("relu2") and not masked_activation_supported(MoEActivation.RELU2)
    assert all(activation_supported(a) and masked_activation_supported(a) for a in SUPPORTED)


def test_config_from_model_and_quant_configs():
    class Model:
        swiglu_limit = 7
        swiglu_alpha = 1.5
        activation_situ_beta = 4

    cfg = ApplyMoEActivationConfig.from_configs(Model(), {"gemm1_clamp_limit": 9.0, "gemm1_beta": 0.25})
    assert cfg == ApplyMoEActivationConfig(clamp_limit=9.0, alpha=1.5, beta=0.25, situ_beta=4.0)
    assert ApplyMoEActivationConfig.from_configs({"activation_situ_linear_beta": 25}).situ_linear_beta == 25.0
    assert ApplyMoEActivationConfig.from_configs(object()) == ApplyMoEActivationConfig()


# ----- errors ---------------------------------------------------------------------------------


def test_relu2_gated_fails_closed_before_tensor_checks():
    with pytest.raises(NotImplementedError, match="relu2_no_mul"):
        apply_moe_activation("relu2", None, None)


@pytest.mark.parametrize("make, exc, words", [
    (lambda: (torch.empty(4, 8), torch.empty(4, 16, dtype=torch.int32), None), TypeError, "input"),
    (lambda: (torch.empty(4, 8, dtype=torch.float16), torch.empty(4, 16), None), TypeError, "output"),
    (lambda: (torch.empty(8), torch.empty(16), None), ValueError, "input must be 2-D or 3-D"),
    (lambda: (torch.empty(4, 8), torch.empty(2, 4, 16), None), ValueError, "rank"),
    (lambda: (torch.empty(4, 8), torch.empty(4, 17), None), ValueError, "last dim must be 16"),
    (lambda: (torch.empty(5, 8), torch.empty(4, 16), None), ValueError, "leading dims"),
    (lambda: (torch.empty(4, 8), torch.empty(16, 4).t(), None), ValueError, "contiguous last dimension"),
    (lambda: (torch.empty(4, 8), torch.empty(4, 16), torch.tensor([1.0])), TypeError, "valid_token_counts"),
    (lambda: (torch.empty(4, 8), torch.empty(4, 16), torch.tensor([1, 2])), ValueError, "length 1"),
    (lambda: (torch.empty(3, 4, 8), torch.empty(3, 4, 16), torch.tensor([1])), ValueError, "length 3"),
    (lambda: (torch.empty(4, 8), torch.empty(4, 16), torch.tensor([[1]])), ValueError, "valid_token_counts"),
    (lambda: (torch.empty(4, 8), torch.empty(4, 16), torch.tensor([1], device="meta")), ValueError, "device"),
    (lambda: (torch.empty(4, 8), "not a tensor", None), TypeError, "input must be a torch.Tensor"),
])
def test_bad_tensors_get_typed_errors(make, exc, words):
    out, x, counts = make()
    with pytest.raises(exc, match=words):
        apply_moe_activation("silu", out, x, valid_token_counts=counts)


def test_situ_needs_beta():
    with pytest.raises(ValueError, match="situ_beta"):
        apply_moe_activation("situ", torch.empty(2, 4), torch.empty(2, 8))
    with pytest.raises(ValueError, match="situ_beta"):
        apply_moe_activation("situ", torch.empty(2, 4), torch.empty(2, 8),
                             activation_config=ApplyMoEActivationConfig(situ_beta=0.0))


def test_unknown_activation_and_bad_config():
    with pytest.raises(ValueError, match="must be one of"):
        apply_moe_activation("tanh", torch.empty(2, 4), torch.empty(2, 8))
    with pytest.raises(TypeError, match="activation_config"):
        apply_moe_activation("silu", torch.empty(2, 4), torch.empty(2, 8), activation_config={"clamp_limit": 1})
    with pytest.raises(ValueError, match="clamp_limit"):
        apply_moe_activation("silu", torch.empty(2, 4), torch.empty(2, 8),
                             activation_config=ApplyMoEActivationConfig(clamp_limit=-1.0))


def test_check_counts_rejects_out_of_range():
    for bad in (-1, 5):
        with pytest.raises(ValueError, match=r"outside \[0, 4\]"):
            apply_moe_activation("silu", torch.empty(4, 4), torch.empty(4, 8),
                                 valid_token_counts=torch.tensor([bad]), check_counts=True)
    apply_moe_activation("silu", torch.empty(4, 4), torch.randn(4, 8),
                         valid_token_counts=torch.tensor([4]), check_counts=True)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "16"])
def test_tuning_programs_per_sm_must_be_none_or_positive(bad):
    with pytest.raises(ValueError, match="programs_per_sm"):
        apply_moe_activation("silu", torch.empty(4, 4), torch.randn(4, 8), tuning={"programs_per_sm": bad})


def test_tuning_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown keys"):
        apply_moe_activation("silu", torch.empty(4, 4), torch.randn(4, 8), tuning={"programs": 4})
