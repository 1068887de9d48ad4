"""Probe: decode-path kernels on cold, clean L2, as in a model's decode step, against pure reads.

The benchmarks time one call per CUDA-graph replay after `triton.testing.do_bench`'s L2 flush, a
256 MB memset: the call then starts with the L2 full of dirty lines, whose write-back shares the
DRAM with the call's weight reads. In a model's decode step the previous layers leave clean lines
(weights) behind. This probe captures L layers' routed-experts calls (distinct weights, so nothing
a call reads is in L2) in one graph, as a model step does, and reports per kernel (torch.profiler
over replays): each decode kernel's time against a plain streaming read of the same experts'
bytes in the same graph, for the default tiles and a few candidates. It also times one call per
replay after do_bench's flush (the number the benchmarks quote) and after a read-only flush.

    PYTHONPATH=src python3 scripts/decode_cold_probe.py [--cases qwen3-30b-a3b:bf16,gpt-oss-120b:mxfp4] [--no-pure-reads]

Not part of the library: it answers where the decode path's time over its weight-read floor goes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import bench_us, captured, copy_bandwidth_gbs, write_json  # noqa: E402
from profile_layer import graph_time, kernel_times  # noqa: E402

from padded_moe import decode as dec  # noqa: E402
from padded_moe import experts as ex  # noqa: E402
from padded_moe.layer import FusedMoE  # noqa: E402


@triton.jit
def _read_kernel(w_ptr, ids_ptr, out_ptr, expert_stride, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Sum of one CHUNK of the slot's expert's weights (a streaming read, nothing else)."""
    s = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.load(ids_ptr + s).to(tl.int64)
    base = w_ptr + e * expert_stride + c * CHUNK
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(0, CHUNK, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + s * tl.num_programs(1) + c, tl.sum(acc))


def pure_read(w: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, programs: int, block: int, stages: int):
    per_expert = w[0].numel()
    slots = ids.numel()
    while per_expert % block:
        block //= 2
    chunks = max(1, programs // slots)
    while per_expert % chunks or (per_expert // chunks) % block:
        chunks -= 1
    _read_kernel[(slots, chunks)](w, ids, out, w.stride(0), CHUNK=per_expert // chunks, BLOCK=block,
                                  num_warps=4, num_stages=stages)


def candidates(default: dec.DecodeTiles, mxfp4: bool, top_k: int) -> list:
    """(label, tiles, `padded_moe.decode` settings): the default tiles, then (bf16 only) the tiles
    before the K-step rule (BK 128, GEMM2 8192 weights per step x 3), GEMM1 at 3 stages, GEMM2 at
    twice the step, and the default tiles with GEMM1 reading its weights by per-thread copies;
    (MXFP4 only) GEMM2 as the Triton kernel and as each native configuration that fits top_k."""
    d = default
    out = [("default", d, {})]
    if mxfp4:
        out += [("triton w2", d, {"MX_W2": "triton"})]
        from padded_moe.kernels import native

        out += [(f"native c{c}", d, {"MX_W2": "cuda", "NATIVE_W2_CONFIG": c})
                for c in range(native.w2_num_configs()) if dec.native_w2_fits(c, top_k)]
    if not mxfp4:
        out += [("before", dec.DecodeTiles(d.bn1, 128, d.bn2, 8192, warps1=d.warps1, stages1=d.stages1,
                                            warps2=d.warps2, stages2=3), {}),
                ("g1 s3", dec.DecodeTiles(d.bn1, d.bk1, d.bn2, d.step2, warps1=d.warps1, stages1=3,
                                          warps2=d.warps2, stages2=d.stages2), {}),
                ("g2 2x step", dec.DecodeTiles(d.bn1, d.bk1, d.bn2, 2 * d.step2, warps1=d.warps1,
                                               stages1=d.stages1, warps2=d.warps2, stages2=d.stages2), {}),
                ("pointer read", d, {"W13_READ": "pointer"})]
    seen, uniq = set(), []
    for label, t, st in out:
        key = (t, tuple(sorted(st.items())))
        if key not in seen:
            seen.add(key)
            uniq.append((label, t, st))
    return uniq


def clean_flush_us(graph, flush: torch.Tensor, reps: int = 30) -> float:
    """One replay after reading (not writing) a buffer larger than L2: clean lines, cold weights."""
    samples = []
    for _ in range(reps):
        flush.sum(dtype=torch.float32)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        samples.append(1000 * a.elapsed_time(b))
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="qwen3-30b-a3b:bf16,gpt-oss-120b:bf16,dsv4-flash:bf16,gpt-oss-120b:mxfp4,"
                                      "dsv4-flash:mxfp4")
    p.add_argument("--no-pure-reads", action="store_true", help="skip the pure-read floors")
    p.add_argument("--read-bytes", type=float, default=300e6, help="weights read per graph replay (sets L)")
    p.add_argument("--out", default="gpu-out/decode-cold.json")
    args = p.parse_args()
    copy = copy_bandwidth_gbs() * 1e9
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s", flush=True)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda").view(torch.float32).normal_()
    report = {"copy_bytes_per_s": copy, "cases": {}}
    for case in args.cases.split(","):
        name, fmt = case.split(":")
        mx = fmt == "mxfp4"
        proto = FusedMoE.from_preset(name, weight_format=fmt, device="cuda", dtype=torch.bfloat16)
        a13, a2 = proto.expert_weights()
        # Bytes of one expert in the format the floor counts (MXFP4: the canonical e2m1 + E8M0).
        expert_bytes = sum(w.nbytes() if mx else w.nbytes for w in (a13, a2)) // proto.num_experts
        n_inter = a2.shape[2]
        L = max(2, min(6, int(args.read_bytes // (expert_bytes * proto.top_k)) + 1))
        del proto, a13, a2
        layers = []
        for i in range(L):
            layer = FusedMoE.from_preset(name, weight_format=fmt, device="cuda", dtype=torch.bfloat16)
            layer.randomize(seed=i, std=0.02)
            layers.append(layer)
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(1, layers[0].hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        routes = [lay.route(lay.gate(x), None) for lay in layers]
        flat_ids = [ids.reshape(-1).to(torch.int32).contiguous() for _, ids in routes]
        hit = [torch.unique(i).numel() for i in flat_ids]
        sums = torch.empty(1 << 16, device="cuda", dtype=torch.float32)
        floor = sum(hit) / L * expert_bytes / copy * 1e6
        res = {"L": L, "experts_hit": hit, "expert_bytes": expert_bytes, "floor_us_per_call": round(floor, 2)}
        print(case, f"L={L} floor {floor:.2f} us per call", flush=True)
        default = dec.pick_tiles(1, layers[0].top_k, n_inter, layers[0].hidden_size, x.device, mxfp4=mx,
                                 mx_dot=dec.uses_mx_dot(layers[0].expert_weights()[0], 1))

        def step():
            for lay, (tw, ids) in zip(layers, routes):
                lay.experts(x, tw, ids)

        plans = ex._launch_plans()
        rows = []
        for label, tiles, settings in candidates(default, mx, layers[0].top_k):
            real = dec.pick_tiles
            saved = {k: getattr(dec, k) for k in settings}
            dec.pick_tiles = lambda *a, _t=tiles, **kw: _t  # noqa: E731
            for k, v in settings.items():
                setattr(dec, k, v)
            plans.enabled = False
            try:
                graph, _ = captured(step)
                kt = kernel_times(graph.replay, 20)
                rt = graph_time(graph, 20)
            finally:
                dec.pick_tiles = real
                for k, v in saved.items():
                    setattr(dec, k, v)
                plans.enabled = True
            g1 = sum(v for k, v in kt.items() if "w13" in k) / L
            g2 = sum(v for k, v in kt.items() if "w2_combine" in k) / L
            rows.append({"label": label, "tiles": tiles.short(), "settings": settings, "gemm1_us": round(g1, 2),
                         "gemm2_us": round(g2, 2), "replay_us_per_call": round(rt / L, 2),
                         "kernels": {k: round(v, 2) for k, v in kt.items()}})
            print(case, label, tiles.short(), settings or "", f"GEMM1 {g1:.2f} GEMM2 {g2:.2f} replay/call "
                  f"{rt / L:.2f} us (floor/replay {floor / (rt / L):.2f})", flush=True)
            del graph
        res["tiles"] = rows
        if not mx and not args.no_pure_reads:  # pure reads of the same experts' bytes, as two kernels per layer (w13 then w2)
            reads = []
            for programs, block, stages in ((1056, 2048, 3), (528, 2048, 4), (2112, 2048, 3), (1056, 4096, 3)):
                def read_step():
                    for lay, ids in zip(layers, flat_ids):
                        a, b = lay.expert_weights()
                        pure_read(a, ids, sums, programs, block, stages)
                        pure_read(b, ids, sums, programs, block, stages)

                read_step()
                graph, _ = captured(read_step)
                kt = kernel_times(graph.replay, 20)
                per = {k: round(v / L / 2, 2) for k, v in kt.items()}  # two kernels per layer, one name
                tot = sum(kt.values()) / L
                reads.append({"programs": programs, "block": block, "stages": stages, "both_us": round(tot, 2)})
                print(case, f"pure read programs~{programs} block {block} s{stages}: {tot:.2f} us per call "
                      f"({sum(hit) / L * expert_bytes / (tot * 1e-6) / 1e12:.2f} TB/s; mean kernel {per})", flush=True)
                del graph
            # Each weight alone, best config above: which kernel the time goes to.
            for which in (0, 1):
                def one_step(which=which):
                    for lay, ids in zip(layers, flat_ids):
                        pure_read(lay.expert_weights()[which], ids, sums, 1056, 2048, 3)
                graph, _ = captured(one_step)
                kt = kernel_times(graph.replay, 20)
                res[f"pure_read_w{'13' if which == 0 else '2'}_us"] = round(sum(kt.values()) / L, 2)
                del graph
            print(case, "pure read w13 alone", res["pure_read_w13_us"], "w2 alone", res["pure_read_w2_us"], flush=True)
            res["pure_reads"] = reads
        tw, ids = routes[0]
        g, _ = captured(lambda: layers[0].experts(x, tw, ids))
        res["one_call_do_bench_us"] = round(bench_us(g.replay), 2)
        res["one_call_clean_flush_us"] = round(clean_flush_us(g, flush), 2)
        kt = kernel_times(g.replay, 20)
        res["one_call_warm_kernels"] = {k: round(v, 2) for k, v in kt.items()}
        print(case, f"one call: do_bench (memset flush) {res['one_call_do_bench_us']} us, clean flush "
              f"{res['one_call_clean_flush_us']} us; back-to-back kernels {res['one_call_warm_kernels']}", flush=True)
        report["cases"][case] = res
        del layers, g
        torch.cuda.empty_cache()
    write_json(args.out, report)


if __name__ == "__main__":
    main()
