"""Where an eager `fused_experts` / `FusedMoE` call spends its host time.

    python benchmarks/profile_host.py --cases dsv4:1 dsv4:16 qwen3:1 qwen3:2048

For each case: the eager time per call (back-to-back calls, one sync at the end), the time of one
CUDA-graph replay of the same call (device time alone), their difference (host overhead), the
kernel launches, allocations and device-to-host synchronisations per call (torch.profiler), and
the Python functions that take the host time (cProfile). Not a benchmark of record: the input for
deciding what to cut.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from collections import Counter

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from _common import bench_graph_us, random_layer  # noqa: E402

from padded_moe import fused_experts  # noqa: E402
from padded_moe.layouts import PermuteScratch  # noqa: E402
from padded_moe.mxfp4 import quantize_mxfp4  # noqa: E402

SHAPES = {  # E, k, K, N, weights
    "dsv4": (256, 6, 4096, 2048, "bf16"),
    "dsv4mx": (256, 6, 4096, 2048, "mxfp4"),
    "qwen3": (128, 8, 2048, 768, "bf16"),
    "mixtral": (8, 2, 4096, 14336, "bf16"),
    "gptoss": (128, 4, 2880, 2880, "mxfp4"),
}


def eager_us(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


@triton.jit
def _noop(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9,
          b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr):
    pass


def launch_floor_us() -> float:
    """Host cost of launching one Triton kernel with ~40 arguments (does nothing on the device)."""
    t = torch.empty(16, device="cuda")
    args = [t] * 10 + list(range(1, 11)) + list(range(1, 11))
    return eager_us(lambda: _noop[(1,)](*args, C0=1, C1=2, C2=3), calls=2000)


def run_case(name: str, T: int, prof_calls: int) -> None:
    E, k, K, N, fmt = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    if fmt == "mxfp4":
        w13, w2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=g)
    logits = torch.randn(T, E, device="cuda", generator=g)
    tw, ti = torch.topk(logits.softmax(-1), k)
    ti = ti.to(torch.int32)
    act = "swigluoai" if name == "gptoss" else "silu"
    fn = lambda: fused_experts(x, w13, w2, tw, ti, activation=act)  # noqa: E731
    scratch = PermuteScratch(T, k, E, E, "cuda")
    gfn = lambda: fused_experts(x, w13, w2, tw, ti, activation=act, scratch=scratch)  # noqa: E731
    e_us = eager_us(fn)
    g_us = bench_graph_us(gfn)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(prof_calls):
            fn()
        torch.cuda.synchronize()
    names = Counter()
    for ev in prof.events():
        names[ev.name] += 1
    kernels = sum(c for n, c in names.items() if n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    syncs = {n: c for n, c in names.items() if "Synchronize" in n or "Memcpy" in n}
    allocs = names.get("aten::empty", 0) + names.get("aten::empty_strided", 0)
    print(f"\n=== {name} T={T}: eager {e_us:.1f} us/call, graph {g_us:.1f} us, host overhead "
          f"{e_us - g_us:.1f} us; per call: {kernels / prof_calls:.1f} launches, "
          f"{allocs / prof_calls:.1f} empty, syncs/memcpy {({n: c / prof_calls for n, c in syncs.items()})}")
    python_profile(f"{name} T={T}", fn, prof_calls)


def python_profile(title: str, fn, calls: int) -> None:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(f"\n--- {title}: Python profile of {calls} calls")
    print("\n".join(s.getvalue().splitlines()[:45]))


def op_profile(title: str, fn, calls: int) -> None:
    """Host time per call of each torch op / launch (torch.profiler's self CPU time)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:18]
    print(f"\n--- {title}: self CPU time per call (torch.profiler, {calls} calls)")
    for e in rows:
        print(f"  {e.self_cpu_time_total / calls:8.1f} us  x{e.count / calls:4.1f}  {e.key[:90]}")


def run_gate(K: int, E: int, bias: bool, tokens: list[int]) -> None:
    """Eager host-inclusive time of a router gate projection, by the call that makes it."""
    import torch.nn.functional as F

    w = torch.randn(E, K, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(E, device="cuda", dtype=torch.bfloat16) * 0.02 if bias else None
    for T in tokens:
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        forms = {"F.linear": lambda: F.linear(x, w, b), "mm": lambda: torch.mm(x, w.t())}
        if b is not None:
            forms["mm + bias"] = lambda: torch.mm(x, w.t()) + b
            forms["addmm 2-D bias"] = lambda: torch.addmm(b.expand(T, E), x, w.t())
        cells = "  ".join(f"{k} {eager_us(f, calls=500):6.1f}" for k, f in forms.items())
        print(f"gate K={K} E={E} bias={bias} T={T}: {cells} us/call")


def run_layer(preset: str, T: int, calls: int) -> None:
    """`FusedMoE` eager vs `torch.compile(fullgraph=True)`: time per call and where the host time goes."""
    from padded_moe import experts as X

    layer = random_layer(preset)
    x = torch.randn(T, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    comp = torch.compile(layer, fullgraph=True)  # the forward as one op (padded_moe::moe_forward)
    traced = torch.compile(lambda x: layer._forward(x, None, None, None), fullgraph=True)  # gate, router, experts
    forms = {"eager": lambda: layer(x),  # decode-sized: the layer's launch plan
             "eager, no layer plan": lambda: layer._forward(x, None, None, None),
             "eager, nn.Linear gate": lambda: layer.experts(x, *layer.route(layer.gate(x))),
             "compiled": lambda: comp(x),
             "compiled, traced forward": lambda: traced(x)}
    with torch.no_grad():
        for label, fn in forms.items():
            us = eager_us(fn)
            plans = 0 if X._PLANS is None else len(X._PLANS)
            print(f"\n=== layer {preset} T={T} {label}: {us:.1f} us/call (launch plans held: {plans})")
            if label in ("eager", "compiled", "compiled, traced forward"):
                python_profile(f"layer {preset} T={T} {label}", fn, calls)
                op_profile(f"layer {preset} T={T} {label}", fn, calls)
        for label in ("eager", "eager, nn.Linear gate"):  # device time of the same work, as graph replays
            print(f"=== layer {preset} T={T} graph replay, {label.split(', ')[-1]}: {bench_graph_us(forms[label]):.1f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cases", nargs="*", default=["dsv4:1", "dsv4:16", "dsv4mx:1", "qwen3:1", "qwen3:2048"])
    p.add_argument("--layers", nargs="*", default=[], help="PRESET:T cases of FusedMoE, eager and compiled")
    p.add_argument("--gates", nargs="*", default=[], help="K:E:bias gate projections (bias 0/1), eager")
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args()
    print(f"launch floor (noop Triton kernel, 33 args): {launch_floor_us():.1f} us")
    for case in args.cases:
        name, T = case.split(":")
        run_case(name, int(T), args.calls)
    for case in args.gates:
        K, E, bias = (int(v) for v in case.split(":"))
        run_gate(K, E, bool(bias), [1, 4, 16, 256])
    for case in args.layers:
        preset, T = case.rsplit(":", 1)
        run_layer(preset, int(T), args.calls)


if __name__ == "__main__":
    main()
