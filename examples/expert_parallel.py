"""A FusedMoE layer with expert parallelism over real processes: one per GPU, or CPU processes.

    python -m torch.distributed.run --nproc-per-node 2 examples/expert_parallel.py          # CPU, gloo
    python -m torch.distributed.run --nproc-per-node 2 examples/expert_parallel.py --cuda   # 2 GPUs, nccl

Every rank builds the same layer from the same global weights and keeps its own share of the
experts; the router runs on every rank. Each rank feeds its own tokens (rank 1 feeds none on the
second step: an idle rank still calls the layer, with a `[0, K]` input, because its experts serve
the other ranks' tokens). Each rank checks its output against the whole layer on one device.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from padded_moe import ExpertParallel, FusedMoE

E, TOP_K, HIDDEN, INTER, MAX_TOKENS = 8, 2, 64, 32, 16


def main(cuda: bool) -> None:
    if cuda:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)  # before the process group and the buffers
        dist.init_process_group("nccl")
        device, dtype = torch.device("cuda", local_rank), torch.bfloat16
    else:
        dist.init_process_group("gloo")
        device, dtype = torch.device("cpu"), torch.float32
    rank, ranks = dist.get_rank(), dist.get_world_size()

    gen = torch.Generator().manual_seed(0)  # the same global weights on every rank
    w13 = (torch.randn(E, 2 * INTER, HIDDEN, generator=gen) * 0.1).to(device, dtype)
    w2 = (torch.randn(E, HIDDEN, INTER, generator=gen) * 0.1).to(device, dtype)
    full = FusedMoE(E, TOP_K, HIDDEN, INTER, dtype=dtype, device=device)  # one device, the reference
    full.load_experts(w13, w2)

    ep = ExpertParallel(None, E, TOP_K, HIDDEN, max_tokens_per_rank=MAX_TOKENS, dtype=dtype, device=device)
    layer = FusedMoE(E, TOP_K, HIDDEN, INTER, expert_parallel=ep, dtype=dtype, device=device)
    layer.gate.load_state_dict(full.gate.state_dict())  # the router: on every rank
    layer.load_experts(w13, w2)  # the global weights; the layer keeps this rank's E / R experts

    tokens = {0: [5, 9], 1: [3, 0]}  # tokens per step for each rank (rank 1 idle on step 2)
    for step in range(2):
        m = tokens.get(rank, [4, 4])[step]
        x = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(10 * rank + step)).to(device, dtype)
        with torch.no_grad():
            y, want = layer(x), full(x)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        if not torch.allclose(y.float(), want.float(), atol=tol, rtol=tol):
            raise SystemExit(f"rank {rank}, step {step}: the expert-parallel layer differs from the whole layer")
    print(f"rank {rank} of {ranks} ({ep.transport_name} transport, {layer.num_local} local experts): "
          f"matches the whole layer")
    dist.barrier()  # no rank tears its connections down while another is still in a collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main(cuda="--cuda" in sys.argv[1:])
