"""Our Triton kernels (`padded_moe.kernels.gemm`) behind the backend interface.

Everything is graph-safe: the grid depends only on shapes, bounds are read on the device.
"""

from __future__ import annotations

from typing import Optional

import torch

from padded_moe import _platform
from padded_moe.backends.base import GemmBackend, Weight
from padded_moe.layouts import GemmLayout, GroupedContiguousMeta, GroupedMaskedMeta, IndexedMeta, LayoutMeta
from padded_moe.mxfp4 import Mxfp4Tensor


def rows_per_expert(a: torch.Tensor, meta: LayoutMeta, stage: str) -> float:
    """Host-side estimate of rows per expert (from shapes only) that picks the tuning regime."""
    L = max(meta.num_local, 1)
    if isinstance(meta, GroupedMaskedMeta):
        return float(meta.max_tokens_per_expert)
    return meta.num_tokens * meta.top_k / L


def launch_args(a: torch.Tensor, meta: LayoutMeta, stage: str) -> dict:
    """Layout-specific keyword arguments of `kernels.gemm.launch`."""
    from padded_moe.kernels import gemm as kg

    if isinstance(meta, IndexedMeta):
        return dict(layout=kg.INDEXED, sorted_ids=meta.sorted_ids, block_expert=meta.block_expert,
                    num_padded=meta.num_padded, block_m=meta.block_m,
                    a_div=meta.top_k if stage == "w13" else 1, mk=meta.num_tokens * meta.top_k)
    if isinstance(meta, GroupedContiguousMeta):
        return dict(layout=kg.GROUPED_CONTIGUOUS, offsets=meta.offsets)
    return dict(layout=kg.GROUPED_MASKED, counts=meta.counts, t_max=meta.max_tokens_per_expert)


class TritonBackend(GemmBackend):
    name = "triton"
    quantizes_inputs = False

    def available(self, device: torch.device) -> Optional[str]:
        # use_triton first: on CPU without the interpreter it answers without importing triton
        # (importing triton while TRITON_INTERPRET=0 would fix tl's helpers in compiled mode).
        if device.type != "cuda" and not _platform.interpreter_requested():
            return ("it runs CUDA tensors, or CPU tensors only under Triton's interpreter "
                    "(TRITON_INTERPRET=1 set before padded_moe.kernels is imported)")
        if not _platform.triton_available():
            return "triton is not installed"
        if not _platform.use_triton(device):
            return ("it runs CUDA tensors, or CPU tensors only under Triton's interpreter "
                    "(TRITON_INTERPRET=1 set before padded_moe.kernels is imported)")
        return None

    def supports(self, layout: GemmLayout, weight: Weight) -> bool:
        return True

    def gemm(self, a, w, meta, *, stage, bias, out, config=None):
        from padded_moe.kernels import gemm as kg

        a2 = a.reshape(-1, a.shape[-1])
        out2 = out.view(-1, out.shape[-1])
        wh = None
        if isinstance(w, Mxfp4Tensor):
            # A prepared weight (Mxfp4Tensor.prepare_for) runs the Hopper-layout kernel unless
            # `config` asks for the dot_scaled one (mx_hopper=False).
            wt, ws, wh = w.blocks, w.scales, w.hopper
        else:
            wt, ws = w, None
        kg.launch(a2, wt, ws, out2, num_local=meta.num_local, bias=bias,
                  rows_per_expert=rows_per_expert(a, meta, stage), config=config, w_hopper=wh,
                  **launch_args(a, meta, stage))
        return out
