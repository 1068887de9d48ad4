"""Routers on CUDA: the same answers as on CPU (tests/test_routing.py), no host sync (CUDA graph
capture), typed errors for tensors on different devices."""

import pytest
import torch
from test_routing import _check_dropped_slots, assert_same_routing

from padded_moe.routing import biased_grouped_topk, hash_topk, softmax_topk

pytestmark = pytest.mark.gpu


@pytest.mark.gpu
def test_hash_invalid_slots_dropped_on_cuda(gen):
    _check_dropped_slots(gen, "cuda")


@pytest.mark.gpu
def test_cuda_matches_cpu_and_captures(gen):
    # 64 tokens keeps the chance of a CPU/CUDA last-ulp near-tie flipping a pick negligible.
    logits = torch.randn(64, 64, generator=gen)
    bias = torch.randn(64, generator=gen) * 0.3
    table = torch.stack([torch.randperm(64, generator=gen)[:6] for _ in range(100)])
    token_ids = torch.randint(0, 100, (64,), generator=gen)
    calls = [
        lambda lg, b, tb, ti: softmax_topk(lg, 8, True),
        lambda lg, b, tb, ti: softmax_topk(lg, 4, False, topk_before_softmax=True),
        lambda lg, b, tb, ti: biased_grouped_topk(lg, b, 8, 8, 4, "sigmoid", 2.5, True),
        lambda lg, b, tb, ti: biased_grouped_topk(lg, b, 6, scoring="sqrtsoftplus", routed_scaling_factor=1.5),
        lambda lg, b, tb, ti: hash_topk(ti, tb, lg, "sqrtsoftplus", 1.5),
    ]
    cuda_args = [a.cuda() for a in (logits, bias, table, token_ids)]
    for call in calls:
        assert_same_routing(call(*cuda_args), call(logits, bias, table, token_ids), atol=2e-6)
        static_logits = cuda_args[0].clone()
        call(static_logits, *cuda_args[1:])  # warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(static_logits, *cuda_args[1:])
        fresh = torch.randn(64, 64, generator=gen)
        static_logits.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert_same_routing(out, call(fresh, bias, table, token_ids), atol=2e-6)


@pytest.mark.gpu
def test_device_mismatch():
    logits = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match="bias must be on logits's device"):
        biased_grouped_topk(logits, torch.randn(8), 2)
    with pytest.raises(ValueError, match="token_ids must be on logits's device"):
        hash_topk(torch.zeros(4, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64, device="cuda"), logits)
