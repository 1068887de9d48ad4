"""HF transformers plug-in on CUDA: the seven families in bf16 with larger (still small) models.

Same oracle and criteria as tests/test_transformers_parity.py (HF's eager experts on the same
model; greedy next tokens compared where the fp32 model's top-2 margin is clear of bf16 rounding),
on our Triton kernels, for both forced layouts, plus one fp32 run per family as a tight check.
"""

from __future__ import annotations

import pytest
import torch
from test_transformers_parity import (
    FAMILIES,
    LAYOUTS,
    Spy,
    assert_bf16_close,
    build,
    check_block_bf16_accuracy,
    experts_modules,
    logits_both,
    max_rel,
    prompts,
)

pytestmark = pytest.mark.gpu

# Larger than the CPU models: K = 256, N = 128, 8 experts, top-2, 64-token prompts.
SMALL = dict(hidden=256, layers=2, experts=8, top_k=2, inter=128)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_model_bf16_cuda(name, layout, monkeypatch):
    monkeypatch.setenv("PADDED_MOE_GEMM_LAYOUT", layout)
    spy = Spy(monkeypatch)
    ids = prompts(32, 64, 77, device="cuda")
    model = build(name, SMALL, dtype=torch.bfloat16, device="cuda")
    ref, out = logits_both(model, ids)
    assert spy.fused == len(experts_modules(model, name))
    with torch.no_grad():
        ref32 = build(name, SMALL, device="cuda")(input_ids=ids).logits
    assert_bf16_close(out, ref, ref32, min_decided=8)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_model_fp32_cuda(name, monkeypatch):
    # TF32 would make HF's eager matmuls the less accurate side; compare true fp32.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = build(name, SMALL, device="cuda")
    ref, out = logits_both(model, prompts(4, 64, 78, device="cuda"))
    assert max_rel(out, ref) <= 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_block_bf16_accuracy_cuda(name, layout, monkeypatch):
    monkeypatch.setenv("PADDED_MOE_GEMM_LAYOUT", layout)
    check_block_bf16_accuracy(name, SMALL, device="cuda", tokens=512)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_plugin_forward_never_syncs(name):
    """No device-to-host synchronisation in what the plug-in runs: each experts module's forward
    under "padded_moe" (every family), and the top-k routers it takes over (`plug._ROUTERS`)."""
    from padded_moe.integrations import transformers as plug

    model = build(name, SMALL, dtype=torch.bfloat16, device="cuda")
    model.set_experts_implementation(plug.IMPLEMENTATION)
    experts = experts_modules(model, name)[0]
    taken_over = {cls for _, cls, _ in plug._ROUTERS}
    routers = [m for m in model.modules() if type(m).__name__ in taken_over and type(m).__dict__.get("_padded_moe_dispatch")]
    assert bool(routers) == (name in ("mixtral", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3", "deepseek_v4")), name
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(16, SMALL["hidden"], device="cuda", generator=g).bfloat16()
    ids = torch.randint(0, SMALL["experts"], (16, SMALL["top_k"]), device="cuda", generator=g)
    ids[3, 0] = -1  # a dropped slot
    w = torch.rand(16, SMALL["top_k"], device="cuda", generator=g).bfloat16()

    def run():
        experts(x, ids, w)
        experts(x[:3], ids[:3], w[:3])
        for router in routers[:1]:
            router(x)

    with torch.no_grad():
        run()  # compiles kernels and fills caches outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_gpt_oss_mxfp4_checkpoint_loads_as_mxfp4_cuda(tmp_path):
    """A GPT-OSS MXFP4 checkpoint loaded onto the GPU with experts_implementation="padded_moe": the
    experts hold the prepared MXFP4 form on the device and match HF's eager experts on the same
    checkpoint dequantized (fp32 activations, so the weights' bytes are the only approximation)."""
    from test_transformers_mxfp4 import load, mxfp4_checkpoint
    from transformers import Mxfp4Config

    from padded_moe.integrations import transformers as plug

    import importlib.util

    mxfp4_checkpoint(tmp_path / "ckpt", 128)
    # transformers needs accelerate for device_map; without it, load on the CPU and move.
    where = {"device_map": "cuda"} if importlib.util.find_spec("accelerate") is not None else {}
    model = load(tmp_path / "ckpt", experts_implementation=plug.IMPLEMENTATION, **where).cuda()
    ref_model = load(tmp_path / "ckpt", experts_implementation="eager", quantization_config=Mxfp4Config(dequantize=True),
                     **where).cuda()
    m = experts_modules(model, "gpt_oss")[0]
    assert m._padded_moe_gate_up_proj_blocks.is_cuda and "gate_up_proj" not in dict(m.named_parameters())
    ids = prompts(4, 33, 79, device="cuda")
    with torch.no_grad():
        assert max_rel(model(input_ids=ids).logits, ref_model(input_ids=ids).logits) <= 1e-3


@pytest.mark.parametrize("gate", ["silu_clamp", "swiglu_alpha", "softcap"])
def test_fp4_experts_module_cuda(gate, monkeypatch):
    """transformers' `FP8Experts` holding packed FP4 experts (DeepSeek-V4's checkpoint form) under
    "padded_moe" on the GPU: the prepared MXFP4 GEMMs against transformers' dequantization and the
    module's own gate in float64 (bf16 activations)."""
    from test_transformers_mxfp4 import E4, K4, fp4_experts, hf_oracle

    module = fp4_experts(gate, "ue8m0")
    weights = {p: (getattr(module, p).detach().clone(), getattr(module, f"{p}_scale_inv").detach().clone())
               for p in ("gate_up_proj", "down_proj")}
    module = module.cuda()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, K4, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E4, generator=gen)[:2] for _ in range(40)])
    ids[7, 0] = -1
    tw = torch.rand(40, 2, generator=gen)
    spy = Spy(monkeypatch)
    with torch.no_grad():
        out = module(x.cuda(), ids.cuda(), tw.cuda())
    assert spy.fused == 1 and module._padded_moe_gate_up_proj_blocks.is_cuda
    assert max_rel(out.cpu(), hf_oracle(module.cpu(), weights, x, ids, tw)) <= 2e-2
