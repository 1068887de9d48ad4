"""Benchmark of the count-aware activation (spec 01) on a GPU.

Shapes: flat [R, 2*2048] with R in {12288, 49152} and batched [32, 512, 2*2048], bf16, silu and
situ, valid fractions 5% / 25% / 100%. Columns: ours (masked), torch eager and torch.compile on the
full buffer (they cannot skip padding), and our bandwidth on valid bytes against the device copy
bandwidth measured in this run. Also: the cost of a call whose counts are all zero, and the
activation buffers of GPT-OSS (swigluoai, interleaved, 2880 columns) and Qwen3-MoE (silu, 768
columns) at 8192 tokens against torch.compile.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import bar_plot, bench_graph_us, bench_us, copy_bandwidth_gbs, print_table, write_report  # noqa: E402

from padded_moe.activation import ApplyMoEActivationConfig, apply_moe_activation  # noqa: E402

D = 2048
FRACTIONS = (0.05, 0.25, 1.0)
CFG = {"silu": ApplyMoEActivationConfig(), "situ": ApplyMoEActivationConfig(situ_beta=4.0, situ_linear_beta=25.0)}


def torch_math(name: str, x: torch.Tensor) -> torch.Tensor:
    g, u = x[..., :D].float(), x[..., D:].float()
    if name == "silu":
        y = torch.nn.functional.silu(g) * u
    else:
        y = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))
    return y.to(x.dtype)


def run_case(name: str, lead: tuple, compiled, results: list, copy_gbs: float) -> None:
    x = torch.randn(*lead, 2 * D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(*lead, D, device="cuda", dtype=torch.bfloat16)
    rows = lead[-1]
    n_slabs = 1 if len(lead) == 1 else lead[0]
    t_eager = bench_us(lambda: torch_math(name, x))
    compiled(name, x)
    t_compile = bench_graph_us(lambda: compiled(name, x))
    for frac in FRACTIONS:
        n = max(1, int(rows * frac))
        counts = torch.full((n_slabs,), n, device="cuda", dtype=torch.int32)

        def ours():
            apply_moe_activation(name, out, x, activation_config=CFG[name], valid_token_counts=counts)

        t_host = bench_us(ours)
        t_ours = bench_graph_us(ours)
        valid_bytes = n_slabs * n * 3 * D * 2
        gbs = valid_bytes / (t_ours * 1e-6) / 1e9
        shape = "x".join(map(str, lead)) + f"x{2 * D}"
        results.append([name, shape, f"{int(frac * 100)}%", t_ours, t_host, t_eager, t_compile,
                        t_compile / t_ours, gbs, gbs / copy_gbs])


# The activation buffers of whole `fused_experts` calls at 8192 tokens whose GEMM1 does not apply the
# activation in its epilogue (256-row tiles): (activation, slots = tokens * top-k, intermediate width).
MODEL_WIDTHS = (("swigluoai", 8192 * 4, 2880),  # GPT-OSS: interleaved gate/up, 2880 columns
                ("silu", 8192 * 8, 768))        # Qwen3-MoE: gate-first halves, 768 columns


def model_math(name: str, x: torch.Tensor) -> torch.Tensor:
    """The activation on a full buffer in torch (spec 01's defaults), for torch.compile."""
    if name == "swigluoai":
        g, u = x[..., 0::2].float().clamp(max=7.0), x[..., 1::2].float().clamp(-7.0, 7.0)
        y = g * torch.sigmoid(1.702 * g) * (u + 1.0)
    else:
        d = x.shape[-1] // 2
        y = torch.nn.functional.silu(x[..., :d].float()) * x[..., d:].float()
    return y.to(x.dtype)


def model_width_cases(copy_gbs: float) -> list:
    """Ours against torch.compile at the model widths above, all rows valid (graph replays)."""
    compiled = torch.compile(model_math)
    rows = []
    for name, slots, d in MODEL_WIDTHS:
        x = torch.randn(slots, 2 * d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(slots, d, device="cuda", dtype=torch.bfloat16)
        counts = torch.full((1,), slots, device="cuda", dtype=torch.int32)
        compiled(name, x)
        t_compile = bench_graph_us(lambda: compiled(name, x))
        t_ours = bench_graph_us(lambda: apply_moe_activation(name, out, x, valid_token_counts=counts))
        gbs = slots * 3 * d * 2 / (t_ours * 1e-6) / 1e9
        rows.append([name, f"{slots}x{2 * d}", t_ours, t_compile, t_compile / t_ours, gbs, gbs / copy_gbs])
    return rows


def zero_count_cost() -> tuple[float, float]:
    """(graph replay µs, eager call µs) of a call whose count is 0."""
    x = torch.randn(49152, 2 * D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(49152, D, device="cuda", dtype=torch.bfloat16)
    counts = torch.zeros(1, device="cuda", dtype=torch.int32)

    def call():
        apply_moe_activation("silu", out, x, valid_token_counts=counts)

    return bench_graph_us(call), bench_us(call)


def sweep_tuning() -> list:
    """Launch shapes for silu and situ on [49152, 4096] (0% / 5% / 25% / 100% valid rows) and
    [12288, 4096] (100%): graph-replay µs each."""
    rows_out = []
    # (tile elements, widest column block, warps, programs per SM): the library's default first;
    # programs/SM None: all the programs the device holds at once, each striding; 4096: more than any
    # buffer here has row blocks, i.e. one program per row block.
    shapes = ((4096, 2048, 8, 32), (4096, 2048, 8, 40), (4096, 2048, 8, 64), (4096, 2048, 8, 4096),
              (8192, 2048, 8, 32), (8192, 2048, 8, 64), (4096, 1024, 4, None), (4096, 1024, 4, 4096))
    for name in ("silu", "situ"):
        for tile, block_d, warps, per_sm in shapes:
            tuning = dict(tile_elems=tile, max_block_d=block_d, num_warps=warps, programs_per_sm=per_sm)
            for rows, fractions in ((49152, (0.0, 0.05, 0.25, 1.0)), (12288, (1.0,))):
                x = torch.randn(rows, 2 * D, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(rows, D, device="cuda", dtype=torch.bfloat16)
                for frac in fractions:
                    counts = torch.full((1,), max(1, int(rows * frac)) if frac else 0, device="cuda",
                                        dtype=torch.int32)
                    t = bench_graph_us(lambda: apply_moe_activation(name, out, x, activation_config=CFG[name],
                                                                    valid_token_counts=counts, tuning=tuning))
                    rows_out.append([name, tile, block_d, warps, "all resident" if per_sm is None else per_sm,
                                     rows, f"{int(frac * 100)}%", t])
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="docs/bench")
    args = parser.parse_args()
    copy_gbs = copy_bandwidth_gbs()
    compiled = torch.compile(torch_math)
    results: list = []
    for name in ("silu", "situ"):
        for lead in ((12288,), (49152,), (32, 512)):
            run_case(name, lead, compiled, results, copy_gbs)
    widths = model_width_cases(copy_gbs)
    width_headers = ["act", "shape", "ours µs (graph)", "torch.compile µs (graph)", "compile/ours", "ours GB/s",
                     "of copy BW"]
    print_table("model widths, bf16, all rows valid", width_headers, widths)
    t_zero, t_zero_host = zero_count_cost()
    sweep = sweep_tuning()
    print_table("launch-shape sweep (graph replay)",
                ["act", "tile elems", "block d", "warps", "programs/SM", "rows", "valid", "µs"], sweep)
    headers = ["act", "shape", "valid", "ours µs (graph)", "ours µs (eager call)", "torch eager µs",
               "torch.compile µs (graph)", "compile/ours", "ours GB/s (valid)", "of copy BW"]
    notes = (f"Copy bandwidth measured in this run: {copy_gbs:.0f} GB/s (read + write). "
             f"A call with all counts 0 on [49152, 4096]: {t_zero:.1f} µs under graph replay, "
             f"{t_zero_host:.1f} µs as an eager call (host launch cost). "
             "Device times are CUDA-graph replays (host launch cost removed) for both ours and "
             "torch.compile; torch eager and compile always process the full buffer, ours the valid prefix.")
    print_table("count-aware activation, bf16", headers, results)
    print(notes)
    write_report(args.out, "activation", "Count-aware activation (spec 01)", notes, headers, results,
                 extra={"copy_gbs": copy_gbs, "zero_count_us": t_zero, "zero_count_eager_us": t_zero_host,
                        "sweep": sweep, "model_widths": {"headers": width_headers, "rows": widths}})
    labels = [f"{r[0]} {r[1]} {r[2]}" for r in results]
    bar_plot(args.out, "activation", "activation: µs (lower is better)", labels,
             {"ours": [r[3] for r in results], "torch.compile (full)": [r[6] for r in results]}, "µs")


if __name__ == "__main__":
    main()
