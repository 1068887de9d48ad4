"""Where a FusedMoE forward spends its GPU time: per-kernel totals from torch.profiler.

    python benchmarks/profile_layer.py --preset dsv4-flash --weights bf16 --tokens 1024 8192
    python benchmarks/profile_layer.py --preset qwen3-30b-a3b --tokens 1 16 --graph

Prints, per token count, each kernel's share of the device time of one forward (averaged over a
few calls after warm-up) — the input for deciding which stage to speed up next. Not a benchmark
of record: the timings in docs/benchmarks.md come from bench_layer.py.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import random_layer  # noqa: E402

from padded_moe._graphs import capture_warm  # noqa: E402


def kernel_times(fn, calls: int, per_launch: bool = False) -> dict:
    """{kernel name (cut at 90 characters): device µs per call} over `calls` calls of `fn`.
    `per_launch`: a kernel launched several times in a call is listed once per launch, "#i name"
    for its i-th launch of the call (e.g. GEMM1 and GEMM2 of one kernel), instead of summed."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda ev: ev.time_range.start)
    launches = Counter(ev.name[:90] for ev in events)
    seen: Counter = Counter()
    totals: dict = defaultdict(float)
    for ev in events:
        name = ev.name[:90]
        per_call = launches[name] // calls if per_launch else 1
        if per_call > 1:
            seen[name] += 1
            name = f"#{(seen[name] - 1) % per_call} {name}"
        totals[name] += ev.device_time / calls
    return totals


def print_kernel_times(title: str, totals: dict, top: int = 15, per: str = "forward", suffix: str = "") -> None:
    """`totals` (µs per kernel, `kernel_times`), longest first: µs per `per` and share of the kernel
    time, under "title: N µs of kernels per `per`" and `suffix`."""
    total = sum(totals.values())
    print(f"\n{title}: {total:.1f} µs of kernels per {per}{suffix}", flush=True)
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us:9.1f} µs {100 * us / total:5.1f}%  {name}", flush=True)


def graph_time(graph: torch.cuda.CUDAGraph, replays: int = 50) -> float:
    """Median µs of one replay over 5 samples of `replays` back-to-back replays."""
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(1000 * start.elapsed_time(end) / replays)
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="dsv4-flash")
    p.add_argument("--weights", default="bf16")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--graph", action="store_true",
                   help="profile CUDA-graph replays of the forward and print the replay time next to the "
                        "sum of kernel times (the difference is launch gaps inside the graph)")
    args = p.parse_args()
    layer = random_layer(args.preset, args.weights)
    for m in args.tokens:
        x = torch.randn(m, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
        fn = torch.no_grad()(lambda: layer(x))
        for _ in range(3):
            fn()
        replay = ""
        if args.graph:
            graph, _ = capture_warm(fn)
            fn = graph.replay
            replay = f", graph replay {graph_time(graph):.1f} µs"
        print_kernel_times(f"{args.preset} {args.weights} tokens={m}", kernel_times(fn, args.calls), suffix=replay)

if __name__ == "__main__":
    main()
