"""`padded-moe demo`: the masked activation on a flat and a batched buffer, then a preset's MoE
layer under every standard layout, each checked against the float64 reference."""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from padded_moe.activation import apply_moe_activation
from padded_moe.layer import FusedMoE, dense_weights
from padded_moe.presets import get_preset
from padded_moe.reference.moe import activation_f64, reference_moe

# bf16 kernels against a float64 reference: relative error (‖out − ref‖ / ‖ref‖) well under this.
TOLERANCE = 2e-2


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _activation_rows(device: torch.device, gen: torch.Generator) -> list:
    """One flat and one batched buffer with NaN padding; rows valid / skipped / error."""
    d, dtype, rows = 96, torch.bfloat16, []
    flat = torch.randn(64, 2 * d, generator=gen).to(device, dtype)
    flat[20:] = float("nan")
    out = torch.full((64, d), -1.0, device=device, dtype=dtype)
    apply_moe_activation("silu", out, flat, valid_token_counts=torch.tensor([20], device=device))
    untouched = bool((out[20:] == -1).all())
    rows.append(["flat [64, 192] silu", 20, 44, _rel(out[:20], activation_f64("silu", flat[:20].cpu())), untouched])
    counts = [0, 5, 16, 9]
    batched = torch.randn(4, 16, 2 * d, generator=gen).to(device, dtype)
    for e, c in enumerate(counts):
        batched[e, c:] = float("nan")
    out = torch.full((4, 16, d), -1.0, device=device, dtype=dtype)
    apply_moe_activation("swigluoai", out, batched, valid_token_counts=torch.tensor(counts, device=device))
    errs = [_rel(out[e, :c], activation_f64("swigluoai", batched[e, :c].cpu())) for e, c in enumerate(counts) if c]
    untouched = all(bool((out[e, c:] == -1).all()) for e, c in enumerate(counts))
    rows.append(["batched [4, 16, 192] swigluoai", sum(counts), 64 - sum(counts), max(errs), untouched])
    return rows


def _layer_rows(preset_name: str, tokens: int, device: torch.device, gen: torch.Generator) -> list:
    preset = get_preset(preset_name)
    rows = []
    for layout in ("indexed", "grouped_contiguous"):
        layer = FusedMoE.from_preset(preset, layout=layout, device=device, dtype=torch.bfloat16)
        layer.randomize(seed=1234)
        x = torch.randn(tokens, preset.hidden_size, generator=gen).to(device, torch.bfloat16)
        with torch.no_grad():
            out = layer(x)
            weights, ids = layer.route(layer.gate(x))
        w13, w2 = layer.expert_weights()
        ref = reference_moe(x, dense_weights(w13), dense_weights(w2), weights, ids,
                            activation=layer.activation.value,
                            activation_kwargs=_ref_kwargs(layer), w13_bias=layer.w13_bias, w2_bias=layer.w2_bias)
        rows.append([f"{preset_name} layer, {layout}, {layer.weight_format}", tokens * preset.top_k, 0,
                     _rel(out, ref), True])
    return rows


def _ref_kwargs(layer: FusedMoE) -> dict:
    c = layer.activation_config
    return dict(limit=c.clamp_limit, alpha=c.alpha, beta=c.beta, situ_beta=c.situ_beta, situ_lambda=c.situ_linear_beta)


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator().manual_seed(args.seed)
    rows = _activation_rows(device, gen) + _layer_rows(args.preset, args.tokens, device, gen)
    table = Table(title=f"padded-moe demo on {device} (preset {args.preset})")
    for col in ("case", "rows valid", "rows skipped", "rel. error vs float64", "padding untouched"):
        table.add_column(col)
    ok = True
    for name, valid, skipped, err, untouched in rows:
        good = err <= TOLERANCE and untouched
        ok &= good
        table.add_row(name, str(valid), str(skipped), f"{err:.2e}", "yes" if untouched else "NO")
    Console().print(table)
    print("all checks passed" if ok else "CHECK FAILED")
    return 0 if ok else 1
