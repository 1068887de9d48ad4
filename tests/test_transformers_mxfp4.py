"""GPT-OSS MXFP4 checkpoints through `from_pretrained(..., experts_implementation="padded_moe")`
(`padded_moe.integrations.transformers_mxfp4`): the experts hold the checkpoint's MXFP4 bytes once,
in the prepared form, and give the logits of HF's eager experts on the same checkpoint dequantized.

Checkpoints are tiny GPT-OSS models written to a temporary directory in the published format
(`*_blocks [E, out, K/32, 16]`, `*_scales [E, out, K/32]`, `quantization_config.quant_method =
"mxfp4"`), so nothing is downloaded.
"""

from __future__ import annotations

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
