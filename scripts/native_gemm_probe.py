"""Exact-integer probes of the native grouped GEMM (`padded_moe.kernels.native.grouped`), for
diagnosing a wrong result from one device run: each probe's inputs make every output an exact
small integer that names where it came from, and the probe prints how many outputs are wrong and
the first few (row, column, expected, got).

- rows: a[r, 0] = r % 256, w[n, 0] = 1, zero elsewhere: out[r, n] = r % 256 (the accumulator's rows)
- cols: a[r, r % 64] = 1, w[n, k] = n % 256: out[r, n] = n % 256 (columns, the B tile's rows)
- k: a[r, r % K] = 1, w[n, k] = k % 256: out[r, n] = r % K % 256 (the k order: swizzle, k steps, stages)

each for counts that use one, four and several 64-row warpgroups and 256-row chunks, in every
configuration of the kernel (persistent, one CTA per tile; the persistent ones with bf16 weights
also walking their tiles from a counter, "dyn"); and for MXFP4 weights (random codes,
scales near 1):
- mx: a[r, r % K] = 1: out[r, n] = the dequantized w[n, r % K], exactly (the upcast, the swizzled
  stores of the producer warps, the scale groups).
Exit status 1 if any is wrong or a configuration hangs (each runs in a child process under a
timeout).

    PYTHONPATH=src python scripts/native_gemm_probe.py
"""

from __future__ import annotations

import subprocess
import sys

import torch

from padded_moe.kernels.native import grouped
from padded_moe.mxfp4 import Mxfp4Tensor, dequantize_mxfp4

DEV = "cuda"
SENTINEL = -7.0
CONFIG_TIMEOUT_S = 50  # a configuration's probes take a few seconds


def rows_of(counts: list) -> tuple:
    """(offsets [L + 1] int64, each row's expert, each row's index within its expert)."""
    offsets = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int64, device=DEV)
    expert = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)]).to(DEV)
    local = torch.cat([torch.arange(c) for c in counts]).to(DEV)
    return offsets, expert, local


def run_and_report(label: str, a: torch.Tensor, w, offsets, expected: torch.Tensor, expert, local,
                   config: int, dynamic: bool = False) -> int:
    """Launch on `a` (float, made bf16 here), count the outputs unequal to `expected`, print the first."""
    R, N = expected.shape
    out = torch.full((R, N), SENTINEL, device=DEV, dtype=torch.bfloat16)
    grouped.launch(a.bfloat16(), w, out, offsets=offsets, config=config, dynamic=dynamic)
    torch.cuda.synchronize()
    got = out.float()
    bad = (got != expected).nonzero()
    print(f"config {config}{' dyn' if dynamic else ''} {label}: {bad.shape[0]} of {R * N} wrong", flush=True)
    for r, n in bad[:6].tolist():
        print(f"    row {r} (expert {int(expert[r])} row {int(local[r])}), col {n}: expected "
              f"{expected[r, n].item():g}, got {got[r, n].item():g}")
    return int(bad.shape[0])


def probe(kind: str, counts: list, K: int, N: int, config: int, dynamic: bool = False) -> int:
    offsets, expert, local = rows_of(counts)
    R = local.numel()
    a = torch.zeros(R, K, device=DEV)
    w = torch.zeros(len(counts), N, K, device=DEV)
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
    return run_and_report(f"{kind:5s} counts={counts} K={K} N={N}", a, w.bfloat16(), offsets, expected, expert,
                          local, config, dynamic)


def probe_mx(counts: list, K: int, N: int, config: int) -> int:
    g = torch.Generator(device=DEV).manual_seed(K + N)
    blocks = torch.randint(0, 256, (len(counts), N, K // 2), generator=g, device=DEV, dtype=torch.uint8)
    scales = torch.randint(124, 131, (len(counts), N, K // 32), generator=g, device=DEV, dtype=torch.uint8)
    q = Mxfp4Tensor(blocks, scales)
    offsets, expert, local = rows_of(counts)
    a = torch.zeros(local.numel(), K, device=DEV)
    a[torch.arange(local.numel(), device=DEV), local % K] = 1
    expected = dequantize_mxfp4(q, torch.float32)[expert, :, local % K]  # [R, N]
    return run_and_report(f"mx    counts={counts} K={K} N={N}", a, q, offsets, expected, expert, local, config)


# (counts, K, N): one warpgroup, four, two chunks with an empty expert between, three chunks with K
# past 8 k tiles and N not a multiple of 128, and 300 small experts (600 tiles: each persistent CTA
# walks several, so its pipeline and, for MXFP4, its cp.async ring carry over from tile to tile).
CASES = (([64], 64, 128), ([256], 64, 128), ([37, 0, 300], 256, 256), ([520], 512, 136), ([3] * 300, 128, 256))
MX_CASES = (([64], 64, 128), ([37, 0, 300], 256, 256), ([520], 96, 136), ([3] * 300, 128, 256))


def run_config(config: int) -> int:
    wrong = 0
    for dynamic in (False, True) if grouped.CONFIGS[config][1] else (False,):
        for kind in ("rows", "cols", "k"):
            for counts, K, N in CASES:
                wrong += probe(kind, counts, K, N, config, dynamic)
    if grouped.runs_mxfp4(config):
        for counts, K, N in MX_CASES:
            wrong += probe_mx(counts, K, N, config)
    return wrong


def main() -> int:
    """Each configuration in a child process under a timeout, so a kernel that hangs (a barrier
    never completing) is reported with the last probe it finished, and the other configuration
    still runs."""
    if len(sys.argv) == 3 and sys.argv[1] == "--config":
        wrong = run_config(int(sys.argv[2]))
        print(f"config {sys.argv[2]}: " + ("all exact" if wrong == 0 else f"{wrong} wrong outputs"), flush=True)
        return 1 if wrong else 0
    if not torch.cuda.is_available():
        raise SystemExit("the probe runs the kernel: it needs a GPU")
    failed = 0
    for config in range(len(grouped.CONFIGS)):
        try:
            done = subprocess.run([sys.executable, __file__, "--config", str(config)], timeout=CONFIG_TIMEOUT_S)
            failed += done.returncode != 0
        except subprocess.TimeoutExpired:
            print(f"config {config}: HUNG (no result within {CONFIG_TIMEOUT_S} s; the line above is the last probe "
                  "it finished)", flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
