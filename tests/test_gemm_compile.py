"""The prepared-MXFP4 kernel compiles for sm_90 (Triton's own ptxas, no GPU needed).

CPU machines run the kernels interpreted, which checks their math but not that Triton can lower
them (layouts, wgmma with the upcast weights in registers, the inline PTX). This compiles the
tuned configs ahead of time in a subprocess (the test process has the kernels interpreted) and
checks that the loops are pipelined (cp.async copies) and wgmma takes its A operand from registers.
"""

from __future__ import annotations

import json

import pytest

from helpers import PTXAS_LOG, compile_for_sm90, launch_signature

# Both compile scripts look at the SASS loops that issue HGMMA (the wgmma main loops).
HGMMA_LOOPS = r"""
def hgmma_loop_bodies(sass):
    # The lines of each SASS loop (a backward branch to a label) that issues HGMMA.
    lines = sass.splitlines()
    labels = {l.strip()[:-1]: i for i, l in enumerate(lines) if re.match(r"^\s*\.?L?\w+:$", l)}
    for i, l in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?([.\w]+)\)?;", l)
        if m and labels.get(m.group(1), i) < i:
            body = lines[labels[m.group(1)] + 1:i + 1]
            if any("HGMMA" in b for b in body):
                yield body
"""

SCRIPT = r"""
import json, os, re, sys
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


def loop_shuffles(sass):
    # Shared-memory stores and warp shuffles in the SASS loops that issue HGMMA (a register layout
    # conversion goes through one or the other); -1 when no such loop is found.
    bodies = list(hgmma_loop_bodies(sass))
    return sum(bool(re.search(r"\b(STS|SHFL)\b", b)) for body in bodies for b in body) if bodies else -1


def wgmma_serialized(ptx):
    # ptxas's advisory C7515: it serializes the kernel's wgmmas (each waits for the one before).
    return "C7515" in ptxas_log(ptx)


out = []
for layout, cfg, folded, planes, act, *rest in json.loads(sys.argv[1]):
    k_tail = rest[0] if rest else True  # an iteration holding columns past K (the general case)
    cfg = kg.GemmConfig(**cfg)
    sig = {"a_ptr": "*bf16", "w_ptr": "*i32" if planes == 4 else "*u8", "s_ptr": "*i16" if folded else "*u8",
           "bias_ptr": "*bf16", "c_ptr": "*bf16",
           "ids_ptr": "*i32", "blk_exp_ptr": "*i32", "npad_ptr": "*i32", "off_ptr": "*i64", "cnt_ptr": "*i32"}
    sig.update({n: "i32" for n in ints})
    sig.update({n: "fp32" for n in ("limit", "alpha", "beta", "situ_beta", "situ_lambda")})
    gated = 0 <= act < 16  # an activation in the epilogue (kernels.activation ids), -1: none
    const = dict(LAYOUT=layout, HAS_BIAS=True, A_DIV=1, BLOCK_MB=cfg.BM, SUB=1, ROWS=cfg.BM, L_POW2=128,
                 FP32_DOT=False, K_TAIL=k_tail, UPCAST_PTX=cfg.mx_ptx, WIDE=cfg.mx_wide, FOLDED=folded, PLANES=planes,
                 W_SHARED=cfg.mx_w_shared, ACT=act, HAS_LIMIT=act >= 0, HAS_LAMBDA=False, FAST=act >= 0,
                 GATED=gated, HAS_K=True, PERSISTENT=cfg.persistent, HALF_TAIL=cfg.half_tail, BM=cfg.BM, BN=cfg.BN,
                 BN_OUT=cfg.BN // 2 if gated else cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M)
    sig.update({k: "constexpr" for k in const})
    names = fn.arg_names
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    ptx = k.asm["ptx"]
    ttgir = k.asm["ttgir"]
    wgmma = [l for l in ptx.splitlines() if "wgmma.mma_async" in l]
    out.append(dict(config=cfg.short(), layout=layout, folded=folded, planes=planes, act=act, k_tail=k_tail,
                    loop_instructions=sum(len(body) for body in hgmma_loop_bodies(k.asm["sass"])),
                    shared=k.metadata.shared,
                    cubin=len(k.asm["cubin"]), bf16x2_muls=ptx.count("mul.rn.bf16x2"),
                    logic_ops=len(re.findall(r"^\s*(?:and|or|shl|shr|prmt)\.b32", ptx, re.M)),
                    async_copies=ttgir.count("async_copy_global_to_local"),
                    # how many wgmma groups each wait in the loop leaves in flight (0: each dot waits for the last)
                    wait_pendings=sorted({int(p) for p in re.findall(r"warp_group_dot_wait .*pendings = (\d+)", ttgir)}),
                    loop_shuffles=loop_shuffles(k.asm["sass"]),
                    # shared-memory stores and shuffles anywhere (the epilogue's layout conversions)
                    sts_shfl=len(re.findall(r"\b(?:STS|SHFL)\b", k.asm["sass"])),
                    wgmma_serialized=wgmma_serialized(ptx),
                    wgmma=len(wgmma),
                    # `wgmma ... {acc}, {a regs}, b_desc, ...` when A comes from registers, `{acc}, a_desc, ...` from shared
                    a_in_registers=all(l.split("},", 1)[1].strip().startswith("{") for l in wgmma)))
print(json.dumps(out))
"""


def test_hopper_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    import dataclasses

    from padded_moe.kernels import gemm as kg

    tuned = [kg.TUNED[("mxfp4_hopper", r)] for r in ("decode", "prefill")]
    ptx = dataclasses.replace(tuned[0], mx_ptx=True)
    wide = [c for cands in kg.SWEEP_MXFP4_HOPPER.values() for c in cands if c.mx_wide]  # sweep-only variant
    unfolded_ptx = [c for c in tuned + [ptx] if c.mx_ptx]
    four = list(dict.fromkeys(tuned + [kg.TUNED[("mxfp4_hopper4", r)] for r in ("decode", "prefill")]))
    w_shared = [dataclasses.replace(kg.TUNED[("mxfp4_hopper4", "prefill")], mx_w_shared=True),
                kg.GemmConfig(128, 128, 64, 8, 8, 3, mx_hopper=True, mx_ptx=True, mx_w_shared=True)]
    cases = ([(1, c, True, 2) for c in tuned + [ptx] + wide] + [(1, c, False, 2) for c in tuned + unfolded_ptx]
             + [(0, tuned[0], True, 2), (2, tuned[0], True, 2)]
             + [(lay, c, folded, 4) for c in four for lay in (0, 1, 2) for folded in (True, False)]
             + [(1, c, True, 4) for c in w_shared])
    cases = [case + (-1,) for case in cases]
    # GEMM1 with swigluoai (3) and silu (0) in the epilogue, on the 4-plane table's tiles
    cases += [(lay, c, True, 4, act) for c in four if c.planes_ok(4) for lay in (0, 1) for act in (3, 0)]
    # persistent programs (`GemmConfig.persistent`) on the 4-plane prefill tile, with and without the epilogue
    walked = dataclasses.replace(kg.TUNED[("mxfp4_hopper4", "prefill")], persistent=True)
    cases += [(lay, walked, True, 4, act) for lay in (0, 1, 2) for act in (-1, 3)]
    # `GemmConfig.half_tail` on the 4-plane medium tile (both loop bodies compiled)
    half = dataclasses.replace(kg.TUNED[("mxfp4_hopper4", "medium")], half_tail=True)
    cases += [(lay, half, True, 4, act) for lay in (0, 1) for act in (-1, 3)]
    # ... and on the small tile (its 32-row half), the table entry
    small = kg.TUNED[("mxfp4_hopper4", "small")]
    assert small.half_tail
    cases += [(lay, small, True, 4, act) for lay in (0, 1, 2) for act in (-1, 3)]
    arg = json.dumps([(lay, dataclasses.asdict(c), folded, planes, act) for lay, c, folded, planes, act in cases])
    results = compile_for_sm90(PTXAS_LOG + HGMMA_LOOPS + SCRIPT, arg)
    for r in results:
        assert r["cubin"] > 0 and r["wgmma"] > 0, r
        assert r["async_copies"] > 0, f"main loop not pipelined: {r}"
        if "_wsh" in r["config"]:
            # the upcast tile is the shared-memory operand: wgmma's A (the tokens) comes from shared
            # memory too
            assert not r["a_in_registers"], r
        else:
            assert r["a_in_registers"], f"wgmma reads the upcast weights from shared memory: {r}"
        # ptxas keeps the wgmmas asynchronous (no advisory C7515): the K loop never runs zero times
        # (`HAS_K`), so no path defines the accumulators by plain moves
        assert r["wgmma_serialized"] is False, r
        assert r["shared"] <= 227 * 1024, r
    # Folded scales drop the 2^126 multiply: the inline-PTX upcast has half the bf16x2 multiplies.
    by_key = {(r["config"], r["layout"], r["folded"], r["planes"]): r for r in results if r["act"] < 0}
    for c in unfolded_ptx:
        folded, plain = by_key[(c.short(), 1, True, 2)], by_key[(c.short(), 1, False, 2)]
        assert 0 < folded["bf16x2_muls"] and 2 * folded["bf16x2_muls"] == plain["bf16x2_muls"], (folded, plain)
    # The 4-plane arrangement places the bits at load: fewer logic instructions per upcast value,
    # and its one dot per K step keeps wgmmas in flight (a wait leaving > 0 pending), where the
    # per-plane dots of the 2-plane kernel each wait for the one before.
    for c in tuned:
        for folded in (True, False):
            two, four = by_key[(c.short(), 1, folded, 2)], by_key[(c.short(), 1, folded, 4)]
            assert four["logic_ops"] < 0.8 * two["logic_ops"], (two, four)
            assert max(four["wait_pendings"]) > 0, four
    # The reorder of the upcast pairs into K order moves no data: on the prefill tile with folded
    # scales, no shared-memory store or shuffle in the loop. (Small tiles and byte scales convert
    # the per-group scale vector through shared memory, a few bytes per row and iteration.)
    prefill = kg.TUNED[("mxfp4_hopper4", "prefill")].short()
    for r in results:
        if r["planes"] == 4 and "_wsh" not in r["config"]:
            assert max(r["wait_pendings"]) > 0 and r["loop_shuffles"] >= 0, r
            if r["config"] == prefill and r["folded"]:
                assert r["loop_shuffles"] == 0, r
    # The activation epilogue changes what follows the loop, not the loop: the same wgmmas from
    # registers, the same pipelined copies, no extra shared-memory store or shuffle per K step.
    # (A persistent program's tile loop holds the K loop and the epilogue: its loop_shuffles count
    # the epilogue's too.)
    for r in results:
        if r["act"] >= 0:
            plain = by_key[(r["config"], r["layout"], True, 4)]
            for key in ("wgmma", "a_in_registers", "loop_shuffles", "async_copies", "wait_pendings"):
                if key != "loop_shuffles" or "_pers" not in r["config"]:
                    assert r[key] == plain[key], (key, r, plain)


def test_hopper_kernel_without_k_tail_compiles_for_sm90():
    """Where K has no tail (`K_TAIL` false: every iteration's columns lie inside K, the case of the
    models' shapes) the table tiles compile for sm_90 as they do with one: wgmmas asynchronous and
    from registers, copies pipelined, and a K loop without the tail's masks no longer."""
    pytest.importorskip("triton")
    import dataclasses

    from padded_moe.kernels import gemm as kg

    tiles = list(dict.fromkeys(kg.TUNED[("mxfp4_hopper4", r)] for r in ("decode", "small", "medium")))
    cases = [(1, c, True, 4, act, k_tail) for c in tiles for act in (-1, 3) for k_tail in (True, False)]
    arg = json.dumps([(lay, dataclasses.asdict(c), folded, planes, act, k_tail)
                      for lay, c, folded, planes, act, k_tail in cases])
    results = compile_for_sm90(PTXAS_LOG + HGMMA_LOOPS + SCRIPT, arg)
    by_key = {(r["config"], r["act"], r["k_tail"]): r for r in results}
    for c in tiles:
        for act in (-1, 3):
            tail, none = by_key[(c.short(), act, True)], by_key[(c.short(), act, False)]
            assert none["wgmma_serialized"] is False and none["a_in_registers"] and none["async_copies"] > 0, none
            assert none["wgmma"] == tail["wgmma"], (tail, none)
            assert 0 < none["loop_instructions"] <= tail["loop_instructions"], (tail, none)


LOADS_SCRIPT = r"""
import json, os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from padded_moe.kernels import gemm as kg

fn = kg._expert_gemm_mx_hopper_kernel
out = []
for sig, values, const, warps, stages in json.loads(sys.argv[1]):
    names = fn.arg_names
    # 16-aligned pointers; each int a multiple of 16 where its value is (`values` None: every int).
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or (sig[n] == "i32" and (values is None or values[n] % 16 == 0))}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    loads = {}  # global loads by width in the loops that issue HGMMA
    for body in hgmma_loop_bodies(k.asm["sass"]):
        for b in body:
            op = re.search(r"\b(LDGSTS|LDG)(\.[.\w]+)?", b)
            if op:
                loads[op.group(0)] = loads.get(op.group(0), 0) + 1
    out.append(loads)
print(json.dumps(out))
"""


@pytest.mark.parametrize("regime", ["decode", "prefill"])
def test_prepared_weights_load_as_wide_on_gpt_oss_rows_as_on_aligned_ones(regime, monkeypatch):
    """GPT-OSS's prepared rows are 360 int32 words (1440 bytes). With the arguments the launcher
    actually passes for them (captured from `launch`, not restated), the prepared-MXFP4 kernel must
    compile to the same loads in its wgmma loop as with every int a multiple of 16: 16-byte
    copies, not a 4-byte copy per word (what strides counted in words gave)."""
    pytest.importorskip("triton")
    import torch

    from padded_moe.kernels import _codes as codes
    from padded_moe.kernels import gemm as kg
    from padded_moe.mxfp4 import Mxfp4Tensor

    rows, k = 2 * 2880, 2880
    g = torch.Generator().manual_seed(7)
    q = Mxfp4Tensor(torch.randint(0, 256, (1, rows, k // 2), dtype=torch.uint8, generator=g),
                    torch.randint(118, 130, (1, rows, k // 32), dtype=torch.uint8, generator=g)).prepare_for()
    cfg = kg.TUNED[("mxfp4_hopper4", regime)]
    calls = []
    monkeypatch.setattr(kg, "launch_kernel", lambda fn, grid, key, args, const, **opt: calls.append((fn, args, const, opt)))
    a2 = torch.zeros(64, k, dtype=torch.bfloat16)
    kg.launch(a2, q.blocks, q.scales, torch.empty(64, rows, dtype=torch.bfloat16), layout=codes.GROUPED_CONTIGUOUS,
              num_local=1, offsets=torch.tensor([0, 64]), counts=torch.tensor([64], dtype=torch.int32),
              config=cfg, w_hopper=q.hopper)
    (fn, args, const, opt), = calls
    assert fn is kg._expert_gemm_mx_hopper_kernel
    names = fn.arg_names
    sig, values = {}, {}
    for n, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            sig[n] = "*" + {torch.bfloat16: "bf16", torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8",
                            torch.int64: "i64", torch.float32: "fp32"}[a.dtype]
        elif isinstance(a, float):
            sig[n] = "fp32"
        else:
            sig[n], values[n] = "i32", a
    const = {c: getattr(v, "value", v) for c, v in const.items()}  # tl.constexpr codes as plain values
    const.update(UPCAST_PTX=True, FP32_DOT=False)  # what a CUDA bf16 call takes
    sig.update({c: "constexpr" for c in const})
    assert values["stride_wn"] % 16 == 0, "GPT-OSS rows are 1440 bytes: the launcher must say so"
    case = (sig, values, const, opt["num_warps"], opt["num_stages"])
    real, aligned = compile_for_sm90(HGMMA_LOOPS + LOADS_SCRIPT, json.dumps([case, case[:1] + (None,) + case[2:]]))
    assert real == aligned and any(".128" in op for op in real), (real, aligned)


TMA_SCRIPT = r"""
import json, os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from padded_moe.kernels import gemm as kg

fn = kg._expert_gemm_kernel


def spills(ptx):
    # bytes ptxas spills (stores + loads), from its -v report
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas_log(ptx)))


out = []
for sig, const, warps, stages, aligned in json.loads(sys.argv[1]):
    names = fn.arg_names
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n].startswith("*") or n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = k.asm["ptx"]
    wgmma = [l for l in ptx.splitlines() if "wgmma.mma_async" in l]
    ttgir = k.asm["ttgir"]
    dots = [l for l in ttgir.splitlines() if "ttng.warp_group_dot " in l]
    out.append(dict(widths=sorted({int(n) for n in re.findall(r"m64n(\d+)k16", " ".join(wgmma))}),
                    wgmma=len(wgmma), tma=ptx.count("cp.async.bulk.tensor"),
                    async_copies=ttgir.count("async_copy_global_to_local"), shared=k.metadata.shared,
                    spills=spills(ptx) if "ptxas_log" in globals() else None,
                    # ptxas's advisory C7515: it serializes the kernel's wgmmas
                    wgmma_serialized=("C7515" in ptxas_log(ptx)) if "ptxas_log" in globals() else None,
                    # register tiles stored to shared memory (none when TMA feeds both operands)
                    local_stores=ttgir.count("ttg.local_store"),
                    persistent=const.get("PERSISTENT"),
                    dot_operands_shared=all(l.count("!ttg.memdesc") >= 2 for l in dots) and bool(dots)))
print(json.dumps(out))
"""


def _captured_launch(cfg, layout: int, epi, tile: str = "one_tile", rows: int = 256):
    """(signature, constexprs, num_warps, num_stages, ints divisible by 16) of the
    `_expert_gemm_kernel` launch that `kg.launch` makes for a bf16 GEMM1 of 2 experts (K 1024, N 512) on `layout`, `epi` the
    activation in the epilogue (None: none), gate-first weights read as `tile` says: the
    arguments as the launcher passes them (TMA descriptors, pointers, ints)."""
    import torch

    from padded_moe.activation import ActivationEpilogue
    from padded_moe.kernels import _codes as codes
    from padded_moe.kernels import gemm as kg

    L, n, k = 2, 512, 1024
    calls = []

    def grab(fn, grid, key, args, const, **opt):
        calls.append((fn, args, const, opt))

    kg_launch, kg_tile, kg.launch_kernel, kg.GATE_UP_TMA = kg.launch_kernel, kg.GATE_UP_TMA, grab, tile
    try:
        w = torch.zeros(L, 2 * n, k, dtype=torch.bfloat16)
        out = torch.empty(rows, n if epi else 2 * n, dtype=torch.bfloat16)
        if layout == codes.INDEXED:
            meta = dict(sorted_ids=torch.arange(rows, dtype=torch.int32), block_m=cfg.BM, mk=rows,
                        block_expert=torch.tensor([0, 1], dtype=torch.int32),
                        num_padded=torch.tensor([rows], dtype=torch.int32))
        else:
            meta = dict(offsets=torch.tensor([0, rows // 2, rows]),
                        counts=torch.tensor([rows // 2, rows // 2], dtype=torch.int32))
        kg.launch(torch.zeros(rows, k, dtype=torch.bfloat16), w, None, out, layout=layout, num_local=L, config=cfg,
                  epilogue=ActivationEpilogue.of(epi) if epi else None, rows_per_expert=1024, **meta)
    finally:
        kg.launch_kernel, kg.GATE_UP_TMA = kg_launch, kg_tile
    (fn, args, const, opt), = calls
    sig, const, aligned = launch_signature(fn, args, const)
    const.update(FP32_DOT=False)  # what a CUDA bf16 call takes
    sig["FP32_DOT"] = "constexpr"
    return sig, const, opt["num_warps"], opt["num_stages"], aligned


def test_gate_first_tma_tile_compiles_to_one_full_width_mma():
    """bf16 TMA tiles with silu in the epilogue: `GATE_UP_TMA = "one_tile"` (a 4-D descriptor over
    [L, 2, N, K]) compiles to the plain kernel's loop, MMAs of the tile's full width and the same
    TMA copies; "two_tiles" to MMAs of half the width. Arguments captured from `launch` itself."""
    pytest.importorskip("triton")
    from padded_moe.kernels import _codes as codes
    from padded_moe.kernels import gemm as kg

    cfg = kg.TUNED[("bf16", "prefill")]
    assert cfg.tma and cfg.BN == 256
    cases = [_captured_launch(cfg, codes.GROUPED_CONTIGUOUS, epi, tile)
             for tile, epi in (("two_tiles", None), ("two_tiles", "silu"), ("one_tile", "silu"))]
    plain, two, one = compile_for_sm90(HGMMA_LOOPS + TMA_SCRIPT, json.dumps(cases))
    assert plain["widths"] == [256] and two["widths"] == [128] and one["widths"] == [256], (plain, two, one)
    assert one["tma"] == plain["tma"] and one["local_stores"] == plain["local_stores"], (plain, one)
    assert plain["dot_operands_shared"] and one["dot_operands_shared"], (plain, one)


def test_half_tail_tiles_compile_both_loops():
    """`GemmConfig.half_tail` on the bf16 medium and prefill tiles (INDEXED: gathered A rows;
    grouped: a second TMA descriptor of BM/2-row blocks), with and without silu in the epilogue:
    both loop bodies are there (more wgmmas than the plain tile, the full tile's widths kept), each
    pipelined like the plain tile's, no spills, asynchronous wgmmas, shared memory within the SM's."""
    pytest.importorskip("triton")
    import dataclasses

    from padded_moe.kernels import _codes as codes
    from padded_moe.kernels import gemm as kg

    cases = [_captured_launch(c, layout, epi) for regime in ("medium", "prefill")
             for layout in (codes.INDEXED, codes.GROUPED_CONTIGUOUS) for epi in (None, "silu")
             for c in (kg.TUNED[("bf16", regime)], dataclasses.replace(kg.TUNED[("bf16", regime)], half_tail=True))]
    results = compile_for_sm90(PTXAS_LOG + HGMMA_LOOPS + TMA_SCRIPT, json.dumps(cases))
    for plain, half in zip(results[::2], results[1::2]):
        assert set(plain["widths"]) <= set(half["widths"]) and half["wgmma"] > plain["wgmma"], (plain, half)
        assert half["tma"] >= plain["tma"] and half["async_copies"] >= plain["async_copies"], (plain, half)
        assert half["local_stores"] == plain["local_stores"] and half["dot_operands_shared"], (plain, half)
        assert half["spills"] == 0 and half["wgmma_serialized"] is False, half
        assert half["shared"] <= 227 * 1024, half


def test_dynamic_tile_order_compiles_to_the_same_main_loop():
    """`GemmConfig.dynamic` (tiles from a device counter) on the bf16 medium tile, alone and with
    half tiles, INDEXED and grouped, with silu in the epilogue: the static walk's wgmma widths and
    copies, no spills, asynchronous wgmmas, shared memory within the SM's."""
    pytest.importorskip("triton")
    import dataclasses

    from padded_moe.kernels import _codes as codes
    from padded_moe.kernels import gemm as kg

    cfg = kg.TUNED[("bf16", "medium")]
    assert cfg.persistent
    cases = [_captured_launch(c, layout, "silu") for layout in (codes.INDEXED, codes.GROUPED_CONTIGUOUS)
             for half in (False, True)
             for c in (dataclasses.replace(cfg, half_tail=half), dataclasses.replace(cfg, half_tail=half, dynamic=True))]
    results = compile_for_sm90(PTXAS_LOG + HGMMA_LOOPS + TMA_SCRIPT, json.dumps(cases))
    for static, dynamic in zip(results[::2], results[1::2]):
        same = ("widths", "wgmma", "tma", "async_copies", "local_stores", "dot_operands_shared")
        assert {k: static[k] for k in same} == {k: dynamic[k] for k in same}, (static, dynamic)
        assert dynamic["spills"] == 0 and dynamic["wgmma_serialized"] is False, dynamic
        assert dynamic["shared"] <= 227 * 1024, dynamic


def test_persistent_programs_compile_to_the_same_main_loop():
    """`GemmConfig.persistent` on the bf16 prefill tile (INDEXED: gathered A rows; grouped: TMA A),
    with and without silu in the epilogue: the same wgmma widths and the same TMA and async
    copies as one program per tile, the K loop still pipelined, no spills, and shared memory
    within the SM's."""
    pytest.importorskip("triton")
    import dataclasses

    from padded_moe.kernels import _codes as codes
    from padded_moe.kernels import gemm as kg

    cfg = kg.TUNED[("bf16", "prefill")]
    cases = [_captured_launch(c, layout, epi) for layout in (codes.INDEXED, codes.GROUPED_CONTIGUOUS)
             for epi in (None, "silu")
             for c in (dataclasses.replace(cfg, persistent=False), dataclasses.replace(cfg, persistent=True))]
    results = compile_for_sm90(PTXAS_LOG + HGMMA_LOOPS + TMA_SCRIPT, json.dumps(cases))
    for one, walked in zip(results[::2], results[1::2]):
        assert one["persistent"] is False and walked["persistent"] is True, (one, walked)
        same = ("widths", "tma", "async_copies", "local_stores", "dot_operands_shared")
        assert {k: one[k] for k in same} == {k: walked[k] for k in same}, (one, walked)
        assert walked["tma"] + walked["async_copies"] > 0 and walked["spills"] == 0, walked
        assert walked["shared"] <= 227 * 1024, walked
        assert walked["wgmma_serialized"] is False, walked
