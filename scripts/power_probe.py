"""Probe: time and energy per call of our fused_experts against the peers under sustained load.

The peers harness times each implementation in a short burst (do_bench, ~100 ms); at DeepSeek-V4
bf16 with 8192 tokens the card reaches its power cap within it, so the clock, and the time, depend on
where in the power ramp the burst falls (notes: run 348). Here each implementation replays its
captured call back to back for `--window-s` seconds, in alternating rounds, and the probe reports per
window the time per call (CUDA events over the window's second half, after the clock has settled),
the energy per call (the mean board power from NVML, `torch.cuda.power_draw` after each batch of
5 replays, times the window's length, over its calls) and the SM clock and power NVML
reports right after the window (one sample; gpu_check's MONITOR=1 traces them through the windows).
Same weights, routing and inputs as the harness (its own builders; `.peers` from
scripts/setup_peers.sh must exist).

    PYTHONPATH=src python3 scripts/power_probe.py [--cases dsv4] [--tokens 8192] [--impls padded_moe,triton_kernels]

`--kernels N`: after the rounds, each implementation's call is profiled N times eagerly on the hot card
(torch.profiler) and its kernels' mean device time per call is printed, longest first: where two
implementations' time per call differs.

An implementation may carry environment settings for its build and capture, e.g.
`padded_moe+PADDED_MOE_GEMM_BACKEND=triton` (our call on the Triton kernels where "auto" takes the
native one).

Not part of the library.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / ".peers"), str(ROOT / ".peers" / "vendor"), str(ROOT / "benchmarks")]
import bench_peers as bp  # noqa: E402
from _common import captured, write_json  # noqa: E402
from profile_layer import kernel_times  # noqa: E402


def window(graph, seconds: float) -> dict:
    """Replay `graph` back to back for `seconds`; time the second half's calls with events."""
    watts = []  # NVML board power (torch.cuda.power_draw, mW) after each batch

    def batch(done=None) -> None:  # 5 replays (then `done` recorded), then once they ran a power sample
        for _ in range(5):
            graph.replay()
        if done is not None:
            done.record()
        torch.cuda.synchronize()
        watts.append(torch.cuda.power_draw() / 1000)

    t0 = time.time()
    calls = 0
    while time.time() < t0 + seconds / 2:
        batch()
        calls += 5
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    timed = 0
    start.record()
    while not timed or time.time() < t0 + seconds:  # at least one batch is timed
        batch(stop)
        timed += 5
    seconds_run = time.time() - t0
    mean_w = sum(watts) / len(watts)
    return {"us_per_call": 1000 * start.elapsed_time(stop) / timed, "calls": calls + timed, "mean_w": mean_w,
            "mJ_per_call": 1000 * mean_w * seconds_run / (calls + timed),
            "sm_mhz_end": torch.cuda.clock_rate(), "power_w_end": torch.cuda.power_draw() / 1000}


@contextlib.contextmanager
def settings(name: str):
    """The environment settings an implementation name carries ("padded_moe+PADDED_MOE_GEMM_BACKEND=triton"),
    set while the block runs."""
    pairs = [kv.split("=", 1) for kv in name.split("+")[1:]]
    saved = {k: os.environ.get(k) for k, _ in pairs}
    os.environ.update(pairs)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="dsv4")
    p.add_argument("--tokens", default="8192")
    p.add_argument("--impls", default="padded_moe,triton_kernels")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window-s", type=float, default=3.0)
    p.add_argument("--kernels", type=int, default=0, help="profile each call this many times after the rounds")
    p.add_argument("--out", default="gpu-out/power.json")
    args = p.parse_args()
    device = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(), "rows": []}
    for case in bp.make_cases(SimpleNamespace(dsv4_topk=6, small=False, cases=args.cases)):
        W = bp.make_weights(case, device, 0)
        for T in [int(t) for t in args.tokens.split(",")]:
            x, ids, tw = bp.make_inputs(case, T, device, 0)
            graphs, keep = {}, []
            for name in args.impls.split(","):
                # The builder holds the weights in the implementation's own arrangement (triton_kernels'
                # re-laid copies); the graph does not, so both stay referenced while it replays.
                try:
                    with settings(name):
                        builder = bp.BUILDERS[name.split("+")[0]](case, W)
                        run = builder.make(x, ids, tw)
                        run.e2e()
                        graphs[name], out = captured(run.e2e)
                    keep.append((name, builder, run, out))
                except bp.Skip as why:  # e.g. vLLM's Triton kernel has no MXFP4 path on Hopper
                    print(f"{case.name}: {name} skipped ({why})", flush=True)
            for r in range(args.rounds):
                for name, g in graphs.items():
                    row = {"case": case.name, "T": T, "impl": name, "round": r, **window(g, args.window_s)}
                    report["rows"].append(row)
                    print(f"{case.name} T={T} round {r} {name:16s} {row['us_per_call']:9.1f} us/call "
                          f"{row['mJ_per_call']:8.1f} mJ/call  SM {row['sm_mhz_end']:.0f} MHz "
                          f"{row['power_w_end']:.0f} W at the end", flush=True)
            for name, _, run, _ in keep if args.kernels else ():
                with settings(name):  # an eager call reads them again (e.g. the layout)
                    run.e2e()
                    torch.cuda.synchronize()
                    rows = sorted(kernel_times(run.e2e, args.kernels, per_launch=True).items(), key=lambda kv: -kv[1])
                report.setdefault("kernels", []).append({"case": case.name, "T": T, "impl": name, "kernels": rows})
                print(f"{case.name} T={T} {name}: {sum(us for _, us in rows):.1f} us of kernels per call", flush=True)
                for kname, us in rows:
                    print(f"    {us:9.1f} us  {kname}", flush=True)
            del graphs, keep, x, ids, tw
            torch.cuda.empty_cache()
    write_json(args.out, report)


if __name__ == "__main__":
    main()
