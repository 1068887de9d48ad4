"""Probe: launch shapes of the count-aware silu activation against torch.compile's kernel (issue 14's
"silu at 100% valid 0.92x torch.compile"), in one process on one GPU.

Variants (all count-aware: rows at/after the count are neither read nor written):
- lib: `apply_moe_activation` as the library launches it (2-D row tiles, programs striding rows);
  lib_exact: the same with the sigmoid from exp (the library's float32 form) instead of tanh.approx;
- flat<B>_w<W>: the valid rows as one flat range of count*D output elements, one program per B
  elements (grid sized for the whole buffer; programs past count*D return at once), W warps;
- flatstride<B>_w<W>_p<P>: the same flat range, P programs per SM striding over it;
- rows_w<W>: one program per row (BLOCK = D), programs past the count return at once;
- striding[_prefetch][_contig]_p<P>: the library kernel's form with its default grid (2 x 2048 tiles,
  8 warps, P programs per SM) and a 32-bit row loop, the next tile loaded before the current one is
  stored and / or each program on one contiguous run of row blocks;
- striding_fastsig_p32 / striding_expsig_p32: striding_p32 with the library's sigmoid (its
  tanh.approx form, used for 16-bit outputs, or its exp form) instead of tl.sigmoid; striding_expsig_ef / _cs /
  _ef_cs: with evict-first loads and / or streaming stores; striding_expsig_p8 / _p16: fewer programs;
- lib_t<T>_d<BD>_w<W>_p<P>: the library's kernel with `tuning` (tile of T elements, BD columns wide,
  W warps, P programs per SM; P large: one program per row block, those past the count return).
Each is checked against the library's output (and rows past the count against NaN poison), then
timed as a CUDA-graph replay at each valid fraction (`--fractions`, default 100%, 5% and 0%), next to
torch.compile on the full buffer and the device's copy bandwidth.

    python scripts/act_variants_probe.py --rows 49152 --out gpu-out/act-variants.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from _common import bench_graph_us, copy_bandwidth_gbs  # noqa: E402

from padded_moe.activation import ApplyMoEActivationConfig, apply_moe_activation  # noqa: E402
from padded_moe.kernels.activation import _sigmoid as _lib_sigmoid  # noqa: E402

D = 2048


@triton.jit
def _silu_mul_sig(g, u, SIG: tl.constexpr):
    """silu(g) * u with the sigmoid as tl.sigmoid (SIG 0) or the library's `_sigmoid` (SIG 1: its
    FAST form, tanh.approx; SIG 2: its exact form, from exp)."""
    g = g.to(tl.float32)
    if SIG == 0:
        s = tl.sigmoid(g)
    elif SIG == 1:
        s = _lib_sigmoid(g, True)
    else:
        s = _lib_sigmoid(g, False)
    return g * s * u.to(tl.float32)


@triton.jit
def _flat_block(out_ptr, in_ptr, start, total, D: tl.constexpr, BLOCK: tl.constexpr):
    """Output elements [start, start + BLOCK) of the flat range [0, total)."""
    idx = start + tl.arange(0, BLOCK)
    m = idx < total
    row = idx // D
    col = idx % D
    g = tl.load(in_ptr + row * (2 * D) + col, mask=m)
    u = tl.load(in_ptr + row * (2 * D) + D + col, mask=m)
    tl.store(out_ptr + idx, _silu_mul_sig(g, u, 0).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _flat_kernel(out_ptr, in_ptr, cnt_ptr, D: tl.constexpr, BLOCK: tl.constexpr):
    total = tl.load(cnt_ptr).to(tl.int64) * D
    start = tl.program_id(0).to(tl.int64) * BLOCK
    if start < total:
        _flat_block(out_ptr, in_ptr, start, total, D, BLOCK)


@triton.jit
def _flat_stride_kernel(out_ptr, in_ptr, cnt_ptr, D: tl.constexpr, BLOCK: tl.constexpr):
    total = tl.load(cnt_ptr).to(tl.int64) * D
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, total, tl.num_programs(0) * BLOCK):
        _flat_block(out_ptr, in_ptr, start, total, D, BLOCK)


@triton.jit
def _row_kernel(out_ptr, in_ptr, cnt_ptr, D: tl.constexpr):
    row = tl.program_id(0)
    if row >= tl.load(cnt_ptr):
        return
    col = tl.arange(0, D)
    base = in_ptr + row.to(tl.int64) * (2 * D)
    g = tl.load(base + col)
    u = tl.load(base + D + col)
    tl.store(out_ptr + row.to(tl.int64) * D + col, _silu_mul_sig(g, u, 0).to(out_ptr.dtype.element_ty))


@triton.jit
def _striding_kernel(out_ptr, in_ptr, cnt_ptr, T, D, stride_in, stride_out, BLOCK_T: tl.constexpr,
                     BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, CONTIG: tl.constexpr, SIG: tl.constexpr,
                     EVICT_FIRST: tl.constexpr = False, STREAM_STORE: tl.constexpr = False):
    """The library kernel's form (runtime widths and strides, row tiles, striding programs), silu only,
    with the row loop in 32 bits and three changes to try: PREFETCH loads the next tile before the
    current one is computed and stored; CONTIG gives each program one contiguous run of row blocks
    instead of every P-th; SIG picks the sigmoid (`_silu_mul_sig`). Without PREFETCH, EVICT_FIRST marks
    the loads evict-first and STREAM_STORE the stores streaming (.cs): neither is read again."""
    pid_t = tl.program_id(0)
    nprog = tl.num_programs(0)
    n = tl.minimum(tl.maximum(tl.load(cnt_ptr), 0), T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    r = tl.arange(0, BLOCK_T)
    if CONTIG:
        per = tl.cdiv(tl.cdiv(T, BLOCK_T), nprog) * BLOCK_T
        start = pid_t * per
        end = tl.minimum(start + per, n)
        step = BLOCK_T
    else:
        start = pid_t * BLOCK_T
        end = n
        step = nprog * BLOCK_T
    if PREFETCH:
        rows = (start + r).to(tl.int64)
        m = (rows < end)[:, None] & col_ok[None, :]
        g = tl.load(in_ptr + rows[:, None] * stride_in + cols[None, :], mask=m)
        u = tl.load(in_ptr + rows[:, None] * stride_in + D + cols[None, :], mask=m)
        for first in range(start, end, step):
            rows_n = (first + step + r).to(tl.int64)
            m_n = (rows_n < end)[:, None] & col_ok[None, :]
            g_n = tl.load(in_ptr + rows_n[:, None] * stride_in + cols[None, :], mask=m_n)
            u_n = tl.load(in_ptr + rows_n[:, None] * stride_in + D + cols[None, :], mask=m_n)
            rows = (first + r).to(tl.int64)
            m = (rows < end)[:, None] & col_ok[None, :]
            tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
                     _silu_mul_sig(g, u, SIG).to(out_ptr.dtype.element_ty), mask=m)
            g = g_n
            u = u_n
    else:
        policy: tl.constexpr = "evict_first" if EVICT_FIRST else ""
        store_mod: tl.constexpr = ".cs" if STREAM_STORE else ""
        for first in range(start, end, step):
            rows = (first + r).to(tl.int64)
            m = (rows < end)[:, None] & col_ok[None, :]
            g = tl.load(in_ptr + rows[:, None] * stride_in + cols[None, :], mask=m, eviction_policy=policy)
            u = tl.load(in_ptr + rows[:, None] * stride_in + D + cols[None, :], mask=m, eviction_policy=policy)
            tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :],
                     _silu_mul_sig(g, u, SIG).to(out_ptr.dtype.element_ty), mask=m, cache_modifier=store_mod)


def variants(rows: int, sms: int) -> dict:
    def flat(block, warps):
        return lambda out, x, cnt: _flat_kernel[(triton.cdiv(rows * D, block),)](out, x, cnt, D=D, BLOCK=block,
                                                                                  num_warps=warps)

    def stride(block, warps, per_sm):
        return lambda out, x, cnt: _flat_stride_kernel[(sms * per_sm,)](out, x, cnt, D=D, BLOCK=block,
                                                                         num_warps=warps)

    def rowk(warps):
        return lambda out, x, cnt: _row_kernel[(rows,)](out, x, cnt, D=D, num_warps=warps)

    def lib(act, tuning=None):
        return lambda out, x, cnt: apply_moe_activation(act, out, x, valid_token_counts=cnt, tuning=tuning,
                                                        activation_config=CFG[act])

    def lib_exact(act):
        """The library's launch with its exact functions (the sigmoid from exp, as for float32
        outputs) instead of tanh.approx: the library kernel's own form of striding_expsig."""
        import padded_moe.activation as activation_module

        def run(out, x, cnt):
            real = activation_module.kernel_args
            activation_module.kernel_args = lambda a, p, fast: real(a, p, False)
            try:
                lib(act)(out, x, cnt)
            finally:
                activation_module.kernel_args = real
        return run

    out = {"lib": lib("silu"), "lib_exact": lib_exact("silu")}
    for tile, bd, warps, per_sm in LIB_TUNINGS:
        out[f"lib_t{tile}_d{bd}_w{warps}_p{per_sm}"] = lib("silu", dict(tile_elems=tile, max_block_d=bd,
                                                                         num_warps=warps, programs_per_sm=per_sm))
    for block, warps in ((4096, 8), (8192, 8), (8192, 16)):
        out[f"flat{block}_w{warps}"] = flat(block, warps)
    out["flatstride1024_w4_p16"] = stride(1024, 4, 16)

    def striding(prefetch, contig, per_sm=32, warps=8, sig=0, evict_first=False, stream_store=False):
        blocks = triton.cdiv(rows, 2)
        grid = (triton.cdiv(blocks, triton.cdiv(blocks, sms * per_sm)), 1)
        return lambda out, x, cnt: _striding_kernel[grid](out, x, cnt, rows, D, x.stride(0), out.stride(0), BLOCK_T=2,
                                                          BLOCK_D=D, PREFETCH=prefetch, CONTIG=contig,
                                                          SIG=sig, EVICT_FIRST=evict_first,
                                                          STREAM_STORE=stream_store, num_warps=warps)

    for prefetch in (False, True):
        for contig in (False, True):
            out[f"striding{'_prefetch' if prefetch else ''}{'_contig' if contig else ''}_p32"] = striding(prefetch, contig)
    out["striding_prefetch_p16"] = striding(True, False, per_sm=16)
    # The library's sigmoid in the probe's form: which of the int32 loop and the sigmoid is the gap.
    out["striding_fastsig_p32"] = striding(False, False, sig=1)
    out["striding_expsig_p32"] = striding(False, False, sig=2)
    out["striding_expsig_ef_p32"] = striding(False, False, sig=2, evict_first=True)
    out["striding_expsig_cs_p32"] = striding(False, False, sig=2, stream_store=True)
    out["striding_expsig_ef_cs_p32"] = striding(False, False, sig=2, evict_first=True, stream_store=True)
    out["striding_expsig_p8"] = striding(False, False, per_sm=8, sig=2)
    out["striding_expsig_p16"] = striding(False, False, per_sm=16, sig=2)
    out["rows_w4"] = rowk(4)
    out["situ lib"] = lib("situ")
    for tile, bd, warps, per_sm in LIB_TUNINGS:
        out[f"situ lib_t{tile}_d{bd}_w{warps}_p{per_sm}"] = lib("situ", dict(
            tile_elems=tile, max_block_d=bd, num_warps=warps, programs_per_sm=per_sm))
    return out


# (tile_elems, max_block_d, num_warps, programs_per_sm) of the library kernel; 4096 programs per SM
# is more than any row count here needs: one program per row block.
LIB_TUNINGS = [(2048, 2048, 4, 4096), (4096, 2048, 8, 4096), (8192, 2048, 8, 4096), (16384, 2048, 8, 4096),
               (16384, 2048, 16, 4096), (4096, 1024, 4, 4096), (8192, 1024, 8, 4096), (16384, 1024, 8, 4096)]
CFG = {"silu": ApplyMoEActivationConfig(), "situ": ApplyMoEActivationConfig(situ_beta=4.0, situ_linear_beta=25.0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=49152)
    p.add_argument("--experts", type=int, default=0,
                   help="a batched buffer [experts, rows, 2*D] with one count per expert (library variants only)")
    p.add_argument("--lib-only", action="store_true", help="only the library kernel's launch shapes")
    p.add_argument("--tunings", default=None,
                   help="library launch shapes to time, 'tile:block_d:warps:per_sm,...' (default: LIB_TUNINGS)")
    p.add_argument("--fractions", default="1.0,0.05,0.0", help="valid fractions of the rows (0: all counts 0)")
    p.add_argument("--only", default=None, help="comma-separated prefixes of the variants to time (default: all)")
    p.add_argument("--out", default="gpu-out/act-variants.json")
    args = p.parse_args()
    global LIB_TUNINGS
    if args.tunings:
        LIB_TUNINGS = [tuple(int(v) for v in t.split(":")) for t in args.tunings.split(",")]
    rows, experts = args.rows, args.experts
    lead = (experts, rows) if experts else (rows,)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_bandwidth_gbs()
    x = torch.randn(*lead, 2 * D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(*lead, D, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda x: (torch.nn.functional.silu(x[..., :D].float()) * x[..., D:].float()).to(x.dtype))
    compiled(x)
    t_compile = bench_graph_us(lambda: compiled(x))
    report = {"shape": list(lead), "copy_gbs": copy, "compile_us": t_compile, "cases": {}}
    print(f"shape {lead}: copy {copy:.0f} GB/s; torch.compile silu (full buffer) {t_compile:.1f} us", flush=True)
    for frac in (float(f) for f in args.fractions.split(",")):
        n = max(1, int(rows * frac)) if frac else 0
        cnt = torch.full((max(1, experts),), n, device="cuda", dtype=torch.int32)
        refs = {}
        for act in CFG:
            refs[act] = torch.full_like(out, float("nan"))
            apply_moe_activation(act, refs[act], x, valid_token_counts=cnt, activation_config=CFG[act])
        for name, fn in variants(rows, sms).items():
            if (args.lib_only or experts) and "lib" not in name:
                continue
            if args.only and not any(name.startswith(o) for o in args.only.split(",")):
                continue
            ref = refs["situ" if name.startswith("situ") else "silu"]
            out.fill_(float("nan"))
            fn(out, x, cnt)
            torch.cuda.synchronize()
            valid, past = ref[..., :n, :].float(), out[..., n:, :]
            err = ((out[..., :n, :].float() - valid).abs().max() / valid.abs().max()).item() if n else 0.0
            untouched = bool(torch.isnan(past).all()) if n < rows else True
            t = min(bench_graph_us(lambda: fn(out, x, cnt)) for _ in range(3))
            gbs = max(1, experts) * max(n, 1) * 3 * D * 2 / (t * 1e-6) / 1e9
            report["cases"][f"{name}@{frac}"] = {"us": t, "of_copy": gbs / copy, "compile_over": t_compile / t,
                                                 "max_rel_err": err, "rows_past_count_untouched": untouched}
            print(f"{frac:>5} {name:36s} {t:8.1f} us  {gbs / copy:.3f} of copy  compile/this {t_compile / t:.3f}  "
                  f"err {err:.1e} untouched {untouched}", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
