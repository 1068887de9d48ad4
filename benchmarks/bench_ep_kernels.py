"""Sweep of the expert-parallel kernels' launch shapes (`padded_moe.ep.tiles.EP_TILES`), one GPU.

    python benchmarks/bench_ep_kernels.py [--tokens 128 1024] [--out DIR]
    TRITON_INTERPRET=1 python benchmarks/bench_ep_kernels.py --tiny    # CPU dry run of the code

Simulates R=2 ranks of the dsv4-flash topology (E=256, k=6, K=4096, bf16) on one GPU: both ranks'
send buffers are packed, rank 0's receive buffer is assembled by copying the chunks (what the
all_to_all would deliver), and each stage of rank 0 is timed alone (median of do_bench) for
every candidate tile: pack, flat and batched receive, both combines, the reduction. The batched
receive is timed together with the zeroing of the expert counts it relies on (the pack kernel
does that in a real dispatch). Prints per stage the best tile against the table's, and the
bytes each stage moves per µs. The table in ep/tiles.py is edited by hand from this output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton.testing  # noqa: E402

from padded_moe import distributed as D
from padded_moe.expert_map import ExpertMap

CANDIDATES = [D.EPTile(r, w) for r in (2, 4, 8, 16, 32) for w in (4, 8)] + \
             [D.EPTile(4, 4, 8), D.EPTile(8, 4, 8), D.EPTile(16, 4, 8), D.EPTile(16, 8, 8)]


def us(fn) -> float:
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3


def build(T: int, K=4096, k=6, E=256, R=2):
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    wire = D.WireFormat(K, k, torch.bfloat16, False)
    geo = D.EPGeometry(R, T, E, wire)
    rows = geo.rows
    owner = D.ExpertParallel._owner_table(E, R, "linear").to(dev)
    ranks = []
    for q in range(R):
        g = torch.Generator(device=dev).manual_seed(7 + q)
        x = torch.randn(T, K, generator=g, device=dev).to(torch.bfloat16)
        ids = torch.rand(T, E, generator=g, device=dev).argsort(1)[:, :k].to(torch.int32)
        w = torch.rand(T, k, generator=g, device=dev)
        raw = torch.empty(rows, wire.buffer_row_bytes, dtype=torch.uint8, device=dev)
        token_rows = torch.full((R, T), rows, dtype=torch.int32, device=dev)
        D.pack_rows(x, ids, w, owner, geo, wire.wire_rows(raw, rows), token_rows, None)
        ranks.append(dict(x=x, ids=ids, w=w, raw=raw, token_rows=token_rows))
    recv_raw = torch.empty_like(ranks[0]["raw"])
    for q in range(R):  # chunk q of rank 0's receive buffer = chunk 0 of rank q's send buffer
        recv_raw[q * T:(q + 1) * T].copy_(ranks[q]["raw"][0:T])
    emap = ExpertMap(E, 0, R, "linear", device=dev)
    L = emap.num_local
    s = dict(dev=dev, geo=geo, wire=wire, rows=rows, owner=owner, r0=ranks[0], recv_raw=recv_raw,
             recv_wire=wire.wire_rows(recv_raw, rows), table=emap.map_for(dev), L=L,
             chunk_counts=torch.zeros(R, dtype=torch.int32, device=dev),
             rb_x=torch.empty(rows, K, dtype=torch.bfloat16, device=dev),
             rb_ids=torch.empty(rows, k, dtype=torch.int32, device=dev),
             rb_w=torch.empty(rows, k, dtype=torch.float32, device=dev),
             rb_valid=torch.zeros(1, dtype=torch.int32, device=dev),
             slab=torch.empty(L * rows + 1, K, dtype=torch.bfloat16, device=dev),
             counts=torch.zeros(L, dtype=torch.int32, device=dev),
             slot_rows=torch.full((rows, k), -1, dtype=torch.int32, device=dev),
             slot_weights=torch.zeros(rows, k, dtype=torch.float32, device=dev),
             comb_send=torch.empty(rows, K, dtype=torch.bfloat16, device=dev),
             comb_recv=torch.randn(rows, K, device=dev).to(torch.bfloat16),
             out=torch.empty(T, K, dtype=torch.bfloat16, device=dev))
    return s


def stages(s) -> dict:
    """stage -> (callable, bytes read + written)."""
    geo, r0, rows, K = s["geo"], s["r0"], s["rows"], s["wire"].hidden_size
    send_wire = s["wire"].wire_rows(r0["raw"], rows)
    row_b = K * 2
    sent = int((r0["token_rows"] < rows).sum())
    # Fill the receive side once so combine has real counts and slot rows to work with.
    D.receive_flat(geo, s["recv_wire"], s["chunk_counts"], True, s["rb_x"], s["rb_ids"], s["rb_w"], s["rb_valid"])
    s["counts"].zero_()
    D.receive_batched(geo, s["recv_wire"], s["chunk_counts"], True, s["table"], s["L"], s["slab"], s["counts"],
                      s["slot_rows"], s["slot_weights"])
    valid = int(s["rb_valid"])
    pairs = int(s["counts"].sum())
    slab3 = s["slab"][: s["L"] * rows].view(s["L"], rows, K)

    def recv_batched():
        s["counts"].zero_()
        D.receive_batched(geo, s["recv_wire"], s["chunk_counts"], True, s["table"], s["L"], s["slab"],
                          s["counts"], s["slot_rows"], s["slot_weights"])

    return {
        "pack": (lambda: D.pack_rows(r0["x"], r0["ids"], r0["w"], s["owner"], geo, send_wire, r0["token_rows"], None),
                 2 * sent * row_b),
        "recv_flat": (lambda: D.receive_flat(geo, s["recv_wire"], s["chunk_counts"], True, s["rb_x"], s["rb_ids"],
                                             s["rb_w"], s["rb_valid"]), 2 * valid * row_b),
        "recv_batched": (recv_batched, (valid + pairs) * row_b),
        "combine_flat": (lambda: D.combine_flat_rows(geo, s["chunk_counts"], s["rb_x"], s["comb_send"]),
                         2 * valid * row_b),
        "combine_batched": (lambda: D.combine_batched_rows(geo, s["chunk_counts"], True, s["slot_rows"],
                                                           s["slot_weights"], slab3, s["comb_send"]),
                            (valid + pairs) * row_b),
        "reduce": (lambda: D.reduce_partials(geo, s["comb_recv"], r0["token_rows"], geo.max_tokens, s["out"]),
                   (sent + geo.max_tokens) * row_b),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--out", default=None, help="directory for bench_ep_kernels.json")
    p.add_argument("--tiny", action="store_true", help="CPU dry run (interpreter, small shapes, 2 tiles)")
    args = p.parse_args()
    shape = dict(K=64, k=2, E=16) if args.tiny else {}
    if args.tiny:
        args.tokens = [16]
        CANDIDATES[2:] = []
    table = dict(D.EP_TILES)
    results = []
    for T in args.tokens:
        s = build(T, **shape)
        for stage, (fn, nbytes) in stages(s).items():
            times = {}
            for tile in [table[stage]] + [c for c in CANDIDATES if c != table[stage]]:
                D.EP_TILES[stage] = tile
                try:
                    times[tile] = us(fn)
                except Exception as exc:  # report and go on (e.g. too many registers)
                    print(f"  {stage} {tile}: failed {type(exc).__name__}: {exc}"[:200])
            # The first timing of a stage can run before the clocks ramp up: time the table's tile
            # again last and keep its faster measurement.
            D.EP_TILES[stage] = table[stage]
            times[table[stage]] = min(times[table[stage]], us(fn))
            best = min(times, key=times.get)
            rec = dict(T=T, stage=stage, all_us={str(t): v for t, v in times.items()},
                       table=str(table[stage]), table_us=times[table[stage]], best=str(best),
                       best_us=times[best], gb_per_s_best=nbytes / (times[best] * 1e-6) / 1e9)
            results.append(rec)
            print(f"T={T:5d} {stage:16s} table {table[stage]} {times[table[stage]]:7.1f} µs | best {best} "
                  f"{times[best]:7.1f} µs ({rec['gb_per_s_best']:.0f} GB/s)", flush=True)
        del s
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_ep_kernels.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
