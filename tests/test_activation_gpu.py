"""Spec 01 on CUDA: compiled kernels, CUDA-graph replay with new counts, torch.compile."""

import pytest
import torch

from helpers import REL_TOL, SENTINEL, rel_err
from padded_moe.activation import ApplyMoEActivationConfig, MoEActivation, apply_moe_activation
from padded_moe.reference.moe import activation_f64

pytestmark = pytest.mark.gpu

SUPPORTED = [a for a in MoEActivation if a is not MoEActivation.RELU2]
CONFIG = ApplyMoEActivationConfig(situ_beta=4.0, situ_linear_beta=25.0)
KW = dict(situ_beta=4.0, situ_lambda=25.0)


def _input(act, lead, d, dtype):
    width = 2 * d if act.is_gated else d
    return (torch.randn(*lead, width, device="cuda") * 4).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", SUPPORTED, ids=lambda a: a.value)
def test_flat_and_batched_on_gpu(act, dtype):
    rows, d = 3000, 2049
    counts_list = [0, 1, 1500, rows, rows + 7, -5]
    x = _input(act, (len(counts_list), rows), d, dtype)
    for e, c in enumerate(counts_list):
        x[e, max(0, min(c, rows)):] = float("nan")
    out = torch.full((len(counts_list), rows, d), SENTINEL, dtype=dtype, device="cuda")
    apply_moe_activation(act, out, x, activation_config=CONFIG,
                         valid_token_counts=torch.tensor(counts_list, device="cuda", dtype=torch.int32))
    for e, c in enumerate(counts_list):
        n = max(0, min(c, rows))
        if n:
            ref = activation_f64(act.value, x[e, :n].cpu(), **KW)
            assert rel_err(out[e, :n], ref) <= REL_TOL[dtype]
        assert (out[e, n:] == SENTINEL).all()
    # flat: the first expert's slab as a 2-D buffer with one count
    flat_out = torch.full((rows, d), SENTINEL, dtype=dtype, device="cuda")
    apply_moe_activation(act, flat_out, x[3], activation_config=CONFIG,
                         valid_token_counts=torch.tensor([rows], device="cuda"))
    assert torch.equal(flat_out, out[3])


@pytest.mark.parametrize("act,d", [(MoEActivation.SWIGLUOAI, 2880), (MoEActivation.SILU, 768)],
                         ids=["bfloat16-swigluoai-2880", "bfloat16-silu-768"])
def test_model_widths_on_gpu(act, d):
    """GPT-OSS's interleaved 2880 columns (three 1024-column blocks, the last partly masked) and
    Qwen3-MoE's 768, bf16, with counts and NaN past them."""
    dtype, rows = torch.bfloat16, 777
    counts_list = [0, 5, rows, 300]
    x = _input(act, (len(counts_list), rows), d, dtype)
    for e, c in enumerate(counts_list):
        x[e, c:] = float("nan")
    out = torch.full((len(counts_list), rows, d), SENTINEL, dtype=dtype, device="cuda")
    apply_moe_activation(act, out, x, valid_token_counts=torch.tensor(counts_list, device="cuda"))
    for e, c in enumerate(counts_list):
        if c:
            assert rel_err(out[e, :c], activation_f64(act.value, x[e, :c].cpu())) <= REL_TOL[dtype]
        assert (out[e, c:] == SENTINEL).all()


def test_graph_replay_with_changed_counts():
    act, rows, d = MoEActivation.SILU, 4096, 1024
    x = _input(act, (rows,), d, torch.bfloat16)
    out = torch.full((rows, d), SENTINEL, dtype=torch.bfloat16, device="cuda")
    counts = torch.tensor([rows], device="cuda", dtype=torch.int32)
    apply_moe_activation(act, out, x, valid_token_counts=counts)  # warm up (compile) outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_moe_activation(act, out, x, valid_token_counts=counts)
    for n in (17, 0, 4000, 1):
        out.fill_(SENTINEL)
        x.copy_(torch.randn_like(x))
        counts.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        if n:
            assert rel_err(out[:n], activation_f64("silu", x[:n].cpu())) <= REL_TOL[torch.bfloat16]
        assert (out[n:] == SENTINEL).all()


def test_torch_compile_fullgraph():
    def step(x, counts):
        h = x * 1.5
        out = torch.full((x.shape[0], x.shape[1] // 2), SENTINEL, dtype=x.dtype, device=x.device)
        apply_moe_activation("swigluoai", out, h, valid_token_counts=counts)
        return out + 0  # something after the op so the mutation must be ordered

    compiled = torch.compile(step, fullgraph=True)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([100], device="cuda")
    got = compiled(x, counts)
    want = step(x, counts)
    assert torch.equal(got, want)
    assert (got[100:] == SENTINEL).all()
