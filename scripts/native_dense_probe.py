"""Where the native grouped GEMM loses time on full tiles: every expert gets the same number of
rows, so the same work runs as one cuBLAS batched matmul (`torch.bmm`, the reference rate), as our
Triton GEMM, and as the native kernel in each bf16 configuration and tile walk. One expert of 8192
rows is a dense GEMM; with many experts the walk also decides which experts' weights share L2.
`gpu_check.sh l2-ncu` runs it under Nsight Compute for the L2 traffic behind these times. Plain
epilogue (no bias, no activation), bf16, CUDA-graph replays timed in alternating rounds (the median;
"spread" is the rounds' (slowest - fastest) / median, so differences between variants below it are
noise). Each output is compared with the bmm's.

    PYTHONPATH=src python scripts/native_dense_probe.py [--cases dense,dsv4,qwen3,mixtral] [--rounds 3]

`--variants triton,c0` keeps those (and bmm); "cN pM" / "cN dyn pM" add configuration N launched
with load-policy mask M (`grouped.LOAD_POLICIES`: 1 the weight tile's loads carry their L2 policy,
2 A's rows'); `--once` runs each once, eagerly and untimed, for ncu.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import bench_us, captured  # noqa: E402

from padded_moe.gemm import expert_gemm  # noqa: E402
from padded_moe.kernels.native import grouped  # noqa: E402
from padded_moe.layouts import build_layout  # noqa: E402

# name -> (experts, rows per expert, K, weight rows N): GEMM1 shapes of the presets at 8192 tokens
# (DeepSeek-V4 at its mean 192 rows and at full 256-row chunks).
CASES = {
    "dense": (1, 8192, 4096, 4096),
    "dsv4": (256, 192, 4096, 4096),
    "dsv4-256": (256, 256, 4096, 4096),
    "qwen3": (128, 512, 2048, 1536),
    "mixtral": (8, 2048, 4096, 28672),
}


def native_variants() -> list:
    """(label, configuration, dynamic walk) of the native kernel with bf16 weights: every
    configuration, the persistent ones in both walks."""
    out = []
    for config, (_, persistent, _, _) in enumerate(grouped.CONFIGS):
        out.append((f"c{config}", config, False))
        if persistent:
            out.append((f"c{config} dyn", config, True))
    return out


def with_policies(keep: set) -> list:
    """(label, configuration, dynamic walk, mask) of the "cN[ dyn] pM" variants in `keep`."""
    out = []
    for label in sorted(keep):
        m = re.fullmatch(r"c(\d+)( dyn)? p(\d+)", label)
        if m:
            config, mask = int(m[1]), int(m[3])
            if config >= len(grouped.CONFIGS) or mask > grouped.POLICY_WEIGHTS | grouped.POLICY_ROWS:
                raise SystemExit(f"variant {label!r}: no configuration {config} or mask {mask}")
            out.append((label, config, bool(m[2]), mask))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="", help="comma list of variants to run (default: all; bmm always)")
    p.add_argument("--once", action="store_true", help="run each variant once, eagerly, untimed (for ncu)")
    args = p.parse_args()
    keep = {v.strip() for v in args.variants.split(",") if v.strip()}
    if not torch.cuda.is_available():
        raise SystemExit("native_dense_probe times the GPU: it needs one")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'case':10} {'variant':10} {'us':>9} {'TFLOP/s':>8} {'bmm/this':>8} {'rel diff':>9} {'spread':>7}")
    for name in args.cases.split(","):
        L, M, K, N = CASES[name]
        a = torch.randn(L * M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(L, N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        ids = torch.arange(L, device="cuda", dtype=torch.int32).repeat_interleave(M)[:, None]
        meta = build_layout("grouped_contiguous", ids, L)
        offsets = meta.offsets
        ref = torch.empty(L, M, N, device="cuda", dtype=torch.bfloat16)
        calls = {"bmm": (lambda: torch.bmm(a.view(L, M, K), w.transpose(1, 2), out=ref), ref)}  # noqa: B023
        out_t = torch.full((L * M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        calls["triton"] = (lambda: expert_gemm(a, w, meta, stage="w2", out=out_t, backend="triton"),  # noqa: B023
                           out_t)
        for label, config, dynamic in native_variants():
            out = torch.full((L * M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            calls[label] = (lambda c=config, d=dynamic, o=out: grouped.launch(a, w, o, offsets=offsets,  # noqa: B023
                                                                                 config=c, dynamic=d), out)
        for label, config, dynamic, mask in with_policies(keep):
            out = torch.full((L * M, N), float("nan"), device="cuda", dtype=torch.bfloat16)

            def run(c=config, d=dynamic, o=out, m=mask):  # the mask is read at launch (and so at capture)
                with mock.patch.dict(grouped.LOAD_POLICIES, {c: m}):
                    grouped.launch(a, w, o, offsets=offsets, config=c, dynamic=d)  # noqa: B023
            calls[label] = (run, out)
        calls = {k: v for k, v in calls.items() if k == "bmm" or not keep or k in keep}
        outs = {k: out for k, (_, out) in calls.items()}
        if args.once:
            for fn, _ in calls.values():
                fn()
            torch.cuda.synchronize()
            continue
        graphs = {k: captured(fn)[0] for k, (fn, _) in calls.items()}
        for g in graphs.values():
            g.replay()
        torch.cuda.synchronize()
        times = {k: [] for k in graphs}
        for _ in range(args.rounds):
            for k, g in graphs.items():
                times[k].append(bench_us(g.replay, warmup_ms=10, rep_ms=100))
        t = {k: statistics.median(v) for k, v in times.items()}
        # The rounds' spread, (slowest - fastest) / median: differences between variants below it are noise.
        spread = {k: (max(v) - min(v)) / t[k] for k, v in times.items()}
        flops = 2.0 * L * M * N * K
        r = ref.view(L * M, N).double()
        for k in graphs:
            o = outs[k].view(L * M, N).double()
            diff = ((o - r).norm() / r.norm()).item()
            print(f"{name:10} {k:10} {t[k]:9.1f} {flops / t[k] / 1e6:8.1f} {t['bmm'] / t[k]:8.3f} {diff:9.1e} "
                  f"{100 * spread[k]:6.1f}%")
        del graphs, outs, calls, a, w, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
