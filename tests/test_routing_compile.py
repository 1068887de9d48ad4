"""The one-kernel top-k (`padded_moe.kernels.topk`) compiles for sm_90 on the forms its launcher
produces (Triton's own ptxas, no GPU): softmax first with and without renormalisation (Qwen3-MoE,
Mixtral) and top-k first (GPT-OSS), 8 to 1024 experts, with libdevice's exponential, no
register spills. The arguments are captured from interpreted calls and specialised as the launcher's first
call would be, with the GPU's LIBDEVICE flag."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import PTXAS_LOG, compile_for_sm90, launch_signature

SCRIPT = r"""
import json, os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from padded_moe.kernels.topk import _topk_router_kernel as fn

out = []
for sig, const, div16, warps in json.loads(sys.argv[1]):
    names = fn.arg_names
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    log = ptxas_log(k.asm["ptx"])
    out.append(dict(spills=sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))))
print(json.dumps(out))
"""

# (experts, k, logits dtype, topk_before_softmax, renormalize)
CASES = [(128, 8, torch.bfloat16, False, True), (8, 2, torch.bfloat16, False, True),
         (128, 4, torch.bfloat16, True, False), (1024, 6, torch.float32, False, False)]


def captured_launch(monkeypatch, num_experts, k, dtype, topk_before_softmax, renormalize) -> list:
    from padded_moe.kernels import _launch
    from padded_moe.routing import fused_topk

    seen, real = [], _launch.launch

    def spy(fn, grid, key, args, constexprs, **opt):
        seen.append((fn, args, constexprs, opt))
        return real(fn, grid, key, args, constexprs, **opt)

    monkeypatch.setattr(_launch, "launch", spy)
    fused_topk(torch.randn(5, num_experts).to(dtype), k, renormalize=renormalize,
               topk_before_softmax=topk_before_softmax, weights_dtype=torch.bfloat16, ids_dtype=torch.int64)
    (fn, args, constexprs, opt), = seen
    sig, const, div16 = launch_signature(fn, args, dict(constexprs, LIBDEVICE=True))
    return [sig, const, div16, opt["num_warps"]]


def test_topk_router_kernel_compiles_for_sm90_without_spills(monkeypatch):
    pytest.importorskip("triton")
    from padded_moe._platform import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("captures the launch from an interpreted call")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cases = [captured_launch(monkeypatch, *c) for c in CASES]
    assert all(c[1]["LIBDEVICE"] for c in cases)
    results = compile_for_sm90(PTXAS_LOG + SCRIPT, json.dumps(cases))
    assert len(results) == len(CASES)
    assert all(r["spills"] == 0 for r in results), results
