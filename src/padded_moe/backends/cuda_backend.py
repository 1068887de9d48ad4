"""Our native CUDA grouped GEMM (`padded_moe.kernels.native.grouped`) behind the backend interface.

It runs bf16 weights, MXFP4 weights in their prepared form (`grouped.takes_rs`: the RS kernel,
whose consumer warpgroups upcast into wgmma's register operand) and other MXFP4 weights that hold
their canonical bytes (upcast to bf16 in shared memory by the producer warps), on the grouped
layouts (GROUPED_CONTIGUOUS, GROUPED_MASKED) on sm_90 GPUs: a CTA takes a tile of (expert,
256-row chunk, 128 weight rows), streams the weight tile once, and four tensor-core warpgroups of
64 rows each skip the rows past the expert's count (or, from the rows per expert where
`grouped.default_config` picks them, tiles of (expert, 128-row chunk, 256 weight rows) over two
warpgroups).
It applies the silu family of `MoEActivation` (silu, swigluoai, swigluoai_uninterleave) in
GEMM1's epilogue; for the RS kernel's weights while `grouped.RS_EPILOGUE` is on, with gate / up
halves (not interleaved) only while `grouped.RS_EPILOGUE_SPLIT` is too (`fuses`; `fused_experts`
uses it unless `PADDED_MOE_FUSE_ACTIVATION=0`); the other activations run as GEMM1 then the
activation op.
GEMM1 on GROUPED_CONTIGUOUS can read its rows from the tokens instead of the permuted copy
(`gathers`: `grouped.RS_GATHER`, `grouped.GATHER_BF16`), off: measured slower.
INDEXED (rows gathered through `sorted_ids`) and MXFP4 weights that neither the RS kernel nor the
producer warps take are not offered (`supports` says False, and `backend="cuda"` on them is a
NotImplementedError).

`resolve_backend("auto", ...)` never returns it; `fused_experts` picks it for "auto" only where
`backends.auto_native` says so (the expert shapes and rows per expert where it measured faster on
whole calls, docs/benchmarks.md). It is chosen by name or by `PADDED_MOE_GEMM_BACKEND=cuda`.

Graph-safe: the grid is bounded from shapes and the rows are read on the device.
"""

from __future__ import annotations

from typing import Optional

import torch

from padded_moe.backends.base import GemmBackend, Weight
from padded_moe.layouts import GemmLayout
from padded_moe.mxfp4 import Mxfp4Tensor

_LAYOUTS = (GemmLayout.GROUPED_CONTIGUOUS, GemmLayout.GROUPED_MASKED)


class CudaBackend(GemmBackend):
    name = "cuda"
    fuses_activation = True

    def fuses(self, activation, weight=None) -> bool:
        from padded_moe.kernels.native.grouped import EPILOGUE_ACTIVATIONS, rs_fuses, takes_rs

        # The RS kernel (prepared MXFP4): the activations its epilogue switches allow (`rs_fuses`).
        return rs_fuses(activation) if takes_rs(weight) else activation.value in EPILOGUE_ACTIVATIONS

    def available(self, device: torch.device) -> Optional[str]:
        from padded_moe.kernels import native

        why = native.unsupported_device(device)
        return why if why is not None else native.GROUPED.failure()

    def supports(self, layout: GemmLayout, weight: Weight) -> bool:
        if layout not in _LAYOUTS:
            return False
        if isinstance(weight, Mxfp4Tensor):
            from padded_moe.kernels.native.grouped import takes_rs

            return weight.holds_canonical or takes_rs(weight)
        return isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16

    def gathers(self, layout, weight) -> bool:
        from padded_moe.kernels.native import grouped

        # The producer warpgroup copies each row from its token: in the RS kernel (`grouped.RS_GATHER`) or
        # with bf16 weights (`grouped.GATHER_BF16`).
        if layout is not GemmLayout.GROUPED_CONTIGUOUS:
            return False
        if isinstance(weight, Mxfp4Tensor):
            return grouped.RS_GATHER and grouped.takes_rs(weight)
        return grouped.GATHER_BF16 and isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16

    def gemm(self, a, w, meta, *, stage, bias, out, epilogue=None, gather=False):
        from padded_moe.kernels.native import grouped

        if meta.layout is GemmLayout.GROUPED_CONTIGUOUS:
            rows = dict(gather_src=meta.src, top_k=meta.top_k) if gather else {}
            grouped.launch(a, w, out, offsets=meta.offsets, bias=bias, epilogue=epilogue, **rows)
        else:
            grouped.launch(a, w, out, counts=meta.counts, bias=bias, epilogue=epilogue)
        return out

    def gemm_activation(self, a, w, meta, *, bias, out, epilogue, gather=False):
        return self.gemm(a, w, meta, stage="w13", bias=bias, out=out, epilogue=epilogue, gather=gather)
