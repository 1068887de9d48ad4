"""Benchmark of a whole MoE layer (router → experts → output) against HF's experts implementations.

Layers: dsv4-flash (bf16 and MXFP4 weights), qwen3-30b-a3b (bf16) and gpt-oss-120b (MXFP4),
tokens in {1, 16, 128, 1024, 8192}. Ours: `FusedMoE` (gate + routing + fused_experts). HF: the same gate and routing
(identical cost on both sides), then transformers' `grouped_mm` and `batched_mm` experts forward
functions on the same weights. Each is timed eagerly and as a CUDA-graph replay.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _common import bar_plot, bench_graph_us, bench_us, print_table, random_layer, write_report  # noqa: E402

from padded_moe.layer import FusedMoE  # noqa: E402

TOKENS = (1, 16, 128, 1024, 8192)


class HFExpertsStandIn(nn.Module):
    """The attributes transformers' experts forward functions read, over our layer's weights."""

    def __init__(self, layer: FusedMoE):
        super().__init__()
        self.gate_up_proj, self.down_proj = layer.w13, layer.w2
        self.num_experts = layer.num_experts
        self.has_gate, self.has_bias, self.is_transposed = True, False, False
        self.is_concatenated, self._is_expert_parallel, self.has_post_expert_norm = True, False, False
        self.act_fn = nn.SiLU()
        self.limit = layer.activation_config.clamp_limit

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is not None:  # DeepSeek-V4's clamp, so both sides compute the same function
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.act_fn(gate) * up


def hf_functions():
    try:
        from transformers.integrations import moe
    except ImportError:
        return {}
    return {name: getattr(moe, f"{name}_experts_forward") for name in ("grouped_mm", "batched_mm")
            if hasattr(moe, f"{name}_experts_forward")}


def time_both(fn) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    try:
        graph = bench_graph_us(fn)
    except Exception as exc:  # a path that cannot be captured is reported, not hidden
        print(f"graph capture failed: {type(exc).__name__}: {exc}")
        graph = float("nan")
    return bench_us(fn), graph


def bench_preset(name: str, weight_format: str, rows: list, hf: dict) -> None:
    layer = random_layer(name, weight_format)
    w13 = layer.expert_weights()[0]
    stand_in = HFExpertsStandIn(layer) if weight_format == "bf16" else None  # HF runs bf16 weights only
    for m in TOKENS:
        x = torch.randn(m, layer.hidden_size, device="cuda", dtype=torch.bfloat16)

        @torch.no_grad()
        def ours():
            return layer(x)

        row = [name, weight_format, m, *time_both(ours)]
        for hf_name in ("grouped_mm", "batched_mm"):
            fn = hf.get(hf_name)
            # batched_mm gathers one weight matrix per routed slot: [M·k, 2N, K] in memory.
            gathered_gb = m * layer.top_k * w13.shape[1] * w13.shape[2] * 2 / 1e9
            skip = fn is None or weight_format != "bf16" or (hf_name == "batched_mm" and gathered_gb > 40)
            if skip:  # HF runs bf16 weights only
                row += [float("nan"), float("nan")]
                continue

            @torch.no_grad()
            def theirs(fn=fn):
                w, ids = layer.route(layer.gate(x))
                return fn(stand_in, x, ids.long(), w.to(x.dtype))

            row += list(time_both(theirs))
        g_ratio = row[6] / row[4] if row[6] == row[6] else float("nan")
        rows.append(row + [g_ratio])
        print(rows[-1], flush=True)
    del layer, stand_in, w13
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="docs/bench")
    parser.add_argument("--presets",
                        default="dsv4-flash:bf16,qwen3-30b-a3b:bf16,dsv4-flash:mxfp4,gpt-oss-120b:mxfp4")
    args = parser.parse_args()
    hf = hf_functions()
    rows: list = []
    for item in args.presets.split(","):
        name, fmt = item.split(":")
        bench_preset(name, fmt, rows, hf)
    headers = ["preset", "weights", "tokens", "ours µs", "ours µs (graph)", "HF grouped_mm µs",
               "HF grouped_mm µs (graph)", "HF batched_mm µs", "HF batched_mm µs (graph)",
               "grouped_mm/ours (graph)"]
    notes = ("Router (gate matmul + routing) is ours on both sides; HF columns run transformers' experts "
             "forward functions on the same bf16 weights. NaN: not applicable (MXFP4 for HF; batched_mm "
             "when its gathered per-slot weights exceed 40 GB) or not capturable.")
    print_table("MoE layer", headers, rows)
    write_report(args.out, "layer", "Whole MoE layer vs HF experts implementations", notes, headers, rows)
    labels = [f"{r[0]} {r[1]} {r[2]}" for r in rows]
    bar_plot(args.out, "layer", "MoE layer, graph replay µs (lower is better)", labels,
             {"ours": [r[4] for r in rows], "HF grouped_mm": [r[6] for r in rows]}, "µs")


if __name__ == "__main__":
    main()
