"""The count-aware MoE activation.

One entry point, `apply_moe_activation`, serves a plain 2-D buffer, a flat buffer whose first `n`
rows are valid (one count) and a batched `[E, T, ·]` buffer with one valid prefix per expert. Rows
past a count are never read or written. CUDA tensors run the Triton kernel in
`padded_moe.kernels.activation`; CPU tensors run `padded_moe.torch_path.activation` (or the Triton
kernel through the interpreter when TRITON_INTERPRET=1).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import torch

from padded_moe import _platform
from padded_moe._ops import custom_op, register_fake
from padded_moe._util import cdiv, even_split, next_pow2
from padded_moe._validation import (FLOAT_DTYPES, INDEX_DTYPES, require_bool, require_dtype,
                                    require_last_dim_contiguous, require_rank,
                                    require_real, require_same_device, require_tensor)
from padded_moe.torch_path import activation as torch_activation


class MoEActivation(enum.Enum):
    """Activations between the two expert GEMMs, spelled as in vLLM."""

    SILU = "silu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    RELU2 = "relu2"
    SWIGLUOAI = "swigluoai"
    SITU = "situ"
    SWIGLUOAI_UNINTERLEAVE = "swigluoai_uninterleave"
    SWIGLUSTEP = "swiglustep"
    SILU_NO_MUL = "silu_no_mul"
    GELU_NO_MUL = "gelu_no_mul"
    GELU_TANH_NO_MUL = "gelu_tanh_no_mul"
    RELU2_NO_MUL = "relu2_no_mul"

    @property
    def is_gated(self) -> bool:
        return not self.value.endswith("_no_mul")

    @property
    def interleaved(self) -> bool:
        """Gate and up interleaved in the input's columns (gate 2i, up 2i+1), not gate half first."""
        return self is MoEActivation.SWIGLUOAI

    def without_mul(self) -> "MoEActivation":
        """The non-gated variant (`silu` → `silu_no_mul`); non-gated ones return themselves."""
        if not self.is_gated:
            return self
        try:
            return MoEActivation(self.value + "_no_mul")
        except ValueError:
            raise NotImplementedError(f"activation {self.value!r} has no non-gated variant") from None

    @classmethod
    def from_str(cls, name: str) -> "MoEActivation":
        if not isinstance(name, str):
            raise TypeError(f"activation must be a str or MoEActivation, got {type(name).__name__}")
        key = _ALIASES.get(name.lower(), name.lower())
        try:
            return cls(key)
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ValueError(f"activation must be one of ({valid}), got {name!r}") from None


_ALIASES = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_pytorch_tanh_no_mul": "gelu_tanh_no_mul"}

# Gated activations that have no kernel (fail closed, name what to use instead).
_UNSUPPORTED = {
    MoEActivation.RELU2: "gated relu2 is not implemented; use relu2_no_mul (NemotronH's non-gated MLP)",
}


def _as_activation(activation: Union[str, MoEActivation]) -> MoEActivation:
    if isinstance(activation, MoEActivation):
        return activation
    return MoEActivation.from_str(activation)


def resolve_supported(activation: Union[str, MoEActivation]) -> MoEActivation:
    """Parse `activation`; raise NotImplementedError (fail closed) if no kernel implements it."""
    act = _as_activation(activation)
    if act in _UNSUPPORTED:
        raise NotImplementedError(_UNSUPPORTED[act])
    return act


def activation_supported(activation: Union[str, MoEActivation]) -> bool:
    """Whether `apply_moe_activation` implements this activation on plain buffers."""
    return _as_activation(activation) not in _UNSUPPORTED


def masked_activation_supported(activation: Union[str, MoEActivation]) -> bool:
    """Whether the count-aware (flat / batched) path implements this activation.

    One kernel family serves masked and unmasked calls, so the answer equals
    `activation_supported`; both exist because vLLM users ask both questions.
    """
    return activation_supported(activation)


@dataclass(frozen=True)
class ApplyMoEActivationConfig:
    """Activation parameters; `None` means the activation's default (set in
    `padded_moe.activation._resolve`; docs/usage.md, "Count-aware activation" lists them)."""

    clamp_limit: Optional[float] = None
    alpha: Optional[float] = None
    beta: Optional[float] = None
    situ_beta: Optional[float] = None
    situ_linear_beta: Optional[float] = None

    def __post_init__(self):
        # A string such as '4' would otherwise reach the kernel launch and fail far from the caller.
        for name in ("clamp_limit", "alpha", "beta", "situ_beta", "situ_linear_beta"):
            value = require_real(name, getattr(self, name), optional=True)
            if value is not None:
                object.__setattr__(self, name, float(value))

    @classmethod
    def from_configs(cls, model_config: Any, quant_config: Any = None) -> "ApplyMoEActivationConfig":
        """Read a model config (object or dict); a quant config's gemm1_* values win."""
        values = {
            "clamp_limit": _read(model_config, "swiglu_limit"),
            "alpha": _read(model_config, "swiglu_alpha"),
            "beta": _read(model_config, "swiglu_beta"),
            "situ_beta": _read(model_config, "activation_situ_beta"),
            "situ_linear_beta": _read(model_config, "activation_situ_linear_beta"),
        }
        if quant_config is not None:
            for field, key in (("clamp_limit", "gemm1_clamp_limit"), ("alpha", "gemm1_alpha"),
                               ("beta", "gemm1_beta")):
                value = _read(quant_config, key)
                if value is not None:
                    values[field] = value
        return cls(**{k: (None if v is None else float(v)) for k, v in values.items()})


def _read(config: Any, key: str) -> Any:
    if config is None:
        return None
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


@dataclass(frozen=True)
class _Params:
    """Resolved numeric parameters handed to the kernel (None = feature off)."""

    limit: Optional[float]
    alpha: float
    beta: float
    situ_beta: float
    situ_lambda: Optional[float]


_OAI = (MoEActivation.SWIGLUOAI, MoEActivation.SWIGLUOAI_UNINTERLEAVE)


def _resolve(act: MoEActivation, cfg: ApplyMoEActivationConfig) -> _Params:
    """Fill the activation's defaults; fields an activation does not use are ignored."""
    limit, alpha, beta, situ_beta, situ_lambda = None, 1.0, 0.0, 1.0, None
    if act is MoEActivation.SILU:
        limit = cfg.clamp_limit
        alpha = 1.0 if cfg.alpha is None else cfg.alpha
        beta = 0.0 if cfg.beta is None else cfg.beta
    elif act in _OAI:
        limit = 7.0 if cfg.clamp_limit is None else cfg.clamp_limit
        alpha = 1.702 if cfg.alpha is None else cfg.alpha
        beta = 1.0 if cfg.beta is None else cfg.beta
    elif act is MoEActivation.SWIGLUSTEP:
        limit = 7.0 if cfg.clamp_limit is None else cfg.clamp_limit
    elif act is MoEActivation.SITU:
        if cfg.situ_beta is None:
            raise ValueError("activation_config.situ_beta is required for situ (Kimi-K3 uses 4.0), got None")
        if not (cfg.situ_beta > 0 and math.isfinite(cfg.situ_beta)):
            raise ValueError(f"activation_config.situ_beta must be a positive finite number, got {cfg.situ_beta}")
        situ_beta = cfg.situ_beta
        lam = cfg.situ_linear_beta
        situ_lambda = lam if lam is not None and lam > 0 else None
    if limit is not None and math.isinf(limit) and limit > 0:
        limit = None  # L = +inf disables both clamps (Step-3.7 layers without a limit)
    if limit is not None and (math.isnan(limit) or limit < 0):
        raise ValueError(f"activation_config.clamp_limit must be >= 0 or inf, got {limit}")
    return _Params(limit, float(alpha), float(beta), float(situ_beta), situ_lambda)


@dataclass(frozen=True)
class ActivationEpilogue:
    """An activation applied in GEMM1's epilogue (`padded_moe.gemm.expert_gemm(activation=...)`):
    the activation and its resolved parameters, for the kernel that computes GEMM1."""

    activation: MoEActivation
    params: _Params

    @classmethod
    def of(cls, activation: Union[str, MoEActivation],
           config: Optional[ApplyMoEActivationConfig] = None) -> "ActivationEpilogue":
        act = resolve_supported(activation)
        cfg = ApplyMoEActivationConfig() if config is None else config
        if not isinstance(cfg, ApplyMoEActivationConfig):
            raise TypeError(f"activation_config must be an ApplyMoEActivationConfig, got {type(cfg).__name__}")
        return cls(act, _resolve(act, cfg))

    def kernel_args(self, fast: bool) -> tuple[tuple, dict]:
        return kernel_args(self.activation, self.params, fast)


def kernel_args(act: MoEActivation, p: _Params, fast: bool) -> tuple[tuple, dict]:
    """What a kernel that applies `act` takes besides its tensors: the floats (limit, alpha, beta,
    situ_beta, situ_lambda; placeholders where a feature is off) and the constexprs ACT, HAS_LIMIT,
    HAS_LAMBDA, FAST in that order. `fast`: approximate tanh (compiled 16-bit outputs only, whose
    rounding hides its error)."""
    from padded_moe.kernels.activation import KERNEL_IDS

    floats = (p.limit if p.limit is not None else 0.0, p.alpha, p.beta, p.situ_beta,
              p.situ_lambda if p.situ_lambda is not None else 1.0)
    kernel = act.value
    if act is MoEActivation.SILU and (p.alpha, p.beta) != (1.0, 0.0):
        # silu with a gate scale or an up offset is swigluoai's formula on silu's row order; the
        # kernels' silu branch is the plain g * sigmoid(g) * u.
        kernel = MoEActivation.SWIGLUOAI_UNINTERLEAVE.value
    return floats, dict(ACT=KERNEL_IDS[kernel], HAS_LIMIT=p.limit is not None,
                        HAS_LAMBDA=p.situ_lambda is not None, FAST=fast)


def _check_tensors(act: MoEActivation, output: Any, input: Any, counts: Any) -> None:
    require_tensor("output", output)
    require_tensor("input", input)
    require_dtype("input", input, FLOAT_DTYPES)
    if output.dtype != input.dtype:
        raise TypeError(f"output must have input's dtype {input.dtype}, got {output.dtype}")
    require_same_device("output", output, "input", input)
    require_rank("input", input, (2, 3))
    if output.dim() != input.dim():
        raise ValueError(f"output must have input's rank {input.dim()}, got shape {tuple(output.shape)}")
    if tuple(output.shape[:-1]) != tuple(input.shape[:-1]):
        raise ValueError(
            f"output's leading dims must equal input's {tuple(input.shape[:-1])}, got {tuple(output.shape[:-1])}")
    width, d = input.shape[-1], output.shape[-1]
    expected = 2 * d if act.is_gated else d
    if width != expected:
        kind = "gated: input width = 2 × output width" if act.is_gated else "non-gated: equal widths"
        raise ValueError(f"input's last dim must be {expected} for {act.value} ({kind}), got {width}")
    require_last_dim_contiguous("input", input)
    require_last_dim_contiguous("output", output)
    if counts is None:
        return
    require_tensor("valid_token_counts", counts)
    require_dtype("valid_token_counts", counts, INDEX_DTYPES)
    require_same_device("valid_token_counts", counts, "input", input)
    want = 1 if input.dim() == 2 else input.shape[0]
    if counts.dim() != 1 or counts.shape[0] != want:
        mode = "flat input: one count" if input.dim() == 2 else f"batched input: one count per expert ({want})"
        raise ValueError(f"valid_token_counts must be 1-D of length {want} ({mode}), got shape {tuple(counts.shape)}")


def _check_counts_on_host(counts: torch.Tensor, num_rows: int) -> None:
    values = counts.detach().cpu().tolist()
    for i, c in enumerate(values):
        if c < 0 or c > num_rows:
            raise ValueError(f"valid_token_counts[{i}] = {c} is outside [0, {num_rows}] (check_counts=True)")


def apply_moe_activation(activation: Union[str, MoEActivation], output: torch.Tensor, input: torch.Tensor, *,
                         activation_config: Optional[ApplyMoEActivationConfig] = None,
                         valid_token_counts: Optional[torch.Tensor] = None,
                         check_counts: bool = False, tuning: Optional[Mapping] = None) -> torch.Tensor:
    """Write `activation(input)` into `output` for the valid rows only; return `output`.

    Plain: `input [T, W]`, no counts. Flat: `input [T, W]`, `valid_token_counts [1]`. Batched:
    `input [E, T, W]`, `valid_token_counts [E]` (or None: all rows valid). `W = 2d` for gated
    activations (gate then up; interleaved for swigluoai), `d` otherwise; `output [.., d]`.
    Counts are clamped to `[0, T]` on the device; output rows at or past a count keep their
    previous contents. `check_counts=True` syncs to the host and rejects counts outside `[0, T]`.
    `tuning` overrides entries of the activation's launch shape (`default_tuning`: `TUNING`, or
    `TUNING_BY_ACTIVATION`'s entry) for this call, eager calls only (benchmarks sweep it; the custom
    op always uses the default).
    """
    act = resolve_supported(activation)
    cfg = ApplyMoEActivationConfig() if activation_config is None else activation_config
    if not isinstance(cfg, ApplyMoEActivationConfig):
        raise TypeError(f"activation_config must be an ApplyMoEActivationConfig, got {type(cfg).__name__}")
    require_bool("check_counts", check_counts)
    _check_tensors(act, output, input, valid_token_counts)
    if check_counts and valid_token_counts is not None:
        _check_counts_on_host(valid_token_counts, input.shape[-2])
    if torch.compiler.is_compiling():
        if tuning is not None:
            raise NotImplementedError("tuning is for eager calls; under torch.compile the op uses the default launch shape")
        # Under torch.compile the registered op keeps the kernel opaque to the tracer. It takes the
        # config's fields as given and resolves them when it runs: the tracer may hold them as
        # symbolic floats (a compiled block reused by layers of different limits), which the
        # checks of `_resolve` cannot evaluate.
        torch.ops.padded_moe.moe_activation(
            act.value, output, input, valid_token_counts,
            cfg.clamp_limit, cfg.alpha, cfg.beta, cfg.situ_beta, cfg.situ_linear_beta)
    else:
        # Eager calls skip the dispatcher: it costs tens of µs of host time per call, more than
        # the kernel itself for small or mostly-padded buffers.
        _run(act, output, input, valid_token_counts, _resolve(act, cfg), _tuning(act, tuning))
    return output


def _tuning(act: MoEActivation, tuning: Optional[Mapping]) -> dict:
    if tuning is None:
        return default_tuning(act)
    if not isinstance(tuning, Mapping):
        raise TypeError(f"tuning must be a mapping of TUNING's keys, got {type(tuning).__name__}")
    unknown = sorted(set(tuning) - set(TUNING))
    if unknown:
        raise ValueError(f"tuning has unknown keys {unknown}; TUNING's keys are {sorted(TUNING)}")
    merged = {**default_tuning(act), **tuning}
    for key, pow2 in (("tile_elems", False), ("max_block_d", True), ("num_warps", True)):
        v, want = merged[key], f"a positive int{' power of two' if pow2 else ''}"
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"tuning[{key!r}] must be {want}, got {type(v).__name__}")
        if v < 1 or (pow2 and v & (v - 1)):
            raise ValueError(f"tuning[{key!r}] must be {want}, got {v}")
    per_sm = merged["programs_per_sm"]
    if per_sm is not None and (not isinstance(per_sm, int) or isinstance(per_sm, bool) or per_sm < 1):
        raise ValueError(f"tuning['programs_per_sm'] must be None (all resident) or a positive int, got {per_sm!r}")
    return merged


# ---------------------------------------------------------------------------------------------
# The custom op: opaque to torch.compile (fake impl mutates nothing observable), capturable.


@custom_op("padded_moe::moe_activation", mutates_args={"output"})
def _moe_activation_op(activation: str, output: torch.Tensor, input: torch.Tensor,
                       counts: Optional[torch.Tensor], clamp_limit: Optional[float], alpha: Optional[float],
                       beta: Optional[float], situ_beta: Optional[float], situ_linear_beta: Optional[float]) -> None:
    act = MoEActivation(activation)
    cfg = ApplyMoEActivationConfig(clamp_limit, alpha, beta, situ_beta, situ_linear_beta)
    _run(act, output, input, counts, _resolve(act, cfg))


def _run(act: MoEActivation, output: torch.Tensor, input: torch.Tensor, counts: Optional[torch.Tensor],
         params: _Params, tuning: Optional[dict] = None) -> None:
    if input.numel() == 0:
        return
    if _platform.use_triton(input.device):
        _launch_triton(act, output, input, counts, params, default_tuning(act) if tuning is None else tuning)
    else:
        _run_torch(act, output, input, counts, params)


@register_fake("padded_moe::moe_activation")
def _moe_activation_fake(activation, output, input, counts, clamp_limit, alpha, beta, situ_beta,
                         situ_linear_beta) -> None:
    return None


def _as_batched(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.dim() == 2 else t


def _run_torch(act: MoEActivation, output: torch.Tensor, input: torch.Tensor,
               counts: Optional[torch.Tensor], p: _Params) -> None:
    out3, in3 = _as_batched(output), _as_batched(input)
    num_rows = in3.shape[1]
    # CPU path: reading counts on the host is free here (CUDA tensors always take the kernel).
    ns = [num_rows] * in3.shape[0] if counts is None else [max(0, min(int(c), num_rows)) for c in counts.tolist()]
    kwargs = dict(limit=p.limit, alpha=p.alpha, beta=p.beta, situ_beta=p.situ_beta, situ_lambda=p.situ_lambda)
    for e, n in enumerate(ns):
        torch_activation.apply_rows(act.value, act.is_gated, act.interleaved,
                                    out3[e, :n], in3[e, :n], kwargs)


# Launch shape of the activation kernel; benchmarks/bench_activation.py sweeps these on a GPU.
# programs_per_sm: None, as many programs as the device holds at once (from the compiled kernel's
# registers and shared memory), each striding over its rows; a number, that many per SM (more than
# fit at once: the hardware starts each as an earlier one ends).
# On an H200 (silu and situ, [49152, 4096] / [12288, 4096] / [32, 512, 4096], graph replays), tiles of
# 4096 elements up to 2048 columns wide (2 rows x 2048 there) with 8 warps took 0.92-0.98x the time
# of all-resident programs striding over 4 x 1024 tiles at 100% valid rows (silu on 49152 rows: 152
# µs at 32 programs per SM, 149 at 64, 147 with one program per row block, against 156; torch.compile
# 145). Every program past the count still starts, so the grid also sets what a mostly padded call
# costs: a call with all counts 0 took 9.9 µs at 64 programs per SM (5.7 all resident), and one
# program per row block made a 5%-valid call 25 µs against 14.
# So 32 per SM: the 8 µs bound on a call with nothing to do holds, and a full buffer still gains.
TUNING = {"tile_elems": 4096, "max_block_d": 2048, "num_warps": 8, "programs_per_sm": 32}
# Plain silu moves more rows per program step: 4 x 2048 tiles took 147 µs against 151 on [49152,
# 4096] all valid, 42.5 against 43.8 on [12288, 4096], 14.3 against 14.5 at 5% valid, the same with
# all counts 0 (three runs alike); situ, whose tanh keep the special-function unit busy, lost there
# (45.9 against 44.4 on [12288], 16.0 against 14.7 at 5%), and the other activations were not
# measured, so they keep TUNING.
TUNING_BY_ACTIVATION = {MoEActivation.SILU: {**TUNING, "tile_elems": 8192}}


def default_tuning(act: MoEActivation) -> dict:
    """The launch shape an activation runs with when the call gives no `tuning`."""
    return TUNING_BY_ACTIVATION.get(act, TUNING)


# The narrowest column block `_block_shape` considers for a width that is not a power of two.
MIN_BLOCK_D = 256


def _block_shape(d: int, tuning: dict) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_D, num_warps): a tile of `tile_elems`, 16-byte vectors along the row. The
    column block is the power of two up to `max_block_d` whose blocks cover `d` with the fewest
    masked columns (the widest of equals): GPT-OSS's 2880 columns take 3 blocks of 1024 (6%
    masked), not 2 of 2048 (30%)."""
    widest = min(tuning["max_block_d"], next_pow2(max(d, 1)))
    candidates = [widest]
    while candidates[-1] > MIN_BLOCK_D:
        candidates.append(candidates[-1] // 2)
    block_d = min(candidates, key=lambda b: (cdiv(d, b) * b, -b))
    block_t = max(1, min(64, tuning["tile_elems"] // block_d))
    return block_t, block_d, tuning["num_warps"]


def _launch_triton(act: MoEActivation, output: torch.Tensor, input: torch.Tensor,
                   counts: Optional[torch.Tensor], p: _Params, tuning: dict) -> None:
    from padded_moe.kernels._launch import launch, ptr_key, resident_programs
    from padded_moe.kernels.activation import moe_activation_kernel

    out3, in3 = _as_batched(output), _as_batched(input)
    num_experts, num_rows, d = out3.shape
    block_t, block_d, num_warps = _block_shape(d, tuning)
    col_blocks = cdiv(d, block_d)
    counts_arg = counts if counts is not None else in3  # unused pointer when HAS_COUNTS is False
    ptrs = (out3, in3, counts_arg)
    # Approximate tanh only where the output's rounding hides it, and never in the interpreter.
    floats, flags = kernel_args(act, p, fast=input.is_cuda and output.dtype != torch.float32)
    scalars = (num_rows, d, in3.stride(0), in3.stride(1), out3.stride(0), out3.stride(1)) + floats
    # Row indices in 32 bits unless the loop could pass 2**31 (rows plus one stride of tiles).
    rows_i64 = num_rows + block_t * cdiv(num_rows, block_t) >= 2 ** 31
    constexprs = dict(ACT=flags.pop("ACT"), HAS_COUNTS=counts is not None, **flags, ROWS_I64=rows_i64,
                      BLOCK_T=block_t, BLOCK_D=block_d)
    key = scalars + ptr_key(*ptrs)
    # Programs that stride over their expert's valid row blocks, all resident at once; as many row
    # blocks each (for a full buffer), so none runs an extra round alone at the end.
    per_sm = tuning["programs_per_sm"]
    if per_sm is None:
        resident = resident_programs(moe_activation_kernel, key, ptrs + scalars, constexprs, num_warps=num_warps)
    else:
        resident = _platform.program_cap(input.device, per_sm=per_sm)
    grid = (even_split(max(1, cdiv(num_rows, block_t)), resident // (col_blocks * num_experts)), col_blocks,
            num_experts)
    launch(moe_activation_kernel, grid, key, ptrs + scalars, constexprs, num_warps=num_warps)
