"""Expert GEMM benchmark (spec 03 targets) on model shapes (DSV4 by default); one run also sweeps the
kernel's block configs per regime and prints the winners for `padded_moe.kernels.gemm.TUNED`.

    python benchmarks/bench_gemm.py [--out docs/] [--humming] [--no-sweep]
    python benchmarks/bench_gemm.py --presets qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b --no-masked
    python benchmarks/bench_gemm.py --tiny          # CPU dry run under TRITON_INTERPRET=1
    python benchmarks/bench_gemm.py --mxfp4-hopper [--models gpt-oss,dsv4-flash] [--rows 1,2,...]
                                    [--no-sweep] [--tiny] [--humming]

`--mxfp4-hopper`: MXFP4 weights prepared for the Hopper kernel (`Mxfp4Tensor.prepare_for`) vs the
same canonical weights through tl.dot_scaled vs bf16 weights, on the GPT-OSS (E=128, K=N=2880) and
dsv4-flash (E=256, K=4096, N=2048) expert shapes, every expert holding `rows` rows (decode 1..32
and larger), GROUPED_CONTIGUOUS for all three plus the prepared kernel on INDEXED and
GROUPED_MASKED, in both arrangements (`prepare_for(planes=4)`, the default, and `planes=2`), each
with its own table tile; every prepared result is
first checked against the dot_scaled one; prints weight bytes read / time as a fraction of copy
bandwidth, and sweeps `SWEEP_MXFP4_HOPPER` per regime on the arrangements `--sweep-planes` names
(winners for `TUNED[("mxfp4_hopper", regime)]` and `TUNED[("mxfp4_hopper4", regime)]`), timed on
INDEXED with the row block `fused_experts` picks by default (`default_block_m`; it caps the tile's
BM: 64 below 80 rows per expert for prepared weights), every candidate checked on all three layouts first.
With `--humming`, humming-kernels on the same canonical weights, on each of the three layouts (INDEXED
with humming's own row block), each result checked against the dot_scaled one before it is timed;
"humming time / ours" compares it with the prepared default (4 planes) on the same layout.

Shapes: per preset (`--presets`, default dsv4-flash), w13 (K=hidden -> 2N) and w2 (N -> hidden);
dsv4-flash: K=4096, N=2048 on 32 and 128 local experts, the other presets on all their experts
(`--experts` overrides); {8, 32, 128, 512, 2048} rows per expert, GROUPED_CONTIGUOUS (the layout
torch._grouped_mm also computes) plus
our INDEXED, and GROUPED_MASKED slabs at 10% vs 100% valid. Ceilings measured in the same run:
device copy bandwidth (read + write of 1 GiB) and a dense bf16 matmul (8192^3).

Targets (H200): decode (<= 32 rows/expert, bf16) weight bytes / time >= 85% of copy bandwidth;
prefill (>= 512 rows/expert) >= 0.9x torch._grouped_mm; masked 10% valid <= 15% of the full call;
MXFP4 >= 1.0x humming (with --humming, here or with --mxfp4-hopper; its first call JIT-compiles about
20 s per configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from padded_moe.backends import get_backend
from padded_moe.gemm import expert_gemm
from padded_moe.kernels import gemm as kg
from padded_moe.layouts import GemmLayout, GroupedContiguousMeta, GroupedMaskedMeta, build_layout, default_block_m
from padded_moe.mxfp4 import Mxfp4Tensor, quantize_mxfp4
from padded_moe.presets import get_preset


def timed(fn, dev) -> float:
    """Median milliseconds per call."""
    if dev.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def ceilings(dev, tiny: bool) -> dict:
    n = (1 << 20) if tiny else (1 << 29)  # bf16 elements: 1 GiB on the GPU
    src = torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), dev)
    copy_bw = 2 * n * 2 / (ms * 1e-3)
    s = 512 if tiny else 8192
    x = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    y = torch.randn(s, s, device=dev, dtype=torch.bfloat16)
    ms = timed(lambda: x @ y, dev)
    return {"copy_bytes_per_s": copy_bw, "dense_tflops": 2 * s**3 / (ms * 1e-3) / 1e12}


def contiguous_meta(L: int, rows: int, dev) -> GroupedContiguousMeta:
    """Exactly `rows` rows per expert (k=1): offsets are multiples of rows."""
    ids = (torch.arange(L * rows, device=dev, dtype=torch.int32) // rows).view(-1, 1)
    return build_layout(GemmLayout.GROUPED_CONTIGUOUS, ids, L)


def masked_meta(L: int, t_max: int, count: int, dev) -> GroupedMaskedMeta:
    c = torch.full((L,), count, dtype=torch.int32, device=dev)
    return GroupedMaskedMeta(num_tokens=L * t_max, top_k=1, num_local=L,
                             slot_expert=torch.zeros(1, dtype=torch.int32, device=dev), activation_counts=c,
                             counts=c, inv=torch.zeros(1, dtype=torch.int32, device=dev),
                             overflow=torch.zeros(1, dtype=torch.int32, device=dev), max_tokens_per_expert=t_max)


def weight_pair(L, n_out, K, dev):
    w = (torch.randn(L, n_out, K, device=dev, dtype=torch.bfloat16) / K**0.5)
    parts = [quantize_mxfp4(w[i:i + 8]) for i in range(0, L, 8)]
    q = Mxfp4Tensor(torch.cat([p.blocks for p in parts]), torch.cat([p.scales for p in parts]))
    return w, q


def wbytes(w) -> int:
    return w.nbytes() if isinstance(w, Mxfp4Tensor) else w.numel() * w.element_size()


def run(args) -> dict:
    dev = torch.device("cpu" if args.tiny else "cuda")
    triton_be = get_backend("triton")
    ceil = ceilings(dev, args.tiny)
    print(f"copy bandwidth {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, dense bf16 {ceil['dense_tflops']:.0f} TFLOP/s")
    if args.tiny:
        models = {"tiny": ({"w13": (64, 64), "w2": (32, 64)}, [4])}
        row_set, slab_set = [8, 32], [64]
    else:
        models = {}
        for name in args.presets.split(","):
            pre = get_preset(name)
            stages = {"w13": (pre.hidden_size, pre.w13_rows), "w2": (pre.intermediate_size, pre.hidden_size)}  # (K, Nout)
            if args.stages:
                stages = {k: v for k, v in stages.items() if k in args.stages.split(",")}
            experts = ([int(x) for x in args.experts.split(",")] if args.experts
                       else [32, 128] if name == "dsv4-flash" else [pre.num_experts])
            models[name] = (stages, experts)
        row_set, slab_set = [8, 32, 128, 512, 2048], [512, 2048]
        if args.rows:
            row_set = [int(x) for x in args.rows.split(",")]
        if args.no_masked:
            slab_set = []
    results = {"ceilings": ceil, "rows": [], "masked": [], "sweep": {}}
    has_gmm = dev.type == "cuda" and hasattr(torch, "_grouped_mm")

    for model, (stages, experts) in models.items():
        for stage, (K, n_out) in stages.items():
            for L in experts:
                w, q = weight_pair(L, n_out, K, dev)
                for r in row_set:
                    meta = contiguous_meta(L, r, dev)
                    a = torch.randn(L * r, K, device=dev, dtype=torch.bfloat16)
                    out = torch.empty(L * r, n_out, device=dev, dtype=torch.bfloat16)
                    ids = (torch.arange(L * r, device=dev, dtype=torch.int32) // r).view(-1, 1)
                    bm_idx = kg.pick_config(r, False, args.tiny).BM
                    imeta = build_layout(GemmLayout.INDEXED, ids, L, block_m=max(16, bm_idx))
                    row = {"model": model, "stage": stage, "L": L, "rows_per_expert": r, "K": K, "N": n_out,
                           "regime": kg.regime(r)}
                    flops = 2.0 * L * r * K * n_out
                    row["ours_bf16_ms"] = timed(lambda: expert_gemm(a, w, meta, out=out, backend="triton"), dev)
                    row["ours_bf16_indexed_ms"] = timed(lambda: expert_gemm(a, w, imeta, out=out, backend="triton"), dev)
                    row["ours_mxfp4_ms"] = timed(lambda: expert_gemm(a, q, meta, out=out, backend="triton"), dev)
                    if has_gmm:
                        offs = meta.offsets[1:].to(torch.int32)
                        wt = w.transpose(-2, -1)
                        row["grouped_mm_ms"] = timed(lambda: torch._grouped_mm(a, wt, offs=offs), dev)
                    if args.humming:
                        try:
                            row["humming_mxfp4_ms"] = timed(lambda: expert_gemm(a, q, meta, out=out, backend="humming"), dev)
                        except Exception as exc:  # report, keep benchmarking
                            row["humming_error"] = repr(exc)[:200]
                    for key in [k for k in list(row) if k.endswith("_ms")]:
                        ms = row[key]
                        row[key.replace("_ms", "_tflops")] = flops / (ms * 1e-3) / 1e12
                        wb = wbytes(q) if "mxfp4" in key else wbytes(w)
                        row[key.replace("_ms", "_wbw_frac")] = wb / (ms * 1e-3) / ceil["copy_bytes_per_s"]
                    if "grouped_mm_ms" in row:
                        row["ours_vs_grouped_mm"] = row["grouped_mm_ms"] / row["ours_bf16_ms"]
                    if "humming_mxfp4_ms" in row:
                        row["mxfp4_vs_humming"] = row["humming_mxfp4_ms"] / row["ours_mxfp4_ms"]
                    results["rows"].append(row)
                    print_row(row)
                    if not args.no_sweep and L == experts[0]:
                        sweep(results["sweep"], stage, L, r, a, w, q, meta, out, dev, triton_be)
                    del a, out
                for T in slab_set:
                    am = torch.randn(L, T, K, device=dev, dtype=torch.bfloat16)
                    om = torch.empty(L, T, n_out, device=dev, dtype=torch.bfloat16)
                    m100 = masked_meta(L, T, T, dev)
                    full = timed(lambda: expert_gemm(am, w, m100, out=om), dev)
                    m10 = masked_meta(L, T, max(1, T // 10), dev)
                    part = timed(lambda: expert_gemm(am, w, m10, out=om), dev)
                    rec = {"model": model, "stage": stage, "L": L, "T_max": T, "full_ms": full, "valid10_ms": part,
                           "ratio": part / full,
                           "config": kg.pick_config(T, False, args.tiny).short()}
                    if not args.tiny:  # the trade-off of the masked table's BM=64 against the 128-row tile
                        big = kg.TUNED[("bf16", kg.regime(T))]
                        run_big = lambda m: triton_be.gemm(am, w, m, stage=stage, bias=None, out=om, config=big)  # noqa: E731
                        rec["bm128_full_ms"] = timed(lambda: run_big(m100), dev)
                        rec["bm128_valid10_ms"] = timed(lambda: run_big(m10), dev)
                        rec["bm128_config"] = big.short()
                    results["masked"].append(rec)
                    print(f"  masked {model} {stage} L={L} T={T} [{rec['config']}]: full {full:.3f} ms, 10% valid "
                          f"{part:.3f} ms -> {100 * part / full:.1f}% (target <= 15%)"
                          + (f" | {rec['bm128_config']}: full {rec['bm128_full_ms']:.3f} ms, 10% "
                             f"{rec['bm128_valid10_ms']:.3f} ms" if "bm128_config" in rec else ""))
                    del am, om
                del w, q
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    report_sweep(results["sweep"])
    return results


def sweep(store, stage, L, r, a, w, q, meta, out, dev, backend):
    reg = kg.regime(r)
    for kind, wt in (("bf16", w), ("mxfp4", q)):
        key = f"{kind}/{reg}"
        cands = kg.sweep_lists(kind)[reg] if not dev.type == "cpu" else [kg.INTERPRET_CONFIG]
        time_candidates(store, key, cands, dev,
                        lambda cfg: backend.gemm(a, wt, meta, stage=stage, bias=None, out=out, config=cfg))


def time_candidates(store, key, cands, dev, run, check=None):
    """Time `run(cfg)` for each candidate into `store[key][cfg.short()]`; a candidate that fails
    (e.g. out of shared memory for a big tile) is reported and skipped. `check(cfg)`, when given,
    returns None or what is wrong with the candidate's results; a wrong candidate is reported,
    recorded under `store["wrong"]` and never timed, so it cannot win."""
    for cfg in cands:
        try:
            wrong = check(cfg) if check is not None else None
            if wrong is not None:
                print(f"    sweep {key} {cfg.short()}: WRONG RESULTS ({wrong}): excluded")
                store.setdefault("wrong", {}).setdefault(key, []).append(f"{cfg.short()}: {wrong}")
                continue
            ms = timed(lambda: run(cfg), dev)
        except Exception as exc:
            print(f"    sweep {key} {cfg.short()}: failed {type(exc).__name__}: {str(exc)[:120]}")
            continue
        store.setdefault(key, {}).setdefault(cfg.short(), []).append(ms)


def result_error(got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """None when `got` is finite and within 2e-2 relative (Frobenius) error of `want`, else why not."""
    if not bool(torch.isfinite(got).all()):
        return f"{int((~torch.isfinite(got)).sum())} non-finite values"
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
    return None if err <= 2e-2 else f"relative error {err:.3g}"


def report_sweep(store):
    if not store:
        return
    print("\nBlock-config sweep (sum of ms over the swept shapes; lower is better):")
    winners = {}
    for key, by_cfg in sorted(store.items()):
        if key == "wrong":
            continue
        totals = {c: sum(v) for c, v in by_cfg.items()}
        best = min(totals, key=totals.get)
        kind, reg = key.split("/")[:2]  # a third part names the layout timed when it is not INDEXED
        table = kg.TUNED[(kind, reg)].short()
        t_tab = totals.get(table, float("nan"))
        print(f"  {key:16s} winner {best} {totals[best]:.3f} ms | table {table} {t_tab:.3f} ms")
        if len(by_cfg) <= 4:  # a narrowed sweep (--sweep-configs): each candidate shape by shape
            for c, v in by_cfg.items():
                print(f"    {c}: " + " ".join(f"{x:.3f}" for x in v))
        winners[key] = best
    print("  -> update kernels/gemm.py TUNED with the winners above where they differ.")
    store["winners"] = winners


def print_row(row):
    def f(key, fmt="{:.3f}"):
        return fmt.format(row[key]) if key in row else "-"

    print(f"{row['model']:14s} {row['stage']:4s} L={row['L']:4d} rows/e={row['rows_per_expert']:5d} [{row['regime']:7s}] "
          f"ours bf16 {f('ours_bf16_ms')} ms ({f('ours_bf16_tflops', '{:.0f}')} TF, "
          f"wbw {f('ours_bf16_wbw_frac', '{:.0%}')}) | idx {f('ours_bf16_indexed_ms')} | "
          f"mxfp4 {f('ours_mxfp4_ms')} ms (wbw {f('ours_mxfp4_wbw_frac', '{:.0%}')}) | "
          f"grouped_mm {f('grouped_mm_ms')} ms ({f('grouped_mm_tflops', '{:.0f}')} TF, "
          f"wbw {f('grouped_mm_wbw_frac', '{:.0%}')}) ours/gmm {f('ours_vs_grouped_mm', '{:.2f}x')} | "
          f"humming {f('humming_mxfp4_ms')}")


def plot(results, path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    keys = [("ours_bf16_tflops", "ours bf16"), ("ours_bf16_indexed_tflops", "ours bf16 indexed"),
            ("ours_mxfp4_tflops", "ours mxfp4 unprepared"), ("grouped_mm_tflops", "torch._grouped_mm"),
            ("humming_mxfp4_tflops", "humming mxfp4")]
    for ax, stage in zip(axes, ("w13", "w2")):
        for model, L in sorted({(r["model"], r["L"]) for r in results["rows"]}):
            rows = [r for r in results["rows"] if r["stage"] == stage and r["L"] == L and r["model"] == model]
            for key, label in keys:
                pts = [(r["rows_per_expert"], r[key]) for r in rows if key in r]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{label} {model} L={L}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows per expert")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(stage)
        ax.axhline(results["ceilings"]["dense_tflops"], color="k", ls=":", lw=0.8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def write_markdown(results, out: Path, suffix: str) -> None:
    """`gemm.md` for docs/benchmarks.md: one row per stage × L × rows/expert, ceilings in the notes."""
    sys.path.insert(0, str(Path(__file__).parent))
    from _common import device_line, markdown_table

    cols = [("model", "model"), ("stage", "stage"), ("L", "L"), ("rows_per_expert", "rows/expert"),
            ("ours_bf16_ms", "ours bf16 ms"), ("ours_bf16_indexed_ms", "ours bf16 indexed ms"),
            ("ours_mxfp4_ms", "ours mxfp4 unprepared ms"), ("grouped_mm_ms", "torch._grouped_mm ms"),
            ("ours_vs_grouped_mm", "grouped_mm time / ours"), ("ours_bf16_wbw_frac", "ours bf16 weight BW / copy BW"),
            ("ours_bf16_tflops", "ours bf16 TFLOP/s"), ("humming_mxfp4_ms", "humming ms")]
    rows = [[r.get(k, "-") for k, _ in cols] for r in results["rows"]]
    ceilings = results.get("ceilings", {})
    masked = results.get("masked", results.get("masked_10pct", ""))
    text = (f"## Expert GEMMs (spec 03)\n\nDevice: {device_line()}\n\nCeilings measured in this run: {ceilings}. "
            f"Masked 10%-valid vs full slab: {masked}\n\n{markdown_table([c for _, c in cols], rows)}\n\n"
            f"![gemm](gemm.png)\n")
    (out / f"gemm{suffix}.md").write_text(text)


# (model, stage) -> (K in, Nout): w13 = gate and up interleaved (2N rows), w2 = down.
HOPPER_MODELS = {"gpt-oss": (128, 2880, 2880), "dsv4-flash": (256, 4096, 2048)}  # (E, hidden K, N)


# The layouts humming is timed on: (name, suffix of its keys `humming{suffix}_ms` /
# `humming{suffix}_vs_ours`, our prepared default's time on the same layout).
HUMMING_LAYOUTS = (("grouped", "", "hopper4_ms"), ("indexed", "_indexed", "hopper4_indexed_ms"),
                   ("masked", "_masked", "hopper4_masked_ms"))


def time_humming(row, q, ids, E, a, out, am, om, meta, mmeta, want, dev) -> None:
    """humming-kernels on the canonical weights `q`, each of `HUMMING_LAYOUTS` (INDEXED built with
    humming's own row block), each result checked against `want` first, into `row` with its time
    over ours; a failure is recorded under `row["humming_wrong"]`, not raised, so the run goes on."""
    hb = get_backend("humming")
    wrong: dict = {}
    try:
        hmeta = build_layout(GemmLayout.INDEXED, ids, E, block_m=hb.indexed_block_m(q, ids.numel()))
    except Exception as exc:  # report, keep benchmarking
        hmeta, wrong["indexed"] = None, repr(exc)[:200]
    args = {"grouped": (meta, a, out), "indexed": (hmeta, a, out), "masked": (mmeta, am, om)}
    for name, suffix, ours in HUMMING_LAYOUTS:
        m_, a_, o_ = args[name]
        row[f"humming{suffix}_ms"] = None
        if m_ is None:
            continue
        try:
            o_.fill_(float("nan"))
            expert_gemm(a_, q, m_, out=o_, backend="humming")
            bad = result_error(out, want)
            if bad is not None:
                wrong[name] = bad
                continue
            ms = timed(lambda: expert_gemm(a_, q, m_, out=o_, backend="humming"), dev)
        except Exception as exc:  # report, keep benchmarking
            wrong[name] = repr(exc)[:200]
            continue
        row[f"humming{suffix}_ms"] = ms
        row[f"humming{suffix}_vs_ours"] = ms / row[ours]
    row["humming_wrong"] = wrong


def hopper_candidates(args, regime: str, planes: int) -> list:
    """The prepared-MXFP4 sweep's candidates for `regime` that run on the `planes` arrangement,
    narrowed to the short names of `--sweep-configs` when it names any."""
    cands = [kg.INTERPRET_HOPPER_CONFIG] if args.tiny else kg.SWEEP_MXFP4_HOPPER[regime]
    names = [n for n in args.sweep_configs.split(",") if n]
    return [c for c in cands if c.planes_ok(planes) and (not names or c.short() in names)]


def run_hopper(args) -> dict:
    """Prepared MXFP4 (Hopper kernel) vs dot_scaled MXFP4 vs bf16, decode to prefill."""
    dev = torch.device("cpu" if args.tiny else "cuda")
    be = get_backend("triton")
    ceil = ceilings(dev, args.tiny)
    copy_bw = ceil["copy_bytes_per_s"]
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s, dense bf16 {ceil['dense_tflops']:.0f} TFLOP/s")
    models = {"tiny": (4, 96, 64)} if args.tiny else {m: HOPPER_MODELS[m] for m in args.models.split(",")}
    row_set = [int(x) for x in args.rows.split(",")] if args.rows else ([1, 16] if args.tiny else
                                                                       [1, 2, 4, 8, 16, 32, 128, 512, 2048])
    results = {"ceilings": ceil, "hopper_rows": [], "sweep": {}}
    for model, (E, hidden, inter) in models.items():
        for stage, (K, n_out) in (("w13", (hidden, 2 * inter)), ("w2", (inter, hidden))):
            w, q = weight_pair(E, n_out, K, dev)
            # q itself stays canonical (the dot_scaled path); each arrangement named, not defaulted
            qh, qh4 = (Mxfp4Tensor(q.blocks, q.scales).prepare_for(planes=p) for p in (2, 4))
            mx_bytes = wbytes(q)
            for r in row_set:
                meta = contiguous_meta(E, r, dev)
                a = torch.randn(E * r, K, device=dev, dtype=torch.bfloat16)
                out = torch.empty(E * r, n_out, device=dev, dtype=torch.bfloat16)
                ids = (torch.arange(E * r, device=dev, dtype=torch.int32) // r).view(-1, 1)
                # the tiles the GROUPED_CONTIGUOUS columns run (`default_config`, as `launch` picks them)
                cfg, cfg4 = (kg.default_config(dev.type == "cuda", True, wq.hopper, meta.code, 1, r) for wq in (qh, qh4))
                # INDEXED with the row block `fused_experts` picks by default: it caps the kernel tile's BM.
                imeta = build_layout(GemmLayout.INDEXED, ids, E, block_m=default_block_m(E * r, E))
                # ... and with 128-row blocks, which let the tile keep BM 128 (the default takes them from
                # `BLOCK_128_MEAN_ROWS` rows)
                imeta128 = build_layout(GemmLayout.INDEXED, ids, E, block_m=128) if r >= 128 else None
                mmeta = masked_meta(E, r, r, dev)
                am, om = a.view(E, r, K), out.view(E, r, n_out)
                # Reference: the dot_scaled kernel on the canonical weights (another kernel, the same
                # e2m1 values); the prepared kernels, and each sweep candidate, must match it.
                want = expert_gemm(a, q, meta, out=torch.empty_like(out), backend="triton").clone()
                checks = {}
                for name, wt in (("hopper2", qh), ("hopper4", qh4)):
                    out.fill_(float("nan"))
                    checks[name] = result_error(expert_gemm(a, wt, meta, out=out, backend="triton"), want)
                    if checks[name] is not None:
                        print(f"    {name} {model} {stage} rows/e={r}: WRONG RESULTS ({checks[name]})")
                row = {"model": model, "stage": stage, "E": E, "K": K, "N": n_out, "rows_per_expert": r,
                       "regime": kg.regime(r), "hopper2_config": cfg.short(), "hopper4_config": cfg4.short(),
                       "wrong": checks,
                       "hopper2_ms": timed(lambda: expert_gemm(a, qh, meta, out=out, backend="triton"), dev),
                       "hopper4_ms": timed(lambda: expert_gemm(a, qh4, meta, out=out, backend="triton"), dev),
                       "hopper4_indexed_ms": timed(lambda: expert_gemm(a, qh4, imeta, out=out, backend="triton"), dev),
                       "hopper4_masked_ms": timed(lambda: expert_gemm(am, qh4, mmeta, out=om, backend="triton"), dev),
                       "hopper4_indexed128_ms": None if imeta128 is None else timed(
                           lambda: expert_gemm(a, qh4, imeta128, out=out, backend="triton"), dev),
                       "hopper2_indexed_ms": timed(lambda: expert_gemm(a, qh, imeta, out=out, backend="triton"), dev),
                       "hopper2_masked_ms": timed(lambda: expert_gemm(am, qh, mmeta, out=om, backend="triton"), dev),
                       "dot_scaled_ms": timed(lambda: expert_gemm(a, q, meta, out=out, backend="triton"), dev),
                       "bf16_ms": timed(lambda: expert_gemm(a, w, meta, out=out, backend="triton"), dev)}
                if args.humming:
                    time_humming(row, q, ids, E, a, out, am, om, meta, mmeta, want, dev)
                for key in [k for k in list(row) if k.endswith("_ms") and row[k] is not None]:
                    wb = wbytes(w) if key == "bf16_ms" else mx_bytes
                    row[key.replace("_ms", "_wbw_frac")] = wb / (row[key] * 1e-3) / copy_bw
                # Speedups of the default arrangement (4 planes) on GROUPED_CONTIGUOUS, like the others.
                row["hopper4_speedup_vs_dot_scaled"] = row["dot_scaled_ms"] / row["hopper4_ms"]
                row["hopper4_speedup_vs_bf16"] = row["bf16_ms"] / row["hopper4_ms"]
                results["hopper_rows"].append(row)
                idx128 = row["hopper4_indexed128_ms"]
                print(f"{model:10s} {stage:3s} E={E} K={K} N={n_out} rows/e={r:5d} [{row['regime']:7s}] "
                      f"4-plane {row['hopper4_ms']:.3f} ms (wbw {row['hopper4_wbw_frac']:.0%}) "
                      f"[{cfg4.short()}], idx {row['hopper4_indexed_ms']:.3f}, masked "
                      f"{row['hopper4_masked_ms']:.3f}, 128-row blocks {'-' if idx128 is None else f'{idx128:.3f}'}"
                      f" | 2-plane {row['hopper2_ms']:.3f} [{cfg.short()}], idx {row['hopper2_indexed_ms']:.3f}, "
                      f"masked {row['hopper2_masked_ms']:.3f} | dot_scaled {row['dot_scaled_ms']:.3f} ms (wbw "
                      f"{row['dot_scaled_wbw_frac']:.0%}) | bf16 {row['bf16_ms']:.3f} ms (wbw {row['bf16_wbw_frac']:.0%})"
                      f" | 4-plane x{row['hopper4_speedup_vs_dot_scaled']:.2f} vs dot_scaled, "
                      f"x{row['hopper4_speedup_vs_bf16']:.2f} vs bf16")
                if args.humming:
                    print("           humming time / ours (the 4-plane default): " + ", ".join(
                        f"{name} {row[f'humming{sfx}_vs_ours']:.2f}" if f"humming{sfx}_vs_ours" in row else f"{name} -"
                        for name, sfx, _ in HUMMING_LAYOUTS)
                          + ("" if not row["humming_wrong"] else f" | {row['humming_wrong']}"))
                # (metadata, input, output) of each layout, by its name in `--sweep-layouts`, in the
                # order a sweep candidate is checked on them
                on_layout = {"grouped_contiguous": (meta, a, out), "indexed": (imeta, a, out),
                             "grouped_masked": (mmeta, am, om)}
                for planes in ([] if args.no_sweep else [int(x) for x in args.sweep_planes.split(",")]):
                    wq = qh4 if planes == 4 else qh
                    cands = hopper_candidates(args, kg.regime(r), planes)

                    def check(c, wq=wq):
                        for m_, a_, o_ in on_layout.values():
                            o_.fill_(float("nan"))
                            be.gemm(a_, wq, m_, stage=stage, bias=None, out=o_, config=c)
                            wrong = result_error(out, want)
                            if wrong is not None:
                                return f"{m_.layout.value}: {wrong}"
                        return None

                    # Timed on each of `--sweep-layouts` (INDEXED by default: what `fused_experts` runs
                    # unless told otherwise), every candidate checked on all three first.
                    for lay in args.sweep_layouts.split(","):
                        m_, a_, o_ = on_layout[lay]
                        key = f"{kg.table_kind(True, True, planes)}/{kg.regime(r)}" + (
                            "" if lay == "indexed" else f"/{lay}")
                        time_candidates(results["sweep"], key, cands, dev,
                                        lambda c, wq=wq, m_=m_, a_=a_, o_=o_: be.gemm(
                                            a_, wq, m_, stage=stage, bias=None, out=o_, config=c),
                                        check=check)
                del a, out, am, om
            del w, q, qh, qh4
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    report_sweep(results["sweep"])
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/", help="directory for bench_gemm.json / bench_gemm.png")
    p.add_argument("--humming", action="store_true", help="also time humming-kernels (its JIT: about 20 s per configuration)")
    p.add_argument("--no-sweep", action="store_true", help="skip the block-config sweep")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU under the interpreter (dry run)")
    p.add_argument("--stages", help="subset of w13,w2 (default both)")
    p.add_argument("--presets", default="dsv4-flash",
                   help="comma list of presets whose expert shapes to time (padded_moe.presets; default dsv4-flash)")
    p.add_argument("--experts", help="comma list of local expert counts (default 32,128 for dsv4-flash, "
                                     "else the preset's expert count)")
    p.add_argument("--rows", help="comma list of rows per expert (default 8,32,128,512,2048)")
    p.add_argument("--no-masked", action="store_true", help="skip the grouped_masked 10%%-valid slabs")
    p.add_argument("--mxfp4-hopper", action="store_true",
                   help="prepared MXFP4 (Hopper kernel) vs dot_scaled vs bf16 on GPT-OSS / dsv4-flash shapes")
    p.add_argument("--models", default="gpt-oss,dsv4-flash", help="with --mxfp4-hopper: subset of gpt-oss,dsv4-flash")
    p.add_argument("--sweep-layouts", default="indexed",
                   help="with --mxfp4-hopper: the layouts each sweep candidate is timed on (comma list of indexed, "
                        "grouped_contiguous, grouped_masked)")
    p.add_argument("--sweep-configs", default="",
                   help="with --mxfp4-hopper: only the sweep candidates of these short names (comma list, e.g. "
                        "BM16_BN128_BK256_G1_w4_s3_hop_ptx)")
    p.add_argument("--sweep-planes", default="2,4",
                   help="with --mxfp4-hopper: the prepared arrangements to sweep (comma list of 2, 4)")
    args = p.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("bench_gemm needs a CUDA GPU (or --tiny for a CPU dry run)")
    if args.mxfp4_hopper:
        t0 = time.time()
        results = run_hopper(args)
        results["wall_s"] = time.time() - t0
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tag = "tiny" if args.tiny else args.models.replace(",", "_")
        path = out / f"bench_gemm_mxfp4_hopper_{tag}.json"
        path.write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {path} ({results['wall_s']:.0f} s)")
        return
    t0 = time.time()
    results = run(args)
    results["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_tiny" if args.tiny else ""
    (out / f"bench_gemm{suffix}.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out / f'bench_gemm{suffix}.json'} ({results['wall_s']:.0f} s)")
    plot(results, out / f"bench_gemm{suffix}.png")
    if (out / f"bench_gemm{suffix}.png").exists():
        (out / f"gemm{suffix}.png").write_bytes((out / f"bench_gemm{suffix}.png").read_bytes())
    write_markdown(results, out, suffix)


if __name__ == "__main__":
    main()
