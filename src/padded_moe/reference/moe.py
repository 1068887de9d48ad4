"""Float64 loop-over-experts MoE: the independent oracle for kernel and layer tests.

Written from the documented formulas (docs/usage.md) with plain torch ops in float64; it shares no
code with the kernels or the torch fast paths it checks.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def activation_f64(name: str, x: torch.Tensor, *, limit=None, alpha=None, beta=None,
                   situ_beta=None, situ_lambda=None) -> torch.Tensor:
    """The activations of docs/usage.md ("Count-aware activation") in float64. `x` is the GEMM1
    output (gated: width 2d)."""
    x = x.double()
    if name.endswith("_no_mul"):
        base = name[: -len("_no_mul")]
        if base == "silu":
            return F.silu(x)
        if base == "gelu":
            return F.gelu(x)
        if base == "gelu_tanh":
            return F.gelu(x, approximate="tanh")
        if base == "relu2":
            return torch.relu(x) ** 2
        raise NotImplementedError(name)
    if name == "swigluoai":
        g, u = x[..., 0::2], x[..., 1::2]
    else:
        d = x.shape[-1] // 2
        g, u = x[..., :d], x[..., d:]
    if name in ("silu", "swigluoai", "swigluoai_uninterleave"):
        oai = name != "silu"
        L = limit if limit is not None else (7.0 if oai else None)
        a = alpha if alpha is not None else (1.702 if oai else 1.0)
        b = beta if beta is not None else (1.0 if oai else 0.0)
        if L is not None:
            g = g.clamp(max=L)
            u = u.clamp(-L, L)
        return g * torch.sigmoid(a * g) * (u + b)
    if name == "gelu":
        return F.gelu(g) * u
    if name == "gelu_tanh":
        return F.gelu(g, approximate="tanh") * u
    if name == "swiglustep":
        L = 7.0 if limit is None else limit
        if math.isinf(L):
            return F.silu(g) * u
        return F.silu(g).clamp(max=L) * u.clamp(-L, L)
    if name == "situ":
        if situ_beta is None:
            raise ValueError("situ needs situ_beta")
        bs = situ_beta
        up = situ_lambda * torch.tanh(u / situ_lambda) if situ_lambda is not None and situ_lambda > 0 else u
        return bs * torch.tanh(g / bs) * torch.sigmoid(g) * up
    raise NotImplementedError(name)


def reference_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, activation: str,
                  activation_kwargs: Optional[dict] = None, expert_map: Optional[torch.Tensor] = None,
                  num_experts: Optional[int] = None, w13_bias=None, w2_bias=None,
                  valid_tokens: Optional[int] = None) -> torch.Tensor:
    """Loop over tokens and slots: out[t] = Σ_j w[t,j] · (act(x_t W13[e]^T + b13) W2[e]^T + b2).

    `w13`/`w2` are dense `[L, out, in]` (dequantize MXFP4 first). `expert_map` is the int `[E]`
    global→local map (-1 non-local) or None (all `E = w13.shape[0]` experts local). Ids outside
    `[0, E)` and non-local ids contribute nothing; tokens at/after `valid_tokens` give zero rows.
    Returns float64 `[M, K]`.
    """
    kw = activation_kwargs or {}
    M, k = topk_ids.shape
    E = num_experts if num_experts is not None else (
        expert_map.numel() if expert_map is not None else w13.shape[0])
    ids = topk_ids.long().cpu()
    weights = topk_weights.double().cpu()
    x = hidden.double().cpu()
    emap = expert_map.long().cpu() if expert_map is not None else None
    out = torch.zeros(M, w2.shape[1], dtype=torch.float64)
    n_valid = M if valid_tokens is None else max(0, min(int(valid_tokens), M))
    in_range = (ids >= 0) & (ids < E)
    local = torch.where(in_range, ids.clamp(0, max(E - 1, 0)), torch.zeros_like(ids))
    if emap is not None and E > 0:
        local = emap[local]
    local = torch.where(in_range, local, torch.full_like(local, -1))
    local[n_valid:] = -1
    for e in range(w13.shape[0]):
        tok, slot = (local == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        # One expert's weights at a time, moved before widening: a model's experts in float64
        # would take four times their bf16 bytes on the device.
        h = x[tok] @ w13[e].cpu().double().T
        if w13_bias is not None:
            h = h + w13_bias[e].double().cpu()
        y = activation_f64(activation, h, **kw) @ w2[e].cpu().double().T
        if w2_bias is not None:
            y = y + w2_bias[e].double().cpu()
        out.index_add_(0, tok, weights[tok, slot, None] * y)
    return out
