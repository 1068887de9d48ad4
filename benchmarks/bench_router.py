"""The routers on a GPU: one Triton kernel against the same formula in torch ops.

For each model's router (`padded_moe.routing`: Mixtral, Qwen3-MoE and GPT-OSS softmax routing,
DeepSeek-V3's sigmoid routing with its group limit, DeepSeek-V4's sqrt-softplus routing, each
with the correction bias where the model has one) and token count, the router logits are bf16
`[tokens, experts]`; both forms are captured in CUDA graphs and timed as replays (device time,
launch cost removed). The torch formula is what the library runs on CPU and where autograd
records, and the same sequence of ops transformers' router modules run.

    python benchmarks/bench_router.py --tokens 1,16,128,1024,8192
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import bench_graph_us, device_line, print_table, write_report  # noqa: E402

from padded_moe import routing  # noqa: E402

# name -> (experts, k, kernel call, formula call); each call takes (logits, bias)
ROUTERS = {
    "mixtral": (8, 2, lambda x, b: routing.fused_topk(x, 2, renormalize=True),
                lambda x, b: routing._topk_formula(x, 2, True, False, torch.float32, torch.int32)),
    "qwen3-moe": (128, 8, lambda x, b: routing.fused_topk(x, 8, renormalize=True),
                  lambda x, b: routing._topk_formula(x, 8, True, False, torch.float32, torch.int32)),
    "gpt-oss": (128, 4, lambda x, b: routing.fused_topk(x, 4, topk_before_softmax=True),
                lambda x, b: routing._topk_formula(x, 4, False, True, torch.float32, torch.int32)),
    "deepseek-v3": (256, 8, lambda x, b: routing.biased_grouped_topk(x, b, 8, 8, 4, "sigmoid", 2.5),
                    lambda x, b: routing._biased_formula(x, b, 8, 8, 4, "sigmoid", 2.5, True)),
    "deepseek-v4": (256, 6, lambda x, b: routing.biased_grouped_topk(x, b, 6, scoring="sqrtsoftplus",
                                                                     routed_scaling_factor=1.5),
                    lambda x, b: routing._biased_formula(x, b, 6, 1, 1, "sqrtsoftplus", 1.5, True)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,16,128,1024,8192")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--out", default="bench-out/router")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_router times CUDA graphs: it needs a GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    with torch.no_grad():
        for name in args.routers.split(","):
            experts, k, kernel, formula = ROUTERS[name]
            bias = torch.randn(experts, device="cuda", generator=gen) * 0.1
            for tokens in (int(t) for t in args.tokens.split(",")):
                logits = (torch.randn(tokens, experts, device="cuda", generator=gen) * 2).to(torch.bfloat16)
                w_k, ids_k = kernel(logits, bias)
                w_f, ids_f = formula(logits, bias)
                # a near-tie within float32 rounding may pick another expert: count the rows that differ
                same = (ids_k.sort(-1).values == ids_f.to(ids_k.dtype).sort(-1).values).all(-1).float().mean().item()
                t_kernel = bench_graph_us(lambda: kernel(logits, bias))
                t_formula = bench_graph_us(lambda: formula(logits, bias))
                rows.append([name, experts, k, tokens, round(t_kernel, 2), round(t_formula, 2),
                             round(t_formula / t_kernel, 2), f"{same:.4f}"])
    headers = ["router", "experts", "k", "tokens", "kernel µs", "torch formula µs", "formula/kernel",
               "rows with the same experts"]
    print(device_line())
    print_table("routers: one kernel vs the torch formula (graph replays, bf16 logits)", headers, rows)
    write_report(args.out, "bench_router", "Routers: one kernel vs the torch formula",
                 "CUDA-graph replays of each form on the same bf16 logits.", headers, rows)


if __name__ == "__main__":
    main()
