"""Drive one small kernel for Nsight Compute (`ncu`): a few warm-up calls, then the profiled ones.

    ncu --kernel-name regex:NAME python3 scripts/ncu_small.py act|unpermute|mx [ROWS]
    ncu --kernel-name regex:_expert_gemm python3 scripts/ncu_small.py layer PRESET[:mxfp4] TOKENS [CONFIG]
    ncu python3 scripts/ncu_small.py mm M N K   (a dense bf16 matmul: the tensor-pipe reference)
    ncu -k regex:"_expert_gemm|grouped_gemm" python3 scripts/ncu_small.py native PRESET TOKENS STAGE
        (one GEMM on GROUPED_CONTIGUOUS: Triton, then the native kernel: configuration 0 static, then
        walking from the counter; configuration 3 from the counter with A's rows evict-last and
        normal in L2, then static)
"""
import sys

import torch

from padded_moe.activation import apply_moe_activation
from padded_moe.layouts import GemmLayout, PermuteScratch, build_layout, permute, unpermute

case = sys.argv[1]
torch.manual_seed(0)
if case == "act":  # silu, [49152, 2*2048] -> [49152, 2048], all rows valid; and torch.compile's kernel
    D, R = 2048, 49152
    x = torch.randn(R, 2 * D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(R, D, device="cuda", dtype=torch.bfloat16)
    counts = torch.full((1,), R, device="cuda", dtype=torch.int32)

    def math(x):
        g, u = x[..., :D].float(), x[..., D:].float()
        return (torch.nn.functional.silu(g) * u).to(x.dtype)

    compiled = torch.compile(math)
    # The probe's copy of the library kernel's form (act_variants_probe.py's striding_expsig_p32),
    # which times ~2% faster than the library kernel with the same SASS size and registers.
    import os
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from act_variants_probe import variants

    probe = variants(R, torch.cuda.get_device_properties(0).multi_processor_count)["striding_expsig_p32"]
    for _ in range(3):
        apply_moe_activation("silu", out, x, valid_token_counts=counts)
        compiled(x)
        probe(out, x, counts)
elif case == "mx":  # prepared MXFP4 w13 of GPT-OSS (E=128, K=2880, N=5760), ROWS (32) rows per expert, INDEXED
    from padded_moe.gemm import expert_gemm
    from padded_moe.mxfp4 import Mxfp4Tensor, quantize_mxfp4

    E, K, N, r = 128, 2880, 5760, int(sys.argv[2]) if len(sys.argv) > 2 else 32
    parts = [quantize_mxfp4(torch.randn(8, N, K, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(E // 8)]
    q = Mxfp4Tensor(torch.cat([p.blocks for p in parts]), torch.cat([p.scales for p in parts])).prepare_for()
    ids = (torch.arange(E * r, device="cuda", dtype=torch.int32) // r).view(-1, 1)
    meta = build_layout(GemmLayout.INDEXED, ids, E)  # the default block: 64 rows at 32 per expert, 128 at 256
    a = torch.randn(E * r, K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(E * r, N, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        expert_gemm(a, q, meta, out=out)
elif case == "layer":  # FusedMoE.experts of a preset (":mxfp4": MXFP4 weights, prepared) at TOKENS tokens
    # with its own router: 3 calls. CONFIG: a GemmConfig short name in place of the bf16 medium table entry
    from padded_moe.kernels import gemm as kg
    from padded_moe.layer import FusedMoE

    if len(sys.argv) > 4:
        kg.TUNED[("bf16", "medium")] = kg.GemmConfig.from_short(sys.argv[4])

    preset, _, fmt = sys.argv[2].partition(":")
    layer = FusedMoE.from_preset(preset, weight_format=fmt or "bf16", device="cuda", dtype=torch.bfloat16)
    layer.randomize(seed=0, std=0.02)
    x = torch.randn(int(sys.argv[3]), layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    tw, ids = layer.route(layer.gate(x), None)
    for _ in range(3):
        layer.experts(x, tw, ids)
elif case == "native":  # GEMM STAGE (w13 / w2) of a bf16 preset at TOKENS tokens: Triton, native variants
    from unittest import mock

    from padded_moe.gemm import expert_gemm
    from padded_moe.kernels.native import grouped
    from padded_moe.layer import FusedMoE
    from padded_moe.layouts import build_layout

    layer = FusedMoE.from_preset(sys.argv[2], weight_format="bf16", device="cuda", dtype=torch.bfloat16)
    layer.randomize(seed=0, std=0.02)
    x = torch.randn(int(sys.argv[3]), layer.hidden_size, device="cuda", dtype=torch.bfloat16)
    tw, ids = layer.route(layer.gate(x), None)
    meta = build_layout("grouped_contiguous", ids, layer.num_experts)
    w = dict(zip(("w13", "w2"), layer.expert_weights()))[sys.argv[4]]
    a = torch.randn(ids.numel(), w.shape[2], device="cuda", dtype=torch.bfloat16)
    out = torch.empty(ids.numel(), w.shape[1], device="cuda", dtype=torch.bfloat16)
    expert_gemm(a, w, meta, stage=sys.argv[4], out=out, backend="triton")
    # (configuration, dynamic walk, A's rows evict-last)
    for config, dynamic, rows_last in ((0, False, True), (0, True, True), (3, True, True), (3, True, False),
                                       (3, False, True)):
        with mock.patch.object(grouped, "default_config", lambda *_, c=config: c), \
                mock.patch.object(grouped, "DYNAMIC_WALK", dynamic), \
                mock.patch.object(grouped, "ROWS_EVICT_LAST", rows_last):
            expert_gemm(a, w, meta, stage=sys.argv[4], out=out, backend="cuda")
elif case == "mm":  # a dense [M, K] @ [K, N] bf16 matmul (cuBLAS), 3 calls
    M, N, K = (int(v) for v in sys.argv[2:5])
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
else:  # unpermute of every layout, M=4096, k=8, E=128, K=4096 (bench_permute's shape)
    M, k, E, K = 4096, 8, 128, 4096
    ids = torch.rand(M, E, device="cuda").topk(k, dim=1).indices.to(torch.int32)
    hidden = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    weights = torch.rand(M, k, device="cuda")
    out = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    scratch = PermuteScratch(M, k, E, E, "cuda", max_tokens_per_expert=2 * (M * k // E + 1), hidden_size=K,
                             dtype=torch.bfloat16)
    for layout in (GemmLayout.INDEXED, GemmLayout.GROUPED_CONTIGUOUS):
        meta = build_layout(layout, ids, E, scratch=scratch, drop_overflow=True)
        y = permute(hidden, meta) if layout != GemmLayout.INDEXED else torch.randn(M * k, K, device="cuda",
                                                                                  dtype=torch.bfloat16)
        for _ in range(3):
            unpermute(out, y, weights, meta)
torch.cuda.synchronize()
