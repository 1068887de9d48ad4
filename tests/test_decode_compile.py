"""The decode kernels compile for sm_90 with the tiles `pick_tiles` chooses on model shapes, and
both main loops are software-pipelined (cp.async copies; GEMM2's loop has no dot, so this is the
`tl.range(num_stages=...)` request taking effect). Triton's own ptxas, no GPU needed."""

from __future__ import annotations

import json

import pytest

from helpers import PTXAS_LOG, compile_for_sm90


def h200_tiles(*args, **kwargs):
    """`decode.pick_tiles(*args, <a CUDA device>, **kwargs)` as on an H200's 132 SMs, without a GPU."""
    from padded_moe import decode as dec

    class _Cuda:
        type = "cuda"

    real_cap = dec._platform.program_cap
    dec._platform.program_cap = lambda device, per_sm=8: 132 * per_sm
    try:
        return dec.pick_tiles(*args, _Cuda(), **kwargs)
    finally:
        dec._platform.program_cap = real_cap


def test_one_token_gemm1_step_divides_k():
    """At one token GEMM1's K step is the largest power of two from 128 down to 64 dividing K (no
    partial last step); wider calls, and a K no such step divides, keep 128."""
    assert h200_tiles(1, 4, 2880, 2880).bk1 == 64  # GPT-OSS: 2880 = 45 x 64
    assert h200_tiles(1, 8, 768, 2048).bk1 == 128  # Qwen3-MoE
    assert h200_tiles(2, 8, 2880, 2880).bk1 == 128
    assert h200_tiles(1, 4, 72, 200).bk1 == 128


SCRIPT = r"""
import json, os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from padded_moe.kernels import decode as kd


def compiled(fn, ptrs, ints, floats, const, warps, stages, values):
    sig = dict(ptrs)
    sig.update({n: "i32" for n in ints})
    sig.update({n: "fp32" for n in floats})
    sig.update({k: "constexpr" for k in const})
    names = fn.arg_names
    # What the launcher's specialisation sees: 16-aligned pointers, and each int it is handed as a
    # multiple of 16 (`values`: the ints the launcher passes; without them, every int).
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or (n in ints and (values is None or values[n] % 16 == 0))}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    loop = longest_loop(k.asm["sass"])
    loads = {}
    for line in loop:  # the main loop's global loads by width (LDG / cp.async, .64 / .128 ...)
        m = re.search(r"\b(LDGSTS|LDG)(\.[.\w]+)?", line)
        if m:
            loads[m.group(0)] = loads.get(m.group(0), 0) + 1
    return dict(shared=k.metadata.shared, cubin=len(k.asm["cubin"]),
                async_copies=k.asm["ttgir"].count("async_copy_global_to_local"),
                loop_instructions=len(loop), loop_loads=loads)


def longest_loop(sass):
    # The instructions of the longest backward-branch loop of the SASS (the main loop).
    lines = sass.splitlines()
    labels = {l.strip()[:-1]: i for i, l in enumerate(lines) if re.match(r"^\s*\.?L?\w+:$", l)}
    best = []
    for i, l in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?([.\w]+)\)?;", l)
        if m and labels.get(m.group(1), i) < i:
            body = [b for b in lines[labels[m.group(1)] + 1:i + 1] if "\t" in b]
            best = body if len(body) > len(best) else best
    return best


out = []
for top_k, act, t, mx, prep, v1, v2 in json.loads(sys.argv[1]):
    w = ("*i32" if prep else "*u8") if mx else "*bf16"  # words (canonical or prepared) are int32
    sc = ("*i16" if prep == "folded" else "*u8") if mx else w
    route = {"": kd.MX_BYTES, "words": kd.MX_WORDS}.get(prep, kd.MX_PREPARED).value
    mx_flags = dict(MX_ROUTE=route, UPCAST_PTX=True, FOLDED=prep == "folded")
    floats = ["limit", "alpha", "beta", "situ_beta", "situ_lambda"]
    const = dict(TOP_K=top_k, HAS_MAP=True, HAS_VT=True, HAS_BIAS=True, ACT=act, HAS_LIMIT=True, HAS_LAMBDA=False,
                 FAST=True)
    if mx:
        ptrs = {"x_ptr": "*bf16", "w_ptr": w, "s_ptr": sc, "bias_ptr": "*bf16", "h_ptr": "*bf16", "ids_ptr": "*i32",
                "map_ptr": "*i32", "vt_ptr": "*i32"}
        ints = ["N", "K", "S", "E", "L", "stride_xm", "stride_im", "stride_ik", "stride_we", "stride_wn",
                "stride_se", "stride_sn", "stride_sk", "KB", "stride_be", "stride_hm"]
        const.update(mx_flags, BN=t["bn1"], BK=t["bk1"], STAGES=t["stages1"])
        r1 = compiled(kd._decode_w13_mx_kernel, ptrs, ints, floats, const, t["warps1"], 1, v1)
    else:
        ptrs = {"x_ptr": "*bf16", "w_ptr": w, "bias_ptr": "*bf16", "h_ptr": "*bf16", "ids_ptr": "*i32",
                "map_ptr": "*i32", "vt_ptr": "*i32"}
        ints = ["N", "K", "S", "E", "L", "stride_xm", "stride_im", "stride_ik", "stride_we", "stride_wn",
                "stride_be", "stride_hm"]
        const.update(FP32_DOT=False, RB=16, BN=t["bn1"], BK=t["bk1"])
        r1 = compiled(kd._decode_w13_act_kernel, ptrs, ints, floats, const, t["warps1"], t["stages1"], v1)
    ptrs = {"h_ptr": "*bf16", "w_ptr": w, "s_ptr": sc, "bias_ptr": "*bf16", "tw_ptr": "*fp32", "out_ptr": "*bf16",
            "ids_ptr": "*i32", "map_ptr": "*i32", "vt_ptr": "*i32"}
    ints = ["K", "N", "E", "L", "stride_hm", "stride_we", "stride_wk", "stride_se", "stride_sk", "stride_sg", "KB",
            "stride_be", "stride_twm", "stride_twk", "stride_om", "stride_im", "stride_ik"]
    k_pow2 = 1 << (top_k - 1).bit_length()
    const = dict(TOP_K=top_k, K_POW2=k_pow2, HAS_MAP=True, HAS_VT=True, HAS_BIAS=True, W_MX=mx)
    const.update(mx_flags if mx else dict(MX_ROUTE=kd.MX_BYTES.value, UPCAST_PTX=False, FOLDED=False))
    const.update(BN=t["bn2"], BK=max(32, t["step2"] // (k_pow2 * t["bn2"])), STAGES=t["stages2"])
    r2 = compiled(kd._decode_w2_combine_kernel, ptrs, ints, [], const, t["warps2"], 1, v2)
    out.append(dict(top_k=top_k, act=act, mx=mx, prep=prep, w13=r1, w2=r2))
print(json.dumps(out))
"""


def test_decode_kernels_compile_for_sm90_pipelined():
    pytest.importorskip("triton")
    import dataclasses

    from padded_moe.kernels.activation import KERNEL_IDS

    cases = [(8, "silu", h200_tiles(1, 8, 768, 2048)),          # Qwen3-MoE, T=1
             (6, "silu", h200_tiles(1, 6, 2048, 4096)),         # DeepSeek-V4, T=1
             (2, "silu", h200_tiles(8, 16, 14336, 4096)),       # Mixtral, T=8
             (4, "swigluoai", h200_tiles(4, 16, 2880, 2880)),   # GPT-OSS, T=4
             (4, "relu2_no_mul", h200_tiles(2, 8, 1024, 1024))]
    mx_cases = [(6, "silu", h200_tiles(1, 6, 2048, 4096, mxfp4=True)),        # DeepSeek-V4 MXFP4
                (4, "swigluoai", h200_tiles(1, 4, 2880, 2880, mxfp4=True)),   # GPT-OSS MXFP4
                (4, "relu2_no_mul", h200_tiles(4, 16, 1024, 1024, mxfp4=True))]
    # MXFP4 cases on the canonical bytes, the same bytes as words, and the prepared 4-plane words
    # (E8M0 and folded scales).
    arg = json.dumps([(k, KERNEL_IDS[a], dataclasses.asdict(t), False, "", None, None) for k, a, t in cases]
                     + [(k, KERNEL_IDS[a], dataclasses.asdict(t), True, prep, None, None) for k, a, t in mx_cases
                        for prep in ("", "words", "bytes", "folded")])
    results = compile_for_sm90(SCRIPT, arg)
    for r in results:
        for kernel in ("w13", "w2"):
            assert r[kernel]["cubin"] > 0, r
            assert r[kernel]["async_copies"] > 0, f"{kernel} main loop not pipelined: {r}"
            assert r[kernel]["shared"] <= 227 * 1024, r


@pytest.mark.parametrize("step", ["words", "prepared"])
def test_word_routes_load_as_wide_on_gpt_oss_rows_as_on_aligned_ones(step, monkeypatch):
    """GPT-OSS's MXFP4 rows are 1440 bytes (360 int32 words, not a multiple of 16). With the row
    strides and lengths `decode_experts` actually passes, both word routes must compile to the
    same main-loop loads as with every int a multiple of 16 (16-byte copies), not to one 4-byte
    copy per word. The launcher specialises ints on divisibility by 16, so strides counted in
    words would hide the rows' 16-byte alignment from the compiler."""
    pytest.importorskip("triton")
    import dataclasses

    import torch

    from padded_moe import decode as dec
    from padded_moe.kernels.activation import KERNEL_IDS
    from padded_moe.mxfp4 import Mxfp4Tensor

    t = h200_tiles(1, 4, 2880, 2880, mxfp4=True)
    monkeypatch.setattr(dec, "MX_STEP", step)
    n = k = 2880
    top_k, experts = 4, 128

    def weight(rows, cols):  # one expert: the strides of a contiguous weight, not its size
        g = torch.Generator().manual_seed(rows)
        q = Mxfp4Tensor(torch.randint(0, 256, (1, rows, cols // 2), dtype=torch.uint8, generator=g),
                        torch.randint(118, 130, (1, rows, cols // 32), dtype=torch.uint8, generator=g))
        return dec._weight_parts(q.prepare_for() if step == "prepared" else q)

    a13, a2 = weight(2 * n, k), weight(k, n)
    assert a13.route == a2.route != 0, "the route under test was not taken"
    v1 = dict(N=n, K=k, S=top_k, E=experts, L=experts, stride_xm=k, stride_im=top_k, stride_ik=1,
              stride_we=a13.strides[0], stride_wn=a13.strides[1], stride_se=a13.scale_strides[0],
              stride_sn=a13.scale_strides[1], stride_sk=a13.scale_strides[2], KB=a13.row_bytes, stride_be=2 * n,
              stride_hm=n)
    v2 = dict(K=k, N=n, E=experts, L=experts, stride_hm=n, stride_we=a2.strides[0], stride_wk=a2.strides[1],
              stride_se=a2.scale_strides[0], stride_sk=a2.scale_strides[1], stride_sg=a2.scale_strides[2],
              KB=a2.row_bytes, stride_be=k, stride_twm=top_k, stride_twk=1, stride_om=k, stride_im=top_k,
              stride_ik=1)
    assert a13.strides[1] % 16 == 0 and a13.row_bytes % 16 == 0, "GPT-OSS rows are a multiple of 16 bytes"
    prep = "words" if step == "words" else ("folded" if a13.folded else "bytes")
    case = (top_k, KERNEL_IDS["swigluoai"], dataclasses.asdict(t), True, prep)
    real, aligned = compile_for_sm90(SCRIPT, json.dumps([case + (v1, v2), case + (None, None)]))
    for kernel in ("w13", "w2"):
        assert real[kernel]["loop_loads"] == aligned[kernel]["loop_loads"], (kernel, real, aligned)
        assert any(".128" in op for op in real[kernel]["loop_loads"]), real


# `fn` compiled for sm_90 with every pointer and int argument taken as 16-divisible (what the
# launcher sees on the model shapes these tests use).
COMPILE_SM90 = r"""
def compile_sm90(fn, ptrs, ints, floats, const, warps, stages):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = dict(ptrs)
    sig.update({n: "i32" for n in ints})
    sig.update({n: "fp32" for n in floats})
    sig.update({k: "constexpr" for k in const})
    names = fn.arg_names
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in ints}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
"""


TMA_SCRIPT = r"""
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from padded_moe.kernels import decode as kd

fn = kd._decode_w13_tma_kernel
out = []
for act, bn, bk, stages, halves, top_k in json.loads(sys.argv[1]):
    rows = 2 * bn if act < kd.ACT_SILU_NO_MUL else bn
    block = [1, 2, bn, bk] if halves else [rows, bk]
    ptrs = {"x_ptr": "*bf16", "w_desc": "tensordesc<bf16[" + ",".join(map(str, block)) + "]>", "bias_ptr": "*bf16",
            "h_ptr": "*bf16", "ids_ptr": "*i32", "map_ptr": "*i32", "vt_ptr": "*i32"}
    ints = ["N", "K", "S", "E", "L", "W_ROWS", "stride_xm", "stride_im", "stride_ik", "stride_be", "stride_hm"]
    floats = ["limit", "alpha", "beta", "situ_beta", "situ_lambda"]
    const = dict(TOP_K=top_k, HAS_MAP=True, HAS_VT=True, HAS_BIAS=True, ACT=act, HAS_LIMIT=True, HAS_LAMBDA=False,
                 FAST=True, FP32_DOT=False, RB=16, BN=bn, BK=bk, HALVES=halves)
    k = compile_sm90(fn, ptrs, ints, floats, const, 4, stages)
    sass = k.asm["sass"]
    out.append(dict(act=act, halves=halves, wgmma=sass.count("HGMMA"), tma_loads=sass.count("UTMALDG"),
                    tma_copies=k.asm["ttgir"].count("async_tma_copy_global_to_local"), shared=k.metadata.shared,
                    c7515="C7515" in ptxas_log(k.asm["ptx"])))
print(json.dumps(out))
"""


def test_tma_read_compiles_to_tma_copies_and_wgmma():
    """The TMA weight read for gate-first halves (Qwen3-MoE, DeepSeek-V4), interleaved rows
    (GPT-OSS) and non-gated rows, with the tiles `decode_experts` launches on an H200: the weight
    tiles come by TMA and meet the slot rows in wgmma (weights on its M side), software-pipelined
    (one TMA copy per stage in flight), wgmmas not serialized by ptxas (C7515)."""
    pytest.importorskip("triton")
    from padded_moe.activation import MoEActivation
    from padded_moe.kernels.activation import KERNEL_IDS

    shapes = [("silu", 1, 8, 768, 2048), ("silu", 1, 6, 2048, 4096), ("swigluoai", 1, 4, 2880, 2880),
              ("relu2_no_mul", 2, 8, 1024, 1024)]
    cases = []
    for act, t, k, n, h in shapes:
        tiles = h200_tiles(t, t * k, n, h)
        a = MoEActivation(act)
        bn = max(tiles.bn1, 32 if a.is_gated else 64)
        cases.append((KERNEL_IDS[act], bn, tiles.bk1, tiles.stages1, a.is_gated and not a.interleaved, k))
    for r in compile_for_sm90(PTXAS_LOG + COMPILE_SM90 + TMA_SCRIPT, json.dumps(cases)):
        assert r["wgmma"] > 0 and r["tma_loads"] > 0, r
        assert not r["c7515"], f"ptxas serializes the wgmmas: {r}"
        assert r["tma_copies"] >= 1, r
        assert r["shared"] <= 227 * 1024, r


MX_DOT_SCRIPT = r"""
import json, os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from padded_moe.kernels import decode as kd

fn = kd._decode_w13_mx_dot_kernel
out = []
for act, bn, bk, stages, warps, folded, top_k in json.loads(sys.argv[1]):
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*i16" if folded else "*u8", "bias_ptr": "*bf16",
            "h_ptr": "*bf16", "ids_ptr": "*i32", "map_ptr": "*i32", "vt_ptr": "*i32"}
    ints = ["N", "K", "K_PAD", "S", "E", "L", "stride_xm", "stride_im", "stride_ik", "stride_we", "stride_wn",
            "stride_se", "stride_sg", "stride_be", "stride_hm"]
    floats = ["limit", "alpha", "beta", "situ_beta", "situ_lambda"]
    const = dict(TOP_K=top_k, HAS_MAP=True, HAS_VT=True, HAS_BIAS=True, ACT=act, HAS_LIMIT=True, HAS_LAMBDA=False,
                 FAST=True, FP32_DOT=False, K_TAIL=True, UPCAST_PTX=True, FOLDED=folded, RB=16, BN=bn, BK=bk)
    k = compile_sm90(fn, ptrs, ints, floats, const, warps, stages)
    sass = k.asm["sass"]
    log = ptxas_log(k.asm["ptx"])
    spill = re.search(r"(\d+) bytes spill stores", log)
    regs = re.search(r"Used (\d+) registers", log)
    out.append(dict(act=act, bn=bn, bk=bk, folded=folded, wgmma=sass.count("HGMMA"),
                    async_copies=k.asm["ttgir"].count("async_copy_global_to_local"), shared=k.metadata.shared,
                    spills=int(spill.group(1)) if spill else 0, registers=int(regs.group(1)) if regs else -1,
                    sass_lines=len(sass.splitlines())))
print(json.dumps(out))
"""


def test_mx_dot_gemm1_compiles_to_pipelined_wgmma():
    """MXFP4 GEMM1 as an MMA (`MX_W13 = "dot"`) with the tiles `decode_experts` launches on an
    H200 (GPT-OSS's interleaved rows, DeepSeek-V4's gate-first halves, non-gated rows; E8M0 and
    folded scales): the weight words come by asynchronous copies (a pipelined loop), meet the slot
    rows in wgmma, and nothing spills."""
    from padded_moe import decode as dec
    from padded_moe.activation import MoEActivation
    from padded_moe.kernels.activation import KERNEL_IDS

    cases = []
    for act, t, k, n, h in [("swigluoai", 1, 4, 2880, 2880), ("silu", 1, 6, 2048, 4096),
                            ("relu2_no_mul", 2, 8, 1024, 1024)]:
        tiles = h200_tiles(t, t * k, n, h, mxfp4=True, mx_dot=True)
        gated = MoEActivation(act).is_gated
        bn = 2 * max(tiles.bn1, 32) if gated else max(tiles.bn1, 64)
        for folded in (False, True):
            cases.append((KERNEL_IDS[act], bn, tiles.bk1, tiles.stages1, tiles.warps1, folded, k))
    assert all(c[2] == dec.MX_DOT_BK for c in cases)
    for r in compile_for_sm90(PTXAS_LOG + COMPILE_SM90 + MX_DOT_SCRIPT, json.dumps(cases)):
        assert r["wgmma"] > 0, r
        assert r["async_copies"] > 0, f"main loop not pipelined: {r}"
        assert r["spills"] == 0, r
        assert r["shared"] <= 227 * 1024, r
