"""Routers: router logits -> (topk_weights float32 [M, k], topk_ids int32 [M, k]).

Each function reproduces one family's router from transformers (the test oracles), given the
router logits the model's gate projection produced (`F.linear(hidden, gate.weight[, bias])`):

| function | models | transformers class |
|---|---|---|
| `softmax_topk(..., renormalize=True)` | Mixtral (always renormalizes) | `MixtralTopKRouter` |
| `softmax_topk(..., renormalize=config.norm_topk_prob)` | Qwen3-MoE, OLMoE | `Qwen3MoeTopKRouter`, `OlmoeTopKRouter` |
| `softmax_topk(..., topk_before_softmax=True)` | GPT-OSS | `GptOssTopKRouter` |
| `biased_grouped_topk(..., scoring="sigmoid")` | DeepSeek-V3 | `DeepseekV3TopkRouter` |
| `biased_grouped_topk(..., scoring="sqrtsoftplus")` | DeepSeek-V4 | `DeepseekV4TopKRouter` |
| `hash_topk` | DeepSeek-V4 hash layers | `DeepseekV4HashRouter` |

All math runs in float32 whatever the logits dtype (transformers does the same for Mixtral,
Qwen3, OLMoE and DeepSeek-V3; GPT-OSS and DeepSeek-V4 compute in the model dtype, so with bf16
logits our weights are the more precise ones and near-ties may pick a different expert).
Everything has fixed output shapes and no host synchronisation, so the same code runs on CPU and
CUDA and captures in a CUDA graph. The softmax routers (`fused_topk`) and the DeepSeek routers
(`biased_grouped_topk`) each run as one Triton kernel on CUDA (inside `torch.compile` as the ops
`padded_moe::fused_topk` and `padded_moe::biased_topk`, so compiled and eager calls give the same
bits), and as the torch formula on CPU. The order of the k slots within a token is
descending by the selection score (table order for `hash_topk`); consumers must not rely on it
(transformers uses `sorted=False` for DeepSeek).

For decode-sized batches the gate projection itself can run here too (`gate_sums`, then
`gate_softmax_topk` / `gate_biased_topk`): `FusedMoE` uses it so that a decode step is Triton
launches only and replays as one launch plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from padded_moe._ops import custom_op, register_fake
from padded_moe._util import next_pow2
from padded_moe._validation import (
    INDEX_DTYPES,
    require_bool,
    require_dtype,
    require_rank,
    require_same_device,
    require_tensor,
)

__all__ = ["SCORING_FUNCS", "softmax_topk", "fused_topk", "biased_grouped_topk", "hash_topk"]

# Logits may come straight from the gate projection in any float dtype; float64 is accepted so
# float64 references can drive the routers too.
LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# DeepSeek-V4's `scoring_func` choices (V3 always uses sigmoid).
SCORING_FUNCS = ("sigmoid", "sqrtsoftplus", "softmax")

# DeepSeek's renormalisation denominator guard (`sum + 1e-20` in transformers V3 and V4).
_DEEPSEEK_NORM_EPS = 1e-20

# The one-kernel top-k (`padded_moe.kernels.topk`) holds a row of logits in registers: rows of up
# to this many experts.
FUSED_TOPK_MAX_EXPERTS = 1024


# `gate_sums` runs the gate projection as its own kernel (`padded_moe.kernels.topk._gate_kernel`)
# for batches of up to this many rows: decode steps, where a GEMM library call costs more host time
# than the projection costs the device.
GATE_KERNEL_MAX_TOKENS = 16


# --------------------------------------------------------------------------------------------
# argument checks


def _check_logits(logits: object) -> torch.Tensor:
    logits = require_tensor("logits", logits)
    require_rank("logits", logits, (2,))
    require_dtype("logits", logits, LOGIT_DTYPES)
    if logits.shape[1] < 1:
        raise ValueError(f"logits must have at least one expert column, got shape {tuple(logits.shape)}")
    return logits


def _check_int(name: str, value: object, low: int, high: int, what: str) -> int:
    # bool is an int subclass; a stray True must not pass as k=1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}] ({what}), got {value}")
    return value


def _check_scale(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"routed_scaling_factor must be a float, got {type(value).__name__}")
    return float(value)


def _check_scoring(scoring: object) -> str:
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"scoring must be one of {', '.join(map(repr, SCORING_FUNCS))}, got {scoring!r}")
    return scoring  # type: ignore[return-value]


def _check_out_dtypes(weights_dtype: object, ids_dtype: object) -> None:
    """The routers' output dtypes a caller may ask for (HF's routers return their scores in the
    logits' dtype and int64 indices; the library's own default is float32 / int32)."""
    if weights_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"weights_dtype must be float32, float16 or bfloat16, got {weights_dtype}")
    if ids_dtype not in INDEX_DTYPES:
        raise TypeError(f"ids_dtype must be torch.int32 or torch.int64, got {ids_dtype}")


def _check_bias(bias: object, logits: torch.Tensor) -> torch.Tensor | None:
    if bias is None:
        return None
    bias = require_tensor("bias", bias)
    require_dtype("bias", bias, LOGIT_DTYPES)
    num_experts = logits.shape[1]
    if tuple(bias.shape) != (num_experts,):
        raise ValueError(
            f"bias must have shape ({num_experts},) (one correction per expert, E from logits), "
            f"got {tuple(bias.shape)}"
        )
    require_same_device("bias", bias, "logits", logits)
    return bias


# --------------------------------------------------------------------------------------------
# shared pieces


def _scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """The per-expert affinity DeepSeek weights experts by (in the input's dtype: float32, or
    bfloat16 for `compute_dtype=torch.bfloat16`)."""
    if scoring == "sigmoid":
        return logits.sigmoid()
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.softmax(dim=-1)


def _finish(weights: torch.Tensor, ids: torch.Tensor, weights_dtype: torch.dtype = torch.float32,
            ids_dtype: torch.dtype = torch.int32) -> tuple[torch.Tensor, torch.Tensor]:
    return weights.to(weights_dtype).contiguous(), ids.to(ids_dtype).contiguous()


def _deepseek_normalize(weights: torch.Tensor, renormalize: bool, scale: float) -> torch.Tensor:
    # DeepSeek renormalises first (with a 1e-20 guard, so an all-zero row stays zero instead of
    # NaN), then scales: the scaled weights sum to `routed_scaling_factor`, not to 1.
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _DEEPSEEK_NORM_EPS)
    return weights * scale


# --------------------------------------------------------------------------------------------
# softmax routers


@dataclass(frozen=True)
class GateSums:
    """A decode-sized batch's router logits as the gate kernel leaves them: `parts [S, M, E]`
    float32 partial sums of `x @ weight.T` over S splits of the hidden size, the gate's `bias`
    (or None) and the logits' `dtype`. The router kernels finish the logits from it (splits added
    in order, the bias, one rounding to `dtype`) as they read them (`gate_softmax_topk`,
    `gate_biased_topk`)."""

    parts: torch.Tensor
    bias: Optional[torch.Tensor]
    dtype: torch.dtype


def gate_sums(hidden_states: torch.Tensor, weight: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> Optional[GateSums]:
    """The gate projection `F.linear(hidden_states [M, D], weight [E, D], bias)` of a decode-sized
    batch as partial sums (`GateSums`), or None where the gate kernel does not serve: past
    `GATE_KERNEL_MAX_TOKENS` rows or `FUSED_TOPK_MAX_EXPERTS` experts, mixed dtypes, strided
    columns, not CUDA (or the interpreter), under `torch.compile`, or a gradient to record.

    Why: `FusedMoE`'s decode step is then Triton launches only, which replay as one launch plan
    (a GEMM library call costs tens of µs of host time there, more than the device spends on it).
    The logits equal a GEMM's with a bias epilogue up to the order of the float32 sums: a logit
    may differ from cuBLAS's `F.linear` by one unit in its last place (a router near-tie may then
    pick the other expert)."""
    from padded_moe import _platform

    x = hidden_states
    if type(x) is not torch.Tensor or torch.compiler.is_compiling() or x.dim() != 2 \
            or not 0 < x.shape[0] <= GATE_KERNEL_MAX_TOKENS or weight.dim() != 2 or x.shape[1] != weight.shape[1] \
            or not 0 < weight.shape[0] <= FUSED_TOPK_MAX_EXPERTS:
        return None
    if x.dtype not in _ROUNDING or weight.dtype != x.dtype \
            or (bias is not None and (bias.dtype != x.dtype or bias.shape != weight.shape[:1]
                                      or bias.device != x.device or bias.stride(0) != 1)):
        return None
    if weight.device != x.device or x.stride(1) != 1 or weight.stride(1) != 1 or not _platform.use_triton(x.device):
        return None
    # Autograd records F.linear; the kernel has no backward.
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    return GateSums(_gate_partials(x, weight), bias, x.dtype)


# How `_row_logits` rounds the finished logits, by their dtype.
_ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# The gate kernel's blocks: experts per program (tl.dot's narrowest side), hidden columns per step.
_GATE_BLOCK_E, _GATE_BLOCK_K = 16, 128
# Programs the gate kernel aims for (about two per SM of an H100 / H200): the gate weight
# (0.3-2 MB) then streams at the device's rate instead of one program's.
_GATE_PROGRAMS = 256
# Splits of the hidden size at most (the router kernels add them in registers, unrolled).
_GATE_MAX_SPLITS = 16


def gate_splits(num_experts: int, hidden: int) -> tuple[int, int]:
    """`(S, KS)`: the gate kernel's splits of the hidden size and columns per split (a multiple of
    its step), so that about `_GATE_PROGRAMS` programs each read at least one step."""
    blocks = -(-num_experts // _GATE_BLOCK_E)
    steps = -(-hidden // _GATE_BLOCK_K)
    want = max(1, min(_GATE_MAX_SPLITS, steps, _GATE_PROGRAMS // blocks))
    per_split = -(-steps // want)
    return -(-steps // per_split), per_split * _GATE_BLOCK_K


def _gate_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from padded_moe.kernels import INTERPRETED
    from padded_moe.kernels._launch import launch, ptr_key
    from padded_moe.kernels.topk import _gate_kernel

    M, D = x.shape
    E = weight.shape[0]
    splits, per_split = gate_splits(E, D)
    parts = torch.empty(splits, M, E, dtype=torch.float32, device=x.device)
    args = (x, x.stride(0), weight, weight.stride(0), parts, parts.stride(0), parts.stride(1), M, E, D, per_split)
    constexprs = dict(BM=16, BE=_GATE_BLOCK_E, BK=_GATE_BLOCK_K, FP32_DOT=x.dtype == torch.float32 or INTERPRETED)
    key = (x.stride(0), weight.stride(0), parts.stride(0), parts.stride(1), M, E, D, per_split) \
        + ptr_key(x, weight, parts)
    launch(_gate_kernel, (-(-E // _GATE_BLOCK_E), splits), key, args, constexprs, num_warps=4)
    return parts


def gate_softmax_topk(gate: GateSums, k: int, renormalize: bool,
                      topk_before_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax_topk` on the logits `gate` holds (one router kernel finishes and routes them)."""
    return _fused_topk_kernel(gate.parts, k, renormalize, topk_before_softmax, torch.float32, torch.int32, gate)


def gate_biased_topk(gate: GateSums, bias: Optional[torch.Tensor], k: int, num_groups: int, topk_groups: int,
                     scoring: str, routed_scaling_factor: float,
                     renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`biased_grouped_topk` (float32 steps) on the logits `gate` holds; the group limit must be
    one the kernel serves (`biased_groups_fit`)."""
    if not biased_groups_fit(gate.parts.shape[2], num_groups, topk_groups):
        raise ValueError(f"the router kernel's group limit needs E and num_groups powers of two, got "
                         f"E={gate.parts.shape[2]}, num_groups={num_groups}")
    return _biased_topk_kernel(gate.parts, bias, k, num_groups, topk_groups, scoring, routed_scaling_factor,
                               renormalize, torch.float32, torch.int32, False, gate)


def _router_source(logits: torch.Tensor, gate: Optional[GateSums]) -> tuple:
    """What the router kernels read: `(tensor, row stride, split stride, gate bias argument,
    constexprs)` for logits, or for a gate's partial sums (`_row_logits`)."""
    if gate is None:
        return logits, logits.stride(0), 0, logits, dict(PARTS=0, GATE_BIAS=False, ROUND=0)
    parts = gate.parts
    gbias = parts if gate.bias is None else gate.bias  # never read without GATE_BIAS
    return parts, parts.stride(1), parts.stride(0), gbias, dict(PARTS=parts.shape[0], GATE_BIAS=gate.bias is not None,
                                                                ROUND=_ROUNDING[gate.dtype])


def softmax_topk(
    logits: torch.Tensor, k: int, renormalize: bool, *, topk_before_softmax: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing (Mixtral, Qwen3-MoE, OLMoE, GPT-OSS).

    Default: softmax over all `E` experts, keep the `k` largest probabilities, and when
    `renormalize` divide them by their sum (no epsilon: the sum includes the row maximum, which
    is at least 1/E). Mixtral always renormalizes; Qwen3-MoE and OLMoE renormalize iff
    `config.norm_topk_prob` (default False for both).

    `topk_before_softmax=True` is GPT-OSS: take the `k` largest logits (the gate has a bias; pass
    logits with the bias added) and softmax over those `k` only; the weights then already sum to
    one, so `renormalize` has no further effect.

    Args:
        logits: float `[M, E]` router logits.
        k: experts per token, `1 <= k <= E`.
        renormalize: divide the kept probabilities by their sum.
        topk_before_softmax: GPT-OSS ordering (top-k of logits, then softmax over the k).

    Returns:
        `(topk_weights float32 [M, k], topk_ids int32 [M, k])`.
    """
    return fused_topk(logits, k, renormalize=renormalize, topk_before_softmax=topk_before_softmax)


def fused_topk(
    logits: torch.Tensor, k: int, *, renormalize: bool = False, topk_before_softmax: bool = False,
    weights_dtype: torch.dtype = torch.float32, ids_dtype: torch.dtype = torch.int32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax_topk`'s routing with the output dtypes chosen: `(weights [M, k] weights_dtype, ids
    [M, k] ids_dtype)`, largest first.

    On CUDA (and the interpreter) one Triton kernel computes it (`padded_moe.kernels.topk`: the
    float32 softmax with an accurate exponential, the k largest with ties to the lower id, the
    renormalisation, the casts), for E up to `FUSED_TOPK_MAX_EXPERTS`; on CPU and for wider rows,
    the torch formula; `torch.compile` sees one op (`padded_moe::fused_topk`) that runs the same.
    The two agree up to float32 rounding of the softmax (a near-tie within that rounding may pick
    either expert). The kernel has no backward: where autograd records (grad enabled and logits
    that require grad, e.g. a gate outside `torch.no_grad()`) the torch formula runs, so the
    weights keep their gradient. transformers' HF routers through the plug-in use it with their
    own output dtypes.
    """
    logits = _check_logits(logits)
    k = _check_int("k", k, 1, logits.shape[1], "experts per token, at most E = logits.shape[1]")
    renormalize = require_bool("renormalize", renormalize)
    topk_before_softmax = require_bool("topk_before_softmax", topk_before_softmax)
    _check_out_dtypes(weights_dtype, ids_dtype)
    if logits.requires_grad and torch.is_grad_enabled():
        return _topk_formula(logits, k, renormalize, topk_before_softmax, weights_dtype, ids_dtype)
    if torch.compiler.is_compiling():
        return torch.ops.padded_moe.fused_topk(logits, k, renormalize, topk_before_softmax, weights_dtype, ids_dtype)
    return _fused_topk_op(logits, k, renormalize, topk_before_softmax, weights_dtype, ids_dtype)


@custom_op("padded_moe::fused_topk", mutates_args=())
def _fused_topk_op(logits: torch.Tensor, k: int, renormalize: bool, topk_before_softmax: bool,
                   weights_dtype: torch.dtype, ids_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if _fused_topk_serves(logits):
        return _fused_topk_kernel(logits, k, renormalize, topk_before_softmax, weights_dtype, ids_dtype)
    return _topk_formula(logits, k, renormalize, topk_before_softmax, weights_dtype, ids_dtype)


def _topk_formula(logits, k, renormalize, topk_before_softmax, weights_dtype, ids_dtype):
    """The routers' formula in torch ops (differentiable in the weights)."""
    logits32 = logits.to(torch.float32)
    if topk_before_softmax:
        top_logits, ids = torch.topk(logits32, k, dim=-1)
        weights = top_logits.softmax(dim=-1)
    else:
        weights, ids = torch.topk(logits32.softmax(dim=-1), k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    return _finish(weights, ids, weights_dtype, ids_dtype)


@register_fake("padded_moe::fused_topk")
def _fused_topk_fake(logits, k, renormalize, topk_before_softmax, weights_dtype, ids_dtype):
    return (logits.new_empty((logits.shape[0], k), dtype=weights_dtype),
            logits.new_empty((logits.shape[0], k), dtype=ids_dtype))


def _fused_topk_serves(logits: torch.Tensor) -> bool:
    from padded_moe import _platform

    return (logits.dtype != torch.float64 and logits.shape[1] <= FUSED_TOPK_MAX_EXPERTS
            and _platform.use_triton(logits.device))


def _fused_topk_kernel(logits, k, renormalize, topk_before_softmax, weights_dtype, ids_dtype,
                       gate: Optional[GateSums] = None):
    """The router kernel on `logits [M, E]`, or with `gate` on its partial sums (then `logits` is
    `gate.parts`)."""
    from padded_moe.kernels._launch import launch, ptr_key
    from padded_moe.kernels.topk import _topk_router_kernel

    logits = _row_major(logits) if gate is None else logits
    num_tokens, num_experts = logits.shape[-2:]
    weights = torch.empty(num_tokens, k, dtype=weights_dtype, device=logits.device)
    ids = torch.empty(num_tokens, k, dtype=ids_dtype, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    src, stride_m, stride_s, gbias, gate_constexprs = _router_source(logits, gate)
    block_e = next_pow2(num_experts)
    args = (src, stride_m, stride_s, gbias, weights, weights.stride(0), ids, ids.stride(0), num_experts)
    constexprs = dict(K=k, K_POW2=next_pow2(k), BLOCK_E=block_e,
                      SOFTMAX_FIRST=not topk_before_softmax, RENORM=renormalize and not topk_before_softmax,
                      LIBDEVICE=logits.is_cuda, **gate_constexprs)
    key = (stride_m, stride_s, weights.stride(0), ids.stride(0), num_experts) + ptr_key(src, gbias, weights, ids)
    launch(_topk_router_kernel, (num_tokens,), key, args, constexprs, num_warps=_router_warps(block_e))
    return weights, ids


def _row_major(logits: torch.Tensor) -> torch.Tensor:
    """The router kernels read each row as one contiguous run."""
    return logits.contiguous() if logits.shape[1] > 1 and logits.stride(1) != 1 else logits


def _router_warps(block_e: int) -> int:
    """One warp holds a row of up to 256 experts; wider rows take four."""
    return 1 if block_e <= 256 else 4


# --------------------------------------------------------------------------------------------
# DeepSeek routers


def _group_mask(choice: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Boolean `[M, E]`: True for experts in the `topk_groups` best groups of each token.

    A group's score is the sum of its two best (biased) expert scores, as in DeepSeek-V3.
    """
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    return keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)


def check_groups(num_experts: int, k: int, num_groups: object, topk_groups: object) -> tuple[int, int]:
    num_groups = _check_int("num_groups", num_groups, 1, num_experts, "expert groups, at most E")
    if num_experts % num_groups:
        raise ValueError(f"num_groups must divide the number of experts E={num_experts}, got {num_groups}")
    topk_groups = _check_int(
        "topk_groups", topk_groups, 1, num_groups, "groups kept per token, at most num_groups"
    )
    group_size = num_experts // num_groups
    if num_groups > 1 and group_size < 2:
        raise ValueError(
            f"num_groups={num_groups} leaves {group_size} expert per group; group scores sum the top-2 "
            f"experts of a group, so each group needs at least 2 (E={num_experts})"
        )
    if k > topk_groups * group_size:
        raise ValueError(
            f"k must be at most topk_groups * E / num_groups = {topk_groups * group_size} (the experts "
            f"left after group selection), got {k}"
        )
    return num_groups, topk_groups


def biased_grouped_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    num_groups: int = 1,
    topk_groups: int = 1,
    scoring: str = "sigmoid",
    routed_scaling_factor: float = 1.0,
    renormalize: bool = True,
    *,
    weights_dtype: torch.dtype = torch.float32,
    ids_dtype: torch.dtype = torch.int32,
    compute_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / V4 routing: scores, bias-corrected group-limited selection, unbiased weights.

    1. `scores = scoring(logits)` in float32 (`sigmoid` for V3; V4's `config.scoring_func`,
       `sqrtsoftplus` = sqrt(softplus(x)) by default, or `sigmoid` / `softmax`).
    2. Selection uses `scores + bias` (`e_score_correction_bias`). With `num_groups > 1` (V3's
       `n_group`) the experts split into contiguous groups, each group is scored by the sum of
       its top-2 biased scores, only the `topk_groups` (V3's `topk_group`) best groups stay
       eligible, and the `k` best eligible experts are chosen. V4 has no groups (defaults).
    3. Weights are the *unbiased* scores of the chosen experts; if `renormalize` (V3's
       `norm_topk_prob`; V4 always renormalizes) they are divided by `sum + 1e-20`, and then
       multiplied by `routed_scaling_factor` (scaling comes after renormalisation).

    Args:
        logits: float `[M, E]` router logits.
        bias: float `[E]` selection-only correction, or None for none.
        k: experts per token.
        num_groups: expert groups; must divide E, each group at least 2 experts when > 1.
        topk_groups: groups kept per token, `1 <= topk_groups <= num_groups`.
        scoring: one of `SCORING_FUNCS`.
        routed_scaling_factor: multiplier applied to the final weights.
        renormalize: divide the chosen scores by their sum before scaling.
        weights_dtype, ids_dtype: the outputs' dtypes (float32 / float16 / bfloat16; int32 /
            int64), written by the same kernel (transformers' routers return int64 indices).
        compute_dtype: None or float32 (the default: every step in float32), or bfloat16: each
            value torch would hold in bfloat16 when the formula runs on bfloat16 logits, as
            transformers' DeepSeek-V4 router does, is rounded to it (the scores, with a bfloat16
            `bias` the biased scores, the sum of the chosen scores, the sum + 1e-20, the quotient,
            the scaled weight), so the experts chosen are transformers' own and not only equal up
            to bfloat16 rounding. Sigmoid and sqrt(softplus) scoring without a group limit only
            (NotImplementedError otherwise).

    Returns:
        `(topk_weights [M, k] weights_dtype, topk_ids [M, k] ids_dtype)`, the k largest choice
        scores first.

    On CUDA one Triton kernel computes it (E up to `FUSED_TOPK_MAX_EXPERTS`; with a group limit, E
    and `num_groups` powers of two), with libdevice's exp / log1p and ties to the lower expert id
    (and to the lower group); elsewhere, and where autograd records, the torch formula. The two
    agree up to float32 rounding (a near-tie within it may pick either expert).
    """
    logits = _check_logits(logits)
    num_experts = logits.shape[1]
    bias = _check_bias(bias, logits)
    k = _check_int("k", k, 1, num_experts, "experts per token, at most E = logits.shape[1]")
    num_groups, topk_groups = check_groups(num_experts, k, num_groups, topk_groups)
    scoring = _check_scoring(scoring)
    scale = _check_scale(routed_scaling_factor)
    renormalize = require_bool("renormalize", renormalize)
    _check_out_dtypes(weights_dtype, ids_dtype)
    if compute_dtype not in (None, torch.float32, torch.bfloat16):
        raise TypeError(f"compute_dtype must be None, torch.float32 or torch.bfloat16, got {compute_dtype}")
    bf16 = compute_dtype == torch.bfloat16
    if bf16 and (scoring == "softmax" or topk_groups < num_groups):
        raise NotImplementedError("compute_dtype=torch.bfloat16 supports scoring 'sigmoid' and 'sqrtsoftplus' "
                                  f"without a group limit (DeepSeek-V4's router), got scoring={scoring!r}, "
                                  f"{topk_groups} of {num_groups} groups")
    args = (logits, bias, k, num_groups, topk_groups, scoring, scale, renormalize, weights_dtype, ids_dtype, bf16)

    if (logits.requires_grad or (bias is not None and bias.requires_grad)) and torch.is_grad_enabled():
        return _biased_formula(*args)
    if torch.compiler.is_compiling():
        return torch.ops.padded_moe.biased_topk(*args)
    return _biased_topk_op(*args)


@custom_op("padded_moe::biased_topk", mutates_args=())
def _biased_topk_op(logits: torch.Tensor, bias: Optional[torch.Tensor], k: int, num_groups: int, topk_groups: int,
                    scoring: str, scale: float, renormalize: bool, weights_dtype: torch.dtype,
                    ids_dtype: torch.dtype, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    args = (logits, bias, k, num_groups, topk_groups, scoring, scale, renormalize, weights_dtype, ids_dtype, bf16)
    if _biased_kernel_serves(logits, num_groups, topk_groups):
        return _biased_topk_kernel(*args)
    return _biased_formula(*args)


@register_fake("padded_moe::biased_topk")
def _biased_topk_fake(logits, bias, k, num_groups, topk_groups, scoring, scale, renormalize, weights_dtype,
                      ids_dtype, bf16):
    return (logits.new_empty((logits.shape[0], k), dtype=weights_dtype),
            logits.new_empty((logits.shape[0], k), dtype=ids_dtype))


def _biased_formula(logits, bias, k, num_groups, topk_groups, scoring, scale, renormalize,
                    weights_dtype=torch.float32, ids_dtype=torch.int32, bf16=False):
    """`biased_grouped_topk` in torch ops (differentiable in the weights). `bf16` (`compute_dtype`):
    the same ops on bfloat16 logits, so torch stores every elementwise step in bfloat16, and the
    biased scores stay bfloat16 with a bfloat16 bias (float32 with any other)."""
    x = logits.to(torch.bfloat16 if bf16 else torch.float32)
    scores = _scores(x, scoring)
    if bias is not None and not (bf16 and bias.dtype == torch.bfloat16):
        bias = bias.to(torch.float32)
    choice = scores if bias is None else scores + bias
    if topk_groups < num_groups:
        choice = choice.masked_fill(~_group_mask(choice, num_groups, topk_groups), float("-inf"))
    ids = torch.topk(choice, k, dim=-1).indices
    weights = _deepseek_normalize(scores.gather(1, ids), renormalize, scale)
    return _finish(weights, ids, weights_dtype, ids_dtype)


def _biased_kernel_serves(logits: torch.Tensor, num_groups: int, topk_groups: int) -> bool:
    return _fused_topk_serves(logits) and biased_groups_fit(logits.shape[1], num_groups, topk_groups)


def biased_groups_fit(num_experts: int, num_groups: int, topk_groups: int) -> bool:
    """The kernel's group limit splits a row held whole in registers: E and the group count
    powers of two (DeepSeek-V3: 256 experts in 8 groups); otherwise the torch formula."""
    pow2 = num_experts & (num_experts - 1) == 0 and num_groups & (num_groups - 1) == 0
    return topk_groups == num_groups or pow2


def _biased_topk_kernel(logits, bias, k, num_groups, topk_groups, scoring, scale, renormalize, weights_dtype,
                        ids_dtype, bf16, gate: Optional[GateSums] = None):
    """The DeepSeek router kernel on `logits [M, E]`, or with `gate` on its partial sums."""
    from padded_moe.kernels._launch import launch, ptr_key
    from padded_moe.kernels.topk import _biased_router_kernel

    logits = _row_major(logits) if gate is None else logits
    num_tokens, num_experts = logits.shape[-2:]
    weights = torch.empty(num_tokens, k, dtype=weights_dtype, device=logits.device)
    ids = torch.empty(num_tokens, k, dtype=ids_dtype, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    if bias is not None:
        bias = bias.contiguous()
    block_e = next_pow2(num_experts)
    if topk_groups == num_groups:  # no group limit: one compiled form whatever the group count
        num_groups = topk_groups = 1
    bias_arg = logits if bias is None else bias  # never read without HAS_BIAS
    src, stride_m, stride_s, gbias, gate_constexprs = _router_source(logits, gate)
    args = (src, stride_m, stride_s, gbias, bias_arg, weights, weights.stride(0), ids, ids.stride(0), num_experts,
            scale)
    constexprs = dict(K=k, K_POW2=next_pow2(k), BLOCK_E=block_e, SCORING=SCORING_FUNCS.index(scoring),
                      HAS_BIAS=bias is not None, GROUPS=num_groups, TOPK_GROUPS=topk_groups,
                      RENORM=renormalize, LIBDEVICE=logits.is_cuda, BF16_STEPS=bf16,
                      BF16_CHOICE=bf16 and bias is not None and bias.dtype == torch.bfloat16, **gate_constexprs)
    key = (stride_m, stride_s, weights.stride(0), ids.stride(0), num_experts, scale) \
        + ptr_key(src, gbias, bias_arg, weights, ids)
    launch(_biased_router_kernel, (num_tokens,), key, args, constexprs, num_warps=_router_warps(block_e))
    return weights, ids


def _hash_lookup(
    token_ids: torch.Tensor, table: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids int64 [M, k], valid bool [M, k])`; invalid slots hold -1, never a wrapped index.

    A slot is invalid when its token id is outside `[0, vocab)` or the table entry is outside
    `[0, E)`. Both checks happen in int64 before anything indexes with the value; the gather
    reads a clamped index and the result is then overwritten, so no out-of-bounds read occurs.
    """
    vocab = table.shape[0]
    tok = token_ids.reshape(-1).to(torch.int64)
    tok_ok = (tok >= 0) & (tok < vocab)
    rows = table.index_select(0, tok.clamp(0, max(vocab - 1, 0))).to(torch.int64)
    valid = tok_ok.unsqueeze(1) & (rows >= 0) & (rows < num_experts)
    return torch.where(valid, rows, torch.full_like(rows, -1)), valid


def hash_topk(
    token_ids: torch.Tensor,
    table: torch.Tensor,
    logits: torch.Tensor,
    scoring: str = "sqrtsoftplus",
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 hash-layer routing (`DeepseekV4HashRouter`): fixed experts, learned weights.

    The experts of token `t` are `table[token_ids[t]]` (transformers: `tid2eid[input_ids]`,
    `k = table.shape[1]` = `num_experts_per_tok`); the weights are `scoring(logits)` at those
    experts, always renormalised by `sum + 1e-20`, then times `routed_scaling_factor`
    (`config.scoring_func`, `config.routed_scaling_factor`).

    Invalid ids, on every device: a slot whose token id is outside `[0, table.shape[0])` (a
    scheduler's padding token, say) or whose table entry is outside `[0, E)` gets `topk_id = -1`
    (which the expert guard drops) and weight 0, and is left out of the renormalisation sum; a token
    with no valid slot gets all-zero weights. Nothing is read back to the host, so this is also
    what runs inside a CUDA graph. (transformers would wrap a negative id or fault on an
    out-of-range one.)

    Args:
        token_ids: int32/int64 token ids, any shape with `M` elements (flattened row-major,
            matching the `[M, E]` logits of the flattened hidden states).
        table: int32/int64 `[vocab, k]` token -> expert ids.
        logits: float `[M, E]` router logits.
        scoring: one of `SCORING_FUNCS` (DeepSeek-V4 default `sqrtsoftplus`).
        routed_scaling_factor: multiplier applied to the final weights.

    Returns:
        `(topk_weights float32 [M, k], topk_ids int32 [M, k])`.
    """
    logits = _check_logits(logits)
    num_tokens, num_experts = logits.shape
    token_ids = require_tensor("token_ids", token_ids)
    require_dtype("token_ids", token_ids, INDEX_DTYPES)
    if token_ids.numel() != num_tokens:
        raise ValueError(
            f"token_ids must have one id per logits row ({num_tokens} elements), "
            f"got shape {tuple(token_ids.shape)}"
        )
    require_same_device("token_ids", token_ids, "logits", logits)
    table = require_tensor("table", table)
    require_dtype("table", table, INDEX_DTYPES)
    require_rank("table", table, (2,))
    if table.shape[0] < 1 or table.shape[1] < 1:
        raise ValueError(f"table must be [vocab, k] with vocab >= 1 and k >= 1, got shape {tuple(table.shape)}")
    require_same_device("table", table, "logits", logits)
    scoring = _check_scoring(scoring)
    scale = _check_scale(routed_scaling_factor)

    return _hash_route(token_ids, table, logits, scoring, scale)


def _hash_route(
    token_ids: torch.Tensor, table: torch.Tensor, logits: torch.Tensor, scoring: str, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The body of `hash_topk` (no host sync): invalid slots -> id -1, weight 0."""
    ids, valid = _hash_lookup(token_ids, table, logits.shape[1])
    scores = _scores(logits.to(torch.float32), scoring)
    weights = scores.gather(1, ids.clamp(min=0)).masked_fill(~valid, 0.0)
    return _finish(_deepseek_normalize(weights, True, scale), ids)
