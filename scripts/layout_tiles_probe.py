"""Probe (issues 12, 14): why an expert GEMM on GROUPED_CONTIGUOUS took longer than on INDEXED under
routed (uneven) counts at decode-to-small sizes, though it was faster with equal counts (prepared
MXFP4, or bf16 with `--weights bf16`).

Routes `tokens` tokens with top-k of random logits (counts scatter around the mean as in a model),
builds each layout from the same ids, and times each GEMM alone (`triton.testing.do_bench`, L2
flushed between calls) for: INDEXED with `fused_experts`' default row block, GROUPED_CONTIGUOUS and
GROUPED_MASKED with the default tile (slabs as large as the largest count, and `--capacity` times
that: the room a batched receive buffer has, run with the tile of its expected rows and with the
tile of its capacity, what it runs without `expected_m`; each masked case also as persistent
programs over the tiles with rows and as one program per tile, the two ways
`kernels.gemm.grouped_walks` chooses between), GROUPED_CONTIGUOUS in a flat buffer with room for
`--capacity` times the tokens (ids -1 past `valid_tokens`, as an expert-parallel receive buffer)
without and with `expected_m`, and the grouped layouts with the tiles named in `--tiles` (short
names, e.g. BM64_BN128_BK64_G4_w4_s4_hop_ptx_half). Prints the m-tiles with rows each
variant computes (from the counts) next to its time, and each output's largest difference from
INDEXED's relative to INDEXED's largest value (same weights, same routed rows, fp32 accumulation);
exits 1 after the tables if any exceeds `TOL`.

    python3 scripts/layout_tiles_probe.py --presets gpt-oss-120b --tokens 1024
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch
import triton

from padded_moe.backends import get_backend
from padded_moe.kernels import gemm as kg
from padded_moe.layouts import GemmLayout, build_layout, default_block_m
from padded_moe.presets import get_preset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_gemm import weight_pair  # noqa: E402

TOL = 2.0**-7  # one bf16 rounding of the largest output


def tiles_by_name() -> dict:
    """The prepared-MXFP4 and bf16 sweep candidates and table entries by short name, and each of
    those with BM 64 and with `half_tail` toggled."""
    base = [c for table in (kg.SWEEP_MXFP4_HOPPER, kg.SWEEP) for cands in table.values() for c in cands]
    base += [c for (kind, _), c in kg.TUNED.items() if kind.startswith("mxfp4_hopper") or kind == "bf16"]
    out = {}
    for c in base:
        for v in (c, dataclasses.replace(c, BM=64)):
            for w in (v, dataclasses.replace(v, half_tail=not v.half_tail)):
                out[w.short()] = w
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="gpt-oss-120b,dsv4-flash", help="comma list of padded_moe.presets names")
    p.add_argument("--tokens", default="1024")
    p.add_argument("--weights", default="mxfp4", choices=("mxfp4", "bf16"))
    p.add_argument("--tiles", default="", help="comma list of tile short names also run on the grouped layouts")
    p.add_argument("--capacity", type=int, default=4,
                   help="roomy buffers: masked slabs this many times the largest count, a flat buffer this many "
                        "times the tokens")
    args = p.parse_args()
    torch.manual_seed(0)
    be = get_backend("triton")
    named = tiles_by_name()
    unknown = [n for n in args.tiles.split(",") if n and n not in named]
    if unknown:
        raise SystemExit(f"--tiles: unknown {unknown}; known: {sorted(named)}")
    extra = [named[n] for n in args.tiles.split(",") if n]
    bad = []
    mx = args.weights == "mxfp4"
    for model in args.presets.split(","):
        pre = get_preset(model)
        E, k = pre.num_experts, pre.top_k
        for stage, (K, n_out) in (("w13", (pre.hidden_size, pre.w13_rows)),
                                  ("w2", (pre.intermediate_size, pre.hidden_size))):
            w, q = weight_pair(E, n_out, K, torch.device("cuda"))
            q = q.prepare_for() if mx else w
            for T in (int(t) for t in args.tokens.split(",")):
                logits = torch.randn(T, E, device="cuda")
                ids = logits.topk(k, dim=-1).indices.to(torch.int32)
                counts = torch.bincount(ids.flatten().long(), minlength=E)
                mean = T * k / E
                x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
                imeta = build_layout(GemmLayout.INDEXED, ids, E)
                cmeta = build_layout(GemmLayout.GROUPED_CONTIGUOUS, ids, E)
                t_max = int(counts.max())
                mmeta = build_layout(GemmLayout.GROUPED_MASKED, ids, E, max_tokens_per_expert=t_max,
                                     drop_overflow=True)  # t_max is the largest count: nothing drops
                cap = args.capacity * t_max
                rmeta = build_layout(GemmLayout.GROUPED_MASKED, ids, E, max_tokens_per_expert=cap,
                                     drop_overflow=True)
                cap_tile = kg.default_config(True, mx, q.hopper if mx else None, rmeta.code, 1, cap, cap)
                # A flat receive buffer with room for `capacity` times the tokens: the same routes, then
                # rows of -1 ids past `valid_tokens`; without and with `expected_m` (the mean).
                pad_ids = torch.full((args.capacity * T, k), -1, device="cuda", dtype=torch.int32)
                pad_ids[:T] = ids
                vt = torch.tensor([T], device="cuda", dtype=torch.int32)
                pmeta = build_layout(GemmLayout.GROUPED_CONTIGUOUS, pad_ids, E, valid_tokens=vt)
                hmeta = build_layout(GemmLayout.GROUPED_CONTIGUOUS, pad_ids, E, valid_tokens=vt,
                                     expected_m=math.ceil(mean))
                # Slot s routes token s // k: w13 reads token rows (INDEXED gathers them by slot // k),
                # w2 slot rows; the grouped layouts read the slot rows at their permuted places.
                src = x.repeat_interleave(k, dim=0)
                a_idx = x if stage == "w13" else src
                ref = torch.empty(T * k, n_out, device="cuda", dtype=torch.bfloat16)
                be.gemm(a_idx, q, imeta, stage=stage, bias=None, out=ref)
                cases = [("indexed", imeta, a_idx, None, None)]
                for name, meta in (("contiguous", cmeta), (f"contiguous x{args.capacity}", pmeta),
                                   (f"contiguous x{args.capacity}, expected_m", hmeta), ("masked", mmeta),
                                   (f"masked x{args.capacity}", rmeta)):
                    a = torch.zeros(meta.rows_shape(K), device="cuda", dtype=torch.bfloat16)
                    a.view(-1, K)[rows_of(meta, T * k)] = src
                    cases.append((name, meta, a, None, None))
                    if meta.code == GemmLayout.GROUPED_MASKED.code:  # kg.MASKED_WALK forced on and off
                        cases.append((f"{name}, walk", meta, a, None, True))
                        cases.append((f"{name}, one program per tile", meta, a, None, False))
                    if meta is rmeta:
                        cases.append((f"{name}, capacity's tile", meta, a, cap_tile, None))
                    cases += [(f"{name} {c.short()}", meta, a, c, None) for c in extra]
                print(f"\n{model} {stage} T={T} mean rows {mean:.1f} (min {int(counts.min())}, max {t_max}); "
                      f"INDEXED block {default_block_m(T * k, E)}")
                base = None
                for name, meta, a, cfg, walk in cases:
                    kg.MASKED_WALK = walk
                    out = torch.full(meta.gemm_out_shape(a, stage, n_out), float("nan"), device="cuda",
                                     dtype=torch.bfloat16)
                    run = lambda: be.gemm(a, q, meta, stage=stage, bias=None, out=out, config=cfg)  # noqa: E731
                    run()
                    got = out.view(-1, n_out)[rows_of(meta, T * k)] if name != "indexed" else out
                    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    if not err <= TOL:  # NaN fails too
                        bad.append(f"{model} {stage} T={T} {name}: {err:.1e}")
                    ms = triton.testing.do_bench(run, warmup=10, rep=60)
                    base = base or ms
                    used = cfg or kg.default_config(True, mx, q.hopper if mx else None, meta.code,
                                                    getattr(meta, "block_m", 1), meta.rows_per_expert(),
                                                    getattr(meta, "max_tokens_per_expert", None))
                    live = "-" if name == "indexed" else int(sum(math.ceil(int(c) / used.BM) for c in counts))
                    if name != "indexed" and walk is None:  # the default: kg.grouped_walks' choice
                        grid_m = kg.grouped_grid_m(meta.code, a.view(-1, K).shape[0], E,
                                                   getattr(meta, "max_tokens_per_expert", 1), used.BM)
                        name += " (walks)" if kg.grouped_walks(used, mx, grid_m, E, meta.rows_per_expert()) else ""
                    print(f"  {name:<48} {ms * 1e3:8.1f} us  x{ms / base:5.3f}  tile {used.short():<40} "
                          f"m-tiles with rows {live:>5}  max rel err {err:.1e}")
    if bad:
        raise SystemExit("outputs differ from INDEXED's by more than TOL:\n" + "\n".join(bad))


def rows_of(meta, S: int) -> torch.Tensor:
    """The permuted row of each slot (slot order) for a grouped layout."""
    return meta.inv.view(-1)[:S].long()


if __name__ == "__main__":
    main()
