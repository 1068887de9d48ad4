"""GPT-OSS MXFP4 checkpoints through `from_pretrained(..., experts_implementation="padded_moe")`
(`padded_moe.integrations.transformers_mxfp4`): the experts hold the checkpoint's MXFP4 bytes once,
in the prepared form, and give the logits of HF's eager experts on the same checkpoint dequantized.

Checkpoints are tiny GPT-OSS models written to a temporary directory in the published format
(`*_blocks [E, out, K/32, 16]`, `*_scales [E, out, K/32]`, `quantization_config.quant_method =
"mxfp4"`), so nothing is downloaded.
"""

from __future__ import annotations

import inspect
import json
import os

import pytest
import torch

from padded_moe.integrations import transformers as plug

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from test_transformers_parity import TINY, Spy, build, experts_modules, max_rel, prompts  # noqa: E402
from transformers import AutoModelForCausalLM, Mxfp4Config  # noqa: E402

from padded_moe.mxfp4 import quantize_mxfp4, to_gpt_oss  # noqa: E402

plug.register()


def mxfp4_checkpoint(path, inter: int) -> dict:
    """A tiny GPT-OSS saved as an MXFP4 checkpoint in `path` (hidden 64, `inter` wide experts);
    returns its tensors."""
    model = build("gpt_oss", sizes=dict(TINY, hidden=64, inter=inter))
    model.save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = to_gpt_oss(quantize_mxfp4(tensors.pop(key).transpose(1, 2).contiguous()))
        tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return tensors


def load(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)


@pytest.mark.parametrize("inter", [64, 32], ids=["held", "down_proj_K32"])
def test_mxfp4_checkpoint_loads_as_mxfp4(tmp_path, monkeypatch, inter):
    """Experts hold the MXFP4 bytes (no float experts); logits equal HF's eager experts on the
    dequantized checkpoint; `state_dict()` / `save_pretrained` give the checkpoint's bytes back.
    A weight whose inner width is not a multiple of 64 (down_proj at inter 32) is held as the
    checkpoint's two tensors instead."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    source = mxfp4_checkpoint(tmp_path / "ckpt", inter)
    model = load(tmp_path / "ckpt", experts_implementation=plug.IMPLEMENTATION)
    ref_model = load(tmp_path / "ckpt", experts_implementation="eager", quantization_config=Mxfp4Config(dequantize=True))
    for m in experts_modules(model, "gpt_oss"):
        params = dict(m.named_parameters())
        buffers = dict(m.named_buffers())
        assert "gate_up_proj" not in params and "down_proj" not in params  # no float experts
        assert buffers["_padded_moe_gate_up_proj_blocks"].dtype == torch.int32
        assert ("_padded_moe_down_proj_blocks" in buffers) == (inter == 64)
        assert ("down_proj_blocks" in buffers) == (inter == 32)
        assert "gate_up_proj_blocks" not in buffers  # held once
    assert all(type(m).__name__ == "GptOssExperts" for m in experts_modules(ref_model, "gpt_oss"))
    ids = prompts(2, 9, 4)
    spy = Spy(monkeypatch)
    with torch.no_grad():
        out = model(input_ids=ids).logits
        ref = ref_model(input_ids=ids).logits
    assert spy.fused >= 2  # one call per layer through padded_moe
    assert max_rel(out, ref) <= 1e-4
    # The checkpoint's bytes come back: from the state dict and from a saved copy.
    state = model.state_dict()
    assert not any("_padded_moe" in k for k in state)
    assert all(torch.equal(state[k], v) for k, v in source.items())
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(os.path.join(tmp_path / "saved", "model.safetensors"))
    assert saved.keys() == source.keys() and all(torch.equal(saved[k], v) for k, v in source.items())
    again = load(tmp_path / "saved", experts_implementation=plug.IMPLEMENTATION)
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, out)


def test_load_state_dict_round_trip(tmp_path, monkeypatch):
    """A held module takes checkpoint tensors back through `load_state_dict` (strict): new bytes
    replace the prepared form."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    mxfp4_checkpoint(tmp_path / "ckpt", 64)
    model = load(tmp_path / "ckpt", experts_implementation=plug.IMPLEMENTATION)
    state = model.state_dict()
    key = next(k for k in state if k.endswith("gate_up_proj_blocks"))
    module = model.get_submodule(key.rpartition(".")[0])
    before = module._padded_moe_gate_up_proj_blocks.clone()
    changed = dict(state, **{key: state[key].flip(0)})  # the experts in reverse order
    model.load_state_dict(changed, strict=True)
    assert torch.equal(model.state_dict()[key], changed[key])
    assert torch.equal(module._padded_moe_gate_up_proj_blocks, before.flip(0))


def test_load_state_dict_refuses_held_experts_of_another_size(tmp_path, monkeypatch):
    """Checkpoint tensors of another expert count for a held weight are refused as PyTorch refuses a
    parameter of another size ("size mismatch"), and the held weight is kept."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    mxfp4_checkpoint(tmp_path / "ckpt", 64)
    model = load(tmp_path / "ckpt", experts_implementation=plug.IMPLEMENTATION)
    ids = prompts(2, 9, 4)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    state = model.state_dict()
    key = next(k for k in state if k.endswith("gate_up_proj_blocks"))
    scales_key = key.replace("_blocks", "_scales")
    bigger = dict(state, **{key: torch.cat([state[key], state[key]]),
                            scales_key: torch.cat([state[scales_key], state[scales_key]])})
    with pytest.raises(RuntimeError, match="size mismatch for .*gate_up_proj_blocks"):
        model.load_state_dict(bigger, strict=True)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)


def test_a_replaced_scales_tensor_reaches_the_cached_weight(tmp_path, monkeypatch):
    """An inner width that is not a multiple of 64 (down_proj at intermediate 32) keeps its checkpoint
    tensors and a prepared copy cached beside them: a new scales tensor alone (the values kept)
    invalidates that copy, as new values do."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    mxfp4_checkpoint(tmp_path / "ckpt", 32)
    model = load(tmp_path / "ckpt", experts_implementation=plug.IMPLEMENTATION)
    ids = prompts(2, 9, 4)
    with torch.no_grad():
        model(input_ids=ids)  # fills the cache
        experts = model.model.layers[0].mlp.experts
        experts.down_proj_scales = experts.down_proj_scales + 1  # every down_proj scale doubled
        got = model(input_ids=ids).logits
    fresh = load(tmp_path / "ckpt", experts_implementation=plug.IMPLEMENTATION)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(got, fresh(input_ids=ids).logits, rtol=0, atol=0)


def test_whole_model_pickles(tmp_path, monkeypatch):
    """`torch.save(model)` of a model loaded with padded_moe experts (transformers keeps our load op
    on it) and `torch.load` back give the same logits."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    mxfp4_checkpoint(tmp_path / "ckpt", 64)
    model = load(tmp_path / "ckpt", experts_implementation=plug.IMPLEMENTATION)
    ids = prompts(2, 9, 4)
    torch.save(model, tmp_path / "whole.pt")
    again = torch.load(tmp_path / "whole.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_other_loads_keep_transformers_behaviour(tmp_path, monkeypatch):
    """`Mxfp4Config(dequantize=True)` still gives float parameters under padded_moe, and a load that
    does not ask for padded_moe takes transformers' own path, checks included (here its accelerate
    check, made to fail), which the padded_moe load does not need."""
    import transformers.quantizers.quantizer_mxfp4 as hf_mxfp4

    mxfp4_checkpoint(tmp_path / "ckpt", 64)
    model = load(tmp_path / "ckpt", experts_implementation=plug.IMPLEMENTATION,
                 quantization_config=Mxfp4Config(dequantize=True))
    m = experts_modules(model, "gpt_oss")[0]
    assert m.gate_up_proj.dtype == torch.float32 and not any("_padded_moe" in n for n, _ in m.named_buffers())
    monkeypatch.setattr(hf_mxfp4, "is_accelerate_available", lambda: False)
    with pytest.raises(ImportError, match="[Aa]ccelerate"):
        load(tmp_path / "ckpt", experts_implementation="eager")
    held = load(tmp_path / "ckpt", experts_implementation=plug.IMPLEMENTATION)
    assert "_padded_moe_gate_up_proj_blocks" in dict(experts_modules(held, "gpt_oss")[0].named_buffers())


def test_expert_parallel_takes_a_loaded_mxfp4_model(tmp_path, monkeypatch, one_rank_group):
    """`enable_expert_parallel(weight_format="mxfp4")` on a model loaded as MXFP4: each rank's
    `FusedMoE` gets the checkpoint's bytes (rebuilt from the held form) and the logits stay."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    source = mxfp4_checkpoint(tmp_path / "ckpt", 64)
    model = load(tmp_path / "ckpt", experts_implementation=plug.IMPLEMENTATION)
    ids = prompts(2, 5, 3)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        handle = plug.enable_expert_parallel(model, max_tokens_per_rank=10, weight_format="mxfp4")
        out = model(input_ids=ids).logits
    assert max_rel(out, ref) <= 1e-5
    layer = next(iter(handle.layers.values())).moe
    key = next(k for k in source if k.endswith("layers.0.mlp.experts.down_proj_blocks"))
    assert torch.equal(to_gpt_oss(layer.expert_weights()[1])[0], source[key])


# ---------------------------------------------------------------------------------------------
# transformers' quantized experts (`FP8Experts`) holding packed FP4 experts (DeepSeek-V4's checkpoints)
# ---------------------------------------------------------------------------------------------

def _fp8_experts_class():
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    # What transformers' FP8 quantizer does to each experts module it replaces.
    return use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS,
                                      has_bias=False, has_gate=True)


GATES = {  # config attributes -> which of FP8Experts' four gates runs
    "silu_clamp": dict(swiglu_limit=0.5),
    "swiglu_alpha": dict(swiglu_limit=0.5, swiglu_alpha=1.3),
    "limit_after_act": dict(swiglu_limit=0.5, limit_after_act=True),
    "silu": dict(),
    "softcap": dict(mlp_gate_softcap=0.7, mlp_up_softcap=0.9),
}
E4, K4, N4 = 4, 64, 64


def fp4_experts(gate: str, scale_fmt: str, seed: int = 0, expert_dtype: str = "fp4"):
    """An `FP8Experts` module with packed FP4 experts (int8 codes, scales as `scale_fmt`:
    "ue8m0" = float8_e8m0fnu, "uint8" = the E8M0 bytes, "float" = float32 powers of two)."""
    import types

    config = types.SimpleNamespace(hidden_size=K4, moe_intermediate_size=N4, num_local_experts=E4, hidden_act="silu",
                                   _experts_implementation=plug.IMPLEMENTATION, **GATES[gate])
    module = _fp8_experts_class()(config=config, block_size=None, activation_scheme="dynamic",
                                  scale_fmt="ue8m0" if scale_fmt == "ue8m0" else "float", expert_dtype=expert_dtype)
    gen = torch.Generator().manual_seed(seed)
    for proj, shape in (("gate_up_proj", (E4, 2 * N4, K4)), ("down_proj", (E4, K4, N4))):
        q = quantize_mxfp4(torch.randn(shape, generator=gen) * 0.3)
        scales = {"ue8m0": q.scales.view(torch.float8_e8m0fnu), "uint8": q.scales,
                  "float": torch.exp2(q.scales.float() - 127)}[scale_fmt]
        setattr(module, proj, torch.nn.Parameter(q.blocks.view(torch.int8), requires_grad=False))
        setattr(module, f"{proj}_scale_inv", torch.nn.Parameter(scales, requires_grad=False))
    return module


def hf_oracle(module, weights: dict, x, ids, tw) -> torch.Tensor:
    """float64 loop with transformers' own pieces: its FP4 dequantization and the module's own
    `_apply_gate`; ids outside [0, E) contribute nothing."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    deq = Fp8Dequantize(None)
    w13 = deq._dequantize_one(*weights["gate_up_proj"], torch.float64)
    w2 = deq._dequantize_one(*weights["down_proj"], torch.float64)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < E4:
                h = module._apply_gate(x[t].double() @ w13[e].T)
                out[t] += float(tw[t, j]) * (h @ w2[e].T)
    return out


@pytest.mark.parametrize("scale_fmt", ["ue8m0", "uint8", "float"])
@pytest.mark.parametrize("gate", list(GATES))
def test_fp4_experts_module_matches_transformers(monkeypatch, gate, scale_fmt):
    """`FP8Experts` with packed FP4 experts under "padded_moe": the plug-in reads the codes and
    scales as MXFP4 and matches transformers' dequantization + the module's own gate (the
    softcap gate has no kernel and runs as the module's callable)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    module = fp4_experts(gate, scale_fmt)
    weights = {p: (getattr(module, p).detach().clone(), getattr(module, f"{p}_scale_inv").detach().clone())
               for p in ("gate_up_proj", "down_proj")}
    assert plug.experts_plan(module).path == (plug.COMPOSED if gate == "softcap" else plug.FUSED)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, K4, generator=gen)
    ids = torch.stack([torch.randperm(E4, generator=gen)[:2] for _ in range(11)])
    ids[3, 1], ids[5, 0] = -1, E4 + 2  # dropped slots
    tw = torch.rand(11, 2, generator=gen)
    spy = Spy(monkeypatch)
    with torch.no_grad():
        out = module(x, ids, tw)
    assert spy.fused == 1
    ref = hf_oracle(module, weights, x, ids, tw)
    assert max_rel(out, ref) <= 1e-4
    # Held once: the checkpoint's two tensors per weight come back from state_dict, same dtype.
    assert "gate_up_proj" not in dict(module.named_parameters())
    state = module.state_dict()
    for proj, (values, scales) in weights.items():
        assert torch.equal(state[proj], values) and state[f"{proj}_scale_inv"].dtype == scales.dtype
        assert torch.equal(state[f"{proj}_scale_inv"].view(torch.uint8) if scale_fmt == "ue8m0"
                           else state[f"{proj}_scale_inv"], scales.view(torch.uint8) if scale_fmt == "ue8m0" else scales)
    with torch.no_grad():  # and a second call runs on the held form alone
        assert torch.equal(module(x, ids, tw), out)


def test_fp4_experts_clamp_is_exercised(monkeypatch):
    """The clamp of the silu_clamp gate changes the result on these inputs (the parity above is
    not blind to it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, K4, generator=gen) * 3
    ids = torch.stack([torch.randperm(E4, generator=gen)[:2] for _ in range(8)])
    tw = torch.rand(8, 2, generator=gen)
    with torch.no_grad():
        clamped = fp4_experts("silu_clamp", "ue8m0")(x, ids, tw)
        plain = fp4_experts("silu", "ue8m0")(x, ids, tw)
    assert max_rel(clamped, plain) > 0.05


def test_fp8_experts_fail_closed():
    """FP8 (e4m3) experts are neither bf16 nor MXFP4: NotImplementedError naming the way out."""
    module = fp4_experts("silu", "ue8m0")
    module.gate_up_proj = torch.nn.Parameter(torch.zeros(E4, 2 * N4, K4, dtype=torch.float8_e4m3fn),
                                             requires_grad=False)
    with pytest.raises(NotImplementedError, match="FP8.*dequantize=True"):
        module(torch.randn(3, K4), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))


def test_float_scales_must_be_powers_of_two():
    module = fp4_experts("silu", "float")
    with torch.no_grad():
        module.down_proj_scale_inv[0, 0, 0] = 0.3
    with pytest.raises(ValueError, match="powers of two"):
        module(torch.randn(3, K4), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))


def test_fp8_interface_knows_padded_moe():
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

    assert ALL_FP8_EXPERTS_FUNCTIONS.get_interface(plug.IMPLEMENTATION, None) is plug.padded_moe_experts_forward


def deepseek_v4_fp4_models():
    """A tiny DeepSeek-V4 twice: with float experts holding MXFP4-representable values, and with
    those experts as transformers' FP4 `FP8Experts` (the modules its FP8 quantizer makes for
    DeepSeek-V4's FP4 checkpoints) holding the same values as codes and E8M0 scales."""
    import copy

    from padded_moe.mxfp4 import dequantize_mxfp4

    model = build("deepseek_v4", sizes=dict(TINY, hidden=64, inter=64))
    fp4 = copy.deepcopy(model)
    cls = _fp8_experts_class()
    for name, m in [(n, m) for n, m in fp4.named_modules() if type(m).__name__ == "DeepseekV4Experts"]:
        # transformers 5.25 passes the module's limit; 5.24 reads config.swiglu_limit (the same value)
        limit = {"swiglu_limit": m.limit} if "swiglu_limit" in inspect.signature(cls.__init__).parameters else {}
        new = cls(config=m.config, block_size=None, activation_scheme="dynamic", scale_fmt="ue8m0", expert_dtype="fp4",
                  **limit)
        for proj in ("gate_up_proj", "down_proj"):
            q = quantize_mxfp4(getattr(m, proj).detach())
            setattr(new, proj, torch.nn.Parameter(q.blocks.view(torch.int8), requires_grad=False))
            setattr(new, f"{proj}_scale_inv", torch.nn.Parameter(q.scales.view(torch.float8_e8m0fnu), requires_grad=False))
            with torch.no_grad():
                getattr(model.get_submodule(name), proj).copy_(dequantize_mxfp4(q, torch.float32))
        parent, _, attr = name.rpartition(".")
        setattr(fp4.get_submodule(parent), attr, new)
    return model, fp4


def test_deepseek_v4_with_fp4_experts_matches_eager(monkeypatch):
    """Whole model: DeepSeek-V4 with FP4 `FP8Experts` under "padded_moe" (hash-routed and top-k
    layers) gives the logits of HF's eager experts on the same weights as floats; the clamp limit
    is the family's small test value, so the gate mapping is exercised."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model, fp4 = deepseek_v4_fp4_models()
    model.set_experts_implementation("eager")
    fp4.config._experts_implementation = plug.IMPLEMENTATION
    ids = prompts(2, 9, 5)
    spy = Spy(monkeypatch)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        out = fp4(input_ids=ids).logits
    assert spy.fused == 2
    assert max_rel(out, ref) <= 1e-4
    assert all(plug.experts_plan(m).activation == "silu" for m in fp4.modules() if type(m).__name__ == "FP8Experts")


def test_expert_parallel_takes_fp4_experts(monkeypatch, one_rank_group):
    """`enable_expert_parallel(weight_format="mxfp4")` on DeepSeek-V4 with FP4 `FP8Experts`."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _, fp4 = deepseek_v4_fp4_models()
    fp4.config._experts_implementation = plug.IMPLEMENTATION
    ids = prompts(2, 5, 6)
    with pytest.raises(ValueError, match="weight_format must be 'mxfp4'"):
        plug.enable_expert_parallel(fp4, max_tokens_per_rank=10)
    with torch.no_grad():
        ref = fp4(input_ids=ids).logits
        plug.enable_expert_parallel(fp4, max_tokens_per_rank=10, weight_format="mxfp4")
        out = fp4(input_ids=ids).logits
    assert max_rel(out, ref) <= 1e-5


def test_loaded_mxfp4_model_compiles_without_a_prepare_call(tmp_path, monkeypatch):
    """A GPT-OSS MXFP4 checkpoint loaded under "padded_moe" holds the prepared form from the start:
    `torch.compile(fullgraph=True, dynamic=True)` traces it as it is and equals the eager model."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    mxfp4_checkpoint(tmp_path / "ckpt", 64)
    model = load(tmp_path / "ckpt", experts_implementation=plug.IMPLEMENTATION)
    ids = prompts(2, 7, 8)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = torch.compile(model, fullgraph=True, dynamic=True, backend="eager")(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fp4_experts_compile_after_prepare_experts(monkeypatch):
    """FP4 `FP8Experts` are turned into the held form by `prepare_experts` (or one eager forward);
    tracing before that raises an error naming the call, after it the compiled model equals eager."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    _, fp4 = deepseek_v4_fp4_models()
    fp4.config._experts_implementation = plug.IMPLEMENTATION
    ids = prompts(2, 7, 9)
    with torch.no_grad(), pytest.raises(Exception, match="prepare_experts"):
        torch.compile(fp4, fullgraph=True, backend="eager")(input_ids=ids)
    torch._dynamo.reset()
    assert plug.prepare_experts(fp4) == 2
    with torch.no_grad():
        want = fp4(input_ids=ids).logits
        got = torch.compile(fp4, fullgraph=True, dynamic=True, backend="eager")(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_held_weight_follows_its_buffers():
    """The held `Mxfp4Tensor` is reused across eager calls and rebuilt when the module's buffers
    are replaced (`.to()`, `_apply`, a new hold): never a view of stale tensors."""
    from padded_moe.integrations.transformers import _held, hold_mxfp4

    module = torch.nn.Module()
    hold_mxfp4(module, "down_proj", quantize_mxfp4(torch.randn(4, 64, 128)))
    first = _held(module, "down_proj")
    assert _held(module, "down_proj") is first
    module._apply(lambda t: t.clone())  # what .to(other device) does to buffers
    moved = _held(module, "down_proj")
    assert moved is not first and moved.hopper.blocks is module._padded_moe_down_proj_blocks
    assert torch.equal(moved.hopper.blocks, first.hopper.blocks)


def test_load_op_names_a_missing_tensor():
    """The conversion op given blocks without scales: a ValueError naming what is missing."""
    import types

    from padded_moe.integrations.transformers_mxfp4 import _load_op_class

    op = _load_op_class()(None)
    model = types.SimpleNamespace(get_submodule=lambda name: torch.nn.Module())
    with pytest.raises(ValueError, match="down_proj_scales"):
        op.convert({"down_proj_blocks": [torch.zeros(2, 4, 2, 16, dtype=torch.uint8)]}, model=model,
                   full_layer_name="model.layers.0.mlp.experts.down_proj")
