"""expert_gemm on an H200-class GPU: real model shapes, every layout, bf16 and MXFP4, CUDA graphs,
torch._grouped_mm, and (when installed, `-m slow`) humming-kernels.

References are float64 on the GPU, per expert, over the rows the layout must compute; only the
experts that received rows are dequantized, so 256-expert weights stay affordable.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch
from helpers import REL_TOL, SENTINEL, extreme_mxfp4_weight, rel_err

from padded_moe import layout_codes as codes
from padded_moe.backends import get_backend
from padded_moe.gemm import expert_gemm
from padded_moe.kernels import gemm as kg
from padded_moe.kernels.gemm import GemmConfig
from padded_moe.layouts import GemmLayout, GroupedContiguousMeta, GroupedMaskedMeta, IndexedMeta, build_layout
from padded_moe.mxfp4 import Mxfp4Tensor, dequantize_mxfp4, quantize_mxfp4

pytestmark = pytest.mark.gpu

LAYOUTS = [GemmLayout.INDEXED, GemmLayout.GROUPED_CONTIGUOUS, GemmLayout.GROUPED_MASKED]
DEV = "cuda"


def make_weight(L, n_out, K, wdtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(L, n_out, K, generator=g, device=DEV, dtype=torch.bfloat16) / math.sqrt(K)
    if wdtype.startswith("mxfp4"):  # quantize in chunks: quantize_mxfp4 works in float64
        parts = [quantize_mxfp4(w[i:i + 8]) for i in range(0, L, 8)]
        q = Mxfp4Tensor(torch.cat([p.blocks for p in parts]), torch.cat([p.scales for p in parts]))
        return q.prepare_for() if wdtype == "mxfp4_hopper" else q
    return w


def expert_w64(w, e):
    if isinstance(w, Mxfp4Tensor):
        return dequantize_mxfp4(w[e], torch.float64)[0]
    return w[e].double()


def rows_of(meta, stage, a_rows):
    """(expert, a_row, out_row) int64 tensors for every row the layout must compute (host side)."""
    if isinstance(meta, IndexedMeta):
        mk = meta.num_tokens * meta.top_k
        npad = int(meta.num_padded)
        ids = meta.sorted_ids[:npad].long()
        e = meta.block_expert.long().repeat_interleave(meta.block_m)[:npad]
        keep = (ids < mk) & (e >= 0)
        ids, e = ids[keep], e[keep]
        return e, (ids // meta.top_k if stage == "w13" else ids), ids
    if isinstance(meta, GroupedContiguousMeta):
        off = meta.offsets.long()
        pos = torch.arange(int(off[-1]), device=off.device)
        e = torch.searchsorted(off[1:], pos, right=True)
        return e, pos, pos
    T = meta.max_tokens_per_expert
    pos = torch.arange(meta.num_local * T, device=meta.counts.device)
    keep = (pos % T) < meta.counts.long()[pos // T]
    pos = pos[keep]
    return pos // T, pos, pos


def check(a, w, meta, stage, out, bias=None, w_ref=None):
    """`w_ref`: the weight the reference uses when `w` is `prepared_only` (garbage canonical bytes)."""
    w = w if w_ref is None else w_ref
    n_out = w.shape[1]
    a2 = a.reshape(-1, a.shape[-1])
    flat = out.reshape(-1, n_out)
    e, ar, cr = rows_of(meta, stage, None)
    written = torch.zeros(flat.shape[0], dtype=torch.bool, device=DEV)
    written[cr] = True
    assert (flat[~written] == SENTINEL).all(), "rows outside the layout were written"
    num, den = 0.0, 0.0
    for ex in torch.unique(e).tolist():
        sel = e == ex
        ref = a2[ar[sel]].double() @ expert_w64(w, ex).T
        if bias is not None:
            ref += bias[ex].double()
        num += (flat[cr[sel]].double() - ref).norm().item() ** 2
        den += ref.norm().item() ** 2
        assert torch.isfinite(flat[cr[sel]]).all()
    err = math.sqrt(num / max(den, 1e-30))
    assert err < REL_TOL[torch.bfloat16], f"relative error {err:.3g}"


def inputs_for(layout, meta, stage, K, M, k, seed):
    """Fresh inputs with NaN in every row the layout must not read."""
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    if layout == GemmLayout.GROUPED_MASKED:
        a = torch.randn(meta.num_local, meta.max_tokens_per_expert, K, generator=g, device=DEV).bfloat16()
        T = meta.max_tokens_per_expert
        a[torch.arange(T, device=DEV)[None, :] >= meta.counts[:, None].long()] = float("nan")
        return a
    if layout == GemmLayout.GROUPED_CONTIGUOUS:
        a = torch.randn(M * k, K, generator=g, device=DEV).bfloat16()
        a[torch.arange(M * k, device=DEV) >= meta.offsets[-1]] = float("nan")
        return a
    rows = M if stage == "w13" else M * k
    a = torch.randn(rows, K, generator=g, device=DEV).bfloat16()
    _, used, _ = rows_of(meta, stage, None)
    mask = torch.ones(rows, dtype=torch.bool, device=DEV)
    mask[used] = False
    a[mask] = float("nan")
    return a


def out_for(layout, meta, a, n_out):
    if layout == GemmLayout.GROUPED_MASKED:
        shape = (meta.num_local, meta.max_tokens_per_expert, n_out)
    elif layout == GemmLayout.INDEXED:
        shape = (meta.num_tokens * meta.top_k, n_out)
    else:
        shape = (a.shape[0], n_out)
    return torch.full(shape, SENTINEL, dtype=torch.bfloat16, device=DEV)


# (name, L, K, N, k, M tokens, bias): DSV4 (E=256, K=4096, N=2048), GPT-OSS (E=128, K=N=2880),
# and a prefill-sized case on 8 experts (>= 1024 rows per expert).
SHAPES = [
    ("dsv4", 256, 4096, 2048, 6, 96, False),
    ("gpt_oss", 128, 2880, 2880, 4, 96, True),
    ("prefill", 8, 4096, 2048, 2, 4096, False),
]


def weight_cache(one_at_a_time: bool = False):
    """`get(name, L, n_out, K, wdtype)`: each model weight made once per module; with
    `one_at_a_time` only the last one is kept (model-sized weights of several models)."""
    cache = {}

    def get(name, L, n_out, K, wdtype):
        key = (name, n_out, K, wdtype)
        if key not in cache:
            if one_at_a_time:
                cache.clear()
            cache[key] = make_weight(L, n_out, K, wdtype, hash(key) % 1000)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def weights():
    return weight_cache()


def real_shape_case(shape, stage, layout, weights, wdtype, block_m=None):
    """`(w, meta, a, bias, out)` for one model shape: ids with -1 and out-of-range garbage (each
    expert at most once per token for prefill), NaN-poisoned padded rows, a poisoned output.
    `block_m`: INDEXED's row block (None: the default)."""
    name, L, K, N, k, M, with_bias = shape
    n_out, k_in = (2 * N, K) if stage == "w13" else (K, N)
    w = weights(name, L, n_out, k_in, wdtype)
    g = torch.Generator(device=DEV).manual_seed(7)
    ids = torch.randint(-1, L + 2, (M, k), generator=g, device=DEV, dtype=torch.int32)
    if name == "prefill":
        ids = torch.stack([torch.randperm(L, device=DEV)[:k] for _ in range(M)]).int()
    meta = build_layout(layout, ids, L, block_m=block_m if layout == GemmLayout.INDEXED else None)
    a = inputs_for(layout, meta, stage, k_in, M, k, 3)
    bias = torch.randn(L, n_out, device=DEV).bfloat16() if with_bias else None
    return w, meta, a, bias, out_for(layout, meta, a, n_out)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
@pytest.mark.parametrize("wdtype", ["bf16", "mxfp4"])
@pytest.mark.parametrize("stage", ["w13", "w2"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_real_shapes(shape, wdtype, stage, layout, weights):
    w, meta, a, bias, out = real_shape_case(shape, stage, layout, weights, wdtype)
    expert_gemm(a, w, meta, stage=stage, bias=bias, out=out, backend="triton")
    torch.cuda.synchronize()
    check(a, w, meta, stage, out, bias)


# Every code path of the compiled kernel, whatever the tuned table picks today: TMA descriptors
# (small and big tiles), MXFP4 through the bit-assembly dequantization instead of dot_scaled, and
# dot_scaled with the operands swapped.
FORCED_CONFIGS = [GemmConfig(32, 64, 128, 1, 4, 4, tma=True), GemmConfig(128, 256, 64, 8, 8, 3, tma=True),
                  GemmConfig(64, 128, 64, 4, 4, 4, mx_native=False), GemmConfig(32, 128, 128, 1, 4, 4, swap_ab=True),
                  GemmConfig(64, 128, 128, 4, 8, 3, swap_ab=True)]


@pytest.mark.parametrize("cfg", FORCED_CONFIGS, ids=lambda c: c.short())
@pytest.mark.parametrize("wdtype", ["bf16", "mxfp4"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_forced_kernel_paths(cfg, wdtype, layout, weights):
    name, L, K, N, k, M, _ = SHAPES[2]  # prefill-sized: full and partial tiles per expert
    w = weights(name, L, 2 * N, K, wdtype)
    g = torch.Generator(device=DEV).manual_seed(13)
    ids = torch.stack([torch.randperm(L, device=DEV, generator=g)[:k] for _ in range(M // 3)]).int()
    ids[::7, 0] = -1  # dropped slots make counts that are not multiples of any tile
    meta = build_layout(layout, ids, L)
    a = inputs_for(layout, meta, "w13", K, ids.shape[0], k, 17)
    out = out_for(layout, meta, a, 2 * N)
    get_backend("triton").gemm(a, w, meta, stage="w13", bias=None, out=out, config=cfg)
    torch.cuda.synchronize()
    check(a, w, meta, "w13", out)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_torch_backend_cuda(layout):
    """torch backend on CUDA: _grouped_mm (GROUPED_CONTIGUOUS bf16), bmm (masked), loop (indexed)."""
    L, K, n_out, M, k = 16, 512, 256, 200, 4
    w = make_weight(L, n_out, K, "bf16", 1)
    ids = torch.randint(-1, L + 1, (M, k), device=DEV, dtype=torch.int32)
    meta = build_layout(layout, ids, L)
    a = inputs_for(layout, meta, "w13", K, M, k, 5)
    out = out_for(layout, meta, a, n_out)
    expert_gemm(a, w, meta, out=out, backend="torch")
    check(a, w, meta, "w13", out)


def replay_on_new_routings(layout, w, gemm, id_highs=(17, 17), L=16, K=512, M=64, k=4):
    """`gemm(a, meta, out)` captured once in a CUDA graph, then replayed after the layout's buffers
    took new routings (ids in [-1, high) per trial: garbage ids past L, or few experts) and fresh
    NaN-poisoned inputs; each replay checked against the reference."""
    n_out = w.shape[1]
    ids = torch.randint(0, L, (M, k), device=DEV, dtype=torch.int32)
    meta = build_layout(layout, ids, L)
    a = inputs_for(layout, meta, "w13", K, M, k, 9)
    out = out_for(layout, meta, a, n_out)
    gemm(a, meta, out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(a, meta, out)
    for trial, high in enumerate(id_highs):
        fresh = build_layout(layout, torch.randint(-1, high, (M, k), device=DEV, dtype=torch.int32), L)
        for f in dataclasses.fields(meta):  # same buffers, new contents
            old, new = getattr(meta, f.name), getattr(fresh, f.name)
            if isinstance(old, torch.Tensor):
                old.copy_(new)
        a.copy_(inputs_for(layout, meta, "w13", K, M, k, 20 + trial))
        out.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        check(a, w, meta, "w13", out)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
@pytest.mark.parametrize("wdtype", ["bf16", "mxfp4", "mxfp4_hopper"])
def test_cuda_graph_replay_after_ids_change(layout, wdtype):
    w = make_weight(16, 256, 512, wdtype, 2)
    replay_on_new_routings(layout, w, lambda a, meta, out: expert_gemm(a, w, meta, out=out))


# The medium / prefill tiles of both tables, each with one of its switches off and on:
# `GemmConfig.persistent` (programs walking tiles) and `GemmConfig.half_tail` (a tile whose rows all
# lie in its first half runs as a half tile; the few-row shapes take that path on every tile, the
# prefill shape on some).
# `GemmConfig.dynamic` (persistent programs taking tiles from a device counter) only on the bf16
# entries, as persistent programs: the prepared-MXFP4 kernel refuses it.
SWITCHED_CONFIGS = [(switch, w, kg.TUNED[(kind, reg)] if switch != "dynamic" else
                     dataclasses.replace(kg.TUNED[(kind, reg)], persistent=True))
                    for switch in ("persistent", "half_tail", "dynamic")
                    for w, kind in (("bf16", "bf16"), ("mxfp4_hopper", "mxfp4_hopper4"))
                    for reg in ("medium", "prefill") if not (switch == "dynamic" and w != "bf16")]
# The prepared-MXFP4 small entry runs half tiles too (32 of its 64 rows).
SWITCHED_CONFIGS += [("half_tail", "mxfp4_hopper", kg.TUNED[("mxfp4_hopper4", "small")])]


@pytest.mark.parametrize("switch,wdtype,cfg", SWITCHED_CONFIGS, ids=lambda v: v if isinstance(v, str) else v.short())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
@pytest.mark.parametrize("stage", ["w13", "w2"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_switch_keeps_the_tiles_bits(layout, stage, shape, switch, wdtype, cfg, weights):
    """Model shapes with garbage ids, NaN-poisoned padding and biases: the tile with `switch` on
    matches the reference and gives the bits of the same tile with it off."""
    w, meta, a, bias, out = real_shape_case(shape, stage, layout, weights, "mxfp4" if wdtype != "bf16" else "bf16")
    w_ref = None
    if wdtype == "mxfp4_hopper":
        w, w_ref = prepared_only(w, 4), w
    be = get_backend("triton")
    off = be.gemm(a, w, meta, stage=stage, bias=bias, out=out.clone(), config=dataclasses.replace(cfg, **{switch: False}))
    on = be.gemm(a, w, meta, stage=stage, bias=bias, out=out, config=dataclasses.replace(cfg, **{switch: True}))
    torch.cuda.synchronize()
    check(a, w, meta, stage, on, bias, w_ref=w_ref)
    assert torch.equal(off, on)


@pytest.mark.parametrize("wdtype", ["bf16", "mxfp4_hopper"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
@pytest.mark.parametrize("stage", ["w13", "w2"])
def test_masked_walk_keeps_the_tiles_bits(stage, shape, wdtype, weights, monkeypatch):
    """GROUPED_MASKED as persistent programs over the tiles with rows (`kernels.gemm.MASKED_WALK`),
    slabs with room for every slot (`T_max` = M*k), the call's default tile: the reference and the
    bits of one program per tile."""
    w, meta, a, bias, out = real_shape_case(shape, stage, GemmLayout.GROUPED_MASKED, weights,
                                            "mxfp4" if wdtype != "bf16" else "bf16")
    w_ref = None
    if wdtype == "mxfp4_hopper":
        w, w_ref = prepared_only(w, 4), w
    be = get_backend("triton")
    monkeypatch.setattr(kg, "MASKED_WALK", False)
    off = be.gemm(a, w, meta, stage=stage, bias=bias, out=out.clone())
    monkeypatch.setattr(kg, "MASKED_WALK", True)
    on = be.gemm(a, w, meta, stage=stage, bias=bias, out=out)
    torch.cuda.synchronize()
    check(a, w, meta, stage, on, bias, w_ref=w_ref)
    assert torch.equal(off, on)


@pytest.mark.parametrize("wdtype", ["bf16", "mxfp4_hopper"])
def test_masked_walk_graph_replay_after_counts_change(wdtype, monkeypatch):
    """Captured once, replayed on new routings: the walk ends where each routing's counts say."""
    monkeypatch.setattr(kg, "MASKED_WALK", True)
    w = make_weight(16, 256, 512, wdtype, 2)
    replay_on_new_routings(GemmLayout.GROUPED_MASKED, w, lambda a, meta, out: expert_gemm(a, w, meta, out=out),
                           id_highs=(17, 3), M=512)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_persistent_graph_replay_after_ids_change(layout):
    """Captured once, replayed on new routings (garbage ids, then few experts): INDEXED's walk ends
    where each routing's `num_padded` says (a device value), GROUPED_CONTIGUOUS's where its offsets
    say."""
    w = make_weight(16, 256, 512, "bf16", 2)
    cfg = dataclasses.replace(kg.TUNED[("bf16", "prefill")], persistent=True)
    be = get_backend("triton")
    replay_on_new_routings(layout, w, lambda a, meta, out: be.gemm(a, w, meta, stage="w13", bias=None, out=out,
                                                                   config=cfg), id_highs=(17, 3), M=512)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("humming") is None, reason="humming-kernels not installed")
@pytest.mark.parametrize("layout", [GemmLayout.GROUPED_MASKED, GemmLayout.GROUPED_CONTIGUOUS, GemmLayout.INDEXED],
                         ids=lambda l: l.value)
def test_humming_backend(layout):
    """JIT-compiles about 20 s per configuration on first use (set HUMMING_CACHE_DIR); INDEXED with
    humming's own row block (`indexed_block_m`)."""
    L, K, N, M, k = 32, 2880, 2880, 64, 4
    w = make_weight(L, 2 * N, K, "mxfp4", 4)
    ids = torch.randint(-1, L + 1, (M, k), device=DEV, dtype=torch.int32)
    # humming's INDEXED kernel reads row blocks of its own BLOCK_M
    bm = get_backend("humming").indexed_block_m(w, M * k) if layout == GemmLayout.INDEXED else None
    meta = build_layout(layout, ids, L, block_m=bm)  # None: the default block (ignored off INDEXED)
    a = inputs_for(layout, meta, "w13", K, M, k, 11)
    out = out_for(layout, meta, a, 2 * N)
    expert_gemm(a, w, meta, out=out, backend="humming")
    torch.cuda.synchronize()
    check(a, w, meta, "w13", out)


def test_repeated_launch_skips_triton_binding(monkeypatch):
    """A second call with the same key launches the compiled binary directly (no JITFunction.run),
    and a call whose input alignment changes goes back through Triton (a new specialisation)."""
    from padded_moe.kernels import gemm as kg

    calls = []
    original = kg._expert_gemm_kernel.run
    monkeypatch.setattr(kg._expert_gemm_kernel, "run", lambda *a, **k: calls.append(1) or original(*a, **k))
    L, M, K, N = 4, 32, 256, 128
    w = (torch.randn(L, N, K, device="cuda") * 0.05).bfloat16()
    ids = torch.randint(0, L, (M, 1), device="cuda", dtype=torch.int32)
    meta = build_layout("grouped_contiguous", ids, L)
    base = torch.randn(M * K + 8, device="cuda", dtype=torch.bfloat16)
    outs = []
    for offset in (0, 0, 1, 1):
        a = base[offset:offset + M * K].view(M, K)
        outs.append((a, expert_gemm(a, w, meta, out=torch.full((M, N), float("nan"), device="cuda",
                                                                dtype=torch.bfloat16))))
    torch.cuda.synchronize()
    assert len(calls) == 2, len(calls)  # first aligned call, first misaligned call
    # GROUPED_CONTIGUOUS: row r belongs to the expert whose [offsets[e], offsets[e+1]) holds it.
    expert_of_row = torch.bucketize(torch.arange(M), meta.offsets.cpu()[1:], right=True).tolist()
    for a, out in outs:
        ref = torch.stack([a[r].float() @ w[expert_of_row[r]].float().T for r in range(M)])
        assert rel_err(out, ref) <= 1e-2


# ---------------------------------------------------------------------------------------------
# MXFP4 prepared for the Hopper kernel (Mxfp4Tensor.prepare_for): `pytest -m gpu -k hopper`
# ---------------------------------------------------------------------------------------------


def prepared_only(q: Mxfp4Tensor, planes: int = 2) -> Mxfp4Tensor:
    """A prepared copy of `q` (`planes`: the arrangement) whose canonical bytes are garbage with NaN
    scales: a correct result can only come from the prepared form (check against `q` with `w_ref=q`)."""
    h = Mxfp4Tensor(q.blocks, q.scales).prepare_for(planes=planes).hopper
    return Mxfp4Tensor(torch.full_like(q.blocks, 0x77), torch.full_like(q.scales, 255), h)


@pytest.mark.parametrize("planes", [2, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
@pytest.mark.parametrize("stage", ["w13", "w2"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_mxfp4_hopper_real_shapes(shape, stage, layout, planes, weights):
    """The tuned config for the shape's regime, model shapes, NaN-poisoned padding, biases, both
    prepared arrangements."""
    q, meta, a, bias, out = real_shape_case(shape, stage, layout, weights, "mxfp4")
    expert_gemm(a, prepared_only(q, planes), meta, stage=stage, bias=bias, out=out, backend="triton")
    torch.cuda.synchronize()
    check(a, None, meta, stage, out, bias, w_ref=q)


# Every medium / prefill candidate on the model shapes where one big tile (since taken out of the
# sweep) gave non-finite outputs: INDEXED at 1024 rows per expert (the kernel tile is then BM 64)
# and GROUPED_MASKED on DeepSeek-V4 shapes (256 mostly empty 576-row slabs).
BIG_TILES = sorted({c for reg in ("medium", "prefill") for c in kg.SWEEP_MXFP4_HOPPER[reg]}, key=lambda c: c.short())


@pytest.mark.parametrize("cfg", BIG_TILES, ids=lambda c: c.short())
@pytest.mark.parametrize("shape,layout", [(SHAPES[2], GemmLayout.INDEXED), (SHAPES[0], GemmLayout.GROUPED_MASKED)],
                         ids=["indexed-prefill", "masked-dsv4"])
def test_mxfp4_hopper_big_tiles_on_model_shapes(shape, layout, cfg, weights):
    q, meta, a, bias, out = real_shape_case(shape, "w13", layout, weights, "mxfp4")
    get_backend("triton").gemm(a, prepared_only(q, 2 if cfg.planes_ok(2) else 4), meta, stage="w13", bias=bias,
                               out=out, config=cfg)
    torch.cuda.synchronize()
    check(a, None, meta, "w13", out, bias, w_ref=q)


# Every sweep candidate on GROUPED_CONTIGUOUS (the layouts share the row selection, `_tile_rows`),
# and the tuned entries on the other two layouts.
HOPPER_CONFIGS = sorted({c for cands in kg.SWEEP_MXFP4_HOPPER.values() for c in cands}, key=lambda c: c.short())
HOPPER_CASES = [(GemmLayout.GROUPED_CONTIGUOUS, c, p) for c in HOPPER_CONFIGS for p in (2, 4)
                if c.planes_ok(p)] + [
    (lay, kg.TUNED[(kg.table_kind(True, True, p), reg)], p) for lay in (GemmLayout.INDEXED, GemmLayout.GROUPED_MASKED)
    for reg in ("decode", "small", "medium", "prefill") for p in (2, 4)]


@pytest.mark.parametrize("layout, cfg, planes", HOPPER_CASES,
                         ids=lambda x: x.value if isinstance(x, GemmLayout) else x.short() if isinstance(x, GemmConfig)
                         else f"planes{x}")
def test_mxfp4_hopper_every_sweep_config(layout, cfg, planes):
    """Every config the benchmark may put into TUNED, on K = 1056 (not a multiple of 64, so the
    prepared weight is padded, and the last iteration of BK=128/256 holds blocks past the
    padded K) with counts that are not multiples of any tile, dropped slots and a bias."""
    L, K, n_out, M, k = 8, 1056, 384, 300, 2
    q = make_weight(L, n_out, K, "mxfp4", 21)
    g = torch.Generator(device=DEV).manual_seed(23)
    ids = torch.stack([torch.randperm(L, device=DEV, generator=g)[:k] for _ in range(M)]).int()
    ids[::7, 0] = -1
    meta = build_layout(layout, ids, L)
    a = inputs_for(layout, meta, "w13", K, M, k, 29)
    bias = torch.randn(L, n_out, device=DEV).bfloat16()
    out = out_for(layout, meta, a, n_out)
    get_backend("triton").gemm(a, prepared_only(q, planes), meta, stage="w13", bias=bias, out=out, config=cfg)
    torch.cuda.synchronize()
    check(a, None, meta, "w13", out, bias, w_ref=q)


# 256-row tiles (token rows on the MMA's N side: wgmma n256, the widest the kernel compiles), which
# take a whole 256-row INDEXED block. No table uses them (whole calls were 1.13-1.36x slower than the
# table on GPT-OSS and DeepSeek-V4 at 192-512 mean rows), but a caller's config may: counts that
# leave each expert a full and a partial tile, dropped slots, a bias, K with and without a tail,
# NaN-poisoned padding, every layout.
TILES_256 = [GemmConfig(256, 128, 64, 8, 8, 3, mx_hopper=True, mx_ptx=True),
             GemmConfig(256, 64, 64, 8, 4, 3, mx_hopper=True, mx_ptx=True)]


@pytest.mark.parametrize("cfg", TILES_256, ids=lambda c: c.short())
@pytest.mark.parametrize("K", [1056, 2880])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_mxfp4_hopper_256_row_tiles(layout, K, cfg):
    L, n_out, M, k = 8, 384, 1500, 2
    q = make_weight(L, n_out, K, "mxfp4", 43)
    g = torch.Generator(device=DEV).manual_seed(47)
    ids = torch.stack([torch.randperm(L, device=DEV, generator=g)[:k] for _ in range(M)]).int()
    ids[::5, 1] = -1
    ids[::11, 0] = L + 3
    meta = build_layout(layout, ids, L, block_m=256)
    a = inputs_for(layout, meta, "w13", K, M, k, 53)
    bias = torch.randn(L, n_out, device=DEV).bfloat16()
    out = out_for(layout, meta, a, n_out)
    get_backend("triton").gemm(a, prepared_only(q, 4), meta, stage="w13", bias=bias, out=out, config=cfg)
    torch.cuda.synchronize()
    check(a, None, meta, "w13", out, bias, w_ref=q)


@pytest.mark.parametrize("cfg", [None, GemmConfig(16, 64, 256, 1, 4, 3, mx_hopper=True),
                                 GemmConfig(64, 128, 64, 1, 8, 3, mx_hopper=True),
                                 GemmConfig(16, 128, 128, 1, 4, 4, mx_hopper=True, mx_ptx=True),
                                 GemmConfig(128, 128, 128, 8, 8, 3, mx_hopper=True, mx_ptx=True),
                                 GemmConfig(16, 128, 256, 1, 4, 3, mx_hopper=True, mx_wide=True),
                                 GemmConfig(16, 128, 256, 1, 4, 3, mx_hopper=True, mx_ptx=True, mx_wide=True),
                                 GemmConfig(128, 128, 128, 8, 8, 3, mx_hopper=True, mx_ptx=True, mx_wide=True),
                                 GemmConfig(128, 128, 128, 8, 8, 3, mx_hopper=True, mx_ptx=True, mx_w_shared=True),
                                 GemmConfig(64, 128, 128, 8, 4, 3, mx_hopper=True, mx_w_shared=True)],
                         ids=lambda c: "tuned" if c is None else c.short())
@pytest.mark.parametrize("planes", [2, 4])
@pytest.mark.parametrize("finite,folded", [(True, False), (False, False), (True, True)],
                         ids=["finite", "inf_nan", "folded"])
def test_mxfp4_hopper_upcast_is_exact(finite, folded, planes, cfg):
    """bf16 identity activations: the output is the upcast weight itself and must equal
    dequantize_mxfp4(q, bf16) bit for bit — scales 0..3 with subnormal products (a flush-to-zero
    multiply or conversion would show here), the largest finite values, inf/NaN as the canonical
    dequantization gives them (0 * inf = NaN spreads over a row, as in float64)."""
    K = 96
    q = extreme_mxfp4_weight(torch.Generator().manual_seed(5), K, finite, device=DEV,
                             max_scale=128 if folded else 254)
    if cfg is not None and not cfg.planes_ok(planes):
        pytest.skip("the config reads the other prepared arrangement")
    assert prepared_only(q).hopper.folded == folded  # scales up to 128 fold: one multiply per element
    c = torch.tensor([K], dtype=torch.int32, device=DEV)
    meta = GroupedMaskedMeta(num_tokens=K, top_k=1, num_local=1, slot_expert=torch.zeros(K, dtype=torch.int32, device=DEV),
                             activation_counts=c, counts=c, inv=torch.zeros(K, dtype=torch.int32, device=DEV),
                             overflow=torch.zeros(1, dtype=torch.int32, device=DEV), max_tokens_per_expert=K)
    a = torch.eye(K, dtype=torch.bfloat16, device=DEV).unsqueeze(0)
    out = torch.full((1, K, q.shape[1]), SENTINEL, dtype=torch.bfloat16, device=DEV)
    get_backend("triton").gemm(a, prepared_only(q, planes), meta, stage="w13", bias=None, out=out,
                               config=cfg or kg.TUNED[("mxfp4_hopper", "medium")])
    torch.cuda.synchronize()
    if finite:
        assert torch.equal(out[0], dequantize_mxfp4(q, torch.bfloat16)[0].T)
    want = (a[0].double() @ dequantize_mxfp4(q, torch.float32)[0].double().T).to(torch.bfloat16)
    torch.testing.assert_close(out[0], want, rtol=0, atol=0, equal_nan=True)
    assert bool(torch.isnan(out[0]).any()) != finite


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.value)
def test_mxfp4_hopper_small_sanitizer(layout):
    """Small and quick, for `compute-sanitizer --tool memcheck`: decode and prefill tuned configs
    and the inline-PTX upcast on both prepared arrangements (and on 4 planes the shared-operand tile
    and the small entry, whose tiles of at most 32 rows run as half tiles), the 16-row decode tile
    that `default_config` gives the grouped layouts at up to 12 rows per expert, ragged counts,
    K = 160 (padded to 192), Nout = 200 (partial n-tile)."""
    L, K, n_out, M, k = 4, 160, 200, 37, 2
    q = make_weight(L, n_out, K, "mxfp4", 31)
    g = torch.Generator(device=DEV).manual_seed(37)
    ids = torch.randint(-1, L + 1, (M, k), generator=g, device=DEV, dtype=torch.int32)
    meta = build_layout(layout, ids, L)
    ptx = GemmConfig(16, 128, 128, 1, 4, 4, mx_hopper=True, mx_ptx=True)
    for planes in (2, 4):
        kind = kg.table_kind(True, True, planes)
        four_planes = [GemmConfig(64, 128, 128, 8, 4, 3, mx_hopper=True, mx_ptx=True, mx_w_shared=True),
                       kg.TUNED[(kind, "small")]] if planes == 4 else []
        decode = kg.TUNED[(kind, "decode")]
        narrowed = dataclasses.replace(decode, BM=16)
        assert kg.default_config(True, True, prepared_only(q, planes).hopper,
                                 codes.GROUPED_CONTIGUOUS, 1, 8) == narrowed
        for cfg in (decode, narrowed, kg.TUNED[(kind, "prefill")], ptx, *four_planes):
            a = inputs_for(layout, meta, "w13", K, M, k, 41)
            out = out_for(layout, meta, a, n_out)
            get_backend("triton").gemm(a, prepared_only(q, planes), meta, stage="w13", bias=None, out=out, config=cfg)
            torch.cuda.synchronize()
            check(a, None, meta, "w13", out, w_ref=q)
