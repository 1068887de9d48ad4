"""The `humming-kernels` package (0.1.19, optional extra `padded-moe[humming]`) as a GEMM backend.

Mapping (humming 0.1.19 `compute_config={"gemm_type": ...}`):
`gemm_type` is the layout's `GemmLayout.value`; the arguments per layout:
- INDEXED -> "indexed": `sorted_ids`, `expert_ids = block_expert`, `num_tokens_padded = num_padded`,
  `top_k = k` for GEMM1 (A row = id // k) and 1 for GEMM2. Humming does not check that
  `sorted_ids` was padded with its kernel's BLOCK_M; we pin the tuning to the one heuristic config
  for this problem size and raise if its `block_shape[0]` differs from `layout_meta.block_m`.
- GROUPED_CONTIGUOUS -> "grouped_contiguous" with `expert_layout = offsets` (`[L+1]`).
- GROUPED_MASKED -> "grouped_masked" with `expert_layout = counts` (clamped to T_max on device),
  A flattened to `[L*T_max, K]`.

Only MXFP4 weights with bf16/fp16 activations (weight-only: no input quantization). Each weight is converted once into a transformed `HummingLayer`, cached
by the weight's storage. The first call per kernel configuration JIT-compiles it (about 20 s each on an H200 machine);
set `HUMMING_CACHE_DIR` to a persistent directory to keep the cubins across processes.
Verified only on a GPU (tests/test_gemm_gpu.py); nothing here runs on CPU.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from padded_moe.backends.base import GemmBackend, Weight
from padded_moe.layouts import GemmLayout, IndexedMeta
from padded_moe.mxfp4 import Mxfp4Tensor

# vLLM's padding choice for humming weights; the kernels take unpadded A and return unpadded C.
PAD_N, PAD_K = 256, 128


class HummingBackend(GemmBackend):
    name = "humming"

    def __init__(self):
        self._layers: dict[tuple, object] = {}

    def available(self, device: torch.device) -> Optional[str]:
        if device.type != "cuda":
            return "humming-kernels runs CUDA tensors only"
        if importlib.util.find_spec("humming") is None:
            return "humming-kernels is not installed (pip install 'padded-moe[humming]')"
        return None

    def supports(self, layout: GemmLayout, weight: Weight) -> bool:
        # humming converts the canonical bytes into its own layout: not those of a weight that holds
        # only our prepared form.
        return layout in _LAYOUT_ARGS and isinstance(weight, Mxfp4Tensor) and weight.holds_canonical

    def _layer(self, w: Mxfp4Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
        key = (w.blocks.data_ptr(), w.scales.data_ptr(), tuple(w.shape),
               None if bias is None else bias.data_ptr(), dtype, w.device)
        layer = self._layers.get(key)
        if layer is None:
            from humming.layer import HummingLayer

            L, N, K = w.shape
            with torch.cuda.device(w.device):
                layer = HummingLayer(shape_n=N, shape_k=K, weight_config={"quant_method": "mxfp4"},
                                     pad_n_to_multiple=PAD_N, pad_k_to_multiple=PAD_K, num_experts=L,
                                     has_bias=bias is not None, torch_dtype=dtype)
                tensors = {"weight": w.blocks, "weight_scale": w.scales}
                if bias is not None:
                    tensors["bias"] = bias.to(dtype)
                layer.load_from_tensors(tensors)
                layer = layer.to(w.device)
                layer.transform()
            self._layers[key] = layer
        return layer

    @staticmethod
    def _indexed_bucket(layer, valid_m: int) -> dict:
        """Humming's one heuristic indexed configuration for `valid_m` routed rows."""
        from humming.tune import get_heuristics_config

        table = get_heuristics_config(layer.humming_config, gemm_type="indexed", device=layer.locks.device)
        for lo, hi, cfg in table:
            if lo < valid_m <= hi:
                return cfg
        raise ValueError(f"humming has no indexed tuning bucket for {valid_m} rows")

    def indexed_block_m(self, w: Mxfp4Tensor, valid_m: int, *, bias: Optional[torch.Tensor] = None,
                        dtype: torch.dtype = torch.bfloat16) -> int:
        """BLOCK_M of humming's indexed kernel for `valid_m` routed rows (`M * top_k`): INDEXED
        layouts for this backend must be built with `block_m` equal to it."""
        return int(self._indexed_bucket(self._layer(w, bias, dtype), valid_m)["block_shape"][0])

    @classmethod
    def _pinned_indexed_config(cls, layer, meta: IndexedMeta, valid_m: int):
        cfg = cls._indexed_bucket(layer, valid_m)
        bm = cfg["block_shape"][0]
        if bm != meta.block_m:
            raise ValueError(
                f"humming's indexed kernel for {valid_m} rows uses BLOCK_M={bm}; build the "
                f"layout with block_m={bm} (layout_meta.block_m is {meta.block_m})"
            )
        return cfg

    def gemm(self, a, w, meta, *, stage, bias, out):
        if out.dtype != a.dtype or a.dtype not in (torch.bfloat16, torch.float16):
            raise NotImplementedError(
                f"backend 'humming' needs bf16/fp16 activations and out of the same dtype, got a "
                f"{a.dtype}, out {out.dtype}"
            )
        layer = self._layer(w, bias, a.dtype)
        a2, out2, kwargs = _LAYOUT_ARGS[meta.layout](self, layer, a, out, meta, stage)
        layer(a2, outputs=out2, compute_config={"gemm_type": meta.layout.value}, **kwargs)
        return out


def _indexed_args(backend: HummingBackend, layer, a, out, meta, stage):
    valid_m = meta.num_tokens * meta.top_k
    return a, out, dict(sorted_ids=meta.sorted_ids, expert_ids=meta.block_expert,
                        num_tokens_padded=meta.num_padded, top_k=meta.top_k if stage == "w13" else 1,
                        valid_shape_m=valid_m, tuning_config=backend._pinned_indexed_config(layer, meta, valid_m))


def _contiguous_args(backend: HummingBackend, layer, a, out, meta, stage):
    return a, out, dict(expert_layout=meta.offsets, valid_shape_m=a.shape[0])


def _masked_args(backend: HummingBackend, layer, a, out, meta, stage):
    a2 = a.reshape(-1, a.shape[-1])
    return a2, out.view(-1, out.shape[-1]), dict(expert_layout=meta.counts.clamp(0, meta.max_tokens_per_expert),
                                                 valid_shape_m=a2.shape[0])


# Humming's arguments for each layout it implements (`gemm_type` = the layout's value).
_LAYOUT_ARGS = {GemmLayout.INDEXED: _indexed_args, GemmLayout.GROUPED_CONTIGUOUS: _contiguous_args,
                GemmLayout.GROUPED_MASKED: _masked_args}
