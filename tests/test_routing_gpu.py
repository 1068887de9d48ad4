"""Routers on CUDA: the same answers as on CPU (tests/test_routing.py), no host sync (CUDA graph
capture), typed errors for tensors on different devices."""

import pytest
import torch
from test_routing import _check_dropped_slots, assert_same_routing, check_v4_bf16_steps

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


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts, k", [(8, 2), (128, 8), (256, 6), (1024, 4)])
@pytest.mark.parametrize("mode", ["softmax", "softmax_renorm", "topk_first"])
def test_fused_topk_kernel_on_cuda(gen, num_experts, k, mode):
    """The compiled one-kernel top-k (libdevice exp) against the float64 formula on 2048 bf16 rows:
    the same scores kept (ties may keep either expert), largest first, weights within float32
    rounding (bf16 output within its rounding)."""
    from padded_moe.routing import fused_topk

    logits = (torch.randn(2048, num_experts, generator=gen) * 2).to(torch.bfloat16).cuda()
    tbs, renorm = mode == "topk_first", mode == "softmax_renorm"
    for w_dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
        w, ids = fused_topk(logits, k, renormalize=renorm, topk_before_softmax=tbs, weights_dtype=w_dtype,
                            ids_dtype=torch.int64)
        x = logits.double()
        score = x if tbs else x.softmax(-1)
        top = score.topk(k, dim=-1).values
        picked = score.gather(1, ids)
        assert torch.equal(picked.sort(-1, descending=True).values, top)
        assert torch.all(picked[:, :-1] >= picked[:, 1:])
        ref = top.softmax(-1) if tbs else (top / top.sum(-1, keepdim=True) if renorm else top)
        torch.testing.assert_close(w.double(), ref, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("num_experts, k, scoring, groups, kept", [
    (256, 6, "sqrtsoftplus", 1, 1),  # DeepSeek-V4
    (256, 8, "sigmoid", 8, 4),       # DeepSeek-V3
    (384, 8, "sigmoid", 1, 1),       # Kimi-K2-like (E not a power of two)
    (1024, 4, "softmax", 16, 16),
])
def test_biased_kernel_on_cuda(gen, num_experts, k, scoring, groups, kept):
    """The compiled DeepSeek router kernel against the float64 formula on 2048 bf16 rows with a
    correction bias: the kept choice scores equal the k best (a near-tie within float32 rounding
    may keep either expert), largest first, within the kept groups, and the weights (unbiased scores,
    renormalised, scaled) within float32 rounding."""
    logits = (torch.randn(2048, num_experts, generator=gen) * 2).to(torch.bfloat16).cuda()
    bias = (torch.randn(num_experts, generator=gen) * 0.1).cuda()
    w, ids = biased_grouped_topk(logits, bias, k, num_groups=groups, topk_groups=kept, scoring=scoring,
                                 routed_scaling_factor=2.5)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    x = logits.double()
    score = {"sigmoid": lambda: x.sigmoid(), "sqrtsoftplus": lambda: torch.nn.functional.softplus(x).sqrt(),
             "softmax": lambda: x.softmax(-1)}[scoring]()
    choice = score + bias.double()
    rows = torch.ones(2048, dtype=torch.bool, device="cuda")
    if kept < groups:
        group_score = choice.view(2048, groups, -1).topk(2, dim=-1).values.sum(-1)
        ordered = group_score.sort(-1, descending=True)
        # A row whose last kept group and first dropped one score within float32 rounding (sums
        # near 2: ulp 2.4e-7) may keep either: its experts must come from the best kept + 1 groups.
        near = (ordered.values[:, kept - 1] - ordered.values[:, kept]) <= 4e-6
        assert int(near.sum()) <= 8, int(near.sum())
        candidates = torch.zeros(2048, groups, dtype=torch.bool, device="cuda").scatter_(
            1, ordered.indices[:, : kept + 1], True)
        picked_groups = ids.long() // (num_experts // groups)
        assert bool(candidates.gather(1, picked_groups)[near].all())
        rows = ~near
        allowed = torch.zeros(2048, groups, dtype=torch.bool, device="cuda").scatter_(1, ordered.indices[:, :kept], True)
        choice = choice.masked_fill(~allowed.repeat_interleave(num_experts // groups, dim=1), float("-inf"))
    top = choice.topk(k, dim=-1).values
    picked = choice.gather(1, ids.long())
    torch.testing.assert_close(picked[rows], top[rows], rtol=0, atol=1e-6)
    assert torch.all(picked[rows, :-1] >= picked[rows, 1:] - 1e-6)
    ref = score.gather(1, ids.long())
    ref = 2.5 * ref / (ref.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(w.double(), ref, rtol=2e-6, atol=1e-7)
    # The output dtypes of transformers' routers (int64 indices) from the same kernel: the same bits.
    w64, ids64 = biased_grouped_topk(logits, bias, k, num_groups=groups, topk_groups=kept, scoring=scoring,
                                     routed_scaling_factor=2.5, ids_dtype=torch.int64)
    assert ids64.dtype == torch.int64 and torch.equal(ids64, ids.long()) and torch.equal(w64, w)


@pytest.mark.gpu
@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bf16_steps_match_transformers_v4_router_on_cuda(gen, scoring_func, bias_dtype):
    """The compiled kernel with `compute_dtype=torch.bfloat16` against transformers' DeepSeek-V4
    router run on CUDA in bfloat16 (libdevice's exp / log1p are CUDA's, as torch's kernels use;
    `check_v4_bf16_steps`, 4096 tokens); a bfloat16 correction bias (a model cast with `.to()`) too."""
    check_v4_bf16_steps(gen, scoring_func, 4096, "cuda", bias_dtype)


@pytest.mark.parametrize("M, E, D, bias", [(1, 128, 2880, True), (16, 128, 2048, False), (4, 256, 4096, False),
                                           (7, 8, 4096, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gate_kernel_on_cuda(gen, dtype, M, E, D, bias):
    """The gate kernel compiled (tensor-core sums): finished logits within one unit in the last
    place of the exact projection (plus float32 summation error) and nearly all equal to cuBLAS's
    `F.linear`; the router kernel routes them as their finished logits (the same experts, weights
within float32 rounding); a NaN row
    stays in its row; gate and router capture in a CUDA graph."""
    from test_routing import _ULP_BITS, finished_logits

    from padded_moe.routing import fused_topk, gate_softmax_topk, gate_sums

    x = torch.randn(M, D, generator=gen).to(dtype).cuda()
    w = (torch.randn(E, D, generator=gen) * 0.05).to(dtype).cuda()
    b = (torch.randn(E, generator=gen) * 0.1).to(dtype).cuda() if bias else None
    if M > 2:
        x[2] = float("nan")
    with torch.no_grad():
        gate = gate_sums(x, w, b)
        lib = torch.nn.functional.linear(x, w, b)
    got = finished_logits(gate)
    exact = x.double() @ w.double().T + (0.0 if b is None else b.double())
    summed = x.double().abs() @ w.double().abs().T + (0.0 if b is None else b.double().abs())
    ok = torch.isfinite(exact)
    tol = exact.abs() * 2.0 ** -_ULP_BITS[dtype] + summed * D * 2.0 ** -23
    assert ((got.double() - exact).abs() <= tol)[ok].all()
    assert torch.isnan(got[~ok]).all()
    if dtype == torch.bfloat16:
        assert (got == lib)[ok].double().mean() >= 0.95
    k = min(4, E)
    routed = gate_softmax_topk(gate, k, True)
    want = fused_topk(got, k, renormalize=True)
    # The same experts; weights within float32 rounding (the compiled kernels may sum the softmax
    # in another order when the row comes from the sums rather than from memory).
    torch.testing.assert_close(routed[0], want[0], rtol=4e-7, atol=0, equal_nan=True)
    assert torch.equal(routed[1], want[1])
    static = x.clone()
    gate_softmax_topk(gate_sums(static, w, b), k, True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gate_softmax_topk(gate_sums(static, w, b), k, True)
    static.copy_(torch.randn(M, D, generator=gen).to(dtype).cuda())
    graph.replay()
    torch.cuda.synchronize()
    again = gate_softmax_topk(gate_sums(static, w, b), k, True)
    assert torch.equal(out[0], again[0]) and torch.equal(out[1], again[1])
