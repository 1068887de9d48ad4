"""Expert GEMMs in plain torch: a correct loop over experts (the CPU path) and CUDA fast paths.

Every layout is first reduced to the same row description (device tensors, no sync) from the
arguments the Triton kernel takes (`layout_meta.gemm_args(stage)`), branching on the layout code
as the kernel's `_tile_rows` does: `a_rows` (which row of `a` a work row reads), `c_rows` (which
row of `out` it writes), `row_expert` and `valid`. The loop then selects each expert's valid rows.

CUDA notes:
- GROUPED_CONTIGUOUS with bf16 weights uses `torch._grouped_mm` (sm90+, shape/alignment checks
  below, all decided from host-known shapes/pointers), then a device-side `where` keeps rows past
  `offsets[L]` untouched. Graph-safe.
- GROUPED_MASKED uses one `bmm` over the full slabs plus a device-side `where` on counts: graph-safe
  but its cost is the full slab, not the valid rows.
- Everything else (INDEXED, MXFP4, fp16/fp32 grouped) runs the loop, which selects rows with
  `nonzero` — a host sync on CUDA, so that path is NOT CUDA-graph safe. Use the triton backend there.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from padded_moe import layout_codes as codes
from padded_moe._platform import capability
from padded_moe.mxfp4 import Mxfp4Tensor, dequantize_mxfp4

Weight = Union[torch.Tensor, Mxfp4Tensor]


def row_plan(num_rows: int, num_local: int, args: dict, device: torch.device):
    """(a_rows, c_rows, row_expert, valid) for a flattened `a` of `num_rows` rows; `args` is
    `layout_meta.gemm_args(stage)`."""
    L, layout = num_local, args["layout"]
    if layout == codes.INDEXED:
        ids = args["sorted_ids"].long()
        pos = torch.arange(ids.numel(), device=device)
        e = args["block_expert"].long()[pos // args["block_m"]]
        mk = args["mk"]
        valid = (pos < args["num_padded"].long()) & (ids >= 0) & (ids < mk) & (e >= 0) & (e < L)
        ids = torch.where(valid, ids, torch.zeros_like(ids))
        return ids // args["a_div"], ids, e.clamp(0, max(L - 1, 0)), valid
    if layout == codes.GROUPED_CONTIGUOUS:
        pos = torch.arange(num_rows, device=device)
        off = args["offsets"].long().clamp(0, num_rows)
        e = torch.searchsorted(off[1:].contiguous(), pos, right=True)
        valid = (pos >= off[0]) & (pos < off[L]) & (e < L)
        return pos, pos, e.clamp(0, max(L - 1, 0)), valid
    if layout == codes.GROUPED_MASKED:
        T = args["t_max"]
        pos = torch.arange(L * T, device=device)
        e = pos // T
        valid = (pos % T) < args["counts"].long().clamp(0, T)[e]
        return pos, pos, e, valid
    raise NotImplementedError(f"the torch GEMM path has no rows for layout code {layout}")


def _expert_weight(w: Weight, e: int) -> torch.Tensor:
    if isinstance(w, Mxfp4Tensor):
        return dequantize_mxfp4(w[e], torch.float32)[0]
    return w[e].float()


def loop(a2: torch.Tensor, w: Weight, bias: Optional[torch.Tensor], out2: torch.Tensor, plan) -> None:
    """Per expert: its valid rows of `a2` times its weight (fp32), written to `out2`'s rows."""
    a_rows, c_rows, row_expert, valid = plan
    for e in range(w.shape[0]):
        sel = (valid & (row_expert == e)).nonzero().squeeze(1)  # host sync on CUDA (documented)
        if sel.numel() == 0:
            continue
        y = a2[a_rows[sel]].float() @ _expert_weight(w, e).T
        if bias is not None:
            y = y + bias[e].float()
        out2[c_rows[sel]] = y.to(out2.dtype)


def grouped_mm_ok(a: torch.Tensor, w: Weight, out: torch.Tensor) -> bool:
    """torch._grouped_mm's fast-path constraints, all from host-known facts (no sync)."""
    if not (a.is_cuda and hasattr(torch, "_grouped_mm")) or isinstance(w, Mxfp4Tensor):
        return False
    if a.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
        return False
    if capability(a.device.index)[0] < 9:
        return False
    L, N, K = w.shape
    aligned = all(t.data_ptr() % 16 == 0 for t in (a, w))
    strides16 = a.stride(0) * 2 % 16 == 0 and w.stride(1) * 2 % 16 == 0 and w.stride(0) * 2 % 16 == 0
    return 0 < L < 1024 and K % 8 == 0 and N % 8 == 0 and aligned and strides16 and a.stride(1) == 1


def grouped_mm(a, w, meta, bias, out) -> None:
    """GROUPED_CONTIGUOUS through `torch._grouped_mm`; rows outside `[offsets[0], offsets[L])` keep `out`."""
    R = a.shape[0]
    off = meta.offsets.clamp(0, R)
    y = torch._grouped_mm(a, w.transpose(-2, -1), offs=off[1:].to(torch.int32))
    pos = torch.arange(R, device=a.device)
    if bias is not None:
        # Rows keep their expert's bias; grouped_mm already rounded to bf16, so this is a second rounding.
        e = torch.searchsorted(off[1:].contiguous(), pos, right=True).clamp(max=meta.num_local - 1)
        y = (y.float() + bias.float()[e]).to(out.dtype)
    keep = ((pos >= off[0]) & (pos < off[meta.num_local])).unsqueeze(1)
    out.copy_(torch.where(keep, y, out))


def masked_bmm(a, w, meta, bias, out) -> None:
    """GROUPED_MASKED as one `bmm` over the full slabs; rows at/after each count keep `out`."""
    y = torch.bmm(a, w.transpose(-2, -1).to(a.dtype))
    if bias is not None:
        y = (y.float() + bias.float()[:, None, :]).to(out.dtype)
    T = meta.max_tokens_per_expert
    keep = torch.arange(T, device=a.device)[None, :] < meta.counts.long().clamp(0, T)[:, None]
    out.copy_(torch.where(keep.unsqueeze(-1), y.to(out.dtype), out))
