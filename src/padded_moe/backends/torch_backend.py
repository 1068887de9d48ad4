"""The torch path's expert GEMM (`padded_moe.torch_path.gemm`) behind the backend interface.

Its CUDA fast paths are per layout (`torch._grouped_mm` for GROUPED_CONTIGUOUS, `bmm` for
GROUPED_MASKED); every other call runs the loop over experts, which syncs on CUDA (not
graph-safe): see the torch path's notes.
"""

from __future__ import annotations

from padded_moe.backends.base import GemmBackend, Weight
from padded_moe.layouts import GemmLayout
from padded_moe.mxfp4 import Mxfp4Tensor
from padded_moe.torch_path import gemm as tg


class TorchBackend(GemmBackend):
    name = "torch"

    def supports(self, layout: GemmLayout, weight: Weight) -> bool:
        return True

    def gemm(self, a, w, meta, *, stage, bias, out):
        if meta.layout is GemmLayout.GROUPED_CONTIGUOUS and tg.grouped_mm_ok(a, w, out):
            tg.grouped_mm(a, w, meta, bias, out)
            return out
        if meta.layout is GemmLayout.GROUPED_MASKED and a.is_cuda and not isinstance(w, Mxfp4Tensor):
            tg.masked_bmm(a, w, meta, bias, out)
            return out
        a2 = a.reshape(-1, a.shape[-1])
        out2 = out.view(-1, out.shape[-1])
        tg.loop(a2, w, bias, out2, tg.row_plan(a2.shape[0], meta.num_local, meta.gemm_args(stage), a.device))
        return out
