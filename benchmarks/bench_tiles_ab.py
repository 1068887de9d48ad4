"""Tile candidates compared on whole routed-experts calls, in alternating rounds.

`bench_gemm.py`'s sweep times each candidate once on uniform rows per expert; between sweeps a
minute apart the same tile moved by up to 8% on the H200, as much as the differences a table
decision rests on. This benchmark decides between a few candidates for one regime the way a user
sees them: `FusedMoE.experts` on a preset's shape with its own router's routing, each candidate's
call captured in a CUDA graph, and the replays of all candidates timed in turn, round after round,
so drift hits every candidate alike. Each candidate's output is checked against the table entry's
first (relative L2 difference at most 2e-2; a wrong tile is off by O(1)).

    python benchmarks/bench_tiles_ab.py --preset gpt-oss-120b --weights mxfp4 --tokens 128 \
        --regime decode --candidates BM32_BN128_BK128_G1_w4_s3_hop_ptx,BM32_BN128_BK256_G1_w4_s4_hop_ptx

The candidates replace `TUNED[(kind, regime)]` (kind: the table the call's weights use), and
`TUNED_NARROW`'s entry where it has one, for their turn; `--candidates sweep`
takes every sweep candidate of that regime, `--candidates persistent` the table entry with
`GemmConfig.persistent` flipped (in the narrow-block entry too), `--candidates half` the same with
`GemmConfig.half_tail`, and any other tile may be named by
its short name (e.g. BM256_BN128_BK64_G8_w8_s3_hop_ptx). A name ending in `@B` runs with INDEXED row
blocks of B rows (a power of two) in place of `fused_experts`' default block, so a wider tile can
take a whole block. `--fuse-activation both` times each candidate also with the activation in
GEMM1's epilogue forced on and forced off. `--planes both` (prepared MXFP4) adds the same weights
in the 2-plane arrangement (`prepare_for(planes=2)`) with that arrangement's table entry. Calls
whose GEMMs run another regime are not affected: the table printed first gives each
token count's regime.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_us, captured, print_table, random_layer, write_report  # noqa: E402

from padded_moe import experts as ex  # noqa: E402
from padded_moe import layouts  # noqa: E402
from padded_moe.gemm import FUSE_ENV  # noqa: E402
from padded_moe.kernels import gemm as kg  # noqa: E402
from padded_moe.layer import FusedMoE  # noqa: E402
from padded_moe.layouts import GemmLayout, build_layout_resolved  # noqa: E402
from padded_moe.mxfp4 import Mxfp4Tensor  # noqa: E402


def candidate_pool(kind: str) -> dict:
    """Every config the sweep lists and tables know for `kind`, and each one's persistent form
    (`GemmConfig.persistent`, short name ending in `_pers`), by short name."""
    pool = {c.short(): c for cands in kg.sweep_lists(kind).values() for c in cands}
    pool.update({c.short(): c for (k, _), c in list(kg.TUNED.items()) + list(kg.TUNED_NARROW.items()) if k == kind})
    twins = [dataclasses.replace(c, persistent=not c.persistent) for c in pool.values()]
    pool.update({c.short(): c for c in twins})
    return pool


def parse_candidate(name: str, pool: dict) -> tuple[kg.GemmConfig, Optional[int]]:
    """(config, INDEXED row block or None for the default) of a `--candidates` entry `NAME[@B]`."""
    base, _, block = name.partition("@")
    try:
        cfg = pool[base] if base in pool else kg.GemmConfig.from_short(base)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not block:
        return cfg, None
    if not block.isdigit() or int(block) < 16 or int(block) & (int(block) - 1):
        raise SystemExit(f"row block in {name!r} must be a power of two >= 16")
    return cfg, int(block)


@contextlib.contextmanager
def indexed_block(block: Optional[int]):
    """INDEXED layouts built inside the block use row blocks of `block` rows (None: the default)."""
    if block is None:
        yield
        return
    with mock.patch.object(layouts, "default_block_m", lambda num_slots, num_local: block):
        yield


def indexed_regime(tokens: int, top_k: int, num_experts: int) -> tuple[float, int, str]:
    """(mean rows per expert, row block, regime) of `fused_experts`' default INDEXED metadata for a
    call of `tokens` tokens, from the layout builder itself."""
    ids = torch.zeros(tokens, top_k, dtype=torch.int32)
    meta = build_layout_resolved(GemmLayout.INDEXED, ids, num_experts, num_experts, None)
    return tokens * top_k / num_experts, meta.block_m, kg.regime(meta.rows_per_expert())


def table_kind_of(w13) -> str:
    """The `TUNED` kind the layer's GEMM1 weight picks (bf16, dot_scaled MXFP4 or prepared)."""
    hopper = getattr(w13, "hopper", None)
    return kg.table_kind(isinstance(w13, Mxfp4Tensor), hopper is not None, 2 if hopper is None else hopper.planes)


# Config fields that change how a tile runs, not the tile: a table entry with other switches keeps
# each entry's own tile (`table_entry`).
SWITCHES = ("persistent", "half_tail", "dynamic")


@contextlib.contextmanager
def table_entry(key: tuple, cfg: kg.GemmConfig):
    """`cfg` in place of the table entry `key` (and of its narrow-block entry, where there is one),
    with launch plans off so that every call picks its config afresh; all restored on exit. The
    table entry itself leaves the tables as they are; the table entry with other `SWITCHES`
    (`GemmConfig.persistent`, `half_tail`, `dynamic`) changes only the switches that differ, in each
    entry, so a narrow-block entry keeps its own tile."""
    tables = [t for t in (kg.TUNED, kg.TUNED_NARROW) if key in t]
    saved = [t[key] for t in tables]
    plans = ex._launch_plans()
    same = cfg == kg.TUNED[key]
    switches = {f: getattr(cfg, f) for f in SWITCHES if getattr(cfg, f) != getattr(kg.TUNED[key], f)}
    twin = dataclasses.replace(kg.TUNED[key], **switches) == cfg
    for t in tables if not same else ():
        t[key] = dataclasses.replace(t[key], **switches) if twin else cfg
    plans.enabled = False
    try:
        yield
    finally:
        for t, old in zip(tables, saved):
            t[key] = old
        plans.enabled = True


def two_plane_twin(weights: dict) -> dict:
    """The layer's prepared MXFP4 weights (`{"w13": q, "w2": q}`) again, prepared in the 2-plane
    arrangement: the same canonical bytes, a second `HopperMxfp4`."""
    return {name: Mxfp4Tensor(q.blocks, q.scales).prepare_for(planes=2) for name, q in weights.items()}


@contextlib.contextmanager
def layer_weights(layer: FusedMoE, weights):
    """`layer`'s prepared MXFP4 weights replaced by `weights` (None: as they are) inside the block,
    restored after; a graph captured inside keeps the weights it captured."""
    saved = dict(layer._mxfp4)
    if weights is not None:
        layer._mxfp4.update(weights)
    try:
        yield
    finally:
        layer._mxfp4.clear()
        layer._mxfp4.update(saved)


def fuse_activation(value):
    """`PADDED_MOE_FUSE_ACTIVATION` set to `value` (None: as it is) inside the block, restored after:
    it is read when `fused_experts` launches, so a graph keeps what it captured."""
    return mock.patch.dict(os.environ, {} if value is None else {FUSE_ENV: value})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt-oss-120b")
    p.add_argument("--weights", default="mxfp4", choices=("bf16", "mxfp4"))
    p.add_argument("--tokens", default="128", help="comma list of token counts")
    p.add_argument("--regime", required=True, choices=("decode", "small", "medium", "prefill"))
    p.add_argument("--candidates", required=True,
                   help="comma list of config short names, 'sweep', 'persistent' (the table entry's other "
                        "persistence) or 'half' (the table entry with GemmConfig.half_tail flipped)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fuse-activation", default="table", choices=("table", "both"),
                   help="'both': each candidate also with the activation in GEMM1's epilogue forced "
                        f"({FUSE_ENV}=1) and forced off ({FUSE_ENV}=0)")
    p.add_argument("--planes", default="table", choices=("table", "both"),
                   help="'both' (prepared MXFP4): also the weights in the 2-plane arrangement with its table entry")
    p.add_argument("--out", default="bench-out/tiles-ab")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_tiles_ab times CUDA graphs: it needs a GPU")
    t0 = time.time()
    layer = random_layer(args.preset, args.weights)
    w13, _ = layer.expert_weights()
    kind = table_kind_of(w13)
    prepared = getattr(w13, "hopper", None)
    key = (kind, args.regime)
    if key not in kg.TUNED:
        raise SystemExit(f"no table entry {key}")
    table = kg.TUNED[key]
    pool = candidate_pool(kind)
    if args.candidates == "sweep":
        names = [c.short() for c in kg.sweep_lists(kind)[args.regime]]
    elif args.candidates in ("persistent", "half"):
        field = "persistent" if args.candidates == "persistent" else "half_tail"
        names = [dataclasses.replace(table, **{field: not getattr(table, field)}).short()]
    else:
        names = [n.strip() for n in args.candidates.split(",") if n.strip()]
    # (config, INDEXED block or None), the table entry at the default block first
    picked = [(table, None)] + [c for c in (parse_candidate(n, pool) for n in names) if c != (table, None)]
    if prepared is not None:
        picked = [(c, b) for c, b in picked if c.planes_ok(prepared.planes)]

    fuse_settings = [None] if args.fuse_activation == "table" else [None, "1", "0"]
    # (table key, config, fuse setting, weights in place of the layer's or None, INDEXED block, name suffix)
    variants = [(key, cfg, fuse, None, block, "" if block is None else f"@{block}")
                for cfg, block in picked for fuse in fuse_settings]
    if args.planes == "both":
        if kind != "mxfp4_hopper4":
            raise SystemExit(f"--planes both needs prepared 4-plane MXFP4 weights, the layer's are {kind}")
        key2 = ("mxfp4_hopper", args.regime)
        twin = two_plane_twin(layer._mxfp4)
        variants += [(key2, kg.TUNED[key2], fuse, twin, None, " planes=2") for fuse in fuse_settings]
    regimes = []
    for T in (int(t) for t in args.tokens.split(",")):
        mean, block, reg = indexed_regime(T, layer.top_k, layer.num_experts)
        regimes.append([T, round(mean, 1), block, reg])
    print_table(f"{args.preset} {args.weights}: INDEXED regime per token count", ["T", "mean rows", "block",
                                                                                  "regime"], regimes)

    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for T, _, _, reg in regimes:
        x = torch.randn(T, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        tw, ids = layer.route(layer.gate(x), None)
        call = lambda: layer.experts(x, tw, ids)  # noqa: E731
        graphs, ref = [], None
        for vkey, cfg, fuse, weights, block, suffix in variants:
            with table_entry(vkey, cfg), fuse_activation(fuse), layer_weights(layer, weights), indexed_block(block):
                graph, out = captured(call)
                graph.replay()
            torch.cuda.synchronize()
            ref = out.clone() if ref is None else ref
            diff = ((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()
            ok = bool(torch.isfinite(out).all()) and diff <= 2e-2
            name = cfg.short() + suffix + ("" if fuse is None else f" {FUSE_ENV}={fuse}")
            graphs.append((name, graph if ok else None, diff))
        times: dict = {name: [] for name, _, _ in graphs}
        for _ in range(args.rounds):
            for name, graph, _ in graphs:
                if graph is not None:
                    times[name].append(bench_us(graph.replay, warmup_ms=10, rep_ms=100))
        base = statistics.median(times[table.short()])
        for name, graph, diff in graphs:
            ts = times[name]
            med = statistics.median(ts) if ts else float("nan")
            rows.append([T, reg, name + (" (table)" if name == table.short() else ""),
                         round(med, 1), round(min(ts), 1) if ts else float("nan"),
                         round(med / base, 3), f"{diff:.1e}", "ok" if graph is not None else "WRONG"])
        del graphs
        torch.cuda.empty_cache()
    headers = ["T", "regime", "config", "median us", "min us", "vs table", "rel diff", "check"]
    print_table(f"{args.preset} {args.weights}, {args.regime} candidates, {args.rounds} alternating rounds "
                "(graph replay of FusedMoE.experts)", headers, rows)
    write_report(args.out, "bench_tiles_ab", "Tile candidates on whole calls, alternating rounds",
                 f"{args.preset} {args.weights}, regime {args.regime}: each candidate replaces TUNED[{key}] for "
                 "its turn; CUDA-graph replays timed in turn, round after round.",
                 headers, rows, extra={"regimes": regimes, "wall_s": time.time() - t0})
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
