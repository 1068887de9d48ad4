"""Probe: programmatic dependent launch (PDL) between two dependent weight-streaming kernels.

A decode-sized MoE call is two weight-streaming GEMVs in a row (GEMM1 then GEMM2), and at one
token a fixed per-call cost (kernel ramp, tail, launch gap) is a large part of its time. With PDL
the second kernel is launched while the first drains (`launch_pdl=True`; the first kernel's
programs call `gdc_launch_dependents`), and it may read what does not depend on the first (its
own weights) before `gdc_wait`. This probe measures, on the GPU and inside a CUDA graph captured
by torch, what that saves on Qwen3-MoE-like decode sizes, and checks that the second kernel
still sees the first one's output (the buffer between them is poisoned before every pair).

    PYTHONPATH=src python3 scripts/pdl_probe.py [--pairs 50] [--replays 20]

Not part of the library: it answers whether the decode path should launch this way.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _gemv_a(w_ptr, x_ptr, y_ptr, K, BN: tl.constexpr, BK: tl.constexpr, TRIGGER: tl.constexpr):
    """y[rows] = w[rows] @ x (the first kernel: GEMM1-like)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros((BN,), tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :])
        acc += tl.sum(w.to(tl.float32) * tl.load(x_ptr + rk).to(tl.float32)[None, :], 1)
    if TRIGGER:
        gdc_launch_dependents()
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty))


@triton.jit
def _gemv_b(w_ptr, y_ptr, z_ptr, K: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr, WAIT: tl.constexpr,
            PREFETCH: tl.constexpr):
    """z[rows] = w[rows] @ y[:K] (the second kernel: GEMM2-like; y is the first kernel's output).
    PREFETCH: the weight tile is loaded before the wait, y after it."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, KP)  # K padded to a power of two
    if WAIT and not PREFETCH:
        gdc_wait()
    w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=(rk < K)[None, :], other=0.0)
    if WAIT and PREFETCH:
        gdc_wait()
    y = tl.load(y_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
    tl.store(z_ptr + rn, tl.sum(w.to(tl.float32) * y[None, :], 1).to(z_ptr.dtype.element_ty))


VARIANTS = {  # name: (launch_pdl, A triggers, B waits, B prefetches its weights before the wait)
    "plain": (False, False, False, False),
    "pdl_wait_first": (True, True, True, False),
    "pdl_prefetch": (True, True, True, True),
    "pdl_prefetch_exit_trigger": (True, False, True, True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=50, help="kernel pairs per captured graph")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=None, help="write the JSON result here")
    args = p.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    # Qwen3-MoE decode, one token, top-8: GEMM1 reads 8 x [1536, 2048], GEMM2 8 x [2048, 768] (bf16).
    ka, na, kb, nb = 2048, 8 * 1536, 768, 8 * 2048
    wa = torch.randn(na, ka, device=dev, dtype=torch.bfloat16, generator=g) / ka ** 0.5
    wb = torch.randn(nb, kb, device=dev, dtype=torch.bfloat16, generator=g) / kb ** 0.5
    x = torch.randn(ka, device=dev, dtype=torch.bfloat16, generator=g)
    y = torch.empty(na, device=dev, dtype=torch.bfloat16)
    z = torch.empty(nb, device=dev, dtype=torch.bfloat16)
    y_ref = (wa.float() @ x.float()).bfloat16()
    z_ref = wb.float() @ y_ref[:kb].float()
    bytes_moved = (wa.numel() + wb.numel()) * 2
    results = {}
    for name, (pdl, trigger, wait, prefetch) in VARIANTS.items():
        def pair():
            y.fill_(float("nan"))  # poisoned: a second kernel that reads too early sees NaN
            _gemv_a[(na // 16,)](wa, x, y, ka, BN=16, BK=256, TRIGGER=trigger, num_warps=4)
            _gemv_b[(nb // 16,)](wb, y, z, kb, triton.next_power_of_2(kb), BN=16, WAIT=wait, PREFETCH=prefetch,
                                 num_warps=4, launch_pdl=pdl)

        try:
            pair()
            torch.cuda.synchronize()
            eager_ok = bool(torch.isfinite(z).all()) and (z.float() - z_ref).abs().max().item() < 5e-2
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    pair()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(args.pairs):
                    pair()
            z.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            graph_ok = bool(torch.isfinite(z).all()) and (z.float() - z_ref).abs().max().item() < 5e-2
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph.replay()
            start.record()
            for _ in range(args.replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1e3 / (args.replays * args.pairs)
            results[name] = dict(us_per_pair=round(us, 2), eager_ok=eager_ok, graph_ok=graph_ok,
                                 tb_per_s=round(bytes_moved / us / 1e6, 3))
        except Exception as e:  # report, keep probing the other variants
            results[name] = dict(error=f"{type(e).__name__}: {e}"[:300])
        print(name, results[name], flush=True)
    print(json.dumps(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
