"""Expert GEMMs for the three GEMM layouts (`GemmLayout`): `expert_gemm`.

Per expert `e`, valid rows compute `a_row @ w[e].T (+ bias[e])`, accumulated in fp32 and rounded
once to `out`'s dtype:

- INDEXED: `a` is `[M, K]` for stage "w13" (rows gathered as `sorted_ids // k`) or `[M*k, N]` for
  "w2" (rows `sorted_ids`); `out` is `[M*k, Nout]` in slot order. Blocks with `block_expert` -1 or
  at/after `num_padded`, and sentinel ids, do nothing; dropped slots' rows are not written.
- GROUPED_CONTIGUOUS: `a` is `[R, K]` (R >= M*k, normally M*k), expert `e` owns rows
  `[offsets[e], offsets[e+1])`; `out` is `[R', Nout]` (R' >= M*k; default R), rows `>= offsets[L]`
  untouched.
- GROUPED_MASKED: `a` is `[L, T_max, K]`; rows `t < counts[e]` only; `out` is `[L, T_max, Nout]`.

`gather=True` (stage "w13", GROUPED_CONTIGUOUS): `a` is the token rows `[M, K]` and each row of the
layout is read from its token (`layout_meta.src[row] // k`) as the GEMM loads it, so no permuted
copy is made; `out` as without it. Only backends whose `gathers` says so take it (the CUDA backend
while `grouped.RS_GATHER` / `GATHER_BF16` are on: both off, measured slower than the permuted copy);
`fused_experts` uses it where offered.

`out=None` allocates with `torch.empty`, so rows the layout does not cover hold garbage; pass a
buffer when they must keep a value.

`activation=` (stage "w13" only): a `MoEActivation` applied to GEMM1's rows before they are
stored, so `out` has the activation's width (`Nout/2` gated, `Nout` otherwise) and no `[rows, Nout]`
buffer is written. The values equal GEMM1 into a buffer of `a`'s dtype followed by
`apply_moe_activation` on the valid rows: the epilogue rounds to `a`'s dtype before the
activation as that buffer would. The Triton backend computes it in GEMM1's epilogue; other backends
run the two steps (allocating the intermediate). `fused_experts` uses the epilogue on the Triton
backend where it is measured faster (`GemmBackend.epilogue_pays`), or as the environment variable
`PADDED_MOE_FUSE_ACTIVATION` says (`fuse_activation_mode`).
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from padded_moe._validation import (FLOAT_DTYPES, INDEX_DTYPES, require_bool, require_dtype,
                                    require_last_dim_contiguous, require_rank,
                                    require_same_device, require_shape, require_tensor)
from padded_moe.activation import ActivationEpilogue, ApplyMoEActivationConfig, MoEActivation, apply_moe_activation
from padded_moe.backends import resolve_backend
from padded_moe.layouts import GemmLayout, LayoutMeta, LayoutMetaBase
from padded_moe.mxfp4 import Mxfp4Tensor

STAGES = ("w13", "w2")
# Whether `fused_experts` applies the activation in GEMM1's epilogue: "auto" (or unset) where
# the backend measures it faster, "1" always (backends that offer it), "0" never (GEMM1, then the
# activation op). The two give equal results; the variable is for comparing them.
FUSE_ENV = "PADDED_MOE_FUSE_ACTIVATION"
_FUSE_MODES = {"": "auto", "auto": "auto", "1": "on", "0": "off"}


def fuse_activation_mode() -> str:
    """"auto", "on" or "off", from `PADDED_MOE_FUSE_ACTIVATION` (read at every call)."""
    value = os.environ.get(FUSE_ENV, "").strip().lower()
    if value not in _FUSE_MODES:
        raise ValueError(f"{FUSE_ENV} must be one of auto, 1, 0 (or unset), got {value!r}")
    return _FUSE_MODES[value]


def _check_meta(meta, device: torch.device) -> None:
    if not isinstance(meta, LayoutMetaBase):
        raise TypeError(
            "layout_meta must be an IndexedMeta, GroupedContiguousMeta or GroupedMaskedMeta "
            f"(from padded_moe.layouts.build_layout), got {type(meta).__name__}"
        )
    meta.check_gemm_fields()
    for f in meta.GEMM_FIELDS:
        t = require_tensor(f"layout_meta.{f}", getattr(meta, f))
        require_dtype(f"layout_meta.{f}", t, INDEX_DTYPES)
        if t.device != device:
            raise ValueError(f"layout_meta.{f} must be on a's device {device}, got {t.device}")
        if t.dim() == 1 and t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(f"layout_meta.{f} must be contiguous")


def check_bias(bias: Optional[torch.Tensor], a: torch.Tensor, num_local: int, n_out: int, *,
               name: str = "bias", a_name: str = "a") -> None:
    """An expert bias `[L, Nout]` (or None) for a GEMM on `a` (`name`, `a_name`: the arguments as
    the caller knows them, for the messages)."""
    if bias is None:
        return
    require_tensor(name, bias)
    require_dtype(name, bias, FLOAT_DTYPES)
    require_shape(name, bias, (num_local, n_out))
    require_same_device(name, bias, a_name, a)
    require_last_dim_contiguous(name, bias)


def check_weight_storage(w, a: torch.Tensor, *, name: str = "w", a_name: str = "a") -> None:
    """An expert weight's storage against the activations `a` it multiplies: an `Mxfp4Tensor` on
    `a`'s device, or a float tensor on it in `a`'s dtype with a contiguous last dimension
    (`name`, `a_name`: the arguments as the caller knows them, for the messages)."""
    if isinstance(w, Mxfp4Tensor):
        if w.device != a.device:
            raise ValueError(f"{name} must be on {a_name}'s device {a.device}, got {w.device}")
        return
    require_tensor(name, w)
    require_dtype(name, w, FLOAT_DTYPES)
    require_same_device(name, w, a_name, a)
    require_last_dim_contiguous(name, w)
    if w.dtype != a.dtype:
        raise TypeError(f"{name} must have {a_name}'s dtype {a.dtype} (or be an Mxfp4Tensor), got {w.dtype}")


def check_weight(w, a: torch.Tensor, num_local: int) -> tuple[int, int]:
    """Returns (Nout, K) after checking `w` against `a` and the metadata."""
    check_weight_storage(w, a)
    if not isinstance(w, Mxfp4Tensor):
        require_rank("w", w, (3,))
    L, n_out, k = w.shape
    if L != num_local:
        raise ValueError(f"w must have layout_meta.num_local = {num_local} experts in dim 0, got {L}")
    if k != a.shape[-1]:
        raise ValueError(f"w's last dimension (K) must equal a's last dimension {a.shape[-1]}, got {k}")
    return n_out, k


def expert_gemm(a: torch.Tensor, w: Union[torch.Tensor, Mxfp4Tensor], layout_meta: LayoutMeta, *,
                stage: str = "w13", bias: Optional[torch.Tensor] = None,
                out: Optional[torch.Tensor] = None, backend: str = "auto",
                activation: Union[None, str, MoEActivation] = None,
                activation_config: Optional[ApplyMoEActivationConfig] = None, gather: bool = False) -> torch.Tensor:
    """One expert GEMM over `layout_meta`'s layout; returns `out` (see the module docstring)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    require_bool("gather", gather)
    epilogue = None
    if activation is not None:
        if stage != "w13":
            raise ValueError(f"activation applies to stage 'w13' (GEMM1's epilogue), got stage {stage!r}")
        epilogue = ActivationEpilogue.of(activation, activation_config)
    elif activation_config is not None:
        raise ValueError("activation_config needs activation")
    require_tensor("a", a)
    require_dtype("a", a, FLOAT_DTYPES)
    require_last_dim_contiguous("a", a)
    _check_meta(layout_meta, a.device)
    n_out, _ = check_weight(w, a, layout_meta.num_local)
    check_bias(bias, a, layout_meta.num_local, n_out)
    width = n_out
    if epilogue is not None and epilogue.activation.is_gated:
        if n_out % 2:
            raise ValueError(f"w's rows must be even (gate and up) for gated {epilogue.activation.value}, "
                             f"got {n_out}")
        width = n_out // 2
    out_shape = _gather_out_shape(a, layout_meta, stage, width) if gather \
        else layout_meta.gemm_out_shape(a, stage, width)
    if out is None:
        out = torch.empty(out_shape, dtype=a.dtype, device=a.device)
    else:
        _check_out(out, out_shape, a, layout_meta)
    impl = resolve_backend(backend, a.device, layout_meta.layout, w)
    rows_from = {}
    if gather:
        if not impl.gathers(layout_meta.layout, w):
            raise NotImplementedError(f"backend {impl.name!r} does not read GEMM1's rows from their tokens with "
                                      f"these weights (GemmBackend.gathers); permute the rows and pass gather=False")
        rows_from = {"gather": True}
    out_rows = out
    if layout_meta.CAPACITY_ROWS and out.shape[0] != a.shape[0] and not gather:
        # Capacity buffers of different sizes: every valid row is < M*k <= both.
        rows = min(a.shape[0], out.shape[0])
        a, out_rows = a[:rows], out[:rows]
    if epilogue is None:
        impl.gemm(a, w, layout_meta, stage=stage, bias=bias, out=out_rows, **rows_from)
    elif impl.fuses(epilogue.activation, w):
        impl.gemm_activation(a, w, layout_meta, bias=bias, out=out_rows, epilogue=epilogue, **rows_from)
    else:  # GEMM1 into an intermediate, then the activation op on the layout's valid rows
        h = torch.empty(out_rows.shape[:-1] + (n_out,), dtype=a.dtype, device=a.device)
        impl.gemm(a, w, layout_meta, stage=stage, bias=bias, out=h, **rows_from)
        apply_moe_activation(epilogue.activation, out_rows, h, activation_config=activation_config,
                             valid_token_counts=layout_meta.activation_counts)
    return out


def _gather_out_shape(a: torch.Tensor, meta: LayoutMeta, stage: str, width: int) -> tuple[int, int]:
    """`out`'s shape when GEMM1 reads its rows from the tokens (`gather`): the layout's M*k rows."""
    if stage != "w13":
        raise ValueError(f"gather reads GEMM1's rows (stage 'w13'), got stage {stage!r}")
    if meta.layout is not GemmLayout.GROUPED_CONTIGUOUS:
        raise ValueError(f"gather reads the token rows of a grouped_contiguous layout (indexed GEMM1 reads them "
                         f"always), got {meta.layout.value}")
    require_rank("a", a, (2,))
    if a.shape[0] != meta.num_tokens:
        raise ValueError(f"a must be the token rows [M = {meta.num_tokens}, K] when gathering, got {tuple(a.shape)}")
    return (meta.num_slots, width)


def _check_out(out, out_shape: tuple[int, ...], a: torch.Tensor, meta: LayoutMeta) -> None:
    require_tensor("out", out)
    require_dtype("out", out, FLOAT_DTYPES)
    require_same_device("out", out, "a", a)
    if meta.CAPACITY_ROWS:
        # Any capacity >= M*k rows (the scratch buffers may be larger than this call's a).
        mk = meta.num_tokens * meta.top_k
        if out.dim() != 2 or out.shape[0] < mk or out.shape[1] != out_shape[1]:
            raise ValueError(f"out must be [R, {out_shape[1]}] with R >= M*k = {mk}, got {tuple(out.shape)}")
    else:
        require_shape("out", out, out_shape)
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {tuple(out.stride())}")
