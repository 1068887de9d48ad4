"""Probe (issue 12): the RS kernel for prepared MXFP4 weights (consumer warpgroups upcast the words
into wgmma's register operand, tokens on the MMA's N side, up to 256 of an expert's rows per tile)
against the library's Triton kernel on the same prepared bytes: its stand-alone walk
(`scripts/mx_rs/mx_rs_gemm.cu`: the library's tile body, one CTA per tile of GROUPED_MASKED slabs,
tiles decoded from blockIdx) and the library's own kernel (`grouped.launch_rs`, `LIB_WALKS`: both
walk orders, chunks of 256 and of 320 rows) on the same slabs and on the same rows as one
GROUPED_CONTIGUOUS buffer.

Per case (model preset, GEMM stage, rows): routed counts from top-k of random logits (`--tokens`)
or equal counts (`--rows`, over `--experts` experts); slabs as large as the largest count, rows past
each count NaN. Each output is checked against a float64 reference on the dequantized weights
(every expert, max error relative to the reference's largest value; exits 1 past `TOL` or on a NaN
in a valid row), the stand-alone kernel's also against the Triton kernel's. On GEMM1 (silu family) also
the library kernel's gated epilogue against its plain GEMM1 and the activation op. Times
are `triton.testing.do_bench` medians (L2 flushed between calls), TFLOP/s counted on the valid rows.

    bash scripts/mx_rs/build.sh && python3 scripts/mx_rs_probe.py --tokens 1024,8192
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
from pathlib import Path

import torch
import triton

from padded_moe.backends import get_backend
from padded_moe.kernels.native import grouped
from padded_moe.layouts import GemmLayout, build_layout
from padded_moe.mxfp4 import dequantize_mxfp4
from padded_moe.presets import get_preset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_gemm import weight_pair  # noqa: E402

TOL = 2.0**-7  # one bf16 rounding of the largest output
# The library kernel's walks timed: (column tiles first, persistent CTAs, 320-row chunks). One CTA
# per tile (persistent False) took 3-25% more time than persistent CTAs in every case of run 311.
LIB_WALKS = ((True, True, False), (False, True, False), (True, True, True), (False, True, True))
LIB = ROOT / ".mx_rs" / "libmx_rs.so"


def load_library() -> ctypes.CDLL:
    if not LIB.exists():
        subprocess.run(["bash", str(ROOT / "scripts" / "mx_rs" / "build.sh")], check=True)
    lib = ctypes.CDLL(str(LIB))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.mx_rs_gemm.argtypes = [i, p, p, i, i, i, p, p, i, p, p]
    lib.mx_rs_gemm.restype = i
    lib.mx_rs_error.argtypes = [i]
    lib.mx_rs_error.restype = ctypes.c_char_p
    return lib


def reference(a: torch.Tensor, wq, counts: torch.Tensor) -> torch.Tensor:
    """a @ W^T of the dequantized weights in float64 (expert by expert), as float32; rows past each
    count NaN."""
    ref = torch.full((a.shape[0], a.shape[1], wq.shape[1]), float("nan"), device=a.device)
    for e in range(a.shape[0]):
        c = int(counts[e])
        if c:
            w = dequantize_mxfp4(wq[e:e + 1], torch.float32)[0].double()
            ref[e, :c] = (a[e, :c].double() @ w.T).float()
    return ref


def rel_err(got: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor) -> float:
    """max |got - ref| / max |ref| over the valid rows (NaN if a valid row of `got` holds one)."""
    rows = torch.arange(got.shape[1], device=got.device)[None, :] < counts[:, None]
    g, r = got[rows].float(), ref[rows].float()
    if torch.isnan(g).any():
        return float("nan")
    return ((g - r).abs().max() / r.abs().max()).item()


def _as_slabs(flat: torch.Tensor, counts: torch.Tensor, t_max: int) -> torch.Tensor:
    """Rows of a GROUPED_CONTIGUOUS output back into NaN-padded slabs."""
    out = torch.full((counts.numel(), t_max, flat.shape[-1]), float("nan"), device=flat.device, dtype=flat.dtype)
    rows = torch.arange(t_max, device=flat.device)[None, :] < counts[:, None]
    out[rows] = flat
    return out


def gated_case(label: str, activation: str, a_flat, q, offsets, out_c, counts, ms_t: float) -> list:
    """A model's GEMM1 with its activation (swigluoai: interleaved gate / up rows; silu: halves) on
    the contiguous rows: the RS kernel's gated epilogue against its plain GEMM1 followed by the
    activation op (outputs within one bf16 rounding of each other, times of both)."""
    from padded_moe.activation import ActivationEpilogue, apply_moe_activation

    act_counts = torch.tensor([a_flat.shape[0]], device="cuda", dtype=torch.int32)
    two = torch.full((a_flat.shape[0], out_c.shape[1] // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
    fused = torch.full_like(two, float("nan"))

    bad = []
    for wide in (False, True):
        def run_two(wide=wide):
            grouped.launch_rs(a_flat, q, out_c, offsets=offsets, wide=wide)
            apply_moe_activation(activation, two, out_c, valid_token_counts=act_counts)

        def run_fused(wide=wide):
            grouped.launch_rs(a_flat, q, fused, offsets=offsets, epilogue=ActivationEpilogue.of(activation), wide=wide)

        two.fill_(float("nan"))
        fused.fill_(float("nan"))
        run_two()
        run_fused()
        torch.cuda.synchronize()
        diff = ((fused.double() - two.double()).abs() / two.double().abs().clamp(min=1e-2)).max().item()
        tag = ", 320-row chunks" if wide else ""
        for name, run in ((f"lib contiguous + activation op{tag}", run_two), (f"lib contiguous, gated epilogue{tag}",
                                                                               run_fused)):
            ms = triton.testing.do_bench(run, warmup=10, rep=80)
            print(f"  {name:<30} {ms * 1e3:9.1f} us  triton GEMM / this time {ms_t / ms:5.3f}")
        print(f"  gated epilogue vs two steps{tag}: max relative difference {diff:.1e}")
        if not diff <= TOL:
            bad.append(f"{label} gated epilogue vs two steps{tag}: {diff:.1e}")
    return bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="gpt-oss-120b,dsv4-flash")
    p.add_argument("--tokens", default="1024,8192", help="routed counts for these token counts (comma list)")
    p.add_argument("--rows", default="", help="equal counts: rows per expert (comma list), over --experts experts")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--stages", default="3,4")
    p.add_argument("--stage", default="w13,w2", help="GEMM stages to run")
    args = p.parse_args()
    torch.manual_seed(0)
    lib = load_library()
    defaults = grouped.RS_COLUMNS_FIRST, grouped.RS_PERSISTENT, grouped.RS_WIDE
    be = get_backend("triton")
    bad = []
    for model in args.presets.split(","):
        pre = get_preset(model)
        E, k = pre.num_experts, pre.top_k
        shapes = {"w13": (pre.hidden_size, pre.w13_rows), "w2": (pre.intermediate_size, pre.hidden_size)}
        for stage in args.stage.split(","):
            K, n_out = shapes[stage]
            cases = [("tokens", int(t)) for t in args.tokens.split(",") if t] + \
                    [("rows", int(r)) for r in args.rows.split(",") if r]
            L_all = {kind: (E if kind == "tokens" else args.experts) for kind, _ in cases}
            weights = {L: weight_pair(L, n_out, K, torch.device("cuda"))[1].prepare_for() for L in set(L_all.values())}
            for kind, n in cases:
                L = L_all[kind]
                q = weights[L]
                h = q.hopper
                if not (h.folded and h.planes == 4 and h.k_padded == K):
                    raise SystemExit(f"{model} {stage}: the probe needs folded 4-plane words with K = k_padded")
                if kind == "tokens":
                    ids = torch.randn(n, E, device="cuda").topk(k, dim=-1).indices.to(torch.int32)
                else:
                    ids = torch.arange(L, device="cuda", dtype=torch.int32).repeat(n)[:, None]
                counts = torch.bincount(ids.flatten().long(), minlength=L)
                t_max = int(counts.max())
                meta = build_layout(GemmLayout.GROUPED_MASKED, ids, L, max_tokens_per_expert=t_max, drop_overflow=True)
                a = torch.randn(L, t_max, K, device="cuda", dtype=torch.bfloat16)
                rows = torch.arange(t_max, device="cuda")[None, :] < counts[:, None]
                a[~rows] = float("nan")
                c32 = meta.counts.to(torch.int32).contiguous()
                ref = reference(a, q.canonical(), counts)
                out_t = torch.full((L, t_max, n_out), float("nan"), device="cuda", dtype=torch.bfloat16)
                run_t = lambda: be.gemm(a, q, meta, stage=stage, bias=None, out=out_t)  # noqa: E731
                run_t()
                flops = 2.0 * float(counts.sum()) * n_out * K
                label = f"{model} {stage} {kind}={n} (L={L}, mean {float(counts.float().mean()):.1f}, max {t_max})"
                err_t = rel_err(out_t, ref, counts)
                ms_t = triton.testing.do_bench(run_t, warmup=10, rep=80)
                print(f"\n{label}\n  triton {ms_t * 1e3:9.1f} us  {flops / ms_t / 1e9:6.0f} TFLOP/s  err {err_t:.1e}")
                if not err_t <= TOL:
                    bad.append(f"{label} triton: {err_t:.1e}")
                for st in (int(s) for s in args.stages.split(",")):
                    out_r = torch.full_like(out_t, float("nan"))

                    def run_r(st=st, out_r=out_r):
                        code = lib.mx_rs_gemm(st, torch.cuda.current_stream().cuda_stream, a.data_ptr(), L, t_max, K,
                                              h.blocks.data_ptr(), h.scales.data_ptr(), n_out, c32.data_ptr(),
                                              out_r.data_ptr())
                        if code != 0:
                            raise RuntimeError(f"mx_rs_gemm: {lib.mx_rs_error(code).decode()}")

                    run_r()
                    torch.cuda.synchronize()
                    err_r = rel_err(out_r, ref, counts)
                    vs_t = rel_err(out_r, out_t, counts)
                    ms_r = triton.testing.do_bench(run_r, warmup=10, rep=80)
                    print(f"  rs s{st}  {ms_r * 1e3:9.1f} us  {flops / ms_r / 1e9:6.0f} TFLOP/s  err {err_r:.1e}  "
                          f"vs triton {vs_t:.1e}  triton / rs time {ms_t / ms_r:5.3f}")
                    if not err_r <= TOL:
                        bad.append(f"{label} rs s{st}: {err_r:.1e}")
                # The library's RS kernel (grouped.launch_rs) on the same slabs, and on the same rows as one
                # GROUPED_CONTIGUOUS buffer (experts in order, as build_layout places them).
                offsets = torch.zeros(L + 1, dtype=torch.int64, device="cuda")
                offsets[1:] = counts.cumsum(0)
                a_flat = a[rows]
                out_c = torch.full((a_flat.shape[0], n_out), float("nan"), device="cuda", dtype=torch.bfloat16)
                out_m = torch.full_like(out_t, float("nan"))
                lib_cases = []
                for first, persistent, wide in LIB_WALKS:
                    tag = ", ".join(["columns first" if first else "chunks first"] + ([] if persistent else ["per tile"])
                                    + (["320-row chunks"] if wide else []))
                    lib_cases += [
                        (f"lib masked, {tag}", (first, persistent, wide),
                         lambda: grouped.launch_rs(a, q, out_m, counts=c32), lambda: out_m),
                        (f"lib contiguous, {tag}", (first, persistent, wide),
                         lambda: grouped.launch_rs(a_flat, q, out_c, offsets=offsets),
                         lambda: _as_slabs(out_c, counts, t_max))]
                for name, (first, persistent, wide), run, got in lib_cases:
                    grouped.RS_COLUMNS_FIRST, grouped.RS_PERSISTENT, grouped.RS_WIDE = first, persistent, wide
                    out_m.fill_(float("nan"))
                    out_c.fill_(float("nan"))
                    run()
                    torch.cuda.synchronize()
                    err = rel_err(got(), ref, counts)
                    ms = triton.testing.do_bench(run, warmup=10, rep=80)
                    print(f"  {name:<30} {ms * 1e3:9.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  err {err:.1e}  "
                          f"triton / this time {ms_t / ms:5.3f}")
                    if not err <= TOL:
                        bad.append(f"{label} {name}: {err:.1e}")
                grouped.RS_COLUMNS_FIRST, grouped.RS_PERSISTENT, grouped.RS_WIDE = defaults
                if stage == "w13" and pre.activation in grouped.EPILOGUE_ACTIVATIONS:
                    bad += gated_case(label, pre.activation, a_flat, q, offsets, out_c, counts, ms_t)
    if bad:
        raise SystemExit("errors past TOL:\n" + "\n".join(bad))


if __name__ == "__main__":
    main()
