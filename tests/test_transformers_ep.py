"""Whole HF models with expert parallelism (spec 04's model-level control, issue 17), gloo on CPU.

Oracle: the same tiny random model (tests/test_transformers_parity.py's builders and seeds) run on
one process with HF's own eager experts, on all prompts at once and without a KV cache. The ranks
split the prompts (data-parallel attention), hold `E / R` experts each, prefill, then decode with
their KV caches; a rank with no prompts, or one that sits a decode step out, calls `idle_step`.
Every logit a rank produces must match the oracle's logit at the same (prompt, position):
max |Δ| ≤ 1e-4 · max |oracle| in fp32. Greedy generation on 2 ranks must give the oracle's tokens.

One spawn per world size runs every family and step (process start dominates the time); 4 ranks
run DeepSeek-V4 only.
"""

from __future__ import annotations

import pytest
import torch

from _spawn import spawn_group
from test_transformers_parity import TINY, build, max_rel

transformers = pytest.importorskip("transformers")

from padded_moe.integrations import transformers as plug  # noqa: E402

EP_FAMILIES = ("deepseek_v4", "qwen3_moe")
PROMPTS, SEQ, VOCAB = 4, 6, 128
TOL = 1e-4
NEW_TOKENS = 4


def prompt_ids() -> torch.Tensor:
    """[PROMPTS, SEQ + 2]: prompts, then the two tokens the decode steps feed (fixed, not greedy, so
    every rank's positions are known in advance)."""
    gen = torch.Generator().manual_seed(17)
    return torch.randint(2, VOCAB, (PROMPTS, SEQ + 2), generator=gen)


# Per world size: which prompts each rank owns, and which ranks sit out decode step 1. A rank
# that sits out decodes its first extension token at step 2 instead (its cache is one step behind).
SCHEDULES = {
    2: dict(owned=[[0, 1, 2], [3]], idle_at_decode1=[1]),
    4: dict(owned=[[0, 1], [2], [], [3]], idle_at_decode1=[0]),   # rank 2 never has a prompt
}


def _ep_worker(rank, world, payload):
    """One rank: for each family, prefill / decode / decode (or idle), then greedy generation."""
    import torch.distributed as dist

    from padded_moe.integrations.transformers import enable_expert_parallel, idle_step

    sched = SCHEDULES[world]
    mine = sched["owned"][rank]
    ids = prompt_ids()[mine]
    results = {}
    for name in payload["families"]:
        model = build(name)
        # The same bound on every rank (the exchange's chunk size): the largest step of any rank.
        handle = enable_expert_parallel(model, None, max_tokens_per_rank=PROMPTS * SEQ)
        steps = []  # (position, logits [len(mine), V]) or (positions, logits) for the prefill
        with torch.no_grad():
            if mine:
                out = model(input_ids=ids[:, :SEQ], use_cache=True)
                cache = out.past_key_values
                steps.append(("prefill", out.logits))
            else:
                idle_step(model)
            fed = SEQ  # next extension position this rank feeds
            for step in (1, 2):
                if not mine or (step == 1 and rank in sched["idle_at_decode1"]):
                    idle_step(model)
                    continue
                out = model(input_ids=ids[:, fed:fed + 1], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                steps.append((fed, out.logits[:, 0]))
                fed += 1
        results[name] = dict(steps=steps, layers=list(handle.layers), num_local=[
            a.moe.num_local for a in handle.layers.values()])
        if world == 2:
            with torch.no_grad():
                model.generation_config.eos_token_id = None  # every rank makes NEW_TOKENS forwards
                gen = model.generate(ids[:, :SEQ], max_new_tokens=NEW_TOKENS, do_sample=False,
                                     pad_token_id=0)
            results[name]["generated"] = gen[:, SEQ:]
        dist.barrier()
    return results


def _oracle(name):
    model = build(name)
    ids = prompt_ids()
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # all prompts, full length, HF eager experts, no cache
        model.generation_config.eos_token_id = None
        gen = model.generate(ids[:, :SEQ], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return model, logits, gen[:, SEQ:]


# 4 ranks (four processes on CI's two cores) for DeepSeek-V4 only, spec 04's model-level control.
@pytest.mark.parametrize("world,families", [(2, EP_FAMILIES), (4, ("deepseek_v4",))], ids=["2", "4"])
def test_logits_on_ranks_equal_single_rank(world, families):
    results = spawn_group(world, _ep_worker, {"families": families})
    sched = SCHEDULES[world]
    for name in families:
        model, ref, ref_gen = _oracle(name)
        assert ref.abs().max() > 1e-2, "logits are ~0: nothing would be tested"
        num_moe = sum(1 for m in model.modules() if type(m).__name__.endswith("Experts"))
        for rank, res in enumerate(results):
            r, mine = res[name], sched["owned"][rank]
            assert len(r["layers"]) == num_moe, (name, r["layers"])
            assert r["num_local"] == [TINY["experts"] // world] * num_moe
            expected_steps = 0 if not mine else (2 if rank in sched["idle_at_decode1"] else 3)
            assert len(r["steps"]) == expected_steps, (name, rank, [p for p, _ in r["steps"]])
            for pos, logits in r["steps"]:
                want = ref[mine, :SEQ] if pos == "prefill" else ref[mine, pos]
                err = max_rel(logits, want)
                assert err <= TOL, f"{name}, {world} ranks, rank {rank}, position {pos}: {err:.2e}"
            if world == 2:
                assert torch.equal(r["generated"], ref_gen[mine]), (name, rank, r["generated"], ref_gen[mine])


# ---------------------------------------------------------------------------------------------
# One process (a world of one): every family maps, refusals, argument checks
# ---------------------------------------------------------------------------------------------

def _all_families():
    from test_transformers_parity import FAMILIES

    return list(FAMILIES)


@pytest.mark.parametrize("name", _all_families())
def test_world_of_one_equals_the_hf_model(name, one_rank_group):
    """With one rank every expert is local: the swapped model must equal HF's eager one, for every
    family the plug-in maps (so the weight and activation hand-over is right for each)."""
    from test_transformers_parity import prompts

    model = build(name)
    ids = prompts(2, 5, 3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        handle = plug.enable_expert_parallel(model, max_tokens_per_rank=10)
        out = model(input_ids=ids).logits
    assert handle.family == model.config.model_type
    assert all(isinstance(a, plug.ExpertParallelExperts) for a in handle.layers.values())
    assert not any(type(m).__name__.endswith("Experts") and not isinstance(m, plug.ExpertParallelExperts)
                   for m in model.modules()), "an HF experts module was left in place"
    assert len(handle.expert_parallel) == 1  # one shape: the layers share the receive buffers
    assert ref.abs().max() > 1e-2
    assert max_rel(out, ref) <= TOL


def test_unsupported_families_are_refused_by_name(one_rank_group):
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

    dense = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(NotImplementedError, match="'llama'"):
        plug.enable_expert_parallel(dense, max_tokens_per_rank=8)
    # A gate padded_moe cannot fuse (relu): refused before anything is replaced.
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                        num_experts_per_tok=2, hidden_act="relu")
    relu = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(NotImplementedError, match="'mixtral'"):
        plug.enable_expert_parallel(relu, max_tokens_per_rank=8)
    assert not any(isinstance(m, plug.ExpertParallelExperts) for m in relu.modules())


def test_argument_errors_name_the_argument(one_rank_group):
    model = build("qwen3_moe")
    with pytest.raises(TypeError, match="max_tokens_per_rank"):
        plug.enable_expert_parallel(model, max_tokens_per_rank="8")
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        plug.enable_expert_parallel(model, max_tokens_per_rank=0)
    with pytest.raises(ValueError, match="mode"):
        plug.enable_expert_parallel(model, max_tokens_per_rank=8, mode="ragged")
    with pytest.raises(ValueError, match="weight_format"):
        plug.enable_expert_parallel(model, max_tokens_per_rank=8, weight_format="fp4")
    with pytest.raises(TypeError, match="model"):
        plug.enable_expert_parallel("qwen3", max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        plug.idle_step(model)
    with pytest.raises(ValueError, match="CUDA"):
        plug.enable_expert_parallel(model, max_tokens_per_rank=8)
        plug.capture_decode_graphs(model, 4)


def test_more_tokens_than_reserved_is_a_value_error(one_rank_group):
    model = build("qwen3_moe")
    plug.enable_expert_parallel(model, max_tokens_per_rank=8)
    with pytest.raises(ValueError, match="max_tokens_per_rank=8"):
        with torch.no_grad():
            model(input_ids=torch.randint(2, VOCAB, (2, 5)))


@pytest.mark.parametrize("name", EP_FAMILIES)
def test_plan_memory_counts_what_the_rank_holds(name, one_rank_group):
    """`plan_memory`'s resident parts equal the bytes the converted model holds: its parameters
    and buffers (dense parts, the FusedMoE weights and gate) plus the shared exchange buffers."""
    model = build(name)
    plan = plug.plan_memory(model, 1, 12)
    handle = plug.enable_expert_parallel(model, max_tokens_per_rank=12)
    held = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    exchange = sum(ep.buffer_bytes() for ep in handle.expert_parallel)
    assert plan["moe_layers"] == len(handle.layers)
    assert plan["dense"] + plan["experts"] == held
    assert plan["exchange"] == exchange
    assert plan["workspace"] > 0 and plan["total"] == held + exchange + plan["workspace"]


@pytest.mark.parametrize("inter", [32, 64])
def test_plan_memory_counts_an_mxfp4_rank(one_rank_group, inter):
    """With weight_format="mxfp4" a rank holds its experts' prepared arrangement, plus their
    canonical MXFP4 bytes (the layer's parameters) where a width is not whole 64-element blocks
    (inter=32), no float copy: `plan_memory` counts exactly that."""

    model = build("qwen3_moe", dict(TINY, hidden=64, inter=inter))
    plan = plug.plan_memory(model, 1, 12, weight_format="mxfp4")
    handle = plug.enable_expert_parallel(model, max_tokens_per_rank=12, weight_format="mxfp4")
    held = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    prepared = 0
    for adapter in handle.layers.values():
        assert not any(p.is_floating_point() and p.dim() == 3 for p in adapter.moe.parameters())
        for q in adapter.moe.expert_weights():
            prepared += sum(t.numel() * t.element_size() for t in (q.hopper.blocks, q.hopper.scales))
        assert (adapter.moe.w13_blocks.numel() == 0) == (inter == 64)  # held once where it can be
    assert plan["dense"] + plan["experts"] == held + prepared


def test_mxfp4_checkpoint_is_served_as_mxfp4(one_rank_group):
    """GPT-OSS experts holding an MXFP4 checkpoint: each rank's `FusedMoE` keeps the checkpoint's
    bytes (no float copy) and the model's logits equal HF's eager experts on the dequantized
    weights; any other weight_format is refused before the model is touched."""
    from test_transformers_parity import experts_modules, gpt_oss_mxfp4_checkpoint, prompts

    from padded_moe.mxfp4 import from_gpt_oss

    model = gpt_oss_mxfp4_checkpoint()
    checkpoint = [from_gpt_oss(m.down_proj_blocks, m.down_proj_scales) for m in experts_modules(model, "gpt_oss")]
    with pytest.raises(ValueError, match="weight_format must be 'mxfp4'.*MXFP4 checkpoint"):
        plug.enable_expert_parallel(model, max_tokens_per_rank=10)
    assert not any(isinstance(m, plug.ExpertParallelExperts) for m in model.modules())
    ids = prompts(2, 5, 3)
    plan = plug.plan_memory(model, 1, 10, weight_format="mxfp4")
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        handle = plug.enable_expert_parallel(model, max_tokens_per_rank=10, weight_format="mxfp4")
        out = model(input_ids=ids).logits
    assert max_rel(out, ref) <= TOL
    prepared = 0
    for adapter, q in zip(handle.layers.values(), checkpoint):
        assert torch.equal(adapter.moe.w2_blocks, q.blocks) and torch.equal(adapter.moe.w2_scales, q.scales)
        prepared += sum(t.numel() * t.element_size() for w in adapter.moe.expert_weights()
                        for t in (w.hopper.blocks, w.hopper.scales))
    held = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    assert plan["dense"] + plan["experts"] == held + prepared
