"""Our Triton kernels (`padded_moe.kernels.gemm`) behind the backend interface.

Everything is graph-safe: the grid depends only on shapes, bounds are read on the device.
"""

from __future__ import annotations

from typing import Optional

import torch

from padded_moe import _platform
from padded_moe.backends.base import GemmBackend, Weight
from padded_moe.layouts import GemmLayout
from padded_moe.mxfp4 import Mxfp4Tensor


class TritonBackend(GemmBackend):
    name = "triton"
    fuses_activation = True

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

    def epilogue_pays(self, a, w, meta, activation) -> bool:
        from padded_moe.kernels import gemm as kg

        args = meta.gemm_args("w13")
        mx = isinstance(w, Mxfp4Tensor)
        cfg = kg.default_config(a.is_cuda, mx, w.hopper if mx else None, args["layout"], args["block_m"],
                                args["rows_per_expert"], args["t_max"])
        tile_m = kg.indexed_tiling(args["block_m"], cfg.BM)[0] if args["layout"] == kg.codes.INDEXED else cfg.BM
        read = "pointer" if mx else kg.weight_read(cfg, a.reshape(-1, a.shape[-1]), w, activation.is_gated,
                                                   activation.interleaved)
        return kg.epilogue_pays(cfg, tile_m, activation.interleaved, read)

    def gemm_activation(self, a, w, meta, *, bias, out, epilogue, config=None):
        return self.gemm(a, w, meta, stage="w13", bias=bias, out=out, config=config, epilogue=epilogue)

    def gemm(self, a, w, meta, *, stage, bias, out, config=None, epilogue=None):
        from padded_moe.kernels import gemm as kg

        a2 = a.reshape(-1, a.shape[-1])
        out2 = out.view(-1, out.shape[-1])
        wh = None
        if isinstance(w, Mxfp4Tensor):
            # A prepared weight (Mxfp4Tensor.prepare_for) runs the Hopper-layout kernel unless
            # `config` asks for the dot_scaled one (mx_hopper=False), which reads the canonical bytes.
            wh = w.hopper
            wt, ws = (w.blocks, w.scales) if w.blocks is not None else (None, wh.scales)
        else:
            wt, ws = w, None
        kg.launch(a2, wt, ws, out2, num_local=meta.num_local, bias=bias, config=config, w_hopper=wh,
                  epilogue=epilogue, **meta.gemm_args(stage))
        return out
