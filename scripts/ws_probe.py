"""Does Triton's automatic warp specialization run on this GPU, and how fast is a matmul with it?

Triton 3.6 compiles `tl.range(..., warp_specialize=True)` for sm_90 (a producer warp group issuing
TMA loads, consumer warp groups issuing wgmma), but on an H200 a kernel that reads through
host-side `TensorDescriptor`s never finished. Reports from the Triton project have the variant with
device-side descriptors (`tl.make_tensor_descriptor`) in a persistent kernel working on Hopper.
Each variant runs in its own process under a timeout, so a kernel that hangs costs its timeout:

    python scripts/ws_probe.py [--timeout 60] [--m 8192 --n 8192 --k 8192]

Prints, per variant: TFLOP/s, max |difference| against torch.matmul, or HANG / ERROR; and
torch.matmul's rate in the same process. `--compile-only` compiles each variant for sm_90 (no
GPU needed) and reports whether it was warp-specialized.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import triton
import triton.language as tl

# (name, device-side descriptors, persistent (None: one tile per program; "outer": the tile loop
# specialized, flattened with the K loop; "inner": the K loop specialized), warp_specialize,
# num_warps, num_stages)
VARIANTS = [
    ("host_desc", False, None, False, 8, 4),
    ("device_desc", True, None, False, 8, 4),
    ("persistent_device_desc", True, "outer", False, 8, 3),
    ("ws_host_desc", False, None, True, 4, 3),
    ("ws_device_desc", True, None, True, 4, 3),
    ("ws_device_desc_s4", True, None, True, 4, 4),
    ("ws_persistent_outer", True, "outer", True, 4, 3),
    ("ws_persistent_inner", True, "inner", True, 4, 3),
    # where the persistent kernel's gain comes from: stages, descriptors
    ("host_desc_s3", False, None, False, 8, 3),
    ("device_desc_s3", True, None, False, 8, 3),
    ("persistent_host_desc", False, "outer", False, 8, 3),
    ("persistent_device_desc_s4", True, "outer", False, 8, 4),
]
BM, BN, BK, GROUP_M = 128, 256, 64, 8


@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % rows, (tile % per_group) // rows


@triton.jit
def _store(c, pm, pn, M, N, acc, BM: tl.constexpr, BN: tl.constexpr):
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    tl.store(c + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(tl.bfloat16),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _tile_kernel(a, b, c, M, N, K, DEVICE_DESC: tl.constexpr, WS: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """One output tile per program; A [M, K], B [N, K] (row-major), C [M, N] stored by pointers."""
    if DEVICE_DESC:
        a_d = tl.make_tensor_descriptor(a, [M, K], [K, 1], [BM, BK])
        b_d = tl.make_tensor_descriptor(b, [N, K], [K, 1], [BN, BK])
    else:
        a_d, b_d = a, b
    pm, pn = _grouped_tile(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, K, BK, warp_specialize=WS):
        acc = tl.dot(a_d.load([pm * BM, k]), b_d.load([pn * BN, k]).T, acc)
    _store(c, pm, pn, M, N, acc, BM, BN)


@triton.jit
def _persistent_kernel(a, b, c, M, N, K, NUM_PROGRAMS: tl.constexpr, WS_OUTER: tl.constexpr,
                       WS_INNER: tl.constexpr, DEVICE_DESC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, GROUP_M: tl.constexpr):
    """NUM_PROGRAMS programs walk the output tiles through device-side (or host) descriptors."""
    if DEVICE_DESC:
        a_d = tl.make_tensor_descriptor(a, [M, K], [K, 1], [BM, BK])
        b_d = tl.make_tensor_descriptor(b, [N, K], [K, 1], [BN, BK])
    else:
        a_d, b_d = a, b
    num_pid_m, num_pid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=WS_OUTER,
                         warp_specialize=WS_OUTER):
        pm, pn = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BM, BN), tl.float32)
        for k in tl.range(0, K, BK, warp_specialize=WS_INNER):
            acc = tl.dot(a_d.load([pm * BM, k]), b_d.load([pn * BN, k]).T, acc)
        _store(c, pm, pn, M, N, acc, BM, BN)


def _compile_only(v) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name, dev, persistent, ws, warps, stages = v
    if dev:
        sig = {"a": "*bf16", "b": "*bf16", "c": "*bf16"}
    else:
        sig = {"a": f"tensordesc<bf16[{BM}, {BK}]>", "b": f"tensordesc<bf16[{BN}, {BK}]>", "c": "*bf16"}
    sig.update(M="i32", N="i32", K="i32")
    fn = _persistent_kernel if persistent else _tile_kernel
    const = dict(WS=ws, BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M)
    if persistent:
        const.pop("WS")
        const.update(NUM_PROGRAMS=132, WS_OUTER=ws and persistent == "outer", WS_INNER=ws and persistent == "inner")
    const.update(DEVICE_DESC=dev)
    sig.update({k: "constexpr" for k in const})
    names = fn.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("a", "b", "c", "M", "N", "K") if n in sig and
             not sig[n].startswith("tensordesc")}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    return dict(variant=name, warp_specialized=k.asm["ttgir"].count("ttg.warp_specialize") > 0,
                warps=k.metadata.num_warps, shared=k.metadata.shared)


def _run_one(v, m, n, k) -> dict:
    import torch
    import triton.testing
    from triton.tools.tensor_descriptor import TensorDescriptor

    name, dev, persistent, ws, warps, stages = v
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
    c = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    tiles = triton.cdiv(m, BM) * triton.cdiv(n, BN)
    args = (a, b, c) if dev else (TensorDescriptor.from_tensor(a, [BM, BK]), TensorDescriptor.from_tensor(b, [BN, BK]), c)
    if persistent:
        progs = torch.cuda.get_device_properties(0).multi_processor_count
        call = lambda: _persistent_kernel[(min(progs, tiles),)](  # noqa: E731
            *args, m, n, k, NUM_PROGRAMS=min(progs, tiles), WS_OUTER=ws and persistent == "outer",
            WS_INNER=ws and persistent == "inner", DEVICE_DESC=dev, BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M,
            num_warps=warps, num_stages=stages)
    else:
        call = lambda: _tile_kernel[(tiles,)](*args, m, n, k, DEVICE_DESC=dev, WS=ws, BM=BM, BN=BN, BK=BK,  # noqa: E731
                                              GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)
    call()
    torch.cuda.synchronize()
    ref = a @ b.T
    diff = float((c.float() - ref.float()).abs().max())
    ms = triton.testing.do_bench(call, warmup=10, rep=50)
    torch_ms = triton.testing.do_bench(lambda: a @ b.T, warmup=10, rep=50)
    flops = 2 * m * n * k
    return dict(variant=name, tflops=round(flops / ms / 1e9), torch_tflops=round(flops / torch_ms / 1e9),
                max_abs_diff=diff)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timeout", type=int, default=60)
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--only", help="comma list of variant names (default: all)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        v = next(v for v in VARIANTS if v[0] == args.one)
        print(json.dumps(_compile_only(v) if args.compile_only else _run_one(v, args.m, args.n, args.k)))
        return
    for v in VARIANTS:
        if args.only and v[0] not in args.only.split(","):
            continue
        cmd = [sys.executable, __file__, "--one", v[0], "--m", str(args.m), "--n", str(args.n), "--k", str(args.k)]
        cmd += ["--compile-only"] if args.compile_only else []
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                               env=dict(os.environ, TRITON_INTERPRET="0"))
            out = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else \
                f"ERROR rc={r.returncode}: {r.stderr.strip().splitlines()[-1][:200] if r.stderr.strip() else ''}"
        except subprocess.TimeoutExpired:
            out = f"HANG (no result within {args.timeout} s)"
        print(f"{v[0]:32s} {out}", flush=True)


if __name__ == "__main__":
    main()
