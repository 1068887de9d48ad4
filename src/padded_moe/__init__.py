"""padded-moe: MoE expert computation over padded layouts without paying for the padding.

Public names are re-exported lazily from their stage modules so that importing the package
stays cheap (no Triton import until a kernel is needed).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "MoEActivation": "activation",
    "ApplyMoEActivationConfig": "activation",
    "apply_moe_activation": "activation",
    "masked_activation_supported": "activation",
    "activation_supported": "activation",
    "softmax_topk": "routing",
    "biased_grouped_topk": "routing",
    "hash_topk": "routing",
    "ExpertMap": "expert_map",
    "sanitize_topk_ids": "expert_map",
    "GemmLayout": "layouts",
    "build_layout": "layouts",
    "permute": "layouts",
    "unpermute": "layouts",
    "PermuteScratch": "layouts",
    "select_gemm_layout": "layouts",
    "expert_gemm": "gemm",
    "Mxfp4Tensor": "mxfp4",
    "Mxfp4NotPreparedWarning": "mxfp4",
    "quantize_mxfp4": "mxfp4",
    "dequantize_mxfp4": "mxfp4",
    "fused_experts": "experts",
    "batched_experts": "experts",
    "FusedMoE": "layer",
    "ExpertParallel": "distributed",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'padded_moe' has no attribute {name!r}")
    return getattr(importlib.import_module(f"padded_moe.{module}"), name)
