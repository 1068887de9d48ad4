"""Probe: CUTLASS's Hopper mixed-input GEMM on e2m1 weights against our prepared-MXFP4 Triton GEMM.

Issue 12's lever is taking the e2m1 -> bf16 upcast off the warps that issue the MMAs. CUTLASS
(>= 4.4) has a warp-specialized sm90 mixed-input collective that converts e2m1 on consumer
warpgroups fed by a TMA producer warp. It takes one scale per weight row per 64-element K tile, so
it cannot compute MXFP4 (32-element groups) exactly; this probe runs it with 64-element groups
on the same e2m1 bytes, for its speed only (checked against a float32 reference of those
semantics), next to our Triton GEMM on the real MXFP4 weights (GROUPED_MASKED, full slabs of M rows
per expert) and torch's bf16 batched matmul on dense copies (the dense ceiling). If CUTLASS's
kernel is not well ahead of ours here, a kernel of ours on the same plan would not be either.

    bash scripts/cutlass_mx/build.sh /path/to/cutlass   # on any machine with nvcc: .cutlass_mx/libmx_gemm.so
    PYTHONPATH=src python3 scripts/cutlass_mx_probe.py [--lib .cutlass_mx/libmx_gemm.so] [--experts 32]

Not part of the library.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import bench_us, matmul_tflops  # noqa: E402
from bench_gemm import masked_meta, weight_pair  # noqa: E402

from padded_moe.gemm import expert_gemm  # noqa: E402
from padded_moe.mxfp4 import Mxfp4Tensor, e2m1_lut  # noqa: E402

# (model, stage, N, K): the expert GEMMs of GPT-OSS-120B and DeepSeek-V4-Flash.
SHAPES = [("gpt-oss", "w13", 5760, 2880), ("gpt-oss", "w2", 2880, 2880),
          ("dsv4", "w13", 4096, 4096), ("dsv4", "w2", 4096, 2048)]
CUTLASS_GROUP = 64


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.mx_gemm_num_configs.restype = ctypes.c_int
    lib.mx_gemm_config_name.restype = ctypes.c_char_p
    lib.mx_gemm_config_name.argtypes = [ctypes.c_int]
    ints = [ctypes.c_int] * 5
    lib.mx_gemm_workspace.restype = ctypes.c_longlong
    lib.mx_gemm_workspace.argtypes = [ctypes.c_int] + ints
    lib.mx_gemm_run.restype = ctypes.c_int
    lib.mx_gemm_run.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + ints + [ctypes.c_void_p] * 2
    return lib


def group64_scales(q: Mxfp4Tensor) -> torch.Tensor:
    """bf16 [L, K/64, N]: 2^(e-127) of each 64-element group's first 32-element scale (the probe's
    semantics, not MXFP4's)."""
    e = q.scales[:, :, ::2].to(torch.float32)
    return torch.exp2(e - 127).to(torch.bfloat16).transpose(1, 2).contiguous()


def reference(a: torch.Tensor, q: Mxfp4Tensor, s64: torch.Tensor, experts: int) -> torch.Tensor:
    """float32 [experts, M, N] of the probe's semantics for the first `experts` experts."""
    b = q.blocks[:experts]
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(experts, b.shape[1], -1).long()
    vals = e2m1_lut(a.device)[codes]
    scale = s64[:experts].transpose(1, 2).float().repeat_interleave(CUTLASS_GROUP, dim=-1)
    return a[:experts].float() @ (vals * scale).transpose(1, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", default=".cutlass_mx/libmx_gemm.so")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--rows", default="256,1024", help="rows per expert")
    p.add_argument("--out", default="gpu-out/cutlass-mx.json")
    args = p.parse_args()
    lib = load(args.lib)
    dev = torch.device("cuda")
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    configs = [(c, lib.mx_gemm_config_name(c).decode()) for c in range(lib.mx_gemm_num_configs())]
    dense = matmul_tflops()
    print(f"dense bf16 matmul {dense:.0f} TFLOP/s", flush=True)
    L = args.experts
    rows = []
    for model, stage, n, k in SHAPES:
        _, q = weight_pair(L, n, k, dev)
        qh = Mxfp4Tensor(q.blocks.clone(), q.scales.clone()).prepare_for()
        s64 = group64_scales(q)
        w_dense = q.dequantize(torch.bfloat16)
        for m in [int(r) for r in args.rows.split(",")]:
            a = torch.randn(L, m, k, device=dev, dtype=torch.bfloat16)
            flops = 2 * L * m * n * k
            rec = {"model": model, "stage": stage, "experts": L, "rows": m, "N": n, "K": k}
            meta = masked_meta(L, m, m, dev)
            out = torch.empty(L, m, n, device=dev, dtype=torch.bfloat16)
            ours = bench_us(lambda: expert_gemm(a, qh, meta, out=out, backend="triton"))
            want = w_dense.float()
            ours_err = ((out[:2].float() - a[:2].float() @ want[:2].transpose(1, 2)).norm()
                        / (a[:2].float() @ want[:2].transpose(1, 2)).norm()).item()
            rec["ours_us"], rec["ours_tflops"], rec["ours_rel_err"] = ours, flops / ours / 1e6, ours_err
            bmm = bench_us(lambda: torch.bmm(a, w_dense.transpose(1, 2)))
            rec["torch_bf16_bmm_us"], rec["torch_bf16_bmm_tflops"] = bmm, flops / bmm / 1e6
            ref = reference(a, q, s64, 2)
            for c, name in configs:
                ws_bytes = lib.mx_gemm_workspace(c, m, n, k, L, CUTLASS_GROUP)
                ws = torch.empty(max(1, ws_bytes), dtype=torch.uint8, device=dev)
                out_c = torch.full((L, m, n), float("nan"), device=dev, dtype=torch.bfloat16)

                def run(c=c, ws=ws, out_c=out_c):
                    rc = lib.mx_gemm_run(c, a.data_ptr(), q.blocks.data_ptr(), s64.data_ptr(), out_c.data_ptr(),
                                         m, n, k, L, CUTLASS_GROUP, ws.data_ptr(), stream)
                    if rc:
                        raise RuntimeError(f"{name}: mx_gemm_run returned {rc}")

                try:
                    run()
                    torch.cuda.synchronize()
                    err = ((out_c[:2].float() - ref).norm() / ref.norm()).item()
                    us = bench_us(run)
                    rec[name] = {"us": us, "tflops": flops / us / 1e6, "rel_err": err,
                                 "ours_time_over_this": ours / us}
                except RuntimeError as e:
                    rec[name] = {"error": str(e)}
            rows.append(rec)
            best = min((v["us"] for v in rec.values() if isinstance(v, dict) and "us" in v), default=float("nan"))
            print(f"{model} {stage} L={L} M={m}: ours {ours:.1f} us ({rec['ours_tflops']:.0f} TFLOP/s, rel err "
                  f"{ours_err:.1e}); torch bf16 bmm {bmm:.1f} us; CUTLASS best {best:.1f} us "
                  f"(ours / best {ours / best:.2f})", flush=True)
            for c, name in configs:
                print(f"    {name}: {rec[name]}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"dense_tflops": dense, "rows": rows}, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
