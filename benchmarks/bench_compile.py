"""FusedMoE eager vs torch.compile vs torch.compile(mode="reduce-overhead") vs our own CUDA graph.

    python benchmarks/bench_compile.py --presets qwen3-30b-a3b dsv4-flash --tokens 16 1024

Eager and compiled times are back-to-back calls with one synchronisation at the end (what a
serving loop sees, host overhead included); the two CUDA-graph columns are replays. Ratios:
compiled / eager (target <= 1.05) and reduce-overhead / own graph (target <= 1.1).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import bench_graph_us, print_table, random_layer, write_report  # noqa: E402


def loop_us(fn, calls: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def profile_calls(title: str, fn, calls: int = 10) -> None:
    """torch.profiler table of `calls` back-to-back calls: where device and host time go."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    print(f"\n=== {title}: {calls} calls", flush=True)
    avg = prof.key_averages()
    print(avg.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    print(avg.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
    waits = {e.key: e.count for e in avg
             if any(w in e.key for w in ("Synchronize", "_local_scalar_dense", "DtoH", "EventQuery"))}
    launches = sum(e.count for e in avg if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    print(f"per call: {launches / calls:.1f} kernel launches; host waits {waits or 'none'} "
          f"(the last synchronize is the loop's own)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "dsv4-flash:bf16", "dsv4-flash:mxfp4",
                                                    "mixtral-8x7b", "gpt-oss-120b"])
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 1024])
    p.add_argument("--out", default="bench-out")
    p.add_argument("--profile", action="store_true",
                   help="also print each case's kernels and host events, eager vs compiled (torch.profiler)")
    args = p.parse_args()
    headers = ["preset", "weights", "T", "eager us", "compiled us", "reduce-overhead us", "own graph us",
               "compiled/eager", "r-o/own graph"]
    rows = []
    for spec in args.presets:
        preset, _, fmt = spec.partition(":")
        layer = random_layer(preset, fmt or None)
        for T in args.tokens:
            torch._dynamo.reset()
            x = torch.randn(T, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                eager = loop_us(lambda: layer(x))
                comp = torch.compile(layer, fullgraph=True)
                compiled = loop_us(lambda: comp(x))
                torch._dynamo.reset()
                ro = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
                reduce = loop_us(lambda: ro(x))
                own = bench_graph_us(lambda: layer(x))
                if args.profile:
                    torch._dynamo.reset()
                    comp = torch.compile(layer, fullgraph=True)
                    for label, fn in (("eager", lambda: layer(x)), ("compiled", lambda: comp(x))):
                        profile_calls(f"{preset} {layer.weight_format} T={T} {label}", fn)
            row = [preset, layer.weight_format, T, eager, compiled, reduce, own, compiled / eager, reduce / own]
            rows.append(row)
            print(row, flush=True)
        del layer
        torch.cuda.empty_cache()
    print_table("FusedMoE under torch.compile (µs per call)", headers, rows)
    write_report(args.out, "compile", "FusedMoE: eager vs torch.compile vs CUDA graphs",
                 "Eager and compiled: back-to-back calls, one sync at the end. Graph columns: replays.",
                 headers, rows)


if __name__ == "__main__":
    main()
