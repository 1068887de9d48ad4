"""The prepared-MXFP4 kernel compiles for sm_90 (Triton's own ptxas, no GPU needed).

CPU machines run the kernels interpreted, which checks their math but not that Triton can lower
them (layouts, wgmma with the upcast weights in registers, the inline PTX). This compiles the
tuned configs ahead of time in a subprocess (the test process has the kernels interpreted) and
checks that the loops are pipelined (cp.async copies) and wgmma takes its A operand from registers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from padded_moe.kernels import gemm as kg

fn = kg._expert_gemm_mx_hopper_kernel
ints = ["N", "K", "K_PAD", "R_a", "num_local", "mk", "T_max", "num_pid_m", "stride_am", "stride_we",
        "stride_wn", "stride_se", "stride_sg", "stride_be", "stride_cm"]
# What the launcher's specialisation sees on model shapes: 16-aligned pointers, strides and K.
aligned = {"N", "K", "K_PAD", "stride_am", "stride_we", "stride_wn", "stride_se", "stride_sg", "stride_be", "stride_cm"}
out = []
for layout, cfg in json.loads(sys.argv[1]):
    cfg = kg.GemmConfig(**cfg)
    sig = {"a_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "bias_ptr": "*bf16", "c_ptr": "*bf16",
           "ids_ptr": "*i32", "blk_exp_ptr": "*i32", "npad_ptr": "*i32", "off_ptr": "*i64", "cnt_ptr": "*i32"}
    sig.update({n: "i32" for n in ints})
    const = dict(LAYOUT=layout, HAS_BIAS=True, A_DIV=1, BLOCK_MB=cfg.BM, SUB=1, ROWS=cfg.BM, L_POW2=128,
                 FP32_DOT=False, K_TAIL=True, UPCAST_PTX=cfg.mx_ptx, WIDE=cfg.mx_wide, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK,
                 GROUP_M=cfg.GROUP_M)
    sig.update({k: "constexpr" for k in const})
    names = fn.arg_names
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    ptx = k.asm["ptx"]
    wgmma = [l for l in ptx.splitlines() if "wgmma.mma_async" in l]
    out.append(dict(config=cfg.short(), layout=layout, shared=k.metadata.shared, cubin=len(k.asm["cubin"]),
                    async_copies=k.asm["ttgir"].count("async_copy_global_to_local"),
                    wgmma=len(wgmma),
                    # `wgmma ... {acc}, {a regs}, b_desc, ...` when A comes from registers, `{acc}, a_desc, ...` from shared
                    a_in_registers=all(l.split("},", 1)[1].strip().startswith("{") for l in wgmma)))
print(json.dumps(out))
"""


def test_hopper_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    import dataclasses

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's bundled ptxas is not installed")
    from padded_moe.kernels import gemm as kg

    tuned = [kg.TUNED[("mxfp4_hopper", r)] for r in ("decode", "prefill")]
    ptx = dataclasses.replace(tuned[0], mx_ptx=True)
    wide = [c for cands in kg.SWEEP_MXFP4_HOPPER.values() for c in cands if c.mx_wide]  # sweep-only variant
    cases = [(1, c) for c in tuned + [ptx] + wide] + [(0, tuned[0]), (2, tuned[0])]
    arg = json.dumps([(lay, dataclasses.asdict(c)) for lay, c in cases])
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", SCRIPT, arg], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    print("\n".join(str(r) for r in results))
    for r in results:
        assert r["cubin"] > 0 and r["wgmma"] > 0, r
        assert r["async_copies"] > 0, f"main loop not pipelined: {r}"
        assert r["a_in_registers"], f"wgmma reads the upcast weights from shared memory: {r}"
        assert r["shared"] <= 227 * 1024, r
