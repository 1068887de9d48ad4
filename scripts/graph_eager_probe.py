"""Probe: the same `fused_experts` call timed eagerly and as a CUDA-graph replay, alternating.

The peers yardstick timed DeepSeek-V4 (bf16) at 4096 tokens at 4330 µs as a graph replay and
3663 µs eagerly (Mixtral at 4096: 5663 / 4779), while at 3072 tokens the two agreed. This probe
repeats both in alternating rounds in one process, with and without a `PermuteScratch` (the
yardstick passes one), records the SM clock and power after each, and lists per-kernel times of
the eager call and of the replay (torch.profiler), to tell a slower kernel from a slower card.

    PYTHONPATH=src python3 scripts/graph_eager_probe.py [--cases dsv4-flash:4096,dsv4-flash:3072,mixtral-8x7b:4096]

Not part of the library.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import bench_us, captured  # noqa: E402
from profile_layer import kernel_times  # noqa: E402

import padded_moe as pm  # noqa: E402
from padded_moe.layer import FusedMoE  # noqa: E402


def clocks() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"n/a ({e})"


def top(times: dict) -> dict:
    return {k: round(v, 1) for k, v in sorted(times.items(), key=lambda kv: -kv[1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="dsv4-flash:4096,dsv4-flash:3072,mixtral-8x7b:4096")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default="gpu-out/graph-eager.json")
    args = p.parse_args()
    report = {}
    for case in args.cases.split(","):
        name, T = case.split(":")
        T = int(T)
        layer = FusedMoE.from_preset(name, weight_format="bf16", device="cuda", dtype=torch.bfloat16)
        layer.randomize(seed=0, std=0.02)
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(T, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        tw, ids = layer.route(layer.gate(x), None)
        w13, w2 = layer.expert_weights()
        scratch = pm.PermuteScratch(T, layer.top_k, layer.num_experts, layer.num_experts, x.device,
                                    hidden_size=layer.hidden_size, dtype=x.dtype)
        kw = dict(activation=layer.activation, w13_bias=layer.w13_bias, w2_bias=layer.w2_bias)
        fns = {"no scratch": lambda: pm.fused_experts(x, w13, w2, tw, ids, **kw),
               "scratch": lambda: pm.fused_experts(x, w13, w2, tw, ids, scratch=scratch, **kw)}
        res = {}
        for label, fn in fns.items():
            ref = fn().clone()
            graph, out = captured(fn)
            graph.replay()
            torch.cuda.synchronize()
            same = bool(torch.equal(out, ref))
            eager, replay, clk = [], [], []
            for _ in range(args.rounds):
                eager.append(round(bench_us(fn), 1))
                clk.append("eager " + clocks())
                replay.append(round(bench_us(graph.replay), 1))
                clk.append("graph " + clocks())
            res[label] = {"eager_us": eager, "graph_us": replay, "graph_equals_eager": same, "clocks": clk,
                          "eager_kernels": top(kernel_times(fn, 5)), "graph_kernels": top(kernel_times(graph.replay, 5))}
            print(case, label, "eager", eager, "graph", replay, "bit-equal", same, flush=True)
            print("  clocks", clk, flush=True)
            print("  eager kernels", res[label]["eager_kernels"], flush=True)
            print("  graph kernels", res[label]["graph_kernels"], flush=True)
            del graph
        report[case] = res
        del layer
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
