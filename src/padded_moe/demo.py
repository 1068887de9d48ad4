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
PROCESS_OVERHEAD = 1 << 30


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
        # skip_init: the construction-time initialisation would be overwritten by randomize() at once.
        layer = torch.nn.utils.skip_init(FusedMoE, preset.num_experts, preset.top_k, preset.hidden_size,
                                         preset.intermediate_size, **_preset_kwargs(preset), layout=layout,
                                         device=device, dtype=torch.bfloat16)
        layer.randomize(seed=1234)
        x = torch.randn(tokens, preset.hidden_size, generator=gen).to(device, torch.bfloat16)
        with torch.no_grad():
            out = layer(x)
            weights, ids = layer.route(layer.gate(x))
        w13, w2 = layer.expert_weights()
        ref = _reference_expert_by_expert(layer, x, w13, w2, weights, ids)
        # Measured, not assumed: slots whose ids name an expert of this layer vs slots dropped.
        valid = int(((ids >= 0) & (ids < preset.num_experts)).sum())
        rows.append([f"{preset_name} layer, {layout}, {layer.weight_format}", valid, ids.numel() - valid,
                     _rel(out, ref), None])
        del layer, w13, w2
    return rows


def _preset_kwargs(preset) -> dict:
    from padded_moe.activation import ApplyMoEActivationConfig

    return dict(activation=preset.activation, activation_config=ApplyMoEActivationConfig(**preset.activation_config),
                router=preset.routing, routed_scaling_factor=preset.routing_config.get("routed_scaling_factor", 1.0),
                weight_format=preset.weight_format, has_bias=preset.has_bias)


def _reference_expert_by_expert(layer: FusedMoE, x, w13, w2, weights, ids) -> torch.Tensor:
    """The float64 reference, one expert's dense copy at a time (a model-sized layer's float64
    copy would not fit a workstation's memory)."""
    E = layer.num_experts
    total = torch.zeros(x.shape[0], layer.hidden_size, dtype=torch.float64)
    for e in range(E):
        if not bool((ids == e).any()):
            continue
        only_e = torch.full((E,), -1, dtype=torch.long)
        only_e[e] = 0
        total += reference_moe(x, dense_weights(w13[e:e + 1]), dense_weights(w2[e:e + 1]), weights, ids,
                               activation=layer.activation.value, activation_kwargs=_ref_kwargs(layer),
                               expert_map=only_e, num_experts=E,
                               w13_bias=None if layer.w13_bias is None else layer.w13_bias[e:e + 1],
                               w2_bias=None if layer.w2_bias is None else layer.w2_bias[e:e + 1])
    return total


def _ref_kwargs(layer: FusedMoE) -> dict:
    c = layer.activation_config
    return dict(limit=c.clamp_limit, alpha=c.alpha, beta=c.beta, situ_beta=c.situ_beta, situ_lambda=c.situ_linear_beta)


def _fail(message: str) -> int:
    print(f"padded-moe demo: {message}")
    return 2


def _resolve_device(name):
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device must be cpu or cuda, got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but this torch build sees no CUDA GPU "
                         f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) present")
    return device


def memory_needed(preset_name: str, tokens: int) -> tuple[int, str]:
    """Bytes the demo's layer step needs, and how the figure is made (the planner's numbers for
    one rank plus what the demo itself adds)."""
    from padded_moe import planner

    preset = get_preset(preset_name)
    bf16 = planner.plan(preset_name, 1, tokens, 1.0, weight_format="bf16")
    if preset.weight_format == "mxfp4":
        # An MXFP4 layer never holds float experts (`randomize` quantizes one expert at a time), but
        # `prepare` holds the canonical bytes and their prepared arrangement side by side until it
        # empties the canonical parameters.
        q = planner.plan(preset_name, 1, tokens, 1.0, weight_format="mxfp4")
        needed = 2 * q.weights_bytes
        how = f"planner: {planner._human(q.weights_bytes)} of MXFP4 weights, twice while preparing"
    else:
        needed = bf16.weights_bytes
        how = f"planner: {planner._human(bf16.weights_bytes)} of bf16 weights"
    needed += bf16.bytes_of("experts")
    # The reference's dense float32 + float64 copies of one expert, and the quantizer's working copy.
    one_expert = (preset.w13_rows * preset.hidden_size + preset.hidden_size * preset.intermediate_size) * 12
    needed += one_expert + bf16.bytes_of("experts")
    how += f" + {planner._human(2 * bf16.bytes_of('experts') + one_expert)} workspace and reference"
    # The process itself (torch, Python) and allocator slack: gpt-oss-120b on CPU peaked 0.5 GiB
    # above the sum of the buffers.
    needed += PROCESS_OVERHEAD
    how += f" + {planner._human(PROCESS_OVERHEAD)} for the process"
    return needed, how


def memory_available(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def run(args: argparse.Namespace) -> int:
    try:
        get_preset(args.preset)
        device = _resolve_device(args.device)
    except ValueError as exc:
        return _fail(str(exc))
    if args.tokens < 1:
        return _fail(f"--tokens must be >= 1, got {args.tokens}")
    needed, how = memory_needed(args.preset, args.tokens)
    available = memory_available(device)
    if needed > available:
        from padded_moe.planner import _human

        return _fail(f"preset {args.preset} needs about {_human(needed)} ({how}), {device} has "
                     f"{_human(available)} available; try a smaller preset (e.g. --preset tiny) or a larger device")
    gen = torch.Generator().manual_seed(args.seed)
    rows = _activation_rows(device, gen) + _layer_rows(args.preset, args.tokens, device, gen)
    table = Table(title=f"padded-moe demo on {device} (preset {args.preset})")
    for col in ("case", "rows valid", "rows skipped", "rel. error vs float64", "padding untouched"):
        table.add_column(col)
    ok = True
    for name, valid, skipped, err, untouched in rows:
        # A full layer has no padded rows, so that cell is "n/a" rather than an unchecked "yes".
        good = err <= TOLERANCE and untouched is not False
        ok &= good
        cell = "n/a" if untouched is None else ("yes" if untouched else "NO")
        table.add_row(name, str(valid), str(skipped), f"{err:.2e}", cell)
    Console().print(table)
    print("all checks passed" if ok else "CHECK FAILED")
    return 0 if ok else 1
