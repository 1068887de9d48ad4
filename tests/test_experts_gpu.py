"""Spec 03 on CUDA: fused_experts at model sizes, CUDA-graph capture and replay, the layer."""

import pytest
import torch

from helpers import rel_err
from padded_moe.expert_map import ExpertMap
from padded_moe.experts import batched_experts, fused_experts
from padded_moe.layer import FusedMoE, dense_weights
from padded_moe.layouts import PermuteScratch
from padded_moe.mxfp4 import quantize_mxfp4
from padded_moe.reference.moe import activation_f64, reference_moe

pytestmark = pytest.mark.gpu
BF16_TOL = 2e-2


def _routes(M, k, E, device="cuda"):
    ids = torch.rand(M, E, device=device).argsort(dim=1)[:, :k].to(torch.int32)
    w = torch.rand(M, k, device=device)
    return w / w.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("layout", ["indexed", "grouped_contiguous"])
def test_dsv4_like_shapes(layout, fmt):
    M, k, E, K, N = 64, 6, 32, 1024, 512  # dsv4-flash's k, fewer experts and narrower for the oracle
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(E, 2 * N, K, device="cuda") * 0.03
    w2 = torch.randn(E, K, N, device="cuda") * 0.03
    if fmt == "mxfp4":
        w13, w2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    tw, ids = _routes(M, k, E)
    ids[3, 2] = -1
    ids[9, 0] = E + 5
    out = fused_experts(x, w13, w2, tw, ids, activation="silu", layout=layout)
    ref = reference_moe(x, dense_weights(w13), dense_weights(w2), tw, ids, activation="silu")
    assert rel_err(out, ref) <= BF16_TOL


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("layout", ["indexed", "grouped_contiguous"])
@pytest.mark.parametrize("mean_rows", [27, 32, 64, 72, 96, 128, 192])
def test_blocks_around_the_medium_regime(mean_rows, layout, fmt):
    """bf16 and prepared MXFP4 around `BLOCK_128_MEAN_ROWS`: the small regime's tile (INDEXED: in
    64-row blocks) below it, the medium tile (INDEXED: in 128-row blocks) at and above it; at 27
    and 32 mean rows GROUPED_CONTIGUOUS takes the small tile too, as INDEXED does there (its
    64-row blocks); swigluoai with biases, dropped and out-of-range ids, NaN rows past `valid_tokens`."""
    from padded_moe.layouts import BLOCK_128_MEAN_ROWS, GemmLayout, build_layout_resolved

    k, E, K, N = 4, 16, 512, 256
    M = mean_rows * E // k
    g = torch.Generator(device="cuda").manual_seed(mean_rows)
    x = torch.randn(M + 8, K, device="cuda", generator=g).bfloat16()
    q13 = quantize_mxfp4(torch.randn(E, 2 * N, K, device="cuda", generator=g) * 0.03).prepare_for()
    q2 = quantize_mxfp4(torch.randn(E, K, N, device="cuda", generator=g) * 0.03).prepare_for()
    if fmt == "bf16":
        q13, q2 = q13.dequantize(torch.bfloat16), q2.dequantize(torch.bfloat16)
    b13 = (torch.randn(E, 2 * N, device="cuda", generator=g) * 0.1).bfloat16()
    b2 = (torch.randn(E, K, device="cuda", generator=g) * 0.1).bfloat16()
    tw, ids = _routes(M + 8, k, E)
    ids[3, 2] = -1
    ids[9, 0] = E + 5
    x[M:] = float("nan")
    ids[M:] = torch.randint(-3, E + 3, (8, k), device="cuda", generator=g, dtype=torch.int32)
    valid = torch.tensor([M], dtype=torch.int32, device="cuda")
    meta = build_layout_resolved(GemmLayout.INDEXED, ids, E, E, None)
    assert meta.block_m == (128 if mean_rows * (M + 8) / M >= BLOCK_128_MEAN_ROWS else 64)
    out = fused_experts(x, q13, q2, tw, ids, activation="swigluoai", layout=layout, w13_bias=b13, w2_bias=b2,
                        valid_tokens=valid)
    ref = reference_moe(x[:M], dense_weights(q13), dense_weights(q2), tw[:M], ids[:M], activation="swigluoai",
                        w13_bias=b13, w2_bias=b2)
    assert torch.isfinite(out[:M]).all() and rel_err(out[:M], ref) <= BF16_TOL


@pytest.mark.parametrize("placement", ["linear", "table"])
@pytest.mark.parametrize("layout", ["indexed", "grouped_contiguous"])
def test_graph_capture_and_replay_with_new_routes(layout, placement):
    M, k, E, K, N = 128, 4, 16, 512, 256
    emap = ExpertMap(E, ep_rank=0, ep_size=2, device="cuda")
    if placement == "table":  # a vLLM-style table on the device: 8 scattered experts, local order shuffled
        table = torch.full((E,), -1, dtype=torch.int32)
        table[torch.randperm(E)[:8]] = torch.randperm(8, dtype=torch.int32)
        emap = ExpertMap.from_table(table.cuda())
    L = emap.num_local
    w13 = (torch.randn(L, 2 * N, K, device="cuda") * 0.05).bfloat16()
    w2 = (torch.randn(L, K, N, device="cuda") * 0.05).bfloat16()
    scratch = PermuteScratch(max_tokens=M, k=k, num_experts=E, num_local=L, device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    tw, ids = _routes(M, k, E)
    valid = torch.tensor([M], device="cuda", dtype=torch.int32)

    def call():
        return fused_experts(x, w13, w2, tw, ids, activation="silu", expert_map=emap, layout=layout,
                             valid_tokens=valid, scratch=scratch)

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for n_valid in (M, 37, 0, 100):
        x.copy_(torch.randn_like(x))
        new_w, new_ids = _routes(M, k, E)
        new_ids[n_valid:] = torch.randint(-5, E + 5, new_ids[n_valid:].shape, device="cuda", dtype=torch.int32)
        tw.copy_(new_w)
        ids.copy_(new_ids)
        valid.fill_(n_valid)
        graph.replay()
        torch.cuda.synchronize()
        if n_valid:
            ref = reference_moe(x, w13, w2, tw, ids, activation="silu", expert_map=emap.map, num_experts=E,
                                valid_tokens=n_valid)
            assert rel_err(out[:n_valid], ref[:n_valid]) <= BF16_TOL


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_layer_graph_with_valid_tokens(fmt):
    """FusedMoE.forward(valid_tokens=) captured once in a CUDA graph and replayed with new inputs
    and counts (0, part, all): the real rows equal the float64 reference on them; padding rows
    hold NaN (through the router too)."""
    M = 64
    layer = FusedMoE(16, 4, 512, 256, weight_format=fmt, device="cuda", dtype=torch.bfloat16)
    layer.randomize(seed=1, std=0.05)
    x = torch.randn(M, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    valid = torch.tensor([M], device="cuda", dtype=torch.int32)
    with torch.no_grad():
        layer(x, valid_tokens=valid)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, valid_tokens=valid)
        w13, w2 = layer.expert_weights()
        for n_valid in (37, 0, M, 5):
            x.copy_(torch.randn_like(x))
            x[n_valid:] = float("nan")
            valid.fill_(n_valid)
            graph.replay()
            torch.cuda.synchronize()
            if n_valid:
                tw, ids = layer.route(layer.gate(x[:n_valid]))
                ref = reference_moe(x[:n_valid], dense_weights(w13), dense_weights(w2), tw, ids, activation="silu")
                assert rel_err(out[:n_valid], ref) <= BF16_TOL, n_valid


def test_mxfp4_layer_holds_its_experts_once_on_gpu():
    """An MXFP4 layer (widths multiples of 64) holds its experts in the prepared form alone: about
    the canonical bytes less device memory than `keep_canonical=True`, and the same outputs bit for
    bit on the decode path (1-4 tokens) and the layout path, eager and as a CUDA-graph replay."""
    E, k, K, N = 64, 4, 512, 256
    canonical_bytes = E * (2 * N * K + K * N) * 17 // 32  # e2m1 codes (half a byte) + E8M0 scales (1 per 32)
    m0 = torch.cuda.memory_allocated()
    once = FusedMoE(E, k, K, N, weight_format="mxfp4", device="cuda", dtype=torch.bfloat16)
    once.randomize(seed=3, std=0.05)
    m1 = torch.cuda.memory_allocated()
    kept = FusedMoE(E, k, K, N, weight_format="mxfp4", device="cuda", dtype=torch.bfloat16, keep_canonical=True)
    kept.randomize(seed=3, std=0.05)
    m2 = torch.cuda.memory_allocated()

    def held(layer):  # bytes of the storages behind the parameters and the prepared form
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in layer.parameters()}
        for q in layer.expert_weights():
            storages.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                             for t in (q.hopper.blocks, q.hopper.scales)})
        return sum(storages.values())

    assert held(kept) - held(once) == canonical_bytes
    # The allocator agrees (its blocks round sizes up and may keep a split's remainder).
    assert (m2 - m1) - (m1 - m0) >= 0.85 * canonical_bytes, (m1 - m0, m2 - m1, canonical_bytes)
    assert once.w13_blocks.numel() == 0 and not once.expert_weights()[1].holds_canonical
    g = torch.Generator(device="cuda").manual_seed(4)
    with torch.no_grad():
        for M in (1, 3, 200):
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            want = kept(x)
            assert torch.equal(once(x), want), M
            static = x.clone()
            graph = torch.cuda.CUDAGraph()
            once(static)
            with torch.cuda.graph(graph):
                out = once(static)
            static.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), M


@pytest.mark.parametrize("weights", ["bf16", "mxfp4"])
@pytest.mark.parametrize("expected_m", [None, 0, 2, 24, 100, 256])
def test_batched_experts_on_gpu(weights, expected_m):
    """Every count is computed whatever `expected_m` says (its tiles: decode, small or medium; the
    capacity's without it), rows past each count untouched; MXFP4 in the prepared form."""
    L, T, K, N = 8, 256, 512, 256
    counts = torch.tensor([0, 1, 255, 256, 17, 64, 128, 3], device="cuda", dtype=torch.int32)
    x = torch.randn(L, T, K, device="cuda", dtype=torch.bfloat16)
    for e, c in enumerate(counts.tolist()):
        x[e, c:] = float("nan")
    w13 = (torch.randn(L, 2 * N, K, device="cuda") * 0.05).bfloat16()
    w2 = (torch.randn(L, K, N, device="cuda") * 0.05).bfloat16()
    if weights == "mxfp4":
        w13, w2 = quantize_mxfp4(w13).prepare_for(), quantize_mxfp4(w2).prepare_for()
    d13, d2 = (w.dequantize() if weights == "mxfp4" else w for w in (w13, w2))
    out = torch.full_like(x, -7.0)
    batched_experts(x, counts, w13, w2, activation="silu", out=out, expected_m=expected_m)
    for e, c in enumerate(counts.tolist()):
        if c:
            ref = activation_f64("silu", x[e, :c].double().cpu() @ d13[e].double().cpu().T) @ d2[e].double().cpu().T
            assert rel_err(out[e, :c], ref) <= BF16_TOL, (e, c)
        assert (out[e, c:] == -7.0).all()


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("expected_m", [None, 0, 3, 40])
def test_flat_receive_buffer_with_expected_m(fmt, expected_m):
    """A flat expert-parallel receive buffer with room for 16 times the tokens it holds (rows past
    `valid_tokens` NaN with garbage ids): every `expected_m` (its tiles, and for prepared MXFP4 the
    walk over the tiles with rows) gives the reference on the valid rows."""
    E, k, K, N, valid = 64, 6, 1024, 512, 24
    M = 16 * valid
    emap = ExpertMap(E, ep_rank=1, ep_size=2)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(emap.num_local, 2 * N, K, device="cuda") * 0.03
    w2 = torch.randn(emap.num_local, K, N, device="cuda") * 0.03
    if fmt == "mxfp4":
        w13, w2 = quantize_mxfp4(w13).prepare_for(), quantize_mxfp4(w2).prepare_for()
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    tw, ids = _routes(M, k, E)
    ids[valid:] = torch.randint(-3, E + 3, (M - valid, k), device="cuda", dtype=torch.int32)
    x[valid:] = float("nan")
    vt = torch.tensor([valid], device="cuda", dtype=torch.int32)
    out = fused_experts(x, w13, w2, tw, ids, activation="silu", expert_map=emap, valid_tokens=vt,
                        expected_m=expected_m)
    ref = reference_moe(x[:valid], dense_weights(w13), dense_weights(w2), tw[:valid], ids[:valid], activation="silu",
                        expert_map=emap.map, num_experts=E)
    assert torch.isfinite(out[:valid]).all() and rel_err(out[:valid], ref) <= BF16_TOL


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "gpt-oss-120b", "kimi-k3-like"])
def test_preset_layers(preset):
    layer = FusedMoE.from_preset(preset, device="cuda", dtype=torch.bfloat16)
    layer.randomize(seed=0, std=0.02)
    x = torch.randn(32, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = layer(x)
        tw, ids = layer.route(layer.gate(x))
    w13, w2 = layer.expert_weights()
    c = layer.activation_config
    ref = reference_moe(x, dense_weights(w13), dense_weights(w2), tw, ids, activation=layer.activation.value,
                        activation_kwargs=dict(limit=c.clamp_limit, situ_beta=c.situ_beta,
                                               situ_lambda=c.situ_linear_beta),
                        w13_bias=layer.w13_bias, w2_bias=layer.w2_bias)
    assert rel_err(out, ref) <= BF16_TOL


@pytest.mark.parametrize("layout", ["indexed", "grouped_contiguous"])
def test_eager_calls_back_to_back_reuse_nothing_stale(layout):
    """Eager calls reuse cached buffers (small calls) and cached launches (same key): calls of
    changing size, queued back to back without a sync and with a misaligned input view, each
    equal the float64 reference."""
    k, E, K, N = 6, 32, 512, 256
    w13 = (torch.randn(E, 2 * N, K, device="cuda") * 0.05).bfloat16()
    w2 = (torch.randn(E, K, N, device="cuda") * 0.05).bfloat16()
    calls = []
    for M in (5, 300, 1, 5, 900, 5, 2):
        base = torch.randn(M * K + 1, device="cuda", dtype=torch.bfloat16)
        x = base[1:].view(M, K) if M == 5 and calls else base[:-1].view(M, K)  # 2-byte offset: misaligned
        tw, ids = _routes(M, k, E)
        ids[0, 0] = -1
        calls.append((x, tw, ids, fused_experts(x, w13, w2, tw, ids, activation="silu", layout=layout)))
    torch.cuda.synchronize()
    for x, tw, ids, out in calls:
        ref = reference_moe(x, dense_weights(w13), dense_weights(w2), tw, ids, activation="silu")
        assert rel_err(out, ref) <= BF16_TOL, x.shape
