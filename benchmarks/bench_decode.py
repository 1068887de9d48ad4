"""Decode-sized `fused_experts` calls: the decode path (two kernels) against the layout path.

    python benchmarks/bench_decode.py                       # Qwen3-MoE, DeepSeek-V4 (bf16), Mixtral, GPT-OSS (bf16)
    python benchmarks/bench_decode.py --sweep               # also time the decode kernels' tile candidates
    python benchmarks/bench_decode.py --weights mxfp4 --presets gpt-oss-120b,dsv4-flash
    python benchmarks/bench_decode.py --ab read            # decode kernel variants side by side (GEMM1's reads)

For each model shape (bf16 or MXFP4 weights, random routing from the layer's own router) and token count,
times one routed-experts call (`FusedMoE.experts`: no router, no shared experts) as a CUDA-graph
replay and as an eager call, with `PADDED_MOE_DECODE` on and off, and gives the weight-read floor:
the bytes of the distinct experts the call hits over the copy bandwidth measured in the same run.
Every decode result is checked against the layout path's before it is timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (bench_graph_us, bench_us, captured, copy_bandwidth_gbs, print_table,  # noqa: E402
                     random_layer, write_report)

from padded_moe import decode as dec  # noqa: E402
from padded_moe import experts as ex  # noqa: E402

PRESETS = ("qwen3-30b-a3b", "dsv4-flash", "mixtral-8x7b", "gpt-oss-120b")
# One kernel's tiles varied at a time, the other's at the middle candidate.
_G1 = [(16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (16, 64, 4, 6), (32, 64, 4, 6), (16, 128, 2, 4),
       (32, 128, 8, 4), (16, 256, 4, 4)]
_G2 = [(8, 8192, 4, 3), (16, 8192, 4, 3), (4, 8192, 4, 3), (8, 4096, 2, 4), (8, 8192, 4, 4), (8, 8192, 4, 2),
       (8, 16384, 8, 3)]
SWEEP = ([dec.DecodeTiles(b1, k1, *_G2[0][:2], warps1=w1, stages1=s1, warps2=_G2[0][2], stages2=_G2[0][3])
          for b1, k1, w1, s1 in _G1]
         + [dec.DecodeTiles(*_G1[1][:2], b2, st, warps1=_G1[1][2], stages1=_G1[1][3], warps2=w2, stages2=s2)
            for b2, st, w2, s2 in _G2[1:]])

# MXFP4: GEMM1 (BN, BK, warps, stages) with GEMM2 at the first _MX2 entry, then GEMM2 (BN, step,
# warps, stages) with GEMM1 at the first _MX1 entry (every variation against the same reference).
_MX1 = [(16, 256, 4, 3), (16, 256, 4, 4), (16, 256, 4, 2), (16, 512, 4, 2), (16, 512, 4, 3), (16, 128, 4, 4),
        (16, 256, 8, 3), (16, 256, 2, 3), (32, 256, 4, 3), (8, 256, 4, 3)]
_MX2 = [(8, 16384, 4, 3), (4, 16384, 4, 3), (16, 16384, 4, 3), (8, 8192, 4, 4), (8, 32768, 4, 3), (8, 32768, 8, 3),
        (8, 16384, 8, 3), (8, 16384, 4, 4), (4, 8192, 4, 4), (8, 16384, 2, 3)]
MX_SWEEP = ([dec.DecodeTiles(b1, k1, _MX2[0][0], _MX2[0][1], warps1=w1, stages1=s1, warps2=_MX2[0][2],
                             stages2=_MX2[0][3]) for b1, k1, w1, s1 in _MX1]
            + [dec.DecodeTiles(_MX1[0][0], _MX1[0][1], b2, st, warps1=_MX1[0][2], stages1=_MX1[0][3], warps2=w2,
                               stages2=s2) for b2, st, w2, s2 in _MX2[1:]])


def tokens_for(preset: str, top_k: int) -> list[int]:
    """Every token count whose slots fit the decode path, powers of two."""
    out, t = [], 1
    while dec.fits_decode(t, t * top_k):
        out.append(t)
        t *= 2
    return out


def with_decode(on: bool, fn):
    os.environ[dec.DECODE_ENV] = "auto" if on else "off"
    try:
        return fn()
    finally:
        os.environ.pop(dec.DECODE_ENV, None)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


# Variants of the decode kernels timed side by side (`--ab`): label -> the `padded_moe.decode`
# settings it runs with; the first is the reference of the ratios.
AB_VARIANTS = {
    "read": {f"{r}": dict(W13_READ=r) for r in dec.W13_READS},
    "mxw13": {"gemv": dict(MX_W13="gemv"), "dot": dict(MX_W13="dot"),
              "dot_bk128": dict(MX_W13="dot", MX_DOT_BK=128, MX_DOT_STAGES=4)},
    # GEMM2 as the Triton kernel, the native kernel as chosen, and each native configuration (added
    # by `ab_variants`: their number comes from the built library; one whose warps do not fit the
    # preset's top_k is left out: NaN).
    "mxw2": {"triton": dict(MX_W2="triton"), "cuda": dict(MX_W2="cuda")},
}
AB_WEIGHTS = {"read": "bf16", "mxw13": "mxfp4", "mxw2": "mxfp4"}


def ab_variants(kind: str) -> dict:
    """`AB_VARIANTS[kind]`, with every native GEMM2 configuration the library has for "mxw2"
    (building the library: only when that comparison is asked for)."""
    variants = dict(AB_VARIANTS[kind])
    if kind == "mxw2":
        from padded_moe.kernels import native

        variants.update({f"cuda_c{c}": dict(MX_W2="cuda", NATIVE_W2_CONFIG=c) for c in range(native.w2_num_configs())})
    return variants


def ab_headers(kind: str) -> list:
    labels = list(ab_variants(kind))
    return ["model", "T"] + [f"{v} us" for v in labels] + [f"{labels[0]} / {v}" for v in labels[1:]] \
        + ["max rel diff"]


def variants_ab(call, kind: str) -> list:
    """The decode call captured once per variant of `ab_variants(kind)`, the replays timed in
    alternating rounds: [µs per variant..., first / each other (above 1: the other is faster),
    largest relative difference of an output to the first's]."""
    graphs = []
    plans = ex._launch_plans()
    for settings in ab_variants(kind).values():
        real = {k: getattr(dec, k) for k in settings}
        try:
            for k, v in settings.items():
                setattr(dec, k, v)
            plans.enabled = False  # a launch plan would replay what an earlier call launched
            try:
                graph, out = with_decode(True, lambda: captured(call))
            except ValueError as exc:  # a variant this shape cannot run (named in the message)
                print(f"variant {settings} skipped: {exc}")
                graphs.append(None)
                continue
            graph.replay()
            torch.cuda.synchronize()
            graphs.append((graph, out.clone()))
        finally:
            plans.enabled = True
            for k, v in real.items():
                setattr(dec, k, v)
    times = [[] for _ in graphs]
    for _ in range(5):
        for i, entry in enumerate(graphs):
            if entry is not None:
                times[i].append(bench_us(entry[0].replay, warmup_ms=10, rep_ms=100))
    us = [sorted(t)[2] if t else float("nan") for t in times]
    diff = max(rel(e[1], graphs[0][1]) for e in graphs[1:] if e is not None)
    return [round(u, 1) for u in us] + [round(us[0] / u, 3) for u in us[1:]] + [f"{diff:.1e}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--weights", default="bf16", choices=("bf16", "mxfp4"),
                   help="expert weight format (mxfp4: quantized and prepared at load, as FusedMoE does)")
    p.add_argument("--sweep", action="store_true", help="time the decode tile candidates at T=1 per preset")
    p.add_argument("--mx-step", choices=dec.MX_STEPS, default=dec.MX_STEP,
                   help="mxfp4: how the decode kernels read the weights (decode.MX_STEP)")
    p.add_argument("--ab", choices=tuple(AB_VARIANTS),
                   help="also time each decode call with each variant of the decode kernels, alternating "
                        "rounds: read (bf16: decode.W13_READS), mxw13 (mxfp4: decode.MX_W13S and the dot route's "
                        "K steps), mxw2 (mxfp4: decode.MX_W2S and the native configurations)")
    p.add_argument("--out", default="bench-out/decode")
    args = p.parse_args()
    dec.MX_STEP = args.mx_step
    t0 = time.time()
    copy = copy_bandwidth_gbs() * 1e9
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s")
    rows, sweep_rows, ab_rows = [], [], []
    for name in args.presets.split(","):
        layer = random_layer(name, args.weights)
        gen = torch.Generator(device="cuda").manual_seed(1)
        # Bytes one expert's weights occupy in the format the call reads (MXFP4: e2m1 + E8M0).
        per_weight = 2 if args.weights == "bf16" else 0.5 + 1 / 32
        w13, w2 = layer.expert_weights()
        expert_bytes = (w13.shape[1] * w13.shape[2] + w2.shape[1] * w2.shape[2]) * per_weight
        for T in tokens_for(name, layer.top_k):
            x = torch.randn(T, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
            tw, ids = layer.route(layer.gate(x), None)
            call = lambda: layer.experts(x, tw, ids)  # noqa: E731
            ref = with_decode(False, call)
            got = with_decode(True, call)
            err = rel(got, ref)
            if not torch.isfinite(got).all() or err > 2e-2:
                raise SystemExit(f"{name} T={T}: decode path differs from the layout path (rel {err:.3g})")
            hit = torch.unique(ids[(ids >= 0) & (ids < layer.num_experts)]).numel()
            floor = hit * expert_bytes / copy * 1e6
            g_on = with_decode(True, lambda: bench_graph_us(call))
            g_off = with_decode(False, lambda: bench_graph_us(call))
            e_on = with_decode(True, lambda: bench_us(call))
            e_off = with_decode(False, lambda: bench_us(call))
            rows.append([name, T, hit, round(floor, 1), round(g_on, 1), round(g_off, 1), round(g_off / g_on, 2),
                         round(floor / g_on, 2), round(e_on, 1), round(e_off, 1), f"{err:.1e}"])
            if args.ab and AB_WEIGHTS[args.ab] == args.weights:
                ab_rows.append([name, T] + variants_ab(call, args.ab))
            if args.sweep and T == 1:
                plans = ex._launch_plans()
                for tiles in (MX_SWEEP if args.weights == "mxfp4" else SWEEP):
                    real = dec.pick_tiles
                    dec.pick_tiles = lambda *a, _t=tiles, **kw: _t  # noqa: E731
                    plans.enabled = False  # every call runs in full, with these tiles
                    try:
                        graph, out = with_decode(True, lambda: captured(call))
                        graph.replay()
                        ok = bool(torch.isfinite(out).all()) and rel(out, ref) <= 2e-2
                        us = bench_us(graph.replay) if ok else float("nan")
                    finally:
                        dec.pick_tiles = real
                        plans.enabled = True
                    sweep_rows.append([name, tiles.short(), round(us, 1), "ok" if ok else "WRONG"])
        del layer
        torch.cuda.empty_cache()
    headers = ["model", "T", "experts hit", "floor us", "decode graph us", "layout graph us", "layout/decode",
               "floor/decode", "decode eager us", "layout eager us", "rel diff"]
    print_table(f"decode path vs layout path ({args.weights}, routed experts only)", headers, rows)
    if sweep_rows:
        print_table("decode tiles at T=1 (graph us)", ["model", "tiles", "us", "check"], sweep_rows)
    if ab_rows:
        print_table(f"decode kernel variants: {args.ab} (graph us, 5 alternating rounds)", ab_headers(args.ab),
                    ab_rows)
    write_report(args.out, "bench_decode", "Decode-sized calls: decode path vs layout path",
                 f"One routed-experts call (FusedMoE.experts), {args.weights} weights, graph replay and eager, "
                 "PADDED_MOE_DECODE on and off; floor = bytes of the experts hit / copy bandwidth.",
                 headers, rows, extra={"sweep": sweep_rows, "ab": [ab_headers(args.ab)] + ab_rows if args.ab else [],
                                       "copy_bytes_per_s": copy, "wall_s": time.time() - t0})
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
