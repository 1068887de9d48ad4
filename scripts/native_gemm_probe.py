"""Exact-integer probes of the native grouped GEMM (`padded_moe.kernels.native.grouped`), for
diagnosing a wrong result from one device run: each probe's inputs make every output an exact
small integer that names where it came from, and the probe prints how many outputs are wrong and
the first few (row, column, expected, got).

- rows: a[r, 0] = r % 256, w[n, 0] = 1, zero elsewhere: out[r, n] = r % 256 (the accumulator's rows)
- cols: a[r, r % 64] = 1, w[n, k] = n % 256: out[r, n] = n % 256 (columns, the B tile's rows)
- k: a[r, r % K] = 1, w[n, k] = k % 256: out[r, n] = r % K % 256 (the k order: swizzle, k steps, stages)

each for counts that use one, four and several 64-row warpgroups and 256-row chunks, in every
configuration of the kernel (persistent, one CTA per tile). Exit status 1 if any is wrong.

    PYTHONPATH=src python scripts/native_gemm_probe.py
"""

from __future__ import annotations

import sys

import torch

from padded_moe.kernels.native import grouped

DEV = "cuda"
SENTINEL = -7.0


def probe(kind: str, counts: list, K: int, N: int, config: int) -> int:
    L = len(counts)
    offsets = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int64, device=DEV)
    R = int(offsets[-1])
    a = torch.zeros(R, K, device=DEV)
    w = torch.zeros(L, N, K, device=DEV)
    local = torch.cat([torch.arange(c) for c in counts]).to(DEV)  # row within its expert
    rows = torch.arange(R, device=DEV)
    if kind == "rows":
        a[:, 0] = (local % 256).float()
        w[:, :, 0] = 1
        expected = (local % 256).float()[:, None].expand(R, N)
    elif kind == "cols":
        a[rows, local % min(K, 64)] = 1
        w[:] = (torch.arange(N, device=DEV) % 256).float()[None, :, None]
        expected = (torch.arange(N, device=DEV) % 256).float()[None, :].expand(R, N)
    else:
        a[rows, local % K] = 1
        w[:] = (torch.arange(K, device=DEV) % 256).float()[None, None, :]
        expected = (local % K % 256).float()[:, None].expand(R, N)
    out = torch.full((R, N), SENTINEL, device=DEV, dtype=torch.bfloat16)
    grouped.launch(a.bfloat16(), w.bfloat16(), out, offsets=offsets, config=config)
    torch.cuda.synchronize()
    got = out.float()
    bad = (got != expected).nonzero()
    print(f"config {config} {kind:5s} counts={counts} K={K} N={N}: {bad.shape[0]} of {R * N} wrong")
    for r, n in bad[:6].tolist():
        print(f"    row {r} (expert row {int(local[r])}), col {n}: expected {expected[r, n].item():g}, "
              f"got {got[r, n].item():g}")
    return int(bad.shape[0])


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("the probe runs the kernel: it needs a GPU")
    wrong = 0
    for config in range(len(grouped.CONFIGS)):
        for kind in ("rows", "cols", "k"):
            for counts, K, N in (([64], 64, 128), ([256], 64, 128), ([37, 0, 300], 256, 256), ([520], 512, 136)):
                wrong += probe(kind, counts, K, N, config)
    print("all exact" if wrong == 0 else f"{wrong} wrong outputs in all")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
