"""Benchmark of spec 02's layout building, permute and unpermute on a GPU.

Shape: M=4096 tokens, k=8, E=128 experts, K=4096, bf16 (override with flags). For every layout:
`build_layout + permute` (INDEXED: build only; GEMM1 gathers on load) against one device copy of
the M*k*K permuted bytes, and `unpermute` against the ideal time of reading M*k*K + writing M*K
at the copy's bandwidth, both measured in this run. Eager (with a PermuteScratch, so no
allocation) and CUDA-graph replay (launch gaps removed). Targets: ratio <= 1.3 for both.

    python benchmarks/bench_permute.py --out docs/
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import bar_plot, bench_graph_us, bench_us, print_table, write_report  # noqa: E402

from padded_moe.layouts import GemmLayout, PermuteScratch, build_layout, permute, unpermute  # noqa: E402


def routed_ids(M: int, E: int, k: int) -> torch.Tensor:
    """Distinct experts per token, uniform over experts (a balanced router)."""
    return torch.rand(M, E, device="cuda").topk(k, dim=1).indices.to(torch.int32)


def run(args) -> tuple[list, dict]:
    M, k, E, K = args.M, args.k, args.E, args.K
    dtype = torch.bfloat16
    S = M * k
    elem = torch.tensor([], dtype=dtype).element_size()
    ids = routed_ids(M, E, k)
    hidden = torch.randn(M, K, device="cuda", dtype=dtype)
    weights = torch.rand(M, k, device="cuda")
    out = torch.empty(M, K, device="cuda", dtype=dtype)
    T = args.T if args.T else 2 * (S // E + 1)  # twice the balanced load: no overflow on random routes
    scratch = PermuteScratch(M, k, E, E, "cuda", block_m=args.block_m, max_tokens_per_expert=T,
                             hidden_size=K, dtype=dtype)

    src = torch.randn(S * K, device="cuda", dtype=dtype)
    dst = torch.empty_like(src)
    t_copy = bench_us(lambda: dst.copy_(src))
    copy_bytes = S * K * elem
    bw = 2 * copy_bytes / (t_copy * 1e-6)  # bytes read + written per second
    t_unperm_ideal = (S * K + M * K) * elem / bw * 1e6

    rows, extra = [], {"M": M, "k": k, "E": E, "K": K, "T_max": T, "block_m": args.block_m,
                       "copy_us": t_copy, "copy_GBps": bw / 1e9, "unpermute_ideal_us": t_unperm_ideal}
    for layout in GemmLayout:
        def build_and_permute(layout=layout):
            return permute(hidden, build_layout(layout, ids, E, scratch=scratch, drop_overflow=True))

        # A T_max below M*k is an explicit capacity (overflow is reported below), hence drop_overflow.
        meta = build_layout(layout, ids, E, scratch=scratch, drop_overflow=True)
        y = build_and_permute() if layout != GemmLayout.INDEXED else torch.randn(S, K, device="cuda", dtype=dtype)
        if layout == GemmLayout.GROUPED_MASKED:
            extra["masked_overflow"] = int(meta.overflow)
        t_bp = bench_us(build_and_permute)
        t_bp_graph = bench_graph_us(build_and_permute)
        t_build = bench_us(lambda: build_layout(layout, ids, E, scratch=scratch, drop_overflow=True))
        t_un = bench_us(lambda: unpermute(out, y, weights, meta))
        t_un_graph = bench_graph_us(lambda: unpermute(out, y, weights, meta))
        rows.append([layout.value, t_build, t_bp, t_bp_graph, t_bp / t_copy, t_bp_graph / t_copy,
                     t_un, t_un_graph, t_un / t_unperm_ideal, t_un_graph / t_unperm_ideal])
    return rows, extra


HEADERS = ["layout", "build us", "build+permute us", "b+p graph us", "b+p / copy", "b+p graph / copy",
           "unpermute us", "unperm graph us", "unperm / ideal", "unperm graph / ideal"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--M", type=int, default=4096)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--E", type=int, default=128)
    ap.add_argument("--K", type=int, default=4096)
    ap.add_argument("--T", type=int, default=0, help="GROUPED_MASKED T_max (default 2x balanced load)")
    ap.add_argument("--block-m", type=int, default=64)
    ap.add_argument("--out", default="docs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_permute needs a CUDA GPU")
    rows, extra = run(args)
    title = f"Layouts: build+permute and unpermute, M={args.M} k={args.k} E={args.E} K={args.K} bf16"
    print(f"copy of M*k*K bf16: {extra['copy_us']:.1f} us ({extra['copy_GBps']:.0f} GB/s read+write); "
          f"unpermute ideal {extra['unpermute_ideal_us']:.1f} us")
    print_table(title, HEADERS, rows)
    notes = (f"copy of the M*k*K permuted bytes: {extra['copy_us']:.1f} us ({extra['copy_GBps']:.0f} GB/s "
             f"read+write). unpermute ideal = (M*k*K + M*K) bytes at that rate = {extra['unpermute_ideal_us']:.1f} us. "
             "Target: both ratios <= 1.3. Eager runs use a PermuteScratch (no allocation); 'graph' is one "
             "CUDA-graph replay.")
    write_report(args.out, "bench_permute", title, notes, HEADERS, rows, extra)
    bar_plot(args.out, "bench_permute", title, [r[0] for r in rows],
             {"build+permute / copy": [r[4] for r in rows], "b+p graph / copy": [r[5] for r in rows],
              "unpermute / ideal": [r[8] for r in rows], "unperm graph / ideal": [r[9] for r in rows]},
             "time ratio (target <= 1.3)")
    print(f"wrote {args.out}/bench_permute.{{md,json,png}}")


if __name__ == "__main__":
    main()
