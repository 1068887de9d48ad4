"""Greedy decoding of an HF MoE model on 2 CPU processes with expert parallelism (gloo).

    python -m torch.distributed.run --nproc-per-node 2 examples/expert_parallel_hf.py

Rank 0 writes a tiny random DeepSeek-V4 checkpoint; every rank loads it, keeps half the experts
of each MoE layer (`enable_expert_parallel`) and decodes its own prompts (data-parallel attention).
Rank 1 wants fewer tokens than rank 0, so it sits the last steps out with `idle_step`, which
still serves the tokens rank 0 routes to rank 1's experts. Rank 0 then checks every rank's tokens
against the same checkpoint decoded on one process without expert parallelism.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

# prompt ids per rank, and how many tokens each rank generates for them
PROMPTS = {0: [[5, 17, 99, 42, 7], [64, 3, 3, 81, 20]], 1: [[11, 12, 13, 14, 15]]}
NEW_TOKENS = {0: 6, 1: 3}


def tiny_checkpoint(path: str) -> None:
    from transformers import AutoModelForCausalLM, DeepseekV4Config

    cfg = DeepseekV4Config(vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=16,
                           num_experts_per_tok=2, n_routed_experts=8, hc_mult=2, sliding_window=8,
                           o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=4,
                           mlp_layer_types=["hash_moe", "moe"], partial_rotary_factor=0.5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger weights than HF's init, so the experts visibly matter
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.6 / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):  # hash routing: distinct experts per token
                b.copy_(torch.rand(b.shape[0], cfg.n_routed_experts).argsort(-1)[:, : b.shape[1]])
    model.save_pretrained(path)


@torch.no_grad()
def greedy(model, prompts: torch.Tensor, steps: int, total_steps: int):
    """`steps` greedy tokens for `prompts` (None: no prompts); idle for the remaining of `total_steps`."""
    from padded_moe.integrations.transformers import idle_step

    tokens, cache, inputs = [], None, prompts
    for step in range(total_steps):
        if prompts is None or step >= steps:
            idle_step(model)  # joins every MoE layer's exchange with zero tokens
            continue
        out = model(input_ids=inputs, cache=cache, use_cache=True)
        cache = out.past_key_values
        inputs = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(inputs)
    return torch.cat(tokens, 1) if tokens else None


def main() -> int:
    from transformers import AutoModelForCausalLM

    from padded_moe.integrations.transformers import enable_expert_parallel

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("run with --nproc-per-node 2")
    path = [tempfile.mkdtemp(prefix="padded_moe_ep_") if rank == 0 else None]
    if rank == 0:
        tiny_checkpoint(path[0])
    dist.broadcast_object_list(path, src=0)
    dist.barrier()

    model = AutoModelForCausalLM.from_pretrained(path[0], dtype=torch.float32).eval()
    # Every rank must reserve the same bound: the largest batch x sequence any rank feeds at once.
    handle = enable_expert_parallel(model, max_tokens_per_rank=16)
    local = [int(e) for e in next(iter(handle.layers.values())).moe.local_experts]
    print(f"rank {rank}: {len(handle.layers)} MoE layers, experts {local} of each")

    # Every rank makes the same number of steps (each step is one exchange per MoE layer).
    total = torch.tensor(NEW_TOKENS[rank])
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    prompts = torch.tensor(PROMPTS[rank]) if PROMPTS.get(rank) else None
    mine = greedy(model, prompts, NEW_TOKENS[rank], int(total))

    gathered = [None] * world
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    ok = True
    if rank == 0:
        reference = AutoModelForCausalLM.from_pretrained(path[0], dtype=torch.float32).eval()
        for r in range(world):
            ref = greedy(reference, torch.tensor(PROMPTS[r]), NEW_TOKENS[r], NEW_TOKENS[r])
            same = torch.equal(gathered[r], ref)
            ok &= same
            print(f"rank {r} tokens {gathered[r].tolist()}  one process {ref.tolist()}  "
                  f"{'same' if same else 'DIFFERENT'}")
        print("expert-parallel decoding matches one process" if ok else "MISMATCH")
        shutil.rmtree(path[0], ignore_errors=True)
    flag = torch.tensor(int(ok))
    dist.broadcast(flag, src=0)
    dist.barrier()  # no rank tears its connections down while another is still in a collective
    dist.destroy_process_group()
    return 0 if int(flag) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
