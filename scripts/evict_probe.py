"""Probe: do weight loads marked L2 evict-first spare the write-back of dirty lines a call finds in L2?

`triton.testing.do_bench` (every benchmark here, the peers' harness included) clears L2 before each
call with a 256 MB memset, so a timed call starts with L2 full of dirty lines, and a decode call's
weight stream evicts them: their write-back shares the DRAM with the weight reads (notes: run 147,
87.7 us after the memset against 78.7 after a read-only flush, DeepSeek-V4 bf16, one token). Loads
with an evict-first L2 priority should take the place of each other, not of the dirty lines.
Triton 3.6 keeps the hint only on loads it does not pipeline (cp.async and TMA loads drop it), so
the probe times a pure streaming read of S MB (plain loads, one stage), normal vs evict-first, after
the memset (do_bench) and after a read-only flush. notes.md (session 62) has what it showed and what
the decode kernels at one stage, where they could carry the hint, cost.

    PYTHONPATH=src python3 scripts/evict_probe.py [--sizes 32,100,300]

Not part of the library.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import bench_us, captured, copy_bandwidth_gbs, write_json  # noqa: E402
from decode_cold_probe import clean_flush_us  # noqa: E402


@triton.jit
def _read_kernel(x_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    base = x_ptr + tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(0, CHUNK, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK), eviction_policy=EVICT).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def pure_reads(sizes_mb, flush, copy) -> list:
    rows = []
    sums = torch.empty(1 << 16, device="cuda", dtype=torch.float32)
    for mb in sizes_mb:
        x = torch.randn(int(mb * (1 << 20)) // 2, device="cuda", dtype=torch.bfloat16)
        block = 2048
        if x.numel() % block:
            raise ValueError(f"--sizes: {mb} MB is not a whole number of {2 * block}-byte blocks")
        programs = 2048
        while x.numel() % (programs * block):
            programs //= 2
        chunk = x.numel() // programs
        for evict in ("", "evict_first"):
            def run(evict=evict):
                _read_kernel[(programs,)](x, sums, CHUNK=chunk, BLOCK=block, EVICT=evict, num_warps=4,
                                          num_stages=1)

            run()
            g, _ = captured(run)
            memset = bench_us(g.replay)
            clean = clean_flush_us(g, flush)
            floor = x.nbytes / copy * 1e6
            rows.append({"MB": mb, "evict": evict or "normal", "after_memset_us": round(memset, 2),
                         "after_read_us": round(clean, 2), "copy_floor_us": round(floor, 2)})
            print(f"pure read {mb} MB {evict or 'normal':12s} after memset {memset:8.2f} us, after read {clean:8.2f}"
                  f" us (copy floor {floor:.2f})", flush=True)
            del g
        del x
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="32,100,300")
    p.add_argument("--out", default="gpu-out/evict.json")
    args = p.parse_args()
    copy = copy_bandwidth_gbs() * 1e9
    print(f"{torch.cuda.get_device_name()} copy bandwidth {copy / 1e12:.2f} TB/s", flush=True)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda").view(torch.float32).normal_()
    report = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy,
              "pure": pure_reads([float(s) for s in args.sizes.split(",") if s], flush, copy)}
    write_json(args.out, report)


if __name__ == "__main__":
    main()
