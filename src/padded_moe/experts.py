"""The fused expert call (spec 03): layout → (permute) → GEMM1 → activation → GEMM2 → unpermute.

The activation always receives the layout's valid-prefix count, so rows that hold padding
(dropped slots, tokens past `valid_tokens`, capacity past an expert's count) are never activated,
and the GEMMs skip them by reading their bounds on the device. With a scratch object every
intermediate buffer is allocated once, so steady-state calls allocate nothing and the whole call
captures in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from padded_moe._validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    require_dtype,
    require_rank,
    require_tensor,
    require_weight,
)
from padded_moe.activation import (
    ApplyMoEActivationConfig,
    MoEActivation,
    apply_moe_activation,
    resolve_supported,
)
from padded_moe.expert_map import ExpertMap
from padded_moe.gemm import expert_gemm
from padded_moe.layouts import (
    GemmLayout,
    GroupedMaskedMeta,
    build_layout,
    permute,
    select_gemm_layout,
    unpermute,
)


def weight_shape(w) -> tuple:
    """Logical `[L, out, in]` of a float weight or an `Mxfp4Tensor`."""
    return tuple(w.shape)


def _check_weights(act: MoEActivation, w13, w2, hidden_size: int) -> tuple[int, int]:
    """Return (num_local, N) after checking w13 [L, 2N|N, K] and w2 [L, K, N]."""
    require_weight("w13", w13)
    require_weight("w2", w2)
    s13, s2 = weight_shape(w13), weight_shape(w2)
    if len(s13) != 3 or len(s2) != 3:
        raise ValueError(f"w13 and w2 must be 3-D [L, out, in], got shapes {s13} and {s2}")
    num_local, rows13, k13 = s13
    if k13 != hidden_size:
        raise ValueError(f"w13 must be [L, 2N, K] with K = hidden size {hidden_size}, got {s13}")
    n = rows13 // 2 if act.is_gated else rows13
    if act.is_gated and rows13 % 2:
        raise ValueError(f"w13's rows must be even (gate and up) for gated {act.value}, got {s13}")
    if s2 != (num_local, hidden_size, n):
        raise ValueError(f"w2 must have shape {(num_local, hidden_size, n)} (L, K, N), got {s2}")
    return num_local, n


def _workspace(scratch, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer cached on the scratch object (allocated on first use), or a fresh one without scratch."""
    if scratch is None:
        return torch.empty(shape, dtype=dtype, device=device)
    cache = scratch.__dict__.setdefault("_experts_workspace", {})
    key = (name, dtype, device)
    buf = cache.get(key)
    numel = 1
    for s in shape:
        numel *= s
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        cache[key] = buf
    return buf[:numel].view(shape)


def _layout_from_argument(layout, expert_parallel: bool) -> GemmLayout:
    override = layout.value if isinstance(layout, GemmLayout) else layout
    return select_gemm_layout(expert_parallel=expert_parallel, batched_format=False, override=override)


def fused_experts(hidden_states: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  activation: Union[str, MoEActivation],
                  activation_config: Optional[ApplyMoEActivationConfig] = None,
                  expert_map: Optional[ExpertMap] = None,
                  layout: Union[None, str, GemmLayout] = None,
                  w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None,
                  valid_tokens: Optional[torch.Tensor] = None,
                  backend: str = "auto", scratch=None) -> torch.Tensor:
    """Routed MoE experts on `hidden_states [M, K]`; returns `[M, K]` in the input's dtype.

    `topk_ids` hold global expert ids; ids outside `[0, E)` and (with `expert_map`) non-local ids
    are dropped. `layout=None` picks INDEXED without expert parallelism and GROUPED_CONTIGUOUS
    with it (spec 02); a string or `GemmLayout` overrides (validated). With `valid_tokens`
    (int32 `[1]` on device) only the first rows are real; output rows at or past it are not
    written (their contents are unspecified).
    """
    act = resolve_supported(activation)
    require_tensor("hidden_states", hidden_states)
    require_dtype("hidden_states", hidden_states, FLOAT_DTYPES)
    require_rank("hidden_states", hidden_states, (2,))
    require_tensor("topk_ids", topk_ids)
    require_dtype("topk_ids", topk_ids, INDEX_DTYPES)
    num_tokens, hidden_size = hidden_states.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must be [M={num_tokens}, k], got shape {tuple(topk_ids.shape)}")
    require_tensor("topk_weights", topk_weights)
    require_dtype("topk_weights", topk_weights, FLOAT_DTYPES + (torch.float64,))
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    num_local, n = _check_weights(act, w13, w2, hidden_size)
    if expert_map is not None and expert_map.num_local != num_local:
        raise ValueError(f"expert_map has {expert_map.num_local} local experts but w13 holds {num_local}")
    chosen = _layout_from_argument(layout, expert_parallel=expert_map is not None)
    experts = expert_map if expert_map is not None else num_local
    meta = build_layout(chosen, topk_ids, experts, valid_tokens=valid_tokens, scratch=scratch)

    device, dtype = hidden_states.device, hidden_states.dtype
    a = permute(hidden_states, meta)
    rows = num_tokens * topk_ids.shape[1]
    width13 = weight_shape(w13)[1]
    h = _workspace(scratch, "gemm1", (rows, width13), dtype, device)
    expert_gemm(a, w13, meta, stage="w13", bias=w13_bias, out=h, backend=backend)
    act_out = _workspace(scratch, "act", (rows, n), dtype, device)
    apply_moe_activation(act, act_out, h, activation_config=activation_config,
                         valid_token_counts=meta.activation_counts)
    y = _workspace(scratch, "gemm2", (rows, hidden_size), dtype, device)
    expert_gemm(act_out, w2, meta, stage="w2", bias=w2_bias, out=y, backend=backend)
    out = _workspace(scratch, "out", (num_tokens, hidden_size), dtype, device)
    unpermute(out, y, topk_weights, meta)
    return out


def masked_meta_from_counts(counts: torch.Tensor, max_tokens_per_expert: int) -> GroupedMaskedMeta:
    """GROUPED_MASKED metadata for a buffer that arrives already batched per expert (no slots)."""
    empty = torch.empty(0, dtype=torch.int32, device=counts.device)
    # Clamp in the counts' own dtype before narrowing: an int64 count of 2**40 must mean "every
    # row", not wrap to 0 in int32. A count past T cannot be honoured (the buffer has T rows).
    counts32 = counts.clamp(0, max_tokens_per_expert).to(torch.int32)
    return GroupedMaskedMeta(
        num_tokens=0, top_k=0, num_local=counts.shape[0], slot_expert=empty,
        activation_counts=counts32, counts=counts32, inv=empty,
        overflow=torch.zeros(1, dtype=torch.int32, device=counts.device),
        max_tokens_per_expert=max_tokens_per_expert)


def batched_experts(x: torch.Tensor, counts: torch.Tensor, w13, w2, *, activation: Union[str, MoEActivation],
                    activation_config: Optional[ApplyMoEActivationConfig] = None,
                    backend: str = "auto", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Experts over a batched receive buffer `x [L, T, K]`, expert `e` valid on rows `[0, counts[e])`.

    GROUPED_MASKED throughout; returns `[L, T, K]` whose rows past each count are untouched
    (left as they were in `out` when given, unspecified otherwise). Router weights are not
    applied here (expert parallelism's combine applies them).
    """
    act = resolve_supported(activation)
    require_tensor("x", x)
    require_dtype("x", x, FLOAT_DTYPES)
    require_rank("x", x, (3,))
    require_tensor("counts", counts)
    require_dtype("counts", counts, INDEX_DTYPES)
    num_local, max_rows, hidden_size = x.shape
    if tuple(counts.shape) != (num_local,):
        raise ValueError(f"counts must be 1-D of length L={num_local}, got shape {tuple(counts.shape)}")
    if _check_weights(act, w13, w2, hidden_size)[0] != num_local:
        raise ValueError(f"w13 must hold L={num_local} experts (x's first dim), got {weight_shape(w13)}")
    n = weight_shape(w2)[2]
    meta = masked_meta_from_counts(counts, max_rows)
    h = torch.empty(num_local, max_rows, weight_shape(w13)[1], dtype=x.dtype, device=x.device)
    expert_gemm(x, w13, meta, stage="w13", out=h, backend=backend)
    act_out = torch.empty(num_local, max_rows, n, dtype=x.dtype, device=x.device)
    apply_moe_activation(act, act_out, h, activation_config=activation_config, valid_token_counts=meta.counts)
    if out is None:
        out = torch.empty_like(x)
    expert_gemm(act_out, w2, meta, stage="w2", out=out, backend=backend)
    return out
