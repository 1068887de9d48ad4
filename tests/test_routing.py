"""Routers against the real transformers router modules (the oracles), plus error paths.

Every test builds the model family's router from transformers with a tiny config, gives it
fresh random weights and hidden states, and compares our (weights, ids) to its output: ids as
sets per token, weights matched per id, within 1e-6 in float32.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import devices

from padded_moe.routing import (
    GATE_KERNEL_MAX_TOKENS,
    SCORING_FUNCS,
    biased_grouped_topk,
    fused_topk,
    hash_topk,
    softmax_topk,
)

ATOL = 1e-6


# --------------------------------------------------------------------------------------------
# helpers


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row by expert id so two routings can be compared order-insensitively."""
    ids64 = ids.to(torch.int64).cpu()
    order = ids64.argsort(dim=-1)
    return weights.float().cpu().gather(1, order), ids64.gather(1, order)


def assert_same_routing(ours, theirs, atol=ATOL):
    w, ids = ours
    ref_w, ref_ids = theirs
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert w.shape == ids.shape == ref_ids.shape
    w_s, ids_s = _by_id(w, ids)
    ref_w_s, ref_ids_s = _by_id(ref_w, ref_ids)
    assert torch.equal(ids_s, ref_ids_s), "selected expert sets differ"
    err = (w_s - ref_w_s).abs().max().item() if w.numel() else 0.0
    assert err <= atol, f"weights differ by {err}"


def _randomize(module: torch.nn.Module, gen: torch.Generator, scale: float = 1.0) -> None:
    # transformers initialises several routers to zeros; routing on zeros would only test ties.
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def _hidden(gen, num_tokens, hidden_size):
    return torch.randn(num_tokens, hidden_size, generator=gen)


def _sets(ids: torch.Tensor) -> list[frozenset]:
    return [frozenset(row) for row in ids.tolist()]


# --------------------------------------------------------------------------------------------
# softmax routers


@pytest.mark.parametrize("num_experts,k", [(8, 2), (16, 1), (6, 6), (64, 8)])
def test_mixtral_matches_transformers(gen, num_experts, k):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = MixtralConfig(hidden_size=32, num_local_experts=num_experts, num_experts_per_tok=k)
    router = MixtralTopKRouter(cfg)
    _randomize(router, gen, scale=0.3)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(_hidden(gen, 97, 32))
    ours = softmax_topk(logits, k, renormalize=True)
    assert_same_routing(ours, (ref_w, ref_ids))
    # Slots come out in descending weight order (documented; cheap to keep honest).
    assert bool((ours[0][:, :-1] >= ours[0][:, 1:]).all())


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen3_olmoe_match_transformers(gen, family, norm_topk_prob):
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig as Config
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Router
    else:
        from transformers import OlmoeConfig as Config
        from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter as Router

    cfg = Config(hidden_size=24, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob)
    router = Router(cfg)
    _randomize(router, gen, scale=0.2)  # logits of std ~1: softmax far from saturated
    with torch.no_grad():
        logits, ref_w, ref_ids = router(_hidden(gen, 65, 24))
    ours = softmax_topk(logits, 4, renormalize=norm_topk_prob)
    assert_same_routing(ours, (ref_w, ref_ids))
    # Without renormalisation the kept probabilities sum to < 1, so the flag really matters.
    sums = ours[0].sum(dim=-1)
    if norm_topk_prob:
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)
    else:
        assert bool((sums < 1 - 1e-3).all())


@pytest.mark.parametrize("num_experts,k", [(32, 4), (8, 1), (5, 5)])
def test_gpt_oss_matches_transformers(gen, num_experts, k):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    cfg = GptOssConfig(hidden_size=16, num_local_experts=num_experts, num_experts_per_tok=k)
    router = GptOssTopKRouter(cfg)
    _randomize(router, gen)  # includes the router bias
    with torch.no_grad():
        logits, ref_w, ref_ids = router(_hidden(gen, 80, 16))
    for renormalize in (False, True):  # a no-op after a softmax over the k
        assert_same_routing(softmax_topk(logits, k, renormalize, topk_before_softmax=True), (ref_w, ref_ids))
    if 1 < k < num_experts:
        # The two orderings differ (k-softmax sums to 1, E-softmax top-k does not): a router that
        # ignored topk_before_softmax would fail the comparison above.
        plain_w, _ = softmax_topk(logits, k, renormalize=False)
        assert (plain_w - _by_id(ref_w, ref_ids)[0]).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------
# DeepSeek routers


def _v3_router(gen, num_experts, k, n_group, topk_group, norm, scale):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=16,
        n_routed_experts=num_experts,
        num_experts_per_tok=k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    router = DeepseekV3TopkRouter(cfg)
    _randomize(router, gen, scale=0.5)
    with torch.no_grad():
        # The correction bias must be large enough to change which experts win.
        router.e_score_correction_bias.copy_(torch.randn(num_experts, generator=gen) * 0.3)
    return router


@pytest.mark.parametrize(
    "num_experts,k,n_group,topk_group",
    [(16, 4, 1, 1), (16, 4, 4, 2), (32, 6, 8, 3), (64, 8, 8, 4), (8, 2, 4, 4), (12, 2, 6, 1)],
)
@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_v3_matches_transformers(cpu_path, gen, num_experts, k, n_group, topk_group, norm):
    scale = 2.5
    router = _v3_router(gen, num_experts, k, n_group, topk_group, norm, scale)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(_hidden(gen, 128, 16))
    bias = router.e_score_correction_bias
    ours = biased_grouped_topk(
        logits, bias, k, n_group, topk_group, scoring="sigmoid", routed_scaling_factor=scale, renormalize=norm
    )
    assert_same_routing(ours, (ref_w, ref_ids))
    if norm:  # renormalised, then scaled: each row sums to the scaling factor
        assert torch.allclose(ours[0].sum(-1), torch.full((128,), scale), atol=1e-5)

    # Non-vacuous: dropping the bias (or the group limit, when one applies) changes the result.
    no_bias = biased_grouped_topk(logits, None, k, n_group, topk_group, "sigmoid", scale, norm)
    assert _sets(no_bias[1]) != _sets(ref_ids)
    if topk_group < n_group:
        no_groups = biased_grouped_topk(logits, bias, k, 1, 1, "sigmoid", scale, norm)
        assert _sets(no_groups[1]) != _sets(ref_ids)


def _v4_config(num_experts, k, scoring_func, *, vocab):
    """A small transformers DeepseekV4Config for the router tests (routed scaling 1.5)."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(hidden_size=16, n_routed_experts=num_experts, num_experts_per_tok=k,
                            scoring_func=scoring_func, routed_scaling_factor=1.5, num_hidden_layers=2,
                            vocab_size=vocab)


@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("num_experts,k", [(16, 6), (8, 1), (7, 7)])
def test_deepseek_v4_matches_transformers(cpu_path, gen, scoring_func, num_experts, k):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    router = DeepseekV4TopKRouter(_v4_config(num_experts, k, scoring_func, vocab=64))
    _randomize(router, gen, scale=0.5)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.randn(num_experts, generator=gen) * 0.3)
        logits, ref_w, ref_ids = router(_hidden(gen, 100, 16))
    bias = router.e_score_correction_bias
    ours = biased_grouped_topk(logits, bias, k, scoring=scoring_func, routed_scaling_factor=1.5)
    assert_same_routing(ours, (ref_w, ref_ids))
    if 1 < k < num_experts:  # k == 1 renormalises to a constant, k == E selects everything
        other = "sigmoid" if scoring_func == "sqrtsoftplus" else "sqrtsoftplus"
        wrong = biased_grouped_topk(logits, bias, k, scoring=other, routed_scaling_factor=1.5)
        assert (_by_id(*wrong)[0] - _by_id(ref_w, ref_ids)[0]).abs().max() > 1e-4


def check_v4_bf16_steps(gen, scoring_func, tokens, device="cpu", bias_dtype=torch.float32):
    """`compute_dtype=torch.bfloat16` against transformers' DeepSeek-V4 router on a bfloat16 model
    (256 experts, top-6) on `device`: every row has transformers' experts and bit-equal bfloat16
    weights, except rows whose 6th and 7th best choice scores (transformers' own) tie exactly
    (torch's top-k leaves those unspecified; the kernel takes the lower id), and those are under 2%.
    Returns (logits, bias, transformers' ids) for further checks."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    router = DeepseekV4TopKRouter(_v4_config(256, 6, scoring_func, vocab=64))
    _randomize(router, gen, scale=0.5)
    router = router.to(device, torch.bfloat16)
    with torch.no_grad():
        # float32 as HF keeps it (`_keep_in_fp32_modules_strict`), bfloat16 after a plain `.to()`
        router.e_score_correction_bias.data = (torch.randn(256, generator=gen) * 0.05).to(device, bias_dtype)
        logits, ref_w, ref_ids = router(_hidden(gen, tokens, 16).to(device, torch.bfloat16))
        choice = router.score_fn(logits) + router.e_score_correction_bias
    bias = router.e_score_correction_bias
    w, ids = biased_grouped_topk(logits, bias, 6, scoring=scoring_func, routed_scaling_factor=1.5,
                                 weights_dtype=torch.bfloat16, ids_dtype=torch.int64, compute_dtype=torch.bfloat16)
    assert (w.dtype, ids.dtype) == (ref_w.dtype, ref_ids.dtype) == (torch.bfloat16, torch.int64)
    same_ids = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1)
    by_id = lambda v, i: v.gather(1, i.argsort(-1))  # noqa: E731
    same = same_ids & (by_id(w, ids) == by_id(ref_w, ref_ids)).all(-1)
    top7 = choice.topk(7, dim=-1).values
    tied = top7[:, 5] == top7[:, 6]
    assert bool((same | tied).all()), (~(same | tied)).nonzero().flatten()[:5].tolist()
    assert same.float().mean() > 0.98
    return logits, bias, ref_ids


@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid"])
def test_deepseek_v4_bf16_steps_match_transformers_bf16_router(cpu_path, gen, scoring_func):
    """transformers' DeepSeek-V4 router on a bfloat16 model computes its scores and weights in
    bfloat16; `compute_dtype=torch.bfloat16` rounds the same steps (`check_v4_bf16_steps`, 400
    tokens). Non-vacuous: the float32 formula (the default) chooses other experts in more than 2%
    of the rows."""
    logits, bias, ref_ids = check_v4_bf16_steps(gen, scoring_func, 400)
    fp32_ids = biased_grouped_topk(logits, bias, 6, scoring=scoring_func, routed_scaling_factor=1.5)[1]
    assert (fp32_ids.long().sort(-1).values != ref_ids.sort(-1).values).any(-1).float().mean() > 0.02


def test_bf16_steps_refuse_what_they_do_not_cover():
    logits = torch.randn(4, 16)
    with pytest.raises(NotImplementedError, match="compute_dtype=torch.bfloat16"):
        biased_grouped_topk(logits, None, 2, scoring="softmax", compute_dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="compute_dtype=torch.bfloat16"):
        biased_grouped_topk(logits, None, 2, 4, 2, compute_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="compute_dtype must be"):
        biased_grouped_topk(logits, None, 2, compute_dtype=torch.float16)


def _v4_hash_router(gen, num_experts, k, vocab, scoring_func="sqrtsoftplus"):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

    cfg = _v4_config(num_experts, k, scoring_func, vocab=vocab)
    assert cfg.mlp_layer_types[0] == "hash_moe"
    router = DeepseekV4HashRouter(cfg)
    _randomize(router, gen, scale=0.5)
    # A real table: k distinct experts per token id (transformers initialises it to zeros).
    table = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(vocab)])
    with torch.no_grad():
        router.tid2eid.copy_(table)
    return cfg, router


@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_deepseek_v4_hash_matches_transformers(gen, scoring_func, id_dtype):
    cfg, router = _v4_hash_router(gen, num_experts=16, k=6, vocab=50, scoring_func=scoring_func)
    input_ids = torch.randint(0, cfg.vocab_size, (3, 21), generator=gen)
    hidden = torch.randn(3, 21, 16, generator=gen)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(hidden, input_ids)
    w, ids = hash_topk(
        input_ids.to(id_dtype),
        router.tid2eid.to(id_dtype),
        logits,
        scoring=cfg.scoring_func,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    assert_same_routing((w, ids), (ref_w, ref_ids))
    # Hash routing keeps the table's slot order exactly.
    assert torch.equal(ids.long(), ref_ids)


# --------------------------------------------------------------------------------------------
# independent float64 references (paths transformers cannot exercise)


def _ref_biased(logits, bias, k, scoring, scale, renormalize):
    """Per-token float64 loop: score, pick the k best biased scores, weight by unbiased ones."""
    x = logits.double()
    if scoring == "sigmoid":
        s = 1 / (1 + torch.exp(-x))
    elif scoring == "sqrtsoftplus":
        s = torch.log1p(torch.exp(x)).sqrt()
    else:
        s = torch.exp(x - x.max(-1, keepdim=True).values)
        s = s / s.sum(-1, keepdim=True)
    out_w, out_ids = [], []
    for row, brow in zip(s.tolist(), (s + bias.double()).tolist()):
        chosen = sorted(range(len(row)), key=lambda e: -brow[e])[:k]
        w = [row[e] for e in chosen]
        if renormalize:
            total = sum(w)
            w = [v / (total + 1e-20) for v in w]
        out_w.append([v * scale for v in w])
        out_ids.append(chosen)
    return torch.tensor(out_w), torch.tensor(out_ids)


@pytest.mark.parametrize("scoring", SCORING_FUNCS)
def test_biased_topk_all_scorings_vs_float64(cpu_path, gen, scoring):
    logits = torch.randn(40, 12, generator=gen) * 2
    bias = torch.randn(12, generator=gen) * 0.1
    for renormalize in (True, False):
        ours = biased_grouped_topk(
            logits, bias, 3, scoring=scoring, routed_scaling_factor=0.7, renormalize=renormalize
        )
        assert_same_routing(ours, _ref_biased(logits, bias, 3, scoring, 0.7, renormalize), atol=2e-6)


def test_biased_topk_output_dtypes(cpu_path, gen):
    """The output dtypes asked for (transformers' DeepSeek-V3 router returns int64 indices): the
    same experts and, within the dtype's rounding, the same weights as the default float32 / int32."""
    logits = torch.randn(37, 64, generator=gen)
    bias = torch.randn(64, generator=gen) * 0.3
    ref_w, ref_ids = biased_grouped_topk(logits, bias, 6, 8, 3, "sigmoid", 2.5)
    for w_dtype, i_dtype in ((torch.float32, torch.int64), (torch.bfloat16, torch.int64), (torch.float16, torch.int32)):
        w, ids = biased_grouped_topk(logits, bias, 6, 8, 3, "sigmoid", 2.5, weights_dtype=w_dtype, ids_dtype=i_dtype)
        assert (w.dtype, ids.dtype, tuple(w.shape)) == (w_dtype, i_dtype, (37, 6))
        assert torch.equal(ids.long(), ref_ids.long())
        torch.testing.assert_close(w.float(), ref_w, rtol=0 if w_dtype == torch.float32 else 8e-3,
                                   atol=0 if w_dtype == torch.float32 else 8e-3)
    with pytest.raises(TypeError, match="weights_dtype must be"):
        biased_grouped_topk(logits, bias, 6, weights_dtype=torch.float64)
    with pytest.raises(TypeError, match="ids_dtype must be"):
        biased_grouped_topk(logits, bias, 6, ids_dtype=torch.int16)


def test_biased_topk_compiles_as_one_op_with_its_dtypes(gen):
    """Under torch.compile (fullgraph, inductor) the router is the op `padded_moe::biased_topk`,
    whose fake gives the output dtypes asked for: the compiled call equals the eager one."""
    logits = torch.randn(9, 32, generator=gen)
    bias = torch.randn(32, generator=gen) * 0.3

    def route(lg, b):
        return biased_grouped_topk(lg, b, 4, 4, 2, "sigmoid", 2.5, weights_dtype=torch.bfloat16,
                                   ids_dtype=torch.int64)

    got = torch.compile(route, fullgraph=True)(logits, bias)
    want = route(logits, bias)
    assert (got[0].dtype, got[1].dtype) == (torch.bfloat16, torch.int64)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_route_in_float32(gen, dtype):
    logits = (torch.randn(64, 16, generator=gen) * 3).to(dtype)
    bias = torch.randn(16, generator=gen) * 0.2
    up = logits.double()
    # Upcasting preserves order, so the float64 results on the same values are the reference.
    ref_soft = torch.softmax(up, -1).topk(4, -1)
    # A float32 softmax is a few float32 ulps (6e-8 just below 1) off the float64 one: 4 ulps at
    # 0.993 were seen (PADDED_MOE_SEED=248, float16), past a 2e-7 bound. A softmax computed in
    # the logits' 16-bit dtype is off by ~1e-3, so ATOL (1e-6) still tells the two apart.
    # 16-bit logits tie often; a tie at the cut may keep either expert, so the kept scores are
    # what must agree (the one-kernel top-k breaks ties to the lower id, torch.topk unspecified).
    w, ids = softmax_topk(logits, 4, renormalize=False)
    picked = torch.softmax(up, -1).gather(1, ids.long())
    assert torch.equal(picked.sort(-1, descending=True).values, ref_soft.values), "different scores kept"
    assert (w.double() - picked).abs().max().item() <= ATOL
    assert_same_routing(
        biased_grouped_topk(logits, bias, 4, scoring="sqrtsoftplus"),
        _ref_biased(up, bias, 4, "sqrtsoftplus", 1.0, True),
        atol=2e-6,
    )


def test_empty_batch_all_routers():
    logits = torch.randn(0, 8)
    for w, ids in (
        softmax_topk(logits, 2, True),
        softmax_topk(logits, 2, False, topk_before_softmax=True),
        biased_grouped_topk(logits, torch.randn(8), 2, 4, 2),
        hash_topk(torch.zeros(0, dtype=torch.int64), torch.randint(0, 8, (5, 2)), logits),
    ):
        assert w.shape == ids.shape == (0, 2)
        assert w.dtype == torch.float32 and ids.dtype == torch.int32


# --------------------------------------------------------------------------------------------
# hash routing: invalid ids


def _check_dropped_slots(gen, device):
    """The CUDA semantics: invalid slots -> id -1, weight 0, excluded from renormalisation."""
    num_experts, vocab, k = 8, 20, 3
    table = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(vocab)])
    table[7, 1] = num_experts  # one bad entry in the row of token 7
    table[9, :] = -5  # a row with no valid entry
    token_ids = torch.tensor([0, -1, 7, vocab, 9, 2**40, 3], dtype=torch.int64)
    logits = torch.randn(7, num_experts, generator=gen)
    w, ids = hash_topk(token_ids.to(device), table.to(device), logits.to(device), "sigmoid", 2.0)
    w, ids = w.cpu(), ids.cpu()

    scores = torch.sigmoid(logits.double())
    for t, tok in enumerate(token_ids.tolist()):
        row = table[tok].tolist() if 0 <= tok < vocab else [None] * k
        keep = [e if e is not None and 0 <= e < num_experts else -1 for e in row]
        assert ids[t].tolist() == keep
        raw = [scores[t, e].item() if e >= 0 else 0.0 for e in keep]
        total = sum(raw)
        expect = [2.0 * v / (total + 1e-20) for v in raw]
        assert torch.allclose(w[t].double(), torch.tensor(expect, dtype=torch.float64), atol=1e-6)
    assert (w[[1, 3, 4, 5]] == 0).all()


def test_hash_invalid_slots_dropped(gen):
    """Out-of-range token ids (negative, past the vocabulary, past int32) and table entries outside
    [0, E) are dropped on the CPU as on CUDA (the GPU test runs the same check)."""
    _check_dropped_slots(gen, "cpu")


# --------------------------------------------------------------------------------------------
# error paths


@pytest.mark.parametrize("device", devices())
def test_logits_errors(device):
    good = torch.randn(4, 8, device=device)
    for fn in (
        lambda lg: softmax_topk(lg, 2, True),
        lambda lg: biased_grouped_topk(lg, None, 2),
        lambda lg: hash_topk(
            torch.zeros(4, dtype=torch.int64, device=device), torch.zeros(3, 2, dtype=torch.int64, device=device), lg
        ),
    ):
        with pytest.raises(TypeError, match="logits must be a torch.Tensor"):
            fn(good.tolist())
        with pytest.raises(ValueError, match="logits must be 2-D"):
            fn(good[0])
        with pytest.raises(ValueError, match="logits must be 2-D"):
            fn(good.unsqueeze(0))
        with pytest.raises(TypeError, match="logits must have dtype"):
            fn(good.to(torch.int32))
        fn(good)  # and the good input passes


@pytest.mark.parametrize("k", [0, -1, 9])
def test_k_out_of_range(k):
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"k must be in \[1, 8\]"):
        softmax_topk(logits, k, True)
    with pytest.raises(ValueError, match=r"k must be in \[1, 8\]"):
        biased_grouped_topk(logits, None, k)


@pytest.mark.parametrize("k", [2.0, True, None, torch.tensor(2)])
def test_k_wrong_type(k):
    with pytest.raises(TypeError, match="k must be an int"):
        softmax_topk(torch.randn(4, 8), k, True)


def test_flag_types():
    logits = torch.randn(4, 8)
    with pytest.raises(TypeError, match="renormalize must be a bool"):
        softmax_topk(logits, 2, 1)
    with pytest.raises(TypeError, match="topk_before_softmax must be a bool"):
        softmax_topk(logits, 2, True, topk_before_softmax="yes")
    with pytest.raises(TypeError, match="routed_scaling_factor must be a float"):
        biased_grouped_topk(logits, None, 2, routed_scaling_factor="2.5")


@pytest.mark.parametrize(
    "num_groups,topk_groups,k,match",
    [
        (8, 1, 2, "num_groups must divide the number of experts E=12"),
        (5, 1, 2, "num_groups must divide"),
        (0, 1, 2, r"num_groups must be in \[1, 12\]"),
        (4, 5, 2, r"topk_groups must be in \[1, 4\]"),
        (4, 0, 2, r"topk_groups must be in \[1, 4\]"),
        (12, 2, 2, "at least 2"),
        (4, 1, 4, r"k must be at most topk_groups \* E / num_groups = 3"),
    ],
)
def test_group_errors(num_groups, topk_groups, k, match):
    with pytest.raises(ValueError, match=match):
        biased_grouped_topk(torch.randn(4, 12), torch.randn(12), k, num_groups, topk_groups)


def test_bias_errors():
    logits = torch.randn(4, 12)
    with pytest.raises(ValueError, match=r"bias must have shape \(12,\)"):
        biased_grouped_topk(logits, torch.randn(11), 2)
    with pytest.raises(ValueError, match=r"bias must have shape \(12,\)"):
        biased_grouped_topk(logits, torch.randn(1, 12), 2)
    with pytest.raises(TypeError, match="bias must have dtype"):
        biased_grouped_topk(logits, torch.zeros(12, dtype=torch.int64), 2)
    with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
        biased_grouped_topk(logits, [0.0] * 12, 2)


@pytest.mark.parametrize("scoring", ["softplus", "Sigmoid", "", None])
def test_unknown_scoring_lists_choices(scoring):
    logits = torch.randn(4, 8)
    pattern = "scoring must be one of 'sigmoid', 'sqrtsoftplus', 'softmax'"
    with pytest.raises(ValueError, match=pattern):
        biased_grouped_topk(logits, None, 2, scoring=scoring)
    with pytest.raises(ValueError, match=pattern):
        hash_topk(torch.zeros(4, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64), logits, scoring)


def test_hash_argument_errors():
    logits = torch.randn(6, 8)
    table = torch.randint(0, 8, (10, 2))
    ids = torch.randint(0, 10, (6,))
    with pytest.raises(TypeError, match="token_ids must have dtype"):
        hash_topk(ids.float(), table, logits)
    with pytest.raises(TypeError, match="token_ids must be a torch.Tensor"):
        hash_topk(ids.tolist(), table, logits)
    with pytest.raises(ValueError, match=r"token_ids must have one id per logits row \(6 elements\)"):
        hash_topk(ids[:5], table, logits)
    with pytest.raises(TypeError, match="table must have dtype"):
        hash_topk(ids, table.float(), logits)
    with pytest.raises(ValueError, match="table must be 2-D"):
        hash_topk(ids, table[:, 0], logits)
    with pytest.raises(ValueError, match="table must be"):
        hash_topk(ids, table[:, :0], logits)
    # [2, 3]-shaped ids are fine (flattened row-major, like input_ids.reshape(-1)).
    w, out = hash_topk(ids.view(2, 3), table, logits)
    assert torch.equal(out.long(), table[ids])
    assert math.isclose(w.sum().item(), 6.0, rel_tol=1e-6)


def test_softmax_reference_formula(gen):
    """A small hand reference for the softmax-then-top-k path with renormalisation."""
    logits = torch.randn(9, 7, generator=gen)
    p = F.softmax(logits.double(), -1)
    top = p.topk(3, -1)
    ref_w = top.values / top.values.sum(-1, keepdim=True)
    assert_same_routing(softmax_topk(logits, 3, True), (ref_w, top.indices))


# --------------------------------------------------------------------------------------------
# the one-kernel top-k (`fused_topk`): the kernel (interpreted) and the torch formula


@pytest.mark.parametrize("topk_before_softmax, renormalize", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("num_experts, k", [(8, 2), (128, 8), (200, 6), (1024, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fused_topk_matches_the_float64_formula(cpu_path, gen, dtype, num_experts, k, topk_before_softmax,
                                                renormalize):
    """Both paths of `fused_topk` against the float64 formula: the same experts (a tie between
    equal logits may pick either; the picked values then agree), weights within float32 rounding,
    largest first; and with the output dtypes asked for."""
    logits = torch.randn(23, num_experts, generator=gen).to(dtype)
    logits[3] = 0  # every expert tied
    logits[5, :k] = logits[5, k:2 * k]  # ties across the cut
    for w_dtype, i_dtype in ((torch.float32, torch.int32), (torch.bfloat16, torch.int64)):
        w, ids = fused_topk(logits, k, renormalize=renormalize, topk_before_softmax=topk_before_softmax,
                            weights_dtype=w_dtype, ids_dtype=i_dtype)
        assert (w.dtype, ids.dtype, tuple(w.shape), tuple(ids.shape)) == (w_dtype, i_dtype, (23, k), (23, k))
        x = logits.double()
        score = x if topk_before_softmax else x.softmax(-1)
        top = score.topk(k, dim=-1).values
        picked = score.gather(1, ids.long())
        assert torch.equal(picked.sort(-1, descending=True).values, top), "different experts"
        assert torch.all(picked[:, :-1] >= picked[:, 1:]), "not largest first"
        ref = top.softmax(-1) if topk_before_softmax else (top / top.sum(-1, keepdim=True) if renormalize else top)
        tol = 1e-6 if w_dtype == torch.float32 else 8e-3
        torch.testing.assert_close(w.double(), ref, rtol=tol, atol=tol)


def test_fused_topk_kernel_breaks_ties_to_the_lower_id_and_drops_nan_rows(monkeypatch):
    """The kernel's own choices where torch's are unspecified: equal scores go to the lower
    expert id; a row of NaN logits routes every slot to id E, which the expert guard drops
    (never an id that reads out of bounds)."""
    from padded_moe._platform import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("the interpreted kernel only")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits = torch.zeros(2, 16)
    logits[0, [3, 9, 12]] = 1.0
    logits[1] = float("nan")
    _, ids = fused_topk(logits, 4)
    assert ids[0].tolist() == [3, 9, 12, 0]
    assert ids[1].tolist() == [16] * 4


def test_fused_topk_argument_errors():
    logits = torch.randn(3, 8)
    with pytest.raises(TypeError, match="weights_dtype must be"):
        fused_topk(logits, 2, weights_dtype=torch.float64)
    with pytest.raises(TypeError, match="ids_dtype must be"):
        fused_topk(logits, 2, ids_dtype=torch.int16)
    with pytest.raises(ValueError, match="k must be"):
        fused_topk(logits, 9)


def test_fused_topk_keeps_the_gradient_where_autograd_records(cpu_path, gen):
    """The kernel has no backward: logits that require grad (grad enabled) take the torch formula,
    whose weights carry the gradient; under no_grad the same call returns the same routing."""
    logits = torch.randn(6, 16, generator=gen, requires_grad=True)
    w, ids = fused_topk(logits, 3, renormalize=True)
    assert w.requires_grad
    w.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    with torch.no_grad():
        w2, ids2 = fused_topk(logits, 3, renormalize=True)
    assert not w2.requires_grad and torch.equal(ids2, ids)
    torch.testing.assert_close(w2, w.detach(), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------
# the gate projection for decode-sized batches (`gate_sums`) and the router kernels finishing it

_ULP_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def _interpreted(monkeypatch):
    from padded_moe._platform import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("the interpreted kernel only")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def finished_logits(gate) -> torch.Tensor:
    """What the router kernels make of `GateSums`: the splits added in order in float32, the bias,
    one rounding to the logits' dtype (torch's float32 -> 16-bit casts round to nearest even)."""
    x = gate.parts[0].clone()
    for part in gate.parts[1:]:
        x += part
    if gate.bias is not None:
        x += gate.bias.float()
    return x.to(gate.dtype)


@pytest.mark.parametrize("M, E, D, bias", [(1, 128, 2880, True), (5, 8, 300, False), (16, 40, 256, True),
                                           (3, 256, 4096, False), (2, 16, 100, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gate_sums_match_the_float64_projection(monkeypatch, gen, dtype, M, E, D, bias):
    """The gate kernel's partial sums add up to `x @ W.T` within float32 summation error, every
    split over its own columns (ragged last split included); finished, every logit is within one
    unit in the last place of the exact `x @ W.T + b` and (16-bit) nearly all round to the nearest;
    a NaN row stays in its row."""
    from padded_moe.routing import gate_splits, gate_sums

    _interpreted(monkeypatch)
    x = torch.randn(M, D, generator=gen).to(dtype)
    w = (torch.randn(E, D, generator=gen) * 0.05).to(dtype)
    b = (torch.randn(E, generator=gen) * 0.1).to(dtype) if bias else None
    if M > 2:
        x[2] = float("nan")
    with torch.no_grad():
        gate = gate_sums(x, w, b)
    splits, per_split = gate_splits(E, D)
    assert tuple(gate.parts.shape) == (splits, M, E) and (splits - 1) * per_split < D <= splits * per_split
    assert gate.dtype == dtype and gate.bias is b
    xd, wd = x.double(), w.double()
    for s in range(splits):  # each split is its own columns' sum
        cols = slice(s * per_split, min(D, (s + 1) * per_split))
        want = xd[:, cols] @ wd[:, cols].T
        ok = torch.isfinite(want)
        bound = (xd[:, cols].abs() @ wd[:, cols].abs().T) * D * 2.0 ** -23 + 1e-30
        assert ((gate.parts[s].double() - want).abs() <= bound)[ok].all(), s
    got = finished_logits(gate)
    exact = xd @ wd.T + (0.0 if b is None else b.double())
    summed = xd.abs() @ wd.abs().T + (0.0 if b is None else b.double().abs())
    tol = exact.abs() * 2.0 ** -_ULP_BITS[dtype] + summed * D * 2.0 ** -23
    ok = torch.isfinite(exact)
    assert ((got.double() - exact).abs() <= tol)[ok].all()
    assert torch.isnan(got[~ok]).all() and (ok.sum(1) == E).sum() == M - (M > 2)
    if dtype != torch.float32:
        # Nearly all: 2%, and at least one, may sit so close to a rounding boundary of the 16-bit
        # format that the float32 sum's own error decides the side (32 logits in the smallest case).
        misses = int((got != exact.to(dtype))[ok].sum())
        assert misses <= max(1, 0.02 * int(ok.sum())), misses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_router_kernels_route_gate_sums_as_their_finished_logits(monkeypatch, gen, dtype):
    """The router kernels reading `GateSums` give the bits they give on the finished logits
    (splits in order, bias, one rounding): softmax routers, GPT-OSS's (with its bias) and the
    DeepSeek router with a group limit; a NaN row routes to the dropped id E."""
    from padded_moe.routing import gate_biased_topk, gate_softmax_topk, gate_sums

    _interpreted(monkeypatch)
    M, E, D = 9, 64, 1000
    x = torch.randn(M, D, generator=gen).to(dtype)
    x[4] = float("nan")
    w = (torch.randn(E, D, generator=gen) * 0.05).to(dtype)
    b = (torch.randn(E, generator=gen) * 0.1).to(dtype)
    e_bias = torch.randn(E, generator=gen) * 0.1
    with torch.no_grad():
        for bias in (None, b):
            gate = gate_sums(x, w, bias)
            logits = finished_logits(gate)
            for renorm, before in ((False, False), (True, False), (False, True)):
                got = gate_softmax_topk(gate, 6, renorm, topk_before_softmax=before)
                want = fused_topk(logits, 6, renormalize=renorm, topk_before_softmax=before)
                torch.testing.assert_close(got[0], want[0], rtol=0, atol=0, equal_nan=True)
                assert torch.equal(got[1], want[1]), (bias is None, renorm, before)
                assert (got[1][4] == E).all()
            got = gate_biased_topk(gate, e_bias, 6, 8, 3, "sigmoid", 2.5, True)
            want = biased_grouped_topk(logits, e_bias, 6, 8, 3, "sigmoid", 2.5, True)
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=0, equal_nan=True)
            assert torch.equal(got[1], want[1])


def test_gate_sums_leave_what_the_kernel_does_not_serve(monkeypatch, gen):
    """None (the caller runs F.linear and the router on its logits) past GATE_KERNEL_MAX_TOKENS
    rows, for strided columns, mixed dtypes and where autograd records; a group limit the router
    kernel cannot split is refused by name."""
    from padded_moe.routing import gate_biased_topk, gate_sums

    _interpreted(monkeypatch)
    w = torch.randn(8, 32, generator=gen).bfloat16()
    with torch.no_grad():
        assert gate_sums(torch.randn(GATE_KERNEL_MAX_TOKENS, 32, generator=gen).bfloat16(), w) is not None
        assert gate_sums(torch.randn(GATE_KERNEL_MAX_TOKENS + 1, 32, generator=gen).bfloat16(), w) is None
        assert gate_sums(torch.randn(32, 2, generator=gen).bfloat16().t(), w) is None
        assert gate_sums(torch.randn(2, 32, generator=gen), w) is None
        gate = gate_sums(torch.randn(2, 32, generator=gen).bfloat16(), torch.randn(12, 32, generator=gen).bfloat16())
        with pytest.raises(ValueError, match="powers of two"):
            gate_biased_topk(gate, None, 2, 4, 2, "sigmoid", 1.0, True)
    assert gate_sums(torch.randn(2, 32, generator=gen).bfloat16(), w.float().bfloat16().requires_grad_()) is None


# --------------------------------------------------------------------------------------------
# the DeepSeek routers' kernel (`biased_grouped_topk` on CUDA / interpreted): where its choices are its own


def _interpreted_only(monkeypatch):
    from padded_moe._platform import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("the interpreted kernel only")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_biased_kernel_ties_go_to_the_lower_id_and_group(monkeypatch):
    """Equal choice scores go to the lower expert id, equal group scores to the lower group; a
    NaN row routes to ids in [0, E] only (E is dropped by the expert guard)."""
    _interpreted_only(monkeypatch)
    logits = torch.zeros(3, 16)
    logits[0, [5, 9, 14]] = 2.0  # three tied winners, then 13 tied experts
    # four groups of 4: groups 1 and 3 tie for best (two 3.0s each), groups 0 and 2 tie below
    logits[1] = -1.0
    logits[1, [4, 5, 12, 13]] = 3.0
    logits[2] = float("nan")
    _, ids = biased_grouped_topk(logits[:1], None, 4)
    assert ids[0].tolist() == [5, 9, 14, 0]
    _, ids = biased_grouped_topk(logits[1:2], None, 6, num_groups=4, topk_groups=3)
    assert ids[0].tolist() == [4, 5, 12, 13, 0, 1], "group 0 (lower than group 2) is the third kept"
    _, ids = biased_grouped_topk(logits[2:], torch.zeros(16), 4, num_groups=4, topk_groups=2)
    assert bool(((ids >= 0) & (ids <= 16)).all())


def test_biased_kernel_softplus_of_very_negative_logits(monkeypatch, gen):
    """sqrt(softplus(x)) for x far below 0 is sqrt(exp(x)), not 0: log1p keeps the small values
    (the weights of a renormalised row of such experts are then still the right ratios)."""
    _interpreted_only(monkeypatch)
    logits = torch.tensor([[-30.0, -25.0, -40.0, -20.0]])
    w, ids = biased_grouped_topk(logits, None, 2, scoring="sqrtsoftplus", renormalize=False)
    assert ids[0].tolist() == [3, 1]
    ref = torch.tensor([-20.0, -25.0], dtype=torch.float64).exp().log1p().sqrt()
    torch.testing.assert_close(w[0].double(), ref, rtol=1e-6, atol=0)


def test_biased_topk_keeps_the_gradient_where_autograd_records(cpu_path, gen):
    logits = torch.randn(6, 16, generator=gen, requires_grad=True)
    bias = torch.randn(16, generator=gen) * 0.1
    w, ids = biased_grouped_topk(logits, bias, 3, scoring="sqrtsoftplus", routed_scaling_factor=1.5)
    assert w.requires_grad
    w.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    with torch.no_grad():
        w2, ids2 = biased_grouped_topk(logits, bias, 3, scoring="sqrtsoftplus", routed_scaling_factor=1.5)
    assert not w2.requires_grad and torch.equal(ids2, ids)
    torch.testing.assert_close(w2, w.detach(), rtol=1e-6, atol=1e-7)
