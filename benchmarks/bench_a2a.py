"""The transport alone: what all_to_all variants cost on the EP wire buffers (2 GPUs, NCCL).

    python benchmarks/bench_a2a.py --tokens 16 128 1024 --out results/a2a

Variants, each over one uint8 buffer `[R*T, row_bytes]` (the dispatch wire of `dsv4-flash`), all
captured in CUDA graphs and replayed round-robin (iteration by iteration, so drift hits all alike):

- `single`:      all_to_all_single of the whole buffer, the chunk to oneself included (our
                 reference "raw a2a" in bench_ep);
- `list_all`:    dist.all_to_all over per-peer chunk views, oneself included;
- `list_peers`:  the same with an empty chunk to oneself (NCCL moves only the peer chunks);
- `peers+local`: `list_peers` launched async, a device copy of one's own chunk on the compute
                 stream meanwhile, then the wait (does a local kernel overlap the transfer?).

Rank 0 prints the medians (the slowest rank's) and writes a2a.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ep import Timer, _spawned_generic, graphed  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="dsv4-flash")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 1024])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="results/bench_a2a")
    return p.parse_args(argv)


def variants(T, row_bytes, device):
    R, me = dist.get_world_size(), dist.get_rank()
    send = torch.randint(0, 255, (R * T, row_bytes), dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    s_all = list(send.split(T))
    r_all = list(recv.split(T))
    s_peer = [c if d != me else c[:0] for d, c in enumerate(s_all)]
    r_peer = [c if d != me else c[:0] for d, c in enumerate(r_all)]

    def single():
        dist.all_to_all_single(recv, send)

    def list_all():
        dist.all_to_all(r_all, s_all)

    def list_peers():
        dist.all_to_all(r_peer, s_peer)

    def peers_local():
        work = dist.all_to_all(r_peer, s_peer, async_op=True)
        r_all[me].copy_(s_all[me])
        work.wait()

    return dict(single=single, list_all=list_all, list_peers=list_peers, peers_local=peers_local)


def main_worker(args):
    from padded_moe.distributed import WireFormat
    from padded_moe.presets import get_preset

    device = torch.device("cuda", torch.cuda.current_device())
    preset = get_preset(args.preset)
    wire = WireFormat(preset.hidden_size, preset.top_k, torch.bfloat16)
    timer = Timer(device, args.iters, args.warmup)
    rows = []
    for T in args.tokens:
        fns = {name: graphed(fn, device) for name, fn in variants(T, wire.row_bytes, device).items()}
        times = timer.round_robin(fns)
        rows.append(dict(tokens_per_rank=T, bytes=dist.get_world_size() * T * wire.row_bytes, **times))
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "a2a.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), ranks=dist.get_world_size(), rows=rows), f, indent=2)
        names = [k for k in rows[0] if k not in ("tokens_per_rank", "bytes")]
        print("tokens  bytes      " + "  ".join(f"{n:>12}" for n in names) + "   (ms, graph replays)")
        for r in rows:
            print(f"{r['tokens_per_rank']:6d}  {r['bytes']:9d}  " + "  ".join(f"{r[n]:12.4f}" for n in names))


if __name__ == "__main__":
    args = parse_args()
    sys.exit(_spawned_generic(main_worker, args))
