"""Expert-parallel dispatch + combine vs raw all_to_all_single moving the same bytes (spec 04).

Run on 2 GPUs (self-spawning):      python benchmarks/bench_ep.py --out results/ep
or under torchrun:                  torchrun --nproc-per-node 2 benchmarks/bench_ep.py --out results/ep
CPU smoke run (gloo):               python benchmarks/bench_ep.py --device cpu --tokens 16 --iters 3 --no-layer
(the layer timing allocates the preset's bf16 weights on every rank: tens of GB on CPU; prefix
TRITON_INTERPRET=1 to run the interpreted kernels instead of the torch path)

For T tokens per rank it times, per mode (flat / batched):
- `a2a`: one all_to_all_single of `[R*T, K]` rows (the dispatch payload); dispatch + combine move
  those bytes twice (there and back), so the reference for them is `2 × a2a`;
- `dispatch+combine`: ExpertParallel.dispatch then combine (experts skipped: combine returns
  the received rows), eager and (GPU, flat and batched) captured in a CUDA graph; the two graph
  replays (raw a2a and dispatch+combine) are timed in alternation, iteration by iteration. On GPU this is
  the Triton path of `padded_moe.kernels.ep`: per direction one all_to_all of `[R*T, row_bytes]`
  wire rows (x + in-band ids / weights / count, ~1% more bytes than the raw a2a) and 2-4 kernels;
  the table title says which path ran ("triton" or "torch");
- `layer`: dispatch → fused_experts / batched_experts (bf16 weights of the preset) → combine;
  on GPU also `one_rank`: one GPU running `fused_experts` with all experts on every rank's tokens
  concatenated, and `ep_speedup` = one_rank / layer (graph replays; spec target ≥ 1.8 at T=1024).
Target (graph): dispatch+combine ≥ 0.8 × the speed of 2 × a2a ("ratio" column).

A timed sample is `--chain` calls back to back (default 10: the steady state; 1: one call, whose
time for a collective includes the ranks' launch skew). `--timeline` prints each kernel's start
and duration in a steady-state graph replay; `--tile STAGE=ROWS,WARPS,PER_SM`, `--free-sms` and
`--overlap-min-tokens` override the EP launch settings for one run (probes).
Writes `ep.json` and `ep.png` to --out; rank 0 prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from padded_moe._graphs import capture_warm  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="dsv4-flash")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 1024], help="tokens per rank")
    p.add_argument("--modes", nargs="+", default=["flat", "batched"])
    p.add_argument("--transports", nargs="+", default=["nccl"],
                   help="ExpertParallel transports to time (nccl, symm_mem)")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--chain", type=int, default=10,
                   help="calls back to back per timed sample (1: one call, launch skew between ranks included)")
    p.add_argument("--no-layer", action="store_true", help="skip the end-to-end layer timing")
    p.add_argument("--timeline", action="store_true",
                   help="rank 0 prints the kernel timeline (start gaps, durations) of chained graph replays")
    p.add_argument("--profile", action="store_true",
                   help="rank 0 prints the per-kernel device time of dispatch+combine (torch.profiler)")
    p.add_argument("--tile", action="append", default=[], metavar="STAGE=ROWS,WARPS,PER_SM",
                   help="override one entry of padded_moe.ep.tiles.EP_TILES for this run (repeatable)")
    p.add_argument("--free-sms", type=int, default=None,
                   help="override padded_moe.ep.tiles.EP_FREE_SMS (SMs the overlapped kernels leave to NCCL)")
    p.add_argument("--overlap-min-tokens", type=int, default=None,
                   help="override padded_moe.ep.tiles.EP_OVERLAP_MIN_TOKENS (batched own-chunk overlap)")
    p.add_argument("--out", default="results/bench_ep")
    return p.parse_args(argv)


def apply_tiles(overrides) -> None:
    """--tile recv_batched=4,8,4 → EP_TILES["recv_batched"] = EPTile(4, 8, 4)."""
    from padded_moe import distributed as D

    for item in overrides:
        stage, _, nums = item.partition("=")
        if stage not in D.EP_TILES:
            raise SystemExit(f"--tile: unknown stage {stage!r}; stages: {sorted(D.EP_TILES)}")
        D.EP_TILES[stage] = D.EPTile(*(int(v) for v in nums.split(",")))


class Timer:
    """Median wall time of one `fn` call in ms; CUDA events on GPU, barriers so ranks start together.

    A sample times `chain` calls back to back and divides: the steady state of layer after layer.
    With chain=1 a collective's sample mostly measures how far apart the ranks launched it (tens
    of µs of host skew against a 30-100 µs transfer), which made the raw all_to_all's time jump
    between runs; the first call of a chain absorbs that skew.
    """

    def __init__(self, device, iters, warmup, chain=1):
        self.cuda = device.type == "cuda"
        self.iters, self.warmup, self.chain = iters, warmup, max(1, chain)

    def _once(self, fn) -> float:
        dist.barrier()
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.chain):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / self.chain
        t0 = time.perf_counter()
        for _ in range(self.chain):
            fn()
        return (time.perf_counter() - t0) * 1e3 / self.chain

    def _slowest_median(self, times) -> float:
        # Every rank reports the slowest rank's median: a collective is as slow as its last rank.
        t = torch.tensor([statistics.median(times)], dtype=torch.float64,
                         device="cuda" if self.cuda else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        return self._slowest_median([self._once(fn) for _ in range(self.iters)])

    def round_robin(self, fns: dict) -> dict:
        """Every function timed in turn, iteration by iteration, so ratios between them compare the
        same conditions (the raw all_to_all's time drifts between moments of one run and between
        runs)."""
        for _ in range(self.warmup):
            for fn in fns.values():
                fn()
        times = {name: [] for name in fns}
        for _ in range(self.iters):
            for name, fn in fns.items():
                times[name].append(self._once(fn))
        return {name: self._slowest_median(t) for name, t in times.items()}

    def pair(self, fn_a, fn_b) -> tuple[float, float]:
        """Both timed in alternation (see `round_robin`)."""
        t = self.round_robin({"a": fn_a, "b": fn_b})
        return t["a"], t["b"]


def graphed(fn, device):
    """Capture fn in a CUDA graph (after a warm-up on a side stream); returns replay."""
    return capture_warm(fn, device=device)[0].replay


def print_kernel_breakdown(fn, mode, T, calls=5):
    """Every rank runs `fn` (it holds collectives); rank 0 profiles and prints per-kernel µs."""
    if dist.get_rank() != 0:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from profile_layer import kernel_times

    totals = kernel_times(fn, calls)
    print(f"\ndispatch+combine {mode} T={T}: {sum(totals.values()):.0f} µs of kernels per call")
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {us:8.1f} µs  {name}")


def print_timeline(replays: dict, T, mode, chain=4):
    """Every rank replays each graph `chain` times back to back; rank 0 records a CUDA trace and
    prints, for the last replay of each, every kernel's start (µs after the previous kernel on
    the GPU ended; negative = overlapping) and duration: where the time between kernels goes."""
    from torch.profiler import ProfilerActivity, profile

    for name, replay in replays.items():
        dist.barrier()
        torch.cuda.synchronize()
        if dist.get_rank() != 0:
            for _ in range(chain):
                replay()
            torch.cuda.synchronize()
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(chain):
                replay()
            torch.cuda.synchronize()
        evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
        if not evs:
            print(f"timeline {name}: no CUDA events recorded")
            continue
        per = max(1, len(evs) // chain)
        last = evs[-per:]
        span = last[-1].time_range.end - last[0].time_range.start
        period = (evs[-1].time_range.end - evs[0].time_range.start) / chain
        print(f"\ntimeline {mode} T={T} {name}: last replay {span:.1f} µs first kernel start to last end; "
              f"{period:.1f} µs per replay over {chain}")
        prev_end = evs[-per - 1].time_range.end if len(evs) > per else last[0].time_range.start
        for e in last:
            print(f"  +{e.time_range.start - prev_end:7.1f}  {e.time_range.end - e.time_range.start:7.1f} µs  {e.name[:60]}")
            prev_end = max(prev_end, e.time_range.end)


_ONE_RANK: dict = {}


def one_rank_ms(preset, x, ids, w, device, timer) -> float:
    """One GPU doing the whole layer: `fused_experts` with all E experts (bf16) on every rank's
    tokens concatenated (R*T), graph replay. Every rank times it on its own GPU (the timer's
    barriers keep them together); the result is cached per token count (mode and transport do not
    change it)."""
    from padded_moe.experts import fused_experts

    R = dist.get_world_size()
    key = (preset.name, R * x.shape[0])
    if key not in _ONE_RANK:
        def gather(t):
            parts = [torch.empty_like(t) for _ in range(R)]
            dist.all_gather(parts, t.contiguous())
            return torch.cat(parts)

        xa, ia, wa = gather(x), gather(ids), gather(w)
        E, K, N = preset.num_experts, preset.hidden_size, preset.intermediate_size
        g = torch.Generator(device=device).manual_seed(7)
        w13 = torch.empty(E, preset.w13_rows, K, dtype=torch.bfloat16, device=device)
        w2 = torch.empty(E, K, N, dtype=torch.bfloat16, device=device)
        for e in range(E):  # one expert at a time: no float32 copy of the whole layer
            w13[e] = torch.randn(preset.w13_rows, K, generator=g, device=device) / K ** 0.5
            w2[e] = torch.randn(K, N, generator=g, device=device) / N ** 0.5
        _ONE_RANK[key] = timer(graphed(lambda: fused_experts(xa, w13, w2, wa, ia, activation="silu"), device))
        del w13, w2
        torch.cuda.empty_cache()
    return _ONE_RANK[key]


def bench_one(preset, mode, T, device, timer, layer, profile=False, timeline=False, transport="nccl"):
    from padded_moe.distributed import ExpertParallel

    R, rank = dist.get_world_size(), dist.get_rank()
    E, k, K, N = preset.num_experts, preset.top_k, preset.hidden_size, preset.intermediate_size
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    x = torch.randn(T, K, generator=gen, device=device).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=gen, device=device).argsort(1)[:, :k].to(torch.int32)
    w = torch.rand(T, k, generator=gen, device=device)
    ep = ExpertParallel(None, E, k, K, T, mode=mode, dtype=torch.bfloat16, device=device, transport=transport)
    rows = R * T
    send = torch.randn(rows, K, device=device).to(torch.bfloat16)
    recv = torch.empty_like(send)

    def a2a():
        dist.all_to_all_single(recv, send)

    def dispatch_combine():  # the received rows stand in for the expert output (same shape)
        rb, h = ep.dispatch(x, ids, w)
        return ep.combine(rb.x, h)

    res = dict(mode=mode, transport=transport, tokens_per_rank=T, ranks=R,
               bytes_per_a2a=send.numel() * send.element_size())
    res["a2a_ms"] = timer(a2a)
    res["dispatch_combine_ms"] = timer(dispatch_combine)
    if device.type == "cuda":
        g_a2a, g_dc = graphed(a2a, device), graphed(dispatch_combine, device)
        res["a2a_graph_ms"], res["dispatch_combine_graph_ms"] = timer.pair(g_a2a, g_dc)
        # Dispatch alone: wire bytes this rank sends to its peers (tokens with a slot on a peer).
        owner = ep._owner.long()
        peers = torch.arange(R, device=device).view(R, 1, 1)
        to_peer = (owner[ids.long()].unsqueeze(0) == peers).any(-1)
        sent_rows = int(to_peer.sum()) - int(to_peer[rank].sum())
        res["dispatch_graph_ms"] = timer(graphed(lambda: ep.dispatch(x, ids, w), device))
        res["dispatch_GBps"] = sent_rows * ep.wire.row_bytes / (res["dispatch_graph_ms"] * 1e-3) / 1e9
        if timeline:
            print_timeline({"raw a2a": g_a2a, "dispatch+combine": g_dc}, T, mode)
        if profile:
            print_kernel_breakdown(dispatch_combine, mode, T)
    if layer:
        from padded_moe.experts import batched_experts, fused_experts

        L = ep.num_local
        wg = torch.Generator(device=device).manual_seed(99 + rank)
        w13 = (torch.randn(L, preset.w13_rows, K, generator=wg, device=device) / K ** 0.5).to(torch.bfloat16)
        w2 = (torch.randn(L, K, N, generator=wg, device=device) / N ** 0.5).to(torch.bfloat16)

        def full_layer():
            rb, h = ep.dispatch(x, ids, w)
            if mode == "flat":
                eo = fused_experts(rb.x, w13, w2, rb.topk_weights, rb.topk_ids, activation="silu",
                                   expert_map=ep.expert_map, valid_tokens=rb.valid_tokens)
            else:
                eo = batched_experts(rb.x, rb.counts, w13, w2, activation="silu")
            return ep.combine(eo, h)

        res["layer_ms"] = timer(full_layer)
        if device.type == "cuda":
            res["layer_graph_ms"] = timer(graphed(full_layer, device))
        del w13, w2
        if device.type == "cuda":
            res["one_rank_graph_ms"] = one_rank_ms(preset, x, ids, w, device, timer)
            res["ep_speedup"] = res["one_rank_graph_ms"] / res["layer_graph_ms"]  # target ≥ 1.8 at T=1024
    best_dc = res.get("dispatch_combine_graph_ms", res["dispatch_combine_ms"])
    best_a2a = res.get("a2a_graph_ms", res["a2a_ms"])
    res["ratio_vs_2x_a2a"] = 2 * best_a2a / best_dc  # ≥ 0.8 is the target
    return res


def main_worker(args):
    from padded_moe.presets import get_preset

    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    preset = get_preset(args.preset)
    apply_tiles(args.tile)
    from padded_moe.ep import tiles  # the launchers read these at every call

    if args.free_sms is not None:
        tiles.EP_FREE_SMS = args.free_sms
    if args.overlap_min_tokens is not None:
        tiles.EP_OVERLAP_MIN_TOKENS = args.overlap_min_tokens
    timer = Timer(device, args.iters, args.warmup, args.chain)
    results = []
    for mode in args.modes:
        for T in args.tokens:
            for transport in args.transports:
                results.append(bench_one(preset, mode, T, device, timer, not args.no_layer, args.profile,
                                         args.timeline, transport))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        from padded_moe._platform import use_triton

        report(args, preset, results, "triton" if use_triton(device) else "torch")


def report(args, preset, results, path="torch"):
    from padded_moe.ep.tiles import EP_FREE_SMS, EP_OVERLAP_MIN_TOKENS, EP_TILES

    os.makedirs(args.out, exist_ok=True)
    meta = dict(preset=preset.name, device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                torch=torch.__version__, ranks=results[0]["ranks"] if results else 0, ep_path=path, chain=args.chain,
                ep_tiles={k: [v.rows, v.num_warps, v.per_sm] for k, v in EP_TILES.items()},
                ep_free_sms=EP_FREE_SMS, ep_overlap_min_tokens=EP_OVERLAP_MIN_TOKENS)
    with open(os.path.join(args.out, "ep.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=2)
    cols = ["mode", "transport", "tokens_per_rank", "a2a_ms", "a2a_graph_ms", "dispatch_combine_ms",
            "dispatch_combine_graph_ms", "dispatch_graph_ms", "dispatch_GBps", "layer_ms", "layer_graph_ms",
            "one_rank_graph_ms", "ep_speedup", "ratio_vs_2x_a2a"]
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"EP dispatch+combine, {meta['preset']}, {meta['ranks']} ranks, {meta['device']}, "
                            f"{path} path")
        for c in cols:
            table.add_column(c)
        for r in results:
            table.add_row(*[f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols])
        Console(width=200).print(table)
    except ImportError:  # pragma: no cover
        print(json.dumps(results, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in args.modes:
        for transport in args.transports:
            rs = [r for r in results if r["mode"] == mode and r["transport"] == transport]
            ts = [r["tokens_per_rank"] for r in rs]
            ax.plot(ts, [r["ratio_vs_2x_a2a"] for r in rs], marker="o",
                    label=f"{mode}, {transport}: 2×a2a / (dispatch+combine)")
    ax.axhline(0.8, color="gray", linestyle="--", label="target 0.8")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("speed relative to raw all_to_all_single")
    ax.set_title(f"{meta['preset']} on {meta['ranks']} ranks ({meta['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "ep.png"), dpi=120)


def _init(rank, world, port, device):
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}" if port else "env://",
                            timeout=datetime.timedelta(seconds=300))


def _spawned(rank, world, port, worker, args):
    _init(rank, world, port, getattr(args, "device", "cuda"))
    try:
        worker(args)
    finally:
        dist.destroy_process_group()


def _spawned_generic(worker, args) -> int:
    """Run `worker(args)` on every rank: under torchrun as it is, else in `args.nproc` spawned
    processes on a free local port."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _init(rank, world, None, getattr(args, "device", "cuda"))
        try:
            worker(args)
        finally:
            dist.destroy_process_group()
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(args.nproc, port, worker, args), nprocs=args.nproc)
    return 0


def main(argv=None):
    return _spawned_generic(main_worker, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
