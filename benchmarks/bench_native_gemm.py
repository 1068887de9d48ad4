"""The native grouped GEMM (backend "cuda") against our Triton GEMM on the models' shapes.

For each preset (`name` or `name:mxfp4` for MXFP4 weights, kept with their canonical bytes, which
the native kernel reads) and token count, a `FusedMoE` layer with random weights routes random
tokens through its own router; then, in alternating rounds of CUDA-graph replays (so drift hits every
variant alike):

- GEMM1 and GEMM2 alone on the GROUPED_CONTIGUOUS layout, Triton (the tuned table's tile) vs
  native in each of its configurations (persistent, one CTA per tile, and for bf16 persistent with
  64-row tiles and with 256-row tiles of two consumers; the persistent ones with bf16 weights also
  walking their tiles from a counter, "dyn"); TFLOP/s count the valid rows only;
- the whole routed-experts call (`fused_experts`): Triton on INDEXED (the ratios' base), the
  library's own choice (`auto`: the native kernel where `backends.auto_native` says so), Triton on
  GROUPED_CONTIGUOUS, and the native kernel on GROUPED_CONTIGUOUS with the activation in GEMM1's
  epilogue (its default; for MXFP4 weights, prepared here, "grouped, cuda" is the RS kernel, which
  runs the activation as its own op; "grouped, cuda, fused" turns its gated epilogue on,
  `grouped.RS_EPILOGUE` and `RS_EPILOGUE_SPLIT`, "chunks256" / "chunks320" force its chunks, `grouped.RS_WIDE`,
  "whole boxes" runs a partial box's MMA whole, `RS_TAIL_PIECES` off, and "dynamic" walks the tiles from a counter,
  `RS_DYNAMIC`), as
  a separate op (`PADDED_MOE_FUSE_ACTIVATION=0`), and in configurations 0, 1 and 3 (the
  producer-upcast kernel, for MXFP4 too) (bf16: 0 and 3 in both tile walks, and walking from the
  counter with A's rows as normal L2 lines) instead of its own choice by shape; for MXFP4 weights,
  where humming-kernels is
  installed, also its GEMMs on GROUPED_CONTIGUOUS (backend "humming");

with the floors of the call: the experts' weights that received rows over the copy bandwidth,
and the valid FLOPs over the dense bf16 matmul rate, both measured in the same run. Each native
output is checked against Triton's (relative L2 difference at most 2e-2; both are checked against
float64 in the GPU tests).

    python benchmarks/bench_native_gemm.py --presets dsv4-flash,qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b:mxfp4 \
        --tokens 16,128,1024,8192 --out bench-out/native-gemm
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_us, captured, copy_bandwidth_gbs, matmul_tflops, print_table, random_layer, write_report  # noqa: E402
from profile_layer import kernel_times, print_kernel_times  # noqa: E402

from padded_moe import fused_experts  # noqa: E402
from padded_moe.backends import get_backend  # noqa: E402
from padded_moe.gemm import FUSE_ENV, expert_gemm  # noqa: E402
from padded_moe.kernels.native import grouped  # noqa: E402
from padded_moe.layer import FusedMoE  # noqa: E402
from padded_moe.layouts import build_layout  # noqa: E402


def rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def alternate(graphs: dict, rounds: int) -> dict:
    """Median replay time (us) of each graph, the graphs timed in turn, round after round."""
    times = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            times[name].append(bench_us(graph.replay, warmup_ms=10, rep_ms=100))
    return {name: statistics.median(ts) for name, ts in times.items()}


def forced_config(config, dynamic=None, rows_last=None):
    """A context in which the native GEMM runs configuration `config` (None: its own choice) and,
    with `dynamic` set, that tile walk (`grouped.DYNAMIC_WALK`), with `rows_last` set, that L2
    policy of A's rows (`grouped.ROWS_EVICT_LAST`)."""
    stack = contextlib.ExitStack()
    if rows_last is not None:
        stack.enter_context(mock.patch.object(grouped, "ROWS_EVICT_LAST", rows_last))
    if config is not None:
        stack.enter_context(mock.patch.object(grouped, "default_config", lambda *_: config))
        # A named configuration is one of the producer-upcast kernel's: prepared MXFP4 weights
        # (which otherwise run the RS kernel) take it too.
        stack.enter_context(mock.patch.object(grouped, "takes_rs", lambda w: False))
    if dynamic is not None:
        stack.enter_context(mock.patch.object(grouped, "DYNAMIC_WALK", dynamic))
    return stack


def gemm_rows(layer: FusedMoE, meta, x_rows: torch.Tensor, h_rows: torch.Tensor, rounds: int, valid: int) -> list:
    """GEMM1 and GEMM2 alone on the same GROUPED_CONTIGUOUS rows: Triton, and the native kernel in
    each configuration (`grouped.CONFIGS`: persistent, one CTA per tile, persistent with 64-row
    tiles, persistent with 256-row tiles of two consumers; the last two bf16 only), the persistent
    ones with bf16 weights in both tile walks ("dyn": from the counter)."""
    w13, w2 = layer.expert_weights()
    mx = not isinstance(w13, torch.Tensor)
    configs = [c for c in range(len(grouped.CONFIGS)) if grouped.runs_mxfp4(c) or not mx]
    variants = [("triton", None, None, None)] + [("cuda", c, False, None) for c in configs]
    variants += [("cuda", c, True, None) for c in configs if grouped.CONFIGS[c][1] and not mx]
    # A's rows as normal L2 lines (against evict-last) in one CTA per tile and in the dynamic walk
    variants += [("cuda", 1, False, False)] + ([] if mx else [("cuda", 3, True, False)])
    rows = []
    for stage, a, w, bias in (("w13", x_rows, w13, layer.w13_bias), ("w2", h_rows, w2, layer.w2_bias)):
        outs, graphs = {}, {}
        for backend, config, dynamic, rows_last in variants:
            name = backend if config is None else (f"cuda c{config}{' dyn' if dynamic else ''}"
                                                   f"{' rows normal' if rows_last is False else ''}")
            out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
            # The configuration, walk and policy are chosen at launch, so the captured graph keeps them.
            with forced_config(config, dynamic, rows_last):
                graph, _ = captured(lambda: expert_gemm(a, w, meta, stage=stage, bias=bias, out=out,  # noqa: B023
                                                        backend=backend))  # noqa: B023
            graph.replay()
            graphs[name], outs[name] = graph, out
        torch.cuda.synchronize()
        t = alternate(graphs, rounds)
        flops = 2.0 * valid * w.shape[1] * w.shape[2]
        for name in graphs:
            if name == "triton":
                continue
            diff = rel_diff(outs[name][:valid], outs["triton"][:valid])
            rows.append([stage, name, round(t["triton"], 1), round(t[name], 1), round(flops / t["triton"] / 1e6, 1),
                         round(flops / t[name] / 1e6, 1), round(t["triton"] / t[name], 3), f"{diff:.1e}"])
    return rows


def call_variants(mx: bool, humming: bool = False) -> dict:
    """The whole-call variants: name -> (layout, backend, PADDED_MOE_FUSE_ACTIVATION during the
    capture or None for unset, native configuration or None for its own choice by shape, tile walk
    and L2 policy of A's rows or None for the defaults); with bf16 weights (`mx` False) also the
    wide tiles, the counter and the rows' L2 policy; with MXFP4 weights and `humming` (the package
    installed) also humming-kernels on GROUPED_CONTIGUOUS (its INDEXED kernels want row blocks of
    sizes our layouts do not build past 8 rows per expert)."""
    variants = {"indexed, Triton": ("indexed", "triton", None, None, None, None),
                "auto": (None, "auto", None, None, None, None),
                "grouped, Triton": ("grouped_contiguous", "triton", None, None, None, None),
                "grouped, cuda": ("grouped_contiguous", "cuda", None, None, None, None),
                "grouped, cuda, unfused": ("grouped_contiguous", "cuda", "0", None, None, None),
                "grouped, cuda c0": ("grouped_contiguous", "cuda", None, 0, False, None),
                "grouped, cuda c1": ("grouped_contiguous", "cuda", None, 1, False, None)}
    if not mx:
        variants["grouped, cuda c0 dyn"] = ("grouped_contiguous", "cuda", None, 0, True, None)
        variants["grouped, cuda c0 dyn, rows normal"] = ("grouped_contiguous", "cuda", None, 0, True, False)
        variants["grouped, cuda c3"] = ("grouped_contiguous", "cuda", None, 3, False, None)
        variants["grouped, cuda c3 dyn"] = ("grouped_contiguous", "cuda", None, 3, True, None)
        variants["grouped, cuda c3 dyn, rows normal"] = ("grouped_contiguous", "cuda", None, 3, True, False)
        variants["grouped, cuda, gather"] = ("grouped_contiguous", "cuda", None, None, None, None)  # `rs_switches`
    if mx:  # the RS kernel (`rs_switches`): with its gated epilogue ("fused"), its chunks of 256 or 320
        # rows forced, a partial box's MMA whole instead of in pieces, the tiles walked from the counter,
        # GEMM1 gathering the token rows
        for fused in ("", ", fused"):
            for extra in ("", ", chunks256", ", chunks320", ", whole boxes", ", dynamic", ", whole boxes, dynamic",
                          ", dynamic, gather"):
                if fused or extra:
                    variants[f"grouped, cuda{fused}{extra}"] = ("grouped_contiguous", "cuda", "1" if fused else None,
                                                                None, None, None)
    if mx and humming:
        variants["grouped, humming"] = ("grouped_contiguous", "humming", None, None, None, None)
    return variants


def rs_switches(name: str):
    """The RS kernel's switches for a whole-call variant "grouped, cuda[, fused][, chunksN][, whole
    boxes][, dynamic][, gather]": `grouped.RS_EPILOGUE` / `RS_EPILOGUE_SPLIT` on only with "fused",
    `RS_WIDE` from "chunks256" / "chunks320" (else the rule), `RS_TAIL_PIECES` off with "whole boxes",
    `RS_DYNAMIC` on with "dynamic", `RS_GATHER` and `GATHER_BF16` (GEMM1 reading the token rows, no
    permuted copy) on with "gather"; every other variant ("auto" included) keeps the library's
    defaults."""
    if not name.startswith("grouped, cuda"):
        return contextlib.nullcontext()
    parts = set(name.split(", ")[2:])
    wide = True if "chunks320" in parts else False if "chunks256" in parts else None
    fused = "fused" in parts
    return mock.patch.multiple(grouped, RS_EPILOGUE=fused, RS_EPILOGUE_SPLIT=fused, RS_WIDE=wide,
                               RS_TAIL_PIECES="whole boxes" not in parts, RS_DYNAMIC="dynamic" in parts,
                               RS_GATHER="gather" in parts, GATHER_BF16="gather" in parts)


def select_variants(variants: dict, keep: set) -> dict:
    """The variants named in `keep` (all when it is empty) and always "indexed, Triton", the ratios'
    base; a name that is no variant of bf16 weights is a SystemExit naming the known ones."""
    known = set(call_variants(False)) | set(call_variants(True, humming=True))
    unknown = keep - known
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; known: {sorted(known)}")
    if not keep:
        return variants
    return {name: v for name, v in variants.items() if name == "indexed, Triton" or name in keep}


GEMM_HEADERS = ["preset", "T", "rows/expert", "GEMM", "native config", "Triton us", "native us", "Triton TFLOP/s",
                "native TFLOP/s", "Triton/native", "rel diff"]
CALL_HEADERS = ["preset", "T", "rows/expert", "variant", "us", "indexed Triton/this", "this/floor", "rel diff vs indexed Triton"]


def report(out_dir: str, gemm_table: list, call_table: list, copy_gbs: float, dense_tflops: float, t0: float) -> None:
    """Print and write the tables so far (called after every case, so a run cut short keeps them)."""
    print_table("GEMMs alone (GROUPED_CONTIGUOUS, graph replays, alternating rounds)", GEMM_HEADERS, gemm_table)
    print_table("Whole routed-experts calls (graph replays, alternating rounds)", CALL_HEADERS, call_table)
    notes = (f"Copy bandwidth {copy_gbs:.0f} GB/s, dense bf16 matmul {dense_tflops:.0f} TFLOP/s (same run). "
             "floor = max(weights of the experts hit / copy bandwidth, valid FLOPs / matmul rate).")
    write_report(out_dir, "bench_native_gemm_calls", "Native grouped GEMM: whole calls", notes, CALL_HEADERS,
                 call_table, extra={"gemms": {"headers": GEMM_HEADERS, "rows": gemm_table},
                                    "wall_s": time.time() - t0})
    print(f"wrote {out_dir} ({time.time() - t0:.0f} s)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="dsv4-flash,qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b:mxfp4,dsv4-flash:mxfp4")
    p.add_argument("--tokens", default="16,128,1024,8192", help="comma list of token counts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench-out/native-gemm")
    p.add_argument("--calls-only", action="store_true", help="skip the GEMMs alone (whole calls only)")
    p.add_argument("--variants", default="", help="semicolon list of whole-call variants to time (default: all; "
                   "the names hold commas); 'indexed, Triton', the ratios' base, is always timed")
    p.add_argument("--breakdown", action="store_true",
                   help="after timing, print each whole-call variant's kernels (torch.profiler over graph replays)")
    args = p.parse_args()
    keep = {v.strip() for v in args.variants.split(";") if v.strip()}
    select_variants({}, keep)  # unknown names fail before any GPU work
    if not torch.cuda.is_available():
        raise SystemExit("bench_native_gemm times CUDA graphs: it needs a GPU")
    has_humming = get_backend("humming").available(torch.device("cuda")) is None
    t0 = time.time()
    copy_gbs, dense_tflops = copy_bandwidth_gbs(), matmul_tflops()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s, dense bf16 matmul {dense_tflops:.0f} TFLOP/s")
    gemm_table, call_table = [], []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for item in (s.strip() for s in args.presets.split(",") if s.strip()):
        preset, _, fmt = item.partition(":")
        fmt = fmt or "bf16"
        layer = random_layer(preset, fmt, keep_canonical=fmt == "mxfp4")
        w13, w2 = layer.expert_weights()
        E, K, N = layer.num_experts, layer.hidden_size, w2.shape[2]
        if fmt == "mxfp4":
            expert_bytes = sum(t.blocks[0].numel() + t.scales[0].numel() for t in (w13, w2))
        else:
            expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            tw, ids = layer.route(layer.gate(x), None)
            meta = build_layout("grouped_contiguous", ids, E)
            valid = int(meta.offsets[-1])
            x_rows = torch.randn(ids.numel(), K, device="cuda", dtype=torch.bfloat16, generator=gen)
            h_rows = torch.randn(ids.numel(), N, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
            if not args.calls_only:
                for row in gemm_rows(layer, meta, x_rows, h_rows, args.rounds, valid):
                    gemm_table.append([item, T, round(valid / E, 1)] + row)

            hit = int((torch.bincount(ids.flatten().long().clamp(min=0), minlength=E)[:E] > 0).sum())
            weight_bytes = hit * expert_bytes
            flops = 2.0 * valid * (w13.shape[1] * K + K * N)
            floor_us = max(weight_bytes / (copy_gbs * 1e3), flops / (dense_tflops * 1e6))
            bias = dict(w13_bias=layer.w13_bias, w2_bias=layer.w2_bias)
            variants = select_variants(call_variants(fmt == "mxfp4", humming=has_humming), keep)
            graphs, outs, failed = {}, {}, {}
            for name, (lay, backend, fuse, config, dynamic, rows_last) in variants.items():
                env = {} if fuse is None else {FUSE_ENV: fuse}
                rs_settings = rs_switches(name)
                try:
                    with mock.patch.dict(os.environ, env), forced_config(config, dynamic, rows_last), rs_settings:
                        graph, out = captured(lambda: fused_experts(  # noqa: B023
                            x, w13, w2, tw, ids, activation=layer.activation,
                            activation_config=layer.activation_config, layout=lay, backend=backend,
                            **bias))  # noqa: B023
                except Exception as exc:
                    if backend != "humming":  # ours must capture; another package's failure is reported
                        raise
                    failed[name] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
                    print(f"{item} T={T} {name}: {failed[name]}", flush=True)
                    continue
                graph.replay()
                # A copy: calls of one shape may share their output buffer (the eager cache).
                graphs[name], outs[name] = graph, out.clone()
            torch.cuda.synchronize()
            t = alternate(graphs, args.rounds)
            base = t["indexed, Triton"]
            if args.breakdown:
                for name, graph in graphs.items():
                    print_kernel_times(f"{item} T={T} {name}", kernel_times(graph.replay, 5), top=10, per="call")
            for name in variants:
                if name in failed:
                    call_table.append([item, T, round(valid / E, 1), name, None, None, None, failed[name]])
                    continue
                diff = rel_diff(outs[name], outs["indexed, Triton"])
                call_table.append([item, T, round(valid / E, 1), name, round(t[name], 1), round(base / t[name], 3),
                                   round(t[name] / floor_us, 2), f"{diff:.1e}"])
            del graphs, outs
            torch.cuda.empty_cache()
        del layer, w13, w2
        torch.cuda.empty_cache()
        report(args.out, gemm_table, call_table, copy_gbs, dense_tflops, t0)


if __name__ == "__main__":
    main()
