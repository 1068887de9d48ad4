"""Torch implementation of the MoE activations' math (`MoEActivation`): the CPU path.

Computes in float32 and rounds once to the output dtype, like the Triton kernel. Only valid rows
are passed in (the caller slices the valid prefix), so padding is never read.
"""

from __future__ import annotations

from typing import Optional

import torch


def _clip(x: torch.Tensor, limit: float) -> torch.Tensor:
    return x.clamp(-limit, limit)


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def gated(name: str, g: torch.Tensor, u: torch.Tensor, *, limit: Optional[float], alpha: float,
          beta: float, situ_beta: float, situ_lambda: Optional[float]) -> torch.Tensor:
    """`g`, `u` in float32; returns float32."""
    if name in ("silu", "swigluoai", "swigluoai_uninterleave"):
        if limit is not None:
            g = g.clamp(max=limit)
            u = _clip(u, limit)
        return g * torch.sigmoid(alpha * g) * (u + beta)
    if name == "gelu":
        return torch.nn.functional.gelu(g) * u
    if name == "gelu_tanh":
        return _tanh_gelu(g) * u
    if name == "swiglustep":
        s = torch.nn.functional.silu(g)
        if limit is not None:
            s = s.clamp(max=limit)
            u = _clip(u, limit)
        return s * u
    if name == "situ":
        if situ_lambda is not None:
            u = situ_lambda * torch.tanh(u / situ_lambda)
        return situ_beta * torch.tanh(g / situ_beta) * torch.sigmoid(g) * u
    raise NotImplementedError(f"gated activation {name!r} has no torch implementation")


def ungated(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu_no_mul":
        return torch.nn.functional.silu(x)
    if name == "gelu_no_mul":
        return torch.nn.functional.gelu(x)
    if name == "gelu_tanh_no_mul":
        return _tanh_gelu(x)
    if name == "relu2_no_mul":
        return torch.relu(x).square()
    raise NotImplementedError(f"activation {name!r} has no torch implementation")


def apply_rows(name: str, is_gated: bool, interleaved: bool, out: torch.Tensor, x: torch.Tensor,
               params: dict) -> None:
    """Activation of the rows of `x` ([n, W]) into `out` ([n, d]), in place."""
    if out.shape[0] == 0:
        return
    xf = x.float()
    if not is_gated:
        y = ungated(name, xf)
    else:
        if interleaved:
            g, u = xf[:, 0::2], xf[:, 1::2]
        else:
            d = out.shape[-1]
            g, u = xf[:, :d], xf[:, d:]
        y = gated(name, g, u, **params)
    out.copy_(y)
