"""Probe: a hand-written sm_90 MXFP4 decode GEMM (mma.sync, words straight into registers) against
the library's decode kernels and a plain streaming read of the same words, on cold L2 as in a
model's decode step.

Issue 12's decode target is the weight read at 85% of copy bandwidth; the Triton kernels spend
about 31 SASS instructions per 32-bit word of weights (8 values) and reach 0.39-0.46 of it. The
kernel in `mx_decode_cuda/mx_decode.cu` spends about 18 (upcast and scale 15, one mma.m16n8k16 per
word, the activations from shared memory). Its configurations (name `wn{W}_ks{S}_d{D}_ld{L}_t{A}`):
W warps of 16 weight rows per program, the K range split over S warps, D chunks of 128 columns
prefetched in registers (or, with A = 3, D shared-memory stages filled by a producer warp's bulk
copies), L the load flavour, A the weight arrangement: 0 the prepared words as they are, 1 each
16-row block's chunks contiguous, 2 a program's W blocks side by side per chunk, 3 that plus the
chunk's scales (built here from the prepared words; the library has none of 1-3).

Every configuration is checked against a float32 reference of the dequantized weights (outputs
poisoned with NaN first) before it is timed, GEMM1 (w13) and GEMM2 (w2) separately. L layers of
distinct weights are captured in one graph so that no call finds its weights in L2 (as
`decode_cold_probe.py`). The library's numbers include its in-kernel routing, activation /
combine and biases; the probe's kernel gets its expert groups from the host and computes the bare
products: the gap is what a hand-written kernel could win, not a drop-in comparison.

    bash scripts/mx_decode_cuda/build.sh
    PYTHONPATH=src python3 scripts/mx_decode_cuda_probe.py [--lib .mx_decode_cuda/libmx_decode.so]

Not part of the library.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import captured, copy_bandwidth_gbs, write_json  # noqa: E402
from profile_layer import kernel_times  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_cold_probe import pure_read  # noqa: E402

from padded_moe.layer import FusedMoE  # noqa: E402


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.mx_decode_num_configs.restype = ctypes.c_int
    lib.mx_decode_config_name.restype = ctypes.c_char_p
    lib.mx_decode_config_name.argtypes = [ctypes.c_int]
    P, I, LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.mx_decode_run.restype = ctypes.c_int
    lib.mx_decode_run.argtypes = [I, P, LL, P, P, P, P, I, P, LL, LL, P, LL, LL, P, LL, I, I, I, I, P]
    return lib


def groups(ids: torch.Tensor, top_k: int):
    """Expert groups of a route: (experts, starts, token row per member, slot per member, max members)."""
    flat = ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    starts = torch.zeros(experts.numel() + 1, dtype=torch.int64, device=ids.device)
    starts[1:] = torch.cumsum(counts, 0)
    i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return i32(experts), i32(starts), i32(order // top_k), i32(order), int(counts.max())


def tiled(w, mode: int, wn: int) -> torch.Tensor:
    """The prepared words in the kernel's TILED arrangement `mode`: 1, each 16-row block's 128-column
    chunks contiguous ([L, rows/16, chunks, half, g, t, c]); 2, the `wn` row blocks of a program side
    by side per chunk ([L, rows/(16 wn), chunks, wn, half, g, t, c]); 3, mode 2's words of each
    (program, chunk) followed by their scales (bytes, for the bulk-copy kernel). K zero-padded to
    whole chunks."""
    b = w.hopper.blocks
    L, n, words = b.shape
    nch = -(-words // 16)
    b = torch.nn.functional.pad(b, (0, nch * 16 - words))
    if mode == 1:  # mode 2 with one row block per program
        wn = 1
    if n % (16 * wn):
        raise ValueError(f"rows {n} are not a multiple of {16 * wn}")
    rb = n // (16 * wn)
    words = b.view(L, rb, wn, 2, 8, nch, 4, 4).permute(0, 1, 5, 2, 3, 4, 6, 7).contiguous()
    if mode in (1, 2):
        return words.squeeze(3) if mode == 1 else words
    # 3: each (program, chunk) run of words followed by its scales, [wn][t][half][g] as uint16.
    sc = w.hopper.scales
    sc = torch.nn.functional.pad(sc, (0, 0, 0, nch * 4 - sc.shape[1]))  # padded groups: factor 0 (their words are 0)
    sc = sc.view(L, nch, 4, rb, wn, 2, 8).permute(0, 3, 1, 4, 2, 5, 6).contiguous()
    return torch.cat([words.view(torch.uint8).view(L, rb, nch, wn * 1024),
                      sc.view(torch.uint8).view(L, rb, nch, wn * 128)], dim=-1).contiguous()


def run(lib, cfg, x, grp, w, out, tiles=None):
    experts, starts, rows, slots, maxc = grp
    h = w.hopper
    if h is None or h.planes != 4 or not h.folded:
        raise ValueError("the probe needs prepared 4-plane words with folded scales")
    b, s = h.blocks, h.scales
    if tiles is not None:
        b = tiles
    rc = lib.mx_decode_run(cfg, x.data_ptr(), x.stride(0), experts.data_ptr(), starts.data_ptr(), rows.data_ptr(),
                           slots.data_ptr(), experts.numel(), b.data_ptr(), b.stride(0), h.blocks.stride(1),
                           s.data_ptr(), s.stride(0), s.stride(1), out.data_ptr(), out.stride(0), h.blocks.shape[1],
                           x.shape[1], h.k_padded, maxc,
                           ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))  # the capture's stream too
    if rc:
        raise RuntimeError(f"launch failed: cuda error {rc}")


def reference(x, grp, w) -> torch.Tensor:
    experts, starts, rows, slots, _ = grp
    out = torch.full((slots.numel(), w.shape[1]), float("nan"), device=x.device)
    for gi, e in enumerate(experts.tolist()):
        wd = w[e].dequantize(torch.float32)[0]
        for m in range(int(starts[gi]), int(starts[gi + 1])):
            out[int(slots[m])] = x[int(rows[m])].float() @ wd.T
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lib", default=".mx_decode_cuda/libmx_decode.so")
    p.add_argument("--cases", default="gpt-oss-120b,dsv4-flash")
    p.add_argument("--tokens", default="gpt-oss-120b:1,4;dsv4-flash:1,2",
                   help="token counts per case (decode-path calls only: at most 16 slots)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--out", default="gpu-out/mx-decode-cuda.json")
    p.add_argument("--ncu", default="", help="comma-separated configurations: only launch their GEMM1 on the first "
                                             "case and token count (for Nsight Compute), then the library's call")
    args = p.parse_args()
    lib = load(args.lib)
    configs = [(c, lib.mx_decode_config_name(c).decode()) for c in range(lib.mx_decode_num_configs())]
    copy = copy_bandwidth_gbs() * 1e9
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s", flush=True)
    report = {"copy_bytes_per_s": copy, "cases": {}}
    for name in args.cases.split(","):
        layers = []
        for i in range(args.layers):
            lay = FusedMoE.from_preset(name, weight_format="mxfp4", device="cuda", dtype=torch.bfloat16)
            lay.randomize(seed=i, std=0.02)
            layers.append(lay)
        w13s, w2s = zip(*(lay.expert_weights() for lay in layers))
        hidden, n_inter2 = layers[0].hidden_size, w13s[0].shape[1]
        e13 = w13s[0].nbytes() // w13s[0].shape[0]
        e2 = w2s[0].nbytes() // w2s[0].shape[0]
        arrangements = {}  # (mode, wn) -> (w13 words per layer, w2 words per layer)

        def arranged(cname):
            mode, wn = int(cname.rsplit("_t", 1)[1]), int(cname.split("_")[0][2:])
            if mode == 0:
                return [None] * len(w13s), [None] * len(w2s)
            key = (mode, wn if mode >= 2 else 0)
            if key not in arrangements:
                arrangements[key] = ([tiled(w, mode, wn) for w in w13s], [tiled(w, mode, wn) for w in w2s])
            return arrangements[key]
        token_counts = dict(item.split(":") for item in args.tokens.split(";"))[name]
        for T in (int(t) for t in token_counts.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(T)
            x = torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
            routes = [lay.route(lay.gate(x), None) for lay in layers]
            grps = [groups(ids, lay.top_k) for lay, (_, ids) in zip(layers, routes)]
            slots = T * layers[0].top_k
            hmid = torch.randn(slots, w2s[0].shape[2], device="cuda", dtype=torch.bfloat16, generator=gen)
            hit = sum(g[0].numel() for g in grps) / len(layers)
            floor1, floor2 = hit * e13 / copy * 1e6, hit * e2 / copy * 1e6
            res = {"experts_hit_per_layer": hit, "floor_gemm1_us": round(floor1, 2), "floor_gemm2_us": round(floor2, 2)}
            out1 = torch.empty(slots, n_inter2, device="cuda", dtype=torch.float32)
            out2 = torch.empty(slots, hidden, device="cuda", dtype=torch.float32)
            if args.ncu:
                for c, cname in configs:
                    if cname in args.ncu.split(","):
                        t13s, _ = arranged(cname)
                        run(lib, c, x, grps[0], w13s[0], out1, t13s[0])
                layers[0].experts(x, *routes[0])
                torch.cuda.synchronize()
                return
            ref1 = reference(x, grps[0], w13s[0])
            ref2 = reference(hmid, grps[0], w2s[0])
            rows = []
            for c, cname in configs:
                t13s, t2s = arranged(cname)
                for out, xin, w, tw_, ref in ((out1, x, w13s[0], t13s[0], ref1), (out2, hmid, w2s[0], t2s[0], ref2)):
                    out.fill_(float("nan"))
                    run(lib, c, xin, grps[0], w, out, tw_)
                    torch.cuda.synchronize()
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    if not err < 1e-5:  # NaN fails too
                        raise SystemExit(f"{name} T={T} {cname}: max relative error {err}")
                t = {}
                for key, xin, ws, tls, out in (("gemm1", x, w13s, t13s, out1), ("gemm2", hmid, w2s, t2s, out2)):
                    def step(xin=xin, ws=ws, tls=tls, out=out):
                        for g, w, tl_ in zip(grps, ws, tls):
                            run(lib, c, xin, g, w, out, tl_)
                    step()
                    graph, _ = captured(step)
                    kt = kernel_times(graph.replay, 20)
                    t[key] = sum(v for k, v in kt.items() if "mx_decode" in k) / len(layers)
                    del graph
                rows.append({"config": cname, "gemm1_us": round(t["gemm1"], 2), "gemm2_us": round(t["gemm2"], 2)})
                print(f"{name} T={T} {cname}: GEMM1 {t['gemm1']:.2f} us ({floor1 / t['gemm1']:.2f} of floor), GEMM2 "
                      f"{t['gemm2']:.2f} us ({floor2 / t['gemm2']:.2f}) [checked]", flush=True)
            res["cuda"] = rows
            sums = torch.empty(1 << 16, device="cuda", dtype=torch.float32)
            for key, ws in (("gemm1", w13s), ("gemm2", w2s)):  # a plain streaming read of the same words
                for programs in (1056, 2112):
                    def read_step(ws=ws, programs=programs):
                        for g, w in zip(grps, ws):
                            pure_read(w.hopper.blocks, g[0], sums, programs, 2048, 3)
                    read_step()
                    graph, _ = captured(read_step)
                    kt = kernel_times(graph.replay, 20)
                    tr = sum(kt.values()) / len(layers)
                    res[f"pure_read_{key}_p{programs}_us"] = round(tr, 2)
                    print(f"{name} T={T} pure read of the {key} words (programs~{programs}): {tr:.2f} us "
                          f"({(floor1 if key == 'gemm1' else floor2) / tr:.2f} of floor)", flush=True)
                    del graph

            def lib_step():
                for lay, (tw, ids) in zip(layers, routes):
                    lay.experts(x, tw, ids)
            lib_step()
            graph, _ = captured(lib_step)
            kt = kernel_times(graph.replay, 20)
            g1 = sum(v for k, v in kt.items() if "w13" in k) / len(layers)
            g2 = sum(v for k, v in kt.items() if "w2_combine" in k) / len(layers)
            if not (g1 and g2):
                raise SystemExit(f"{name} T={T}: not a decode-path call ({sorted(kt)})")
            res["library"] = {"gemm1_us": round(g1, 2), "gemm2_us": round(g2, 2),
                              "kernels": {k: round(v / len(layers), 2) for k, v in kt.items()}}
            print(f"{name} T={T} library: GEMM1 {g1:.2f} us ({floor1 / g1:.2f} of floor), GEMM2 {g2:.2f} us "
                  f"({floor2 / g2:.2f}); floors {floor1:.2f} / {floor2:.2f} us", flush=True)
            del graph
            report["cases"][f"{name} T={T}"] = res
        arrangements.clear()
        del layers, w13s, w2s, t13s, t2s
        torch.cuda.empty_cache()
    write_json(args.out, report)


if __name__ == "__main__":
    main()
