"""Probe (issue 14): at DeepSeek-V4's 192 rows per expert, is one program over all of an expert's
rows (one weight stream) faster than two 128-row m-tiles (the second half empty)?

Grouped slabs `[E, 256, K]` with `rows` valid per expert, weights `[E, N, K]`, TMA for both, one
program per tile. Modes: `m128` (BM 128 tiles, partner m-tiles adjacent), `c192` (rows 0-127 and
128-191 of the expert as two accumulators under one weight tile), `m256` (one 256-row tile).
Prints µs per GEMM (CUDA-graph replay) and TFLOP/s of useful rows; checks each against torch.

    python3 scripts/tile192_probe.py [--rows 192]
"""
import argparse

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _probe_kernel(a128, a64, a256, w_desc, c_ptr, cnt_ptr, N, K, SLAB, stride_cm,
                  MODE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUBS: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    if MODE == 0:  # (e, n, m): the expert's SUBS m-tiles adjacent
        m = pid % SUBS
        n = (pid // SUBS) % n_tiles
        e = pid // (SUBS * n_tiles)
    else:
        m = 0
        n = pid % n_tiles
        e = pid // n_tiles
    cnt = tl.load(cnt_ptr + e)
    n0 = n * BN
    w_row = e * N + n0
    rn = n0 + tl.arange(0, BN)
    if MODE == 0:
        t0 = m * 128
        if t0 >= cnt:
            return
        acc = tl.zeros((128, BN), tl.float32)
        for k0 in range(0, K, BK):
            a = a128.load([e * SLAB + t0, k0])
            w = w_desc.load([w_row, k0])
            acc = tl.dot(a, tl.trans(w), acc)
        rm = t0 + tl.arange(0, 128)
        ptrs = c_ptr + (e * SLAB + rm).to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(ptrs, acc.to(tl.bfloat16), mask=(rm < cnt)[:, None])
    elif MODE == 1:
        acc = tl.zeros((128, BN), tl.float32)
        acc2 = tl.zeros((64, BN), tl.float32)
        for k0 in range(0, K, BK):
            w = tl.trans(w_desc.load([w_row, k0]))
            a = a128.load([e * SLAB, k0])
            a2 = a64.load([e * SLAB + 128, k0])
            acc = tl.dot(a, w, acc)
            acc2 = tl.dot(a2, w, acc2)
        rm = tl.arange(0, 128)
        ptrs = c_ptr + (e * SLAB + rm).to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(ptrs, acc.to(tl.bfloat16), mask=(rm < cnt)[:, None])
        rm2 = 128 + tl.arange(0, 64)
        ptrs2 = c_ptr + (e * SLAB + rm2).to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(ptrs2, acc2.to(tl.bfloat16), mask=(rm2 < cnt)[:, None])
    else:
        acc = tl.zeros((256, BN), tl.float32)
        for k0 in range(0, K, BK):
            a = a256.load([e * SLAB, k0])
            w = w_desc.load([w_row, k0])
            acc = tl.dot(a, tl.trans(w), acc)
        rm = tl.arange(0, 256)
        ptrs = c_ptr + (e * SLAB + rm).to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(ptrs, acc.to(tl.bfloat16), mask=(rm < cnt)[:, None])


def run(name, mode, a, w, c, cnt, BN, BK, warps, stages):
    E, SLAB, K = a.shape
    N = w.shape[1]
    a2, w2, c2 = a.view(E * SLAB, K), w.view(E * N, K), c.view(E * SLAB, N)
    d = lambda t, r, b: TensorDescriptor.from_tensor(t, [r, b])  # noqa: E731
    args = (d(a2, 128, BK), d(a2, 64, BK), d(a2, 256 if mode == 2 else 128, BK), d(w2, BN, BK), c2, cnt, N, K, SLAB, c2.stride(0))
    grid = (E * (2 if mode == 0 else 1) * triton.cdiv(N, BN),)
    launch = lambda: _probe_kernel[grid](*args, MODE=mode, BN=BN, BK=BK, SUBS=2, num_warps=warps,  # noqa: E731
                                         num_stages=stages)
    c.fill_(float("nan"))
    try:
        launch()
        torch.cuda.synchronize()
    except Exception as ex:  # noqa: BLE001
        print(f"{name}: failed to compile/run: {type(ex).__name__}: {str(ex)[:200]}")
        return
    rows = int(cnt[0])
    ref = torch.einsum("erk,enk->ern", a[:8, :rows].float(), w[:8].float())
    err = ((c[:8, :rows].float() - ref).norm() / ref.norm()).item()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(5):
            launch()
    us = triton.testing.do_bench(g.replay, warmup=50, rep=400) * 1e3 / 5
    k = _probe_kernel.warmup(*args, MODE=mode, BN=BN, BK=BK, SUBS=2, num_warps=warps, num_stages=stages, grid=grid)
    regs, spills = getattr(k, "n_regs", -1), getattr(k, "n_spills", -1)
    tf = 2 * E * rows * N * K / us / 1e6
    print(f"{name:28s} {us:9.1f} us  {tf:6.1f} TFLOP/s useful  err {err:.1e}  regs {regs} spills {spills}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=192)
    args = p.parse_args()
    torch.manual_seed(0)
    E, SLAB = 256, 256
    for gemm, N, K in (("w13", 4096, 4096), ("w2", 4096, 2048)):
        a = torch.randn(E, SLAB, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        c = torch.empty(E, SLAB, N, device="cuda", dtype=torch.bfloat16)
        cnt = torch.full((E,), args.rows, device="cuda", dtype=torch.int32)
        print(f"== DeepSeek-V4 {gemm}: E {E}, {args.rows} rows per expert, N {N}, K {K}")
        for name, mode, bn, bk, wp, st in (("m128 BN256 BK64 w8 s4", 0, 256, 64, 8, 4),
                                           ("m128 BN256 BK64 w8 s3", 0, 256, 64, 8, 3),
                                           ("c192 BN128 BK64 w8 s4", 1, 128, 64, 8, 4),
                                           ("c192 BN128 BK64 w8 s3", 1, 128, 64, 8, 3),
                                           ("c192 BN128 BK64 w8 s2", 1, 128, 64, 8, 2),
                                           ("c192 BN128 BK32 w8 s4", 1, 128, 32, 8, 4),
                                           ("c192 BN128 BK32 w8 s5", 1, 128, 32, 8, 5),
                                           ("c192 BN256 BK64 w8 s3", 1, 256, 64, 8, 3),
                                           ("c192 BN256 BK64 w8 s2", 1, 256, 64, 8, 2),
                                           ("m256 BN128 BK64 w8 s4", 2, 128, 64, 8, 4),
                                           ("m256 BN128 BK64 w8 s3", 2, 128, 64, 8, 3)):
            run(name, mode, a, w, c, cnt, bn, bk, wp, st)
        # dense reference: cuBLAS on the useful rows of all experts as one matmul with one expert's weight
        x = a[:, :args.rows].reshape(-1, K)
        us = triton.testing.do_bench(lambda: x @ w[0].T, warmup=50, rep=400) * 1e3
        print(f"{'dense cuBLAS (same FLOPs)':28s} {us:9.1f} us  {2 * x.shape[0] * N * K / us / 1e6:6.1f} TFLOP/s")
        del a, w, c
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
