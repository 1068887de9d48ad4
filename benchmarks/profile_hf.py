"""Where an HF model's captured decode step spends its GPU time, per experts implementation.

    python benchmarks/profile_hf.py --models qwen3_moe --batch 1

Builds the model of `bench_hf.py` (random weights, no downloads), captures one static-cache decode
step per implementation (`grouped_mm`, `padded_moe`) as `bench_hf.py`'s graph column does, and
prints for each: the replay time, the sum of kernel times per replay, and the kernels by total
time. The input for deciding what to cut from the graph decode step; not a benchmark of record
(`bench_hf.py` is).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_hf  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def replay_us(step, replays: int) -> float:
    """Median µs of one replay over 5 samples, each `replays` back-to-back replays from the reset cache."""
    samples = []
    for _ in range(5):
        step.reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step.run(replays)
        end.record()
        torch.cuda.synchronize()
        samples.append(1000 * start.elapsed_time(end) / replays)
    return sorted(samples)[2]


def kernels_per_replay(step, replays: int) -> tuple:
    """({kernel name: µs per replay}, kernel launches per replay)."""
    step.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.run(replays)
        torch.cuda.synchronize()
    totals: dict = {}
    count = 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            totals[ev.name[:100]] = totals.get(ev.name[:100], 0.0) + ev.device_time / replays
            count += 1
    return totals, count / replays


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="qwen3_moe", help=f"comma-separated, of {', '.join(bench_hf.MODELS)}")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--top", type=int, default=25, help="kernels listed per implementation")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import padded_moe.integrations.transformers as pmt

    pmt.register()
    device = torch.device("cuda")
    shapes = bench_hf.FULL
    for key in args.models.split(","):
        name, make = bench_hf.MODELS[key]
        config = make(False)
        model = bench_hf.build_model(config, device, torch.bfloat16, args.seed)
        prompt = bench_hf.random_ids(args.batch, shapes.prompt_len, config.vocab_size, args.seed + 40, device)
        nxt = bench_hf.random_ids(args.batch, 1, config.vocab_size, args.seed + 41, device)
        with torch.no_grad():
            for impl in bench_hf.IMPLS:
                model.set_experts_implementation(impl)
                step = bench_hf.StaticStep(model, prompt, nxt, device, args.replays)
                step.capture()
                replay = replay_us(step, args.replays)
                totals, launches = kernels_per_replay(step, args.replays)
                total = sum(totals.values())
                print(f"\n{name} b{args.batch} {impl}: graph replay {replay:.1f} µs, kernels {total:.1f} µs, "
                      f"{launches:.0f} kernels per replay ({len(totals)} distinct)")
                for kname, us in sorted(totals.items(), key=lambda kv: -kv[1])[:args.top]:
                    print(f"  {us:8.2f} µs {100 * us / total:5.1f}%  {kname}")
                del step
                torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
