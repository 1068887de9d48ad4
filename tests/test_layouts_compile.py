"""The unpermute kernel compiles for sm_90 within its register budget (Triton's own ptxas, no GPU).

`layouts.UNPERMUTE_MAXNREG` caps the kernel's registers so that 8 programs of 8 warps fit an SM:
left free, the INDEXED variant (slot rows read directly) took 48 registers. The cap applies up to
top-k `UNPERMUTE_MAXNREG_TOP_K` and must not make ptxas spill there; wider top-k (where it would)
launches without it. The arguments are captured from an interpreted `unpermute` call on model-like widths
and specialised as the launcher's first call would be (ints that are multiples of 16 marked so,
ints equal to 1 made constants).
"""

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
from padded_moe.kernels.layouts import _unpermute_kernel as fn

out = []
for sig, const, div16, warps, maxnreg in json.loads(sys.argv[1]):
    names = fn.arg_names
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, maxnreg=maxnreg))
    log = ptxas_log(k.asm["ptx"])
    out.append(dict(regs=int(re.search(r"Used (\d+) registers", log).group(1)),
                    spills=sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))))
print(json.dumps(out))
"""


def captured_launches(monkeypatch, layout, dtype=torch.bfloat16, k=8, K=4096) -> list:
    """(signature, constexprs, ints divisible by 16, warps, maxnreg) of the unpermute launch of an
    interpreted call on `layout` (expert outputs of `dtype`, top-k `k`, width `K`)."""
    from padded_moe.kernels import _launch
    from padded_moe.layouts import build_layout, unpermute

    seen, real = [], _launch.launch

    def spy(fn, grid, key, args, constexprs, **opt):
        seen.append((fn, args, constexprs, opt))
        return real(fn, grid, key, args, constexprs, **opt)

    monkeypatch.setattr(_launch, "launch", spy)
    M, E = 16, 32
    ids = torch.randint(0, E, (M, k), dtype=torch.int32)
    meta = build_layout(layout, ids, E)
    y = torch.randn(*meta.rows_shape(K)).to(dtype)
    unpermute(torch.empty(M, K, dtype=dtype), y, torch.rand(M, k), meta)
    (fn, args, constexprs, opt), = [s for s in seen if s[0].__name__ == "_unpermute_kernel"]
    sig, const, div16 = launch_signature(fn, args, constexprs)
    return [sig, const, div16, opt["num_warps"], opt["maxnreg"]]


def test_unpermute_fits_its_register_budget_without_spills(monkeypatch):
    """Model widths: DeepSeek-V4 / Kimi (k 6-8, K 4096-7168), GPT-OSS (k 4, K 2880), Mixtral (k 2),
    float32 outputs; and a top-k past the cap's range, which launches without it."""
    pytest.importorskip("triton")
    from padded_moe._platform import kernels_interpreted
    from padded_moe.layouts import UNPERMUTE_MAXNREG, UNPERMUTE_MAXNREG_TOP_K, GemmLayout

    if not kernels_interpreted():
        pytest.skip("captures the launch from an interpreted call")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    layouts = (GemmLayout.INDEXED, GemmLayout.GROUPED_CONTIGUOUS)
    shapes = [(torch.bfloat16, 8, 4096), (torch.float32, 8, 4096), (torch.bfloat16, 4, 2880),
              (torch.bfloat16, 2, 4096), (torch.bfloat16, 8, 7168), (torch.float32, 8, 7168)]
    assert max(k for _, k, _ in shapes) == UNPERMUTE_MAXNREG_TOP_K
    cases = [captured_launches(monkeypatch, layout, *shape) for shape in shapes for layout in layouts]
    assert all(c[4] == UNPERMUTE_MAXNREG for c in cases)
    for case, res in zip(cases, compile_for_sm90(PTXAS_LOG + SCRIPT, json.dumps(cases))):
        assert res["regs"] <= UNPERMUTE_MAXNREG and res["spills"] == 0, (case[1], res)
        # 64K registers per SM on sm_90: 8 programs of 8 warps need at most 32 per thread.
        assert res["regs"] * 32 * case[3] * 8 <= 65536, (case[1], res)
    wide = [captured_launches(monkeypatch, layout, torch.bfloat16, UNPERMUTE_MAXNREG_TOP_K + 2, 4096)
            for layout in layouts]
    assert all(c[4] is None for c in wide)
