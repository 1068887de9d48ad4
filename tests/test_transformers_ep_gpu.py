"""A whole HF MoE model on two GPUs: DP=1 against DP=2/EP=2 over NCCL (spec 04, issue 17).

Run on a machine with two GPUs (one process per GPU through tests/_spawn.py's harness):

    .venv/bin/python -m pytest -q -rA tests/test_transformers_ep_gpu.py -s

Model: DeepSeek-V4 at full layer width (hidden 4096, 256 routed experts, top-6, expert width 2048,
the released attention shapes and vocabulary) with 2 layers (one hash-routed, one top-k routed)
and seeded random weights, bf16; experts in bf16 and in MXFP4. Each rank builds the same model.

- DP=1: each rank alone (a one-rank group) greedy-decodes all 8 prompts (32 tokens each).
- DP=2/EP=2: each rank keeps 128 experts per layer, decodes its own 4 prompts; decode steps replay
  CUDA graphs of the expert exchange (`capture_decode_graphs`).
- idle: rank 0 decodes its prompts for 8 steps while rank 1, with no prompts, calls `idle_step`.

Greedy tokens must equal DP=1's wherever the choice is clear: a prompt may diverge only at a step
whose DP=1 top-2 logit margin is at most twice the logit difference between the two runs there
(bf16 rounding differs between one rank and two: different GEMM row counts and a different
summation order of the experts' contributions). Over the steps both runs saw the same prefix,
the median logit error must stay at bf16 level (LOGIT_TOL of the logit scale; a broken exchange
gives errors of order one) with few outliers (a router near-tie sends a token to other experts in
one run: a large error at that step, which is why no hard maximum is asserted). Memory:
what a rank holds after the swap and graph capture is within 10% of `plan_memory`'s estimate.
"""

from __future__ import annotations

import os

import pytest
import torch

from _spawn import spawn_group

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

PROMPTS, SEQ, NEW_TOKENS, IDLE_STEPS = 8, 32, 32, 8
LOGIT_TOL = 3e-2      # median bf16 logit error relative to max |logit|, same-prefix steps
OUTLIER_SHARE = 0.1   # of same-prefix steps may exceed 10x that median (router near-ties)
MEMORY_TOL = 0.10
SEED = int(os.environ.get("PADDED_MOE_SEED") or int.from_bytes(os.urandom(4), "little"))
FULL = dict(num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"])


def build_model(overrides: dict, device, dtype, seed: int):
    """DeepSeek-V4 with the config's defaults (the released shapes) except `overrides`, random
    weights drawn on `device` from `seed` (identical on every rank): matrices N(0, 0.6² / fan_in),
    norm scales 1 + N(0, 0.1²), other vectors N(0, 0.1²), hash routing to distinct experts."""
    from transformers import AutoModelForCausalLM, DeepseekV4Config

    cfg = DeepseekV4Config(**overrides)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, experts_implementation="eager")
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1, generator=gen)
            else:
                p.normal_(0.0, 0.6 / p.shape[-1] ** 0.5, generator=gen)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                scores = torch.rand(b.shape[0], cfg.n_routed_experts, generator=gen, device=device)
                b.copy_(scores.argsort(-1)[:, : b.shape[1]])
    return model.eval()


@torch.no_grad()
def greedy(model, prompts, steps: int):
    """Greedy decode with a KV cache; `prompts` None: an idle rank (idle_step per step).
    Returns (tokens [P, steps], last-position logits [steps, P, V] float) or (None, None)."""
    from padded_moe.integrations.transformers import idle_step

    tokens, logits, cache, inputs = [], [], None, prompts
    for _ in range(steps):
        if prompts is None:
            idle_step(model)
            continue
        out = model(input_ids=inputs, cache=cache, use_cache=True)
        cache = out.past_key_values
        last = out.logits[:, -1].float()
        inputs = last.argmax(-1, keepdim=True)
        tokens.append(inputs)
        logits.append(last)
    if prompts is None:
        return None, None
    return torch.cat(tokens, 1), torch.stack(logits)


def compare(ref_tokens, ref_logits, tokens, logits) -> dict:
    """Per prompt: where the tokens first differ and whether that step was a near-tie; the logit
    error (relative to max |logit|) at every step both runs saw the same prefix (see module doc)."""
    out = dict(identical=0, explained=0, unexplained=[], rel=[])
    for p in range(tokens.shape[0]):
        diff = (tokens[p] != ref_tokens[p]).nonzero()
        d = int(diff[0]) if diff.numel() else tokens.shape[1]
        for t in range(min(d + 1, tokens.shape[1])):  # logits up to and including the divergence
            err = float((logits[t, p] - ref_logits[t, p]).abs().max())
            out["rel"].append(err / float(ref_logits[t, p].abs().max()))
        if d == tokens.shape[1]:
            out["identical"] += 1
            continue
        top2 = ref_logits[d, p].topk(2).values
        margin = float(top2[0] - top2[1])
        err = float((logits[d, p] - ref_logits[d, p]).abs().max())
        if margin <= 2 * err:
            out["explained"] += 1
        else:
            out["unexplained"].append(dict(prompt=p, step=d, margin=margin, err=err))
    rel = torch.tensor(out.pop("rel"), dtype=torch.float64)
    out["median_rel"] = float(rel.median())
    out["share_above_10x_median"] = float((rel > 10 * rel.median()).double().mean())
    out["steps_compared"] = rel.numel()
    return out


def _worker(rank, world, payload):
    import torch.distributed as dist

    from padded_moe.integrations.transformers import (capture_decode_graphs, enable_expert_parallel,
                                                      plan_memory)

    dev = torch.device("cuda", rank) if payload["device"] == "cuda" else torch.device("cpu")
    dtype = payload["dtype"]
    solo = [dist.new_group([r]) for r in range(world)]  # every rank takes part in creating each
    gen = torch.Generator().manual_seed(payload["seed"] + 1)
    vocab = payload.get("vocab", 129280)
    ids = torch.randint(2, vocab, (PROMPTS, SEQ), generator=gen).to(dev)
    per_rank = PROMPTS // world
    mine = ids[rank * per_rank:(rank + 1) * per_rank]
    results = {}
    for fmt in payload["formats"]:
        res = results[fmt] = {}
        # DP=1: this rank alone serves all prompts (eager).
        model = build_model(payload["config"], dev, dtype, payload["seed"])
        enable_expert_parallel(model, solo[rank], max_tokens_per_rank=PROMPTS * SEQ, weight_format=fmt)
        ref_tokens, ref_logits = greedy(model, ids, NEW_TOKENS)
        ref_logits = ref_logits.cpu()  # kept off the device: the memory check below measures it
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()

        # DP=2/EP=2: own prompts, half the experts, decode steps on CUDA graphs.
        model = build_model(payload["config"], dev, dtype, payload["seed"])
        estimate = plan_memory(model, world, per_rank * SEQ, weight_format=fmt)
        enable_expert_parallel(model, None, max_tokens_per_rank=per_rank * SEQ, weight_format=fmt)
        if payload["graphs"]:
            capture_decode_graphs(model, per_rank)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            res["resident"] = torch.cuda.memory_allocated(dev)
            res["estimate"] = estimate["total"]
        tokens, logits = greedy(model, mine, NEW_TOKENS)
        mine_ref = slice(rank * per_rank, (rank + 1) * per_rank)
        res["ep"] = compare(ref_tokens[mine_ref].cpu(), ref_logits[:, mine_ref], tokens.cpu(), logits.cpu())

        # Rank 1 idle for every step (prefill included): rank 0 alone has prompts.
        tokens, logits = greedy(model, mine if rank == 0 else None, IDLE_STEPS)
        if rank == 0:
            res["idle"] = compare(ref_tokens[mine_ref, :IDLE_STEPS].cpu(), ref_logits[:IDLE_STEPS, mine_ref],
                                  tokens.cpu(), logits.cpu())
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()
    return results


def check(results, formats) -> None:
    for fmt in formats:
        for rank, per_rank in enumerate(results):
            r = per_rank[fmt]
            print(f"{fmt} rank {rank}: {r}")
            for phase in ("ep", "idle") if rank == 0 else ("ep",):
                c, where = r[phase], f"seed {SEED}, {fmt}, rank {rank}, {phase}"
                assert not c["unexplained"], f"{where}: diverged where the choice was clear: {c['unexplained']}"
                assert c["median_rel"] <= LOGIT_TOL, f"{where}: median logit error {c['median_rel']}"
                # a token sent to other experts by a router near-tie moves its logits a lot; rare
                assert c["share_above_10x_median"] <= OUTLIER_SHARE, f"{where}: {c}"
            if "resident" in r:
                est, got = r["estimate"], r["resident"]
                assert abs(est - got) <= MEMORY_TOL * got, f"{fmt}, rank {rank}: plan {est} B, allocated {got} B"


def test_dp1_vs_dp2_ep2_full_width_deepseek_v4():
    formats = ["bf16", "mxfp4"]
    payload = dict(device="cuda", dtype=torch.bfloat16, config=FULL, formats=formats, graphs=True, seed=SEED)
    results = spawn_group(2, _worker, payload, backend="nccl", timeout=1200)
    check(results, formats)
