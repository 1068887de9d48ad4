"""HF transformers plug-in (spec 03): parity with HF's own eager experts on tiny random models.

Oracle: the same HF model run with `experts_implementation="eager"` (HF's per-expert loop with the
module's own `_apply_gate`). Every model is tiny (hidden 32, 2 layers, 4 experts, vocab 128) and
re-initialised with non-trivial random weights (HF's init leaves some parameters at zero). Clamp
limits are set far below the defaults (0.5 instead of 7 / 10) so that the clamps change the result
— `test_clamp_is_exercised` proves a wrong clamp would fail the parity tests.

Seeds are fixed per family: whole-model bf16 greedy decoding is compared token for token, and a
fixed seed keeps that comparison deterministic (see docs/transformers.md on near-ties).
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Callable

import pytest
import torch
from helpers import rel_err

import padded_moe.experts as pm_experts
from padded_moe.integrations import transformers as plug

try:  # import the kernels now, while conftest's TRITON_INTERPRET=1 is in force (see conftest)
    import padded_moe.kernels.activation  # noqa: F401
    import padded_moe.kernels.gemm  # noqa: F401
    import padded_moe.kernels.layouts  # noqa: F401
except ImportError:
    pass

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

plug.register()

LIMIT = 0.5  # far below the real models' 7 / 10 so the clamps bite on these tiny models
ALPHA = 1.3  # not GPT-OSS's 1.702, to prove alpha is read from the module
VOCAB = 128


# ---------------------------------------------------------------------------------------------
# the seven families
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    make: Callable[[dict], torch.nn.Module]  # size overrides -> model (fp32, eager experts)
    experts_class: str
    activation: str


def _common(s: dict) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                num_attention_heads=4, num_key_value_heads=2)


def _causal_lm(config) -> torch.nn.Module:
    return AutoModelForCausalLM.from_config(config, experts_implementation="eager")


def _mixtral(s):
    from transformers import MixtralConfig

    return _causal_lm(MixtralConfig(**_common(s), intermediate_size=s["inter"],
                                    num_local_experts=s["experts"], num_experts_per_tok=s["top_k"]))


def _qwen3_moe(s):
    from transformers import Qwen3MoeConfig

    return _causal_lm(Qwen3MoeConfig(**_common(s), intermediate_size=2 * s["inter"], head_dim=8,
                                     moe_intermediate_size=s["inter"], num_experts=s["experts"],
                                     num_experts_per_tok=s["top_k"], norm_topk_prob=True))


def _olmoe(s):
    from transformers import OlmoeConfig

    return _causal_lm(OlmoeConfig(**_common(s), intermediate_size=s["inter"], num_experts=s["experts"],
                                  num_experts_per_tok=s["top_k"], eos_token_id=1, pad_token_id=0))


def _deepseek_v4(s):
    from transformers import DeepseekV4Config

    # layer 0 hash-routed, layer 1 top-k routed: the experts are replaced in both.
    layers = ["hash_moe"] + ["moe"] * (s["layers"] - 1)
    cfg = DeepseekV4Config(vocab_size=VOCAB, hidden_size=s["hidden"], moe_intermediate_size=s["inter"],
                           num_hidden_layers=s["layers"], num_attention_heads=4, num_key_value_heads=1,
                           head_dim=16, q_lora_rank=16, num_experts_per_tok=s["top_k"],
                           n_routed_experts=s["experts"], hc_mult=2, sliding_window=8, o_groups=2,
                           o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=4,
                           mlp_layer_types=layers, partial_rotary_factor=0.5, swiglu_limit=LIMIT)
    return _causal_lm(cfg)


def _deepseek_v3(s):
    from transformers import DeepseekV3Config

    # Two expert groups with one kept per token, a shared expert, routed scaling 2.5: the router's
    # group limit and correction bias (randomized below) decide which experts run.
    common = dict(_common(s), num_key_value_heads=4)  # MLA: as many key/value heads as query heads
    cfg = DeepseekV3Config(**common, intermediate_size=2 * s["inter"], moe_intermediate_size=s["inter"],
                           n_routed_experts=s["experts"], num_experts_per_tok=s["top_k"], n_group=2, topk_group=1,
                           first_k_dense_replace=0, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
                           qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
                           norm_topk_prob=True)
    return _causal_lm(cfg)


def _gpt_oss(s):
    from transformers import GptOssConfig

    return _causal_lm(GptOssConfig(**_common(s), intermediate_size=s["inter"], head_dim=8,
                                   num_local_experts=s["experts"], num_experts_per_tok=s["top_k"],
                                   swiglu_limit=LIMIT, swiglu_alpha=ALPHA))


def _minimax_m3(s):
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    cfg = MiniMaxM3VLTextConfig(**_common(s), intermediate_size=s["inter"], head_dim=8,
                                num_experts_per_tok=s["top_k"], num_local_experts=s["experts"],
                                dense_intermediate_size=2 * s["inter"], shared_intermediate_size=s["inter"],
                                rotary_dim=4, index_n_heads=2, index_head_dim=8, index_block_size=4,
                                index_topk_blocks=2, swiglu_limit=LIMIT, swiglu_alpha=ALPHA,
                                bos_token_id=0, eos_token_id=1)
    return _causal_lm(cfg)


def step3p7_limits(layers: int) -> list:
    """Per-layer routed-expert limits: none (0) on even layers, LIMIT on odd ones."""
    return [0 if i % 2 == 0 else LIMIT for i in range(layers)]


def _step3p7(s):
    from transformers.models.step3p7.configuration_step3p7 import Step3p7Config
    from transformers.models.step3p7.modeling_step3p7 import Step3p7ForConditionalGeneration

    text = dict(**_common(s), intermediate_size=2 * s["inter"], head_dim=8,
                num_experts_per_tok=s["top_k"], num_local_experts=s["experts"],
                n_routed_experts=s["experts"], moe_intermediate_size=s["inter"],
                share_expert_dim=s["inter"], swiglu_limits=step3p7_limits(s["layers"]),
                mlp_layer_types=["sparse"] * s["layers"], sliding_window=8)
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    cfg = Step3p7Config(text_config=text, vision_config=vision, experts_implementation="eager")
    return Step3p7ForConditionalGeneration(cfg)


FAMILIES = {
    f.name: f for f in [
        Family("mixtral", _mixtral, "MixtralExperts", "silu"),
        Family("qwen3_moe", _qwen3_moe, "Qwen3MoeExperts", "silu"),
        Family("olmoe", _olmoe, "OlmoeExperts", "silu"),
        Family("deepseek_v3", _deepseek_v3, "DeepseekV3Experts", "silu"),
        Family("deepseek_v4", _deepseek_v4, "DeepseekV4Experts", "silu"),
        Family("gpt_oss", _gpt_oss, "GptOssExperts", "swigluoai"),
        Family("minimax_m3", _minimax_m3, "MiniMaxM3VLExperts", "swigluoai_uninterleave"),
        Family("step3p7", _step3p7, "Step3p7Experts", "swiglustep"),
    ]
}
TINY = dict(hidden=32, layers=2, experts=4, top_k=2, inter=16)
SEEDS = {name: 1000 + i for i, name in enumerate(FAMILIES)}


def randomize(model: torch.nn.Module, seed: int, scale: float = 0.6) -> torch.nn.Module:
    """Non-trivial random weights: matrices N(0, scale^2 / fan_in) (fan_in = last dim, so
    activations keep their size at any width), other vectors N(0, 0.1^2), norm scales
    1 + N(0, 0.1^2), DeepSeek-V3's expert-score correction bias N(0, 0.3^2) (HF initialises it to
    zero, which would leave it untested), and DeepSeek-V4's hash table filled with distinct experts
    per token."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(scale / math.sqrt(p.shape[-1]) * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias") and model.config.model_type == "deepseek_v3":
                b.copy_(0.3 * torch.randn(b.shape, generator=gen, dtype=torch.float64))
            if name.endswith("tid2eid"):
                num_experts = model.config.n_routed_experts
                b.copy_(torch.rand(b.shape[0], num_experts, generator=gen).argsort(-1)[:, : b.shape[1]])
    return model.eval()


def build(name: str, sizes: dict = TINY, dtype=torch.float32, device="cpu") -> torch.nn.Module:
    model = randomize(FAMILIES[name].make(sizes), SEEDS[name])
    return model.to(device=device, dtype=dtype)


def experts_modules(model, name: str) -> list:
    found = [m for m in model.modules() if type(m).__name__ == FAMILIES[name].experts_class]
    assert found, f"no {FAMILIES[name].experts_class} in the {name} model"
    return found


def prompts(batch: int, seq: int, seed: int, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch, seq), generator=gen).to(device)


class Spy:
    """Counts calls into padded_moe's fused experts and expert GEMMs (the plug-in imports them at
    call time), so a parity test fails if HF silently kept its own implementation."""

    def __init__(self, monkeypatch):
        import padded_moe.gemm as pm_gemm

        self.fused = self.gemm = 0
        real_fused, real_gemm = pm_experts.fused_experts, pm_gemm.expert_gemm

        def fused(*a, **kw):
            self.fused += 1
            return real_fused(*a, **kw)

        def gemm(*a, **kw):
            self.gemm += 1
            return real_gemm(*a, **kw)

        monkeypatch.setattr(pm_experts, "fused_experts", fused)
        monkeypatch.setattr(pm_gemm, "expert_gemm", gemm)
        monkeypatch.setattr(pm_experts, "expert_gemm", gemm)  # fused_experts' own binding


@torch.no_grad()
def logits_both(model, ids: torch.Tensor):
    """Logits with HF's eager experts, then with padded_moe (switched on the same model)."""
    model.set_experts_implementation("eager")
    ref = model(input_ids=ids).logits
    model.set_experts_implementation(plug.IMPLEMENTATION)
    out = model(input_ids=ids).logits
    model.set_experts_implementation("eager")
    return ref, out


def max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (the logit scale)."""
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


# ---------------------------------------------------------------------------------------------
# registration and detection
# ---------------------------------------------------------------------------------------------


def test_register_is_idempotent_and_visible_to_transformers():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    plug.register()
    plug.register()
    assert plug.is_registered()
    assert ALL_EXPERTS_FUNCTIONS[plug.IMPLEMENTATION] is plug.padded_moe_experts_forward
    # from_config accepts the name, and set_experts_implementation switches to it and back.
    from transformers import MixtralConfig

    cfg = MixtralConfig(**_common(TINY), intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation=plug.IMPLEMENTATION)
    assert model.config._experts_implementation == plug.IMPLEMENTATION
    model.set_experts_implementation("eager")
    assert model.config._experts_implementation == "eager"


def test_unknown_implementation_name_still_rejected_by_transformers():
    from transformers import MixtralConfig

    cfg = MixtralConfig(**_common(TINY), intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="padded_moe_typo"):
        AutoModelForCausalLM.from_config(cfg, experts_implementation="padded_moe_typo")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_plan_maps_each_family_to_its_activation(name):
    model = build(name)
    for i, m in enumerate(experts_modules(model, name)):
        plan = plug.experts_plan(m)
        assert plan.path == plug.FUSED, plan
        assert plan.activation == FAMILIES[name].activation
        cfg = plan.activation_config
        if name in ("deepseek_v4", "gpt_oss", "minimax_m3"):
            assert cfg.clamp_limit == LIMIT
        if name in ("gpt_oss", "minimax_m3"):
            assert (cfg.alpha, cfg.beta) == (ALPHA, 1.0)
        if name == "step3p7":  # per-layer: no limit (0 -> inf) on even layers
            want = step3p7_limits(TINY["layers"])[i] or math.inf
            assert cfg.clamp_limit == want


def test_plan_is_reused_until_what_it_reads_changes():
    """An eager forward reuses the module's plan while nothing it reads has changed; a new limit, a
    new activation module or another `_apply_gate` on the class gives a new plan."""
    m = experts_modules(build("deepseek_v4"), "deepseek_v4")[0]
    first = plug.experts_plan(m)
    assert plug.experts_plan(m) is first
    m.limit = 0.25
    assert plug.experts_plan(m).activation_config.clamp_limit == 0.25
    m.act_fn = torch.nn.ReLU()  # not SiLU: DeepSeek-V4's reader sends it to the composed path
    assert plug.experts_plan(m).path == plug.COMPOSED
    mixtral = experts_modules(build("mixtral"), "mixtral")[0]
    assert plug.experts_plan(mixtral).path == plug.FUSED  # HF's default gate
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(mixtral), "_apply_gate", lambda self, x: x)  # the class's gate replaced in place
        assert plug.experts_plan(mixtral).path == plug.COMPOSED
    assert plug.experts_plan(mixtral).path == plug.FUSED


def test_step3p7_layer_without_a_limit_reads_as_no_clamp():
    """transformers 5.25 leaves `limit` None on Step-3.7 layers without a clamp (5.24 gave inf):
    both map to swiglustep with an infinite limit, whichever version is installed."""
    for limit in (None, math.inf):
        name, cfg = plug._step3p7(types.SimpleNamespace(act_fn=torch.nn.SiLU(), limit=limit))
        assert name == "swiglustep" and cfg.clamp_limit == math.inf
    assert plug._step3p7(types.SimpleNamespace(act_fn=torch.nn.SiLU(), limit=16.0))[1].clamp_limit == 16.0


def test_step3p7_dispatch_leaves_other_implementations_alone():
    """register() makes the undecorated Step3p7Experts dispatch to us only for "padded_moe"."""
    model = build("step3p7")
    m = experts_modules(model, "step3p7")[0]
    assert model.config.text_config._experts_implementation == "eager"
    x = torch.randn(5, TINY["hidden"])
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3]])
    w = torch.rand(5, 2)
    with torch.no_grad():
        eager = m(x, ids, w)
        model.set_experts_implementation(plug.IMPLEMENTATION)
        assert model.config.text_config._experts_implementation == plug.IMPLEMENTATION
        ours = m(x, ids, w)
    assert rel_err(ours, eager) < 1e-5


class LaunchSpy:
    """Names of the Triton kernels launched through `padded_moe.kernels._launch.launch`."""

    def __init__(self, monkeypatch):
        from padded_moe.kernels import _launch

        self.names, real = [], _launch.launch

        def spy(fn, *args, **kwargs):
            self.names.append(fn.__name__ if hasattr(fn, "__name__") else fn.fn.__name__)
            return real(fn, *args, **kwargs)

        monkeypatch.setattr(_launch, "launch", spy)


def assert_same_router_output(ours: tuple, hf: tuple, tol: float) -> None:
    """(logits, scores, indices) of a router under the plug-in against HF's own: the same logits,
    HF's dtypes and shapes, the same experts per token and their scores within `tol`."""
    (logits, scores, ids), (hf_logits, hf_scores, hf_ids) = ours, hf
    assert torch.equal(logits, hf_logits)
    assert (scores.dtype, ids.dtype, scores.shape, ids.shape) == (hf_scores.dtype, hf_ids.dtype, hf_scores.shape,
                                                                  hf_ids.shape)
    assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values)
    order = lambda s, i: s.float().gather(1, i.argsort(-1))  # noqa: E731 - scores by expert id
    torch.testing.assert_close(order(scores, ids), order(hf_scores, hf_ids), rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3", "deepseek_v4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_router_runs_hf_formula_in_one_kernel(name, dtype, cpu_path, monkeypatch):
    """register() makes the top-k routers of `plug._ROUTERS` run `fused_topk` (DeepSeek-V3 / V4:
    `biased_grouped_topk`, V4 with its steps in the model dtype) under "padded_moe" (one kernel
    launch: the interpreted path shows it): the same logits (HF's own projection), the same experts
    and scores as HF's formula within float32 rounding, HF's output dtypes (int64 indices; scores in
    the logits' dtype, float32 for Mixtral and DeepSeek-V3); HF's own forward otherwise."""
    model = build(name, dtype=dtype)
    block = next(m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter"))
    assert type(block).__dict__.get("_padded_moe_dispatch"), type(block).__name__
    launched = LaunchSpy(monkeypatch)
    x = torch.randn(9, TINY["hidden"], generator=torch.Generator().manual_seed(SEEDS[name])).to(dtype)
    with torch.no_grad():
        hf = block(x)  # the model was built with "eager" experts: HF's forward
        assert launched.names == []
        model.set_experts_implementation(plug.IMPLEMENTATION)
        ours = block(x)
    want = "_biased_router_kernel" if name.startswith("deepseek") else "_topk_router_kernel"
    assert launched.names == ([want] if cpu_path == "triton_interpret" else []), launched.names
    assert_same_router_output(ours, hf, 1e-6 if dtype == torch.float32 or name == "deepseek_v3" else 8e-3)


def _biased_router(module: str, config: str, group_limit: bool):
    """A DeepSeek-V3-formula router alone (16 experts, 4 per token; 4 groups, 2 kept where
    `group_limit`), random weights and correction bias, built after register()."""
    import importlib

    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    cls = next(c for n, c in vars(mod).items() if n.lower().endswith("topkrouter") and isinstance(c, type))
    cfg = getattr(importlib.import_module("transformers"), config)(
        hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4 if group_limit else 1,
        topk_group=2 if group_limit else 1, norm_topk_prob=True, routed_scaling_factor=2.5)
    cfg._experts_implementation = "eager"
    router = cls(cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.copy_(0.5 * torch.randn(router.weight.shape, generator=gen))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
    return cfg, router


@pytest.mark.parametrize("module,config", [("deepseek_v3", "DeepseekV3Config"), ("deepseek_v32", "DeepseekV32Config"),
                                           ("glm4_moe", "Glm4MoeConfig")])
@pytest.mark.parametrize("group_limit", [True, False], ids=["groups", "no_groups"])
def test_deepseek_v3_formula_routers(module, config, group_limit, cpu_path, monkeypatch):
    """The routers that share DeepSeek-V3's formula run `biased_grouped_topk` under "padded_moe"
    with HF's results and dtypes (float32 logits and scores, int64 indices), HF's forward under any
    other name; the group limit and the correction bias change the experts (non-vacuous)."""
    from padded_moe.routing import biased_grouped_topk

    cfg, router = _biased_router(module, config, group_limit)
    assert type(router).__dict__.get("_padded_moe_dispatch"), type(router).__name__
    launched = LaunchSpy(monkeypatch)
    x = torch.randn(2, 33, 16, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        hf = router(x)
        assert launched.names == []
        cfg._experts_implementation = plug.IMPLEMENTATION
        ours = router(x)
    assert launched.names == (["_biased_router_kernel"] if cpu_path == "triton_interpret" else []), launched.names
    assert_same_router_output(ours, hf, 1e-6)
    logits = hf[0]
    unbiased = biased_grouped_topk(logits, None, 4, cfg.n_group, cfg.topk_group, "sigmoid", 2.5)[1]
    assert not torch.equal(unbiased.sort(-1).values.long(), hf[2].sort(-1).values)
    if group_limit:
        ungrouped = biased_grouped_topk(logits, router.e_score_correction_bias, 4, 1, 1, "sigmoid", 2.5)[1]
        assert not torch.equal(ungrouped.sort(-1).values.long(), hf[2].sort(-1).values)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v4", "gpt_oss", "minimax_m3", "step3p7"])
def test_model_compiles_fullgraph_with_dynamic_shapes(name):
    """`torch.compile(model, fullgraph=True, dynamic=True)` of a model on padded_moe equals the eager
    model. dynamic=True makes the experts modules' float attributes (clamp limits, alpha) symbolic,
    which the plan must read without `math.isnan` / `math.isinf`; GPT-OSS's transposed weights are
    re-laid before tracing by `prepare_experts` (the graph reads views of the parameters, never a
    copy made per call)."""
    torch._dynamo.reset()
    model = build(name)
    model.set_experts_implementation(plug.IMPLEMENTATION)
    assert plug.prepare_experts(model) == (TINY["layers"] if name == "gpt_oss" else 0)
    ids = prompts(2, 7, SEEDS[name])
    # A node computing a tensor of an expert weight's shape in our layout would be the per-call
    # conversion; views of the parameters (GPT-OSS's re-laid weights seen in our layout) copy nothing.
    weight_shapes = {tuple(w.shape) for m in experts_modules(model, name) for w in plug.expert_weights(m)[:2]}
    views = {"transpose", "detach", "view", torch.transpose, torch.Tensor.transpose, torch.Tensor.detach}
    copies = []

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            value = n.meta.get("example_value")
            static = isinstance(value, torch.Tensor) and all(type(d) is int for d in value.shape)
            if n.op.startswith("call") and static and tuple(value.shape) in weight_shapes and n.target not in views:
                copies.append(n.format_node())
        return gm.forward

    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)(input_ids=ids).logits
    assert copies == [], copies
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_gpt_oss_transposed_weights_are_held_once():
    """GPT-OSS's transposed parameters are re-laid in place at the first forward: each keeps its
    object, shape and values and becomes the transposed view of the contiguous `[E, out, in]`
    storage the GEMMs read (no copy beside it). HF's eager experts then read the same values, the
    state dict gives them back, and a write into a parameter reaches our layout without a new copy."""
    model = build("gpt_oss")
    m = experts_modules(model, "gpt_oss")[0]
    params = {name: getattr(m, name) for name in ("gate_up_proj", "down_proj")}
    before = {name: p.detach().clone() for name, p in params.items()}
    assert not params["gate_up_proj"].transpose(1, 2).is_contiguous()  # HF's layout to begin with
    ids = prompts(2, 9, 3)
    ref, out = logits_both(model, ids)  # HF eager, then padded_moe (which re-lays), then back to eager
    assert max_rel(out, ref) <= 1e-4
    w13, w2, _, _ = plug.expert_weights(m)
    for (name, p), ours in zip(params.items(), (w13, w2)):
        assert getattr(m, name) is p and tuple(p.shape) == tuple(before[name].shape) and torch.equal(p, before[name])
        assert ours.is_contiguous() and ours.data_ptr() == p.data_ptr()
        assert torch.equal(ours, before[name].transpose(1, 2))
    assert not m.__dict__.get("_padded_moe_cache")
    with torch.no_grad():
        again = model(input_ids=ids).logits  # HF's eager experts on the strided parameters
    torch.testing.assert_close(again, ref, rtol=1e-5, atol=1e-6)
    state = model.state_dict()
    key = next(k for k, v in state.items() if v is params["gate_up_proj"] or v.data_ptr() == w13.data_ptr())
    assert torch.equal(state[key], before["gate_up_proj"])
    with torch.no_grad():
        params["gate_up_proj"].mul_(2)
    w13_after = plug.expert_weights(m)[0]
    assert w13_after.data_ptr() == w13.data_ptr() and torch.equal(w13_after, 2 * before["gate_up_proj"].transpose(1, 2))


def test_gpt_oss_relayout_under_inference_mode_keeps_the_parameters_trainable():
    """The first forward under `torch.inference_mode()` re-lays GPT-OSS's parameters outside it: they
    stay ordinary parameters that take gradients afterwards."""
    model = build("gpt_oss")
    model.set_experts_implementation(plug.IMPLEMENTATION)
    m = experts_modules(model, "gpt_oss")[0]
    with torch.inference_mode():
        model(input_ids=prompts(1, 5, 2))
    p = m.gate_up_proj
    assert p.transpose(1, 2).is_contiguous() and not p.is_inference() and p.requires_grad
    (p * 1.0).sum().backward()
    assert p.grad is not None and p.grad.shape == p.shape


def test_compile_before_the_weights_are_converted_says_what_to_call():
    """GPT-OSS's transposed weights traced before `prepare_experts` (or an eager forward): an error
    naming the call, not a weight copy inside the graph."""
    torch._dynamo.reset()
    model = build("gpt_oss")
    model.set_experts_implementation(plug.IMPLEMENTATION)
    with torch.no_grad(), pytest.raises(Exception, match="prepare_experts"):
        torch.compile(model, fullgraph=True)(input_ids=prompts(1, 5, 1))


# ---------------------------------------------------------------------------------------------
# whole-model parity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_model_logits_fp32(name, cpu_path, monkeypatch):
    spy = Spy(monkeypatch)
    model = build(name)
    ref, out = logits_both(model, prompts(2, 12, SEEDS[name]))
    assert spy.fused == len(experts_modules(model, name))
    assert ref.abs().max() > 1e-2, "logits are ~0: the random weights are too small to test anything"
    assert max_rel(out, ref) <= 1e-4


def greedy_agreement(out: torch.Tensor, ref: torch.Tensor, ref32: torch.Tensor):
    """(decided, disagree): prompts whose fp32 top-2 margin exceeds twice both bf16 runs' logit
    error (there neither argmax can flip by rounding), and how many of those pick different
    next tokens. Near-ties are left out: there HF's own bf16 run disagrees with fp32 too."""
    last, last_ref, last32 = out[:, -1].double(), ref[:, -1].double(), ref32[:, -1].double()
    top2 = last32.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    err = torch.maximum((last - last32).abs().amax(-1), (last_ref - last32).abs().amax(-1))
    decided = margin > 2 * err
    disagree = (last.argmax(-1) != last_ref.argmax(-1)) & decided
    return int(decided.sum()), int(disagree.sum())


def position_errors(out: torch.Tensor, ref32: torch.Tensor) -> torch.Tensor:
    """‖out_t − ref_t‖ / ‖ref_t‖ per (prompt, position)."""
    diff = (out.double() - ref32.double()).norm(dim=-1)
    return diff / ref32.double().norm(dim=-1)


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor, ref32: torch.Tensor, min_decided: int) -> None:
    """bf16 model criteria shared with the GPU file.

    Greedy next tokens equal HF's bf16 run's on every clearly decided prompt. Logits are judged
    per position against the fp32 model, robustly: a router near-tie can send one token to other
    experts in either bf16 run (measured: one position of 256 with 30x the typical error), so
    whole-tensor norms say more about luck than about the kernels.
    """
    decided, disagree = greedy_agreement(out, ref, ref32)
    assert decided >= min_decided, f"only {decided}/32 prompts have a clear next token; the test says little"
    assert disagree == 0
    ours, hf = position_errors(out, ref32), position_errors(ref, ref32)
    assert ours.median() <= 1.5 * hf.median() + 1e-3
    assert (ours > 10 * hf.median()).double().mean() <= 0.05


@pytest.mark.parametrize("name", list(FAMILIES))
def test_model_greedy_bf16(name, monkeypatch):
    """32 prompts in one batch, bf16, against HF's bf16 eager run and the fp32 model."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # 32 prompts: the torch path (kernels: fp32 test)
    spy = Spy(monkeypatch)
    ids = prompts(32, 8, SEEDS[name] + 1)
    ref, out = logits_both(build(name, dtype=torch.bfloat16), ids)
    assert spy.fused == len(experts_modules(build(name), name))
    with torch.no_grad():
        ref32 = build(name)(input_ids=ids).logits
    assert_bf16_close(out, ref, ref32, min_decided=16)


def check_block_bf16_accuracy(name: str, sizes: dict, device="cpu", tokens: int = 64) -> None:
    """Per experts module in bf16 (no routing in the loop): at least as close to the fp32 module
    as HF's bf16 eager loop is."""
    model16 = build(name, sizes, dtype=torch.bfloat16, device=device)
    model32 = build(name, sizes, device=device)
    pairs = zip(experts_modules(model16, name), experts_modules(model32, name))
    for i, (m16, m32) in enumerate(pairs):
        hidden, ids, weights = block_inputs(m32, SEEDS[name] + 50 + i, tokens, sizes["top_k"], device)
        with torch.no_grad():
            ref32 = m32(hidden, ids, weights)
            hf = m16(hidden.bfloat16(), ids, weights.bfloat16())
            ours = plug.padded_moe_experts_forward(m16, hidden.bfloat16(), ids, weights.bfloat16())
        assert ours.dtype == torch.bfloat16
        assert rel_err(ours, ref32) <= 1.25 * rel_err(hf, ref32) + 1e-3, f"layer {i}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_block_bf16_accuracy(name, monkeypatch):
    # Torch path only: Triton 3.6's interpreter casts fp32 -> bf16 by truncation (cast_impl passes
    # no rounding mode), doubling every bf16 rounding error; on a GPU the cast rounds to nearest
    # even, and tests/test_transformers_parity_gpu.py checks the kernels there.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    check_block_bf16_accuracy(name, TINY)


def test_clamp_is_exercised(monkeypatch):
    """The parity tests can fail: with GPT-OSS's default limit/alpha instead of the module's, the
    logits move far beyond the fp32 tolerance."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = build("gpt_oss")
    ids = prompts(2, 12, 7)
    real_plan = plug.experts_plan

    def default_config_plan(module):
        return dataclasses.replace(real_plan(module), activation_config=plug._config())

    monkeypatch.setattr(plug, "experts_plan", default_config_plan)
    ref, out = logits_both(model, ids)
    assert max_rel(out, ref) > 1e-2


# ---------------------------------------------------------------------------------------------
# per MoE block: every layout
# ---------------------------------------------------------------------------------------------

LAYOUTS = ["indexed", "grouped_contiguous"]


def block_inputs(m, seed: int, tokens: int = 24, top_k: int = 2, device="cpu"):
    """Hidden states, distinct top-k ids and router-like weights for one experts module."""
    gen = torch.Generator().manual_seed(seed)
    hidden_size = plug.expert_weights(m)[1].shape[1]  # w2 is [E, K, N]
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    ids = torch.rand(tokens, m.num_experts, generator=gen).argsort(-1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=gen)
    weights = weights / weights.sum(-1, keepdim=True)
    return hidden.to(device), ids.to(device), weights.to(device)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_block_every_layout(name, layout, cpu_path, monkeypatch):
    """Each experts module alone: HF eager vs the plug-in with the layout forced by
    PADDED_MOE_GEMM_LAYOUT, and vs fused_experts(layout=...) on the module's weights."""
    model = build(name)
    for i, m in enumerate(experts_modules(model, name)):
        hidden, ids, weights = block_inputs(m, SEEDS[name] + i)
        with torch.no_grad():
            ref = m(hidden, ids, weights)  # the model was built with eager experts
            monkeypatch.setenv("PADDED_MOE_GEMM_LAYOUT", layout)
            via_plugin = plug.padded_moe_experts_forward(m, hidden, ids, weights)
            plan = plug.experts_plan(m)
            w13, w2, b13, b2 = plug.expert_weights(m)
            direct = pm_experts.fused_experts(hidden, w13, w2, weights, ids, activation=plan.activation,
                                              activation_config=plan.activation_config, layout=layout,
                                              w13_bias=b13, w2_bias=b2)
        assert ref.abs().max() > 1e-3
        assert rel_err(via_plugin, ref) < 1e-5, f"layer {i}"
        assert rel_err(direct, ref) < 1e-5, f"layer {i}"


def fused_moe_from(m, layout: str):
    """A `padded_moe.layer.FusedMoE` holding the HF experts module's weights and activation."""
    from padded_moe.layer import FusedMoE

    plan = plug.experts_plan(m)
    w13, w2, b13, b2 = plug.expert_weights(m)
    E, rows, K = w13.shape
    layer = FusedMoE(E, 2, K, w2.shape[2], activation=plan.activation,
                     activation_config=plan.activation_config, has_bias=b13 is not None,
                     layout=layout, dtype=w13.dtype)
    layer.load_experts(w13.detach(), w2.detach(), None if b13 is None else b13.detach(),
                       None if b2 is None else b2.detach())
    return layer


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_fused_moe_layer_matches_block(name, layout, cpu_path):
    """FusedMoE loaded from each experts module, fed HF's own routing, gives the module's output."""
    model = build(name)
    for i, m in enumerate(experts_modules(model, name)):
        hidden, ids, weights = block_inputs(m, SEEDS[name] + 100 + i)
        with torch.no_grad():
            ref = m(hidden, ids, weights)
            ours = fused_moe_from(m, layout).experts(hidden, weights, ids.to(torch.int32))
        assert rel_err(ours, ref) < 1e-5, f"layer {i}"


def test_block_expert_parallel_sentinel_contributes_nothing(monkeypatch):
    """HF's expert parallelism marks other ranks' routes with id == num_experts (zero weight);
    the eager loop skips them and so must we, even with a non-zero weight."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = build("mixtral")
    m = experts_modules(model, "mixtral")[0]
    hidden, ids, weights = block_inputs(m, 5)
    ids[::3, 1] = m.num_experts
    with torch.no_grad():
        ref = m(hidden, ids, weights)
        ours = plug.padded_moe_experts_forward(m, hidden, ids, weights)
    assert rel_err(ours, ref) < 1e-5


# ---------------------------------------------------------------------------------------------
# the composed path: an unknown `_apply_gate`, an unsupported act_fn
# ---------------------------------------------------------------------------------------------


def _odd_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
    """A gate no spec-01 activation computes."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.tanh(gate) * up + 0.25 * gate


def _with_custom_gate(model) -> int:
    """Swap every MiniMax-M3 experts module for a subclass whose `_apply_gate` differs (MiniMax's
    eager loop calls `self._apply_gate`, so HF's eager run is the oracle); returns the count."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLExperts

    class OddGateExperts(MiniMaxM3VLExperts):
        _apply_gate = _odd_gate

    swapped = 0
    for layer in model.model.layers:
        old = layer.mlp.experts
        new = OddGateExperts(old.config)
        new.load_state_dict(old.state_dict())
        layer.mlp.experts = new
        swapped += 1
    return swapped


@pytest.mark.parametrize("layout", LAYOUTS)
def test_custom_apply_gate_takes_composed_path(layout, cpu_path, monkeypatch):
    monkeypatch.setenv("PADDED_MOE_GEMM_LAYOUT", layout)
    model = build("minimax_m3")
    n = _with_custom_gate(model)
    plan = plug.experts_plan(model.model.layers[0].mlp.experts)
    assert plan.path == plug.COMPOSED and plan.activation is None
    spy = Spy(monkeypatch)
    ids = prompts(2, 12, 3)
    ref, out = logits_both(model, ids)
    # The composed path is fused_experts with the module's gate as its activation callable.
    assert spy.fused == n and spy.gemm == 2 * n
    assert max_rel(out, ref) <= 1e-4
    # and the custom gate matters: the unmodified model gives other logits.
    with torch.no_grad():
        assert max_rel(build("minimax_m3")(input_ids=ids).logits, ref) > 1e-3


def test_unsupported_act_fn_takes_composed_path(monkeypatch):
    """Mixtral with hidden_act="relu": the default gate, but no spec-01 activation for relu."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from transformers import MixtralConfig

    cfg = MixtralConfig(**_common(TINY), intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                        hidden_act="relu")
    model = randomize(_causal_lm(cfg), 11)
    assert plug.experts_plan(model.model.layers[0].mlp.experts).path == plug.COMPOSED
    spy = Spy(monkeypatch)
    ref, out = logits_both(model, prompts(2, 12, 4))
    assert spy.fused == cfg.num_hidden_layers and spy.gemm == 2 * cfg.num_hidden_layers
    assert max_rel(out, ref) <= 1e-4


def test_gelu_tanh_default_gate_maps_to_fused():
    from transformers import MixtralConfig

    cfg = MixtralConfig(**_common(TINY), intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                        hidden_act="gelu_pytorch_tanh")
    model = randomize(_causal_lm(cfg), 12)
    plan = plug.experts_plan(model.model.layers[0].mlp.experts)
    assert (plan.path, plan.activation) == (plug.FUSED, "gelu_tanh")
    ref, out = logits_both(model, prompts(2, 12, 5))
    assert max_rel(out, ref) <= 1e-4


def _nemotron_h_experts():
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    cfg = NemotronHConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=8,
                          n_routed_experts=4, moe_intermediate_size=16, num_experts_per_tok=2)
    return NemotronHExperts(cfg)


def _muse_spark_experts():
    from transformers.models.muse_spark.configuration_muse_spark import MuseSparkTextConfig
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts

    cfg = MuseSparkTextConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, moe_hidden_size=32, moe_intermediate_size=16, num_local_experts=4,
                              num_experts_per_tok=2)
    return MuseSparkExperts(cfg)


@pytest.mark.parametrize("kind, path, activation", [
    ("nemotron_h", plug.FUSED, "relu2_no_mul"),  # ungated experts: up_proj + act_fn
    ("muse_spark", plug.COMPOSED, "silu"),  # a post-expert norm forces the composed path
])
def test_block_other_experts_contracts(kind, path, activation, cpu_path):
    m = randomize(_nemotron_h_experts() if kind == "nemotron_h" else _muse_spark_experts(), 21)
    m.config._experts_implementation = "eager"
    plan = plug.experts_plan(m)
    assert (plan.path, plan.activation) == (path, activation)
    hidden, ids, weights = block_inputs(m, 22)
    with torch.no_grad():
        ref = m(hidden, ids, weights)
        ours = plug.padded_moe_experts_forward(m, hidden, ids, weights)
    assert ref.abs().max() > 1e-3
    assert rel_err(ours, ref) < 1e-5


# ---------------------------------------------------------------------------------------------
# GPT-OSS MXFP4 checkpoint tensors
# ---------------------------------------------------------------------------------------------


def gpt_oss_mxfp4_checkpoint() -> torch.nn.Module:
    """A tiny GPT-OSS whose experts modules hold the checkpoint's `*_blocks` / `*_scales` (the
    experts quantized to MXFP4), with HF's float parameters set to the same weights dequantized,
    which HF's eager path runs."""
    from padded_moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4, to_gpt_oss

    model = build("gpt_oss", sizes=dict(TINY, hidden=64, inter=32))  # MXFP4 groups of 32 along K
    for m in experts_modules(model, "gpt_oss"):
        for proj in ("gate_up_proj", "down_proj"):
            ours = quantize_mxfp4(getattr(m, proj).detach().transpose(1, 2).contiguous())  # [E, out, in]
            blocks, scales = to_gpt_oss(ours)
            m.register_buffer(f"{proj}_blocks", blocks)
            m.register_buffer(f"{proj}_scales", scales)
            with torch.no_grad():
                getattr(m, proj).copy_(dequantize_mxfp4(ours, torch.float32).transpose(1, 2))
    return model


def test_gpt_oss_mxfp4_checkpoint_tensors(monkeypatch):
    """A GPT-OSS experts module holding the checkpoint's `*_blocks` / `*_scales` runs on them; HF's
    eager path runs on the same weights dequantized into its transposed parameters. A weight whose
    inner width is a multiple of 64 (gate_up_proj, K = 64) is then held once, prepared, and its
    checkpoint tensors come back from `state_dict()`; the other (down_proj, K = 32) keeps them and
    caches its prepared form."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = gpt_oss_mxfp4_checkpoint()
    before = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(("_blocks", "_scales"))}
    ref, out = logits_both(model, prompts(2, 12, 6))
    assert max_rel(out, ref) <= 1e-4
    m = experts_modules(model, "gpt_oss")[0]
    cache = m.__dict__["_padded_moe_cache"]
    assert "down_proj_mxfp4" in cache and "gate_up_proj_mxfp4" not in cache and "gate_up_proj" not in cache
    assert "gate_up_proj_blocks" not in dict(m.named_buffers()) and "down_proj_blocks" in dict(m.named_buffers())
    after = model.state_dict()
    assert before.keys() <= after.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert not any("_padded_moe" in k for k in after)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def test_bad_input_raises_typed_errors():
    model = build("mixtral")
    m = experts_modules(model, "mixtral")[0]
    hidden, ids, weights = block_inputs(m, 9)
    with pytest.raises(TypeError, match="topk_ids"):
        plug.padded_moe_experts_forward(m, hidden, ids.float(), weights)
    with pytest.raises(ValueError):
        plug.padded_moe_experts_forward(m, hidden[:, :-1], ids, weights)
