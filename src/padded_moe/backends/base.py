"""The interface every expert-GEMM backend implements.

`padded_moe.gemm.expert_gemm` validates its arguments, allocates `out`, then hands the call to
one backend. A backend therefore receives checked inputs: `a` (2-D, or 3-D for GROUPED_MASKED),
`w` `[L, Nout, K]` (float tensor or Mxfp4Tensor), the layout metadata, `stage`, `bias [L, Nout]`
or None, and a preallocated `out` it must fill only at valid rows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Union

import torch

from padded_moe.layouts import GemmLayout, LayoutMeta
from padded_moe.mxfp4 import Mxfp4Tensor

Weight = Union[torch.Tensor, Mxfp4Tensor]


class GemmBackend(ABC):
    name: str = "?"
    # Backend interface flag read by expert parallelism: a backend that quantizes its activations
    # itself would quantize fp8-dispatched rows twice, so `ExpertParallel` refuses fp8 dispatch in
    # batched mode for it (`distributed._backend_quantizes_inputs`). No backend here does; the flag
    # stays on the interface for backends added later (and the refusal is tested with one that
    # sets it).
    quantizes_inputs: bool = False
    # Whether `gemm_activation` applies the library's activation (`MoEActivation`) in GEMM1's
    # epilogue. The pipeline (`fused_experts`) uses it where offered (`fuses`); other backends run
    # GEMM1, then the activation op.
    fuses_activation: bool = False

    def available(self, device: torch.device) -> Optional[str]:
        """None when usable on `device`; otherwise the reason it is not."""
        return None

    @abstractmethod
    def supports(self, layout: GemmLayout, weight: Weight) -> bool:
        """Whether this backend computes `layout` with this weight format. A backend reads the
        metadata through what every layout exposes (`meta.code`, `meta.gemm_args(stage)`, the
        layout's `GemmLayout`), so a backend that does not know a layout answers False here."""

    @abstractmethod
    def gemm(self, a: torch.Tensor, w: Weight, meta: LayoutMeta, *, stage: str,
             bias: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Fill `out` at the layout's valid rows; leave every other row untouched."""

    def gathers(self, layout: GemmLayout, weight: Weight) -> bool:
        """Whether GEMM1 on `layout` with `weight` reads each row from its token itself: `gemm` /
        `gemm_activation` then take `gather=True` with `a` the token rows `[num_tokens, K]`, and
        the pipeline skips the permuted copy. False here."""
        return False

    def fuses(self, activation, weight: Optional[Weight] = None) -> bool:
        """Whether `gemm_activation` takes `activation` (a `MoEActivation`) with `weight` (None:
        any weight the backend supports); callers run GEMM1 and the activation op for the others.
        Every activation, on a backend with `fuses_activation`."""
        return self.fuses_activation

    def gemm_activation(self, a: torch.Tensor, w: Weight, meta: LayoutMeta, *, bias: Optional[torch.Tensor],
                        out: torch.Tensor, epilogue) -> torch.Tensor:
        """GEMM1 with `epilogue` (an `ActivationEpilogue`) applied before the store: `out` has the
        activation's width and is filled at the valid rows only, with the values GEMM1 then the
        activation op would give. Only backends with `fuses_activation`."""
        raise NotImplementedError(f"backend {self.name!r} does not apply the activation in GEMM1's epilogue")

    def epilogue_pays(self, a: torch.Tensor, w: Weight, meta: LayoutMeta, activation) -> bool:
        """Whether the epilogue with `activation` (a `MoEActivation`) is measured faster than the two
        steps for this GEMM1 (what `fused_experts` asks by default); only backends with
        `fuses_activation`."""
        return self.fuses_activation
