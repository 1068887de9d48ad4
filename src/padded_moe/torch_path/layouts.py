"""Torch path of the GEMM layouts (the CPU path when Triton's interpreter is off).

Computes exactly the metadata of `padded_moe.kernels.layouts` (same stable order: by local expert,
then by slot id) and writes it into the buffers it is given, so a scratch object works the same on
both paths. Host reads (`int(...)`) are allowed here: this path only serves CPU tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

from padded_moe import layout_codes as codes
from padded_moe.expert_map import sanitize_torch


def _fill_counts_and_rank(se: torch.Tensor, num_local: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert counts (int64 `[L+1]`, last = dropped), stable order, and each slot's sorted position."""
    counts_all = torch.zeros(num_local + 1, dtype=torch.int64)
    counts_all.scatter_add_(0, se.long(), torch.ones_like(se, dtype=torch.int64))
    order = torch.argsort(se, stable=True)  # by expert, ties by increasing slot id
    pos = torch.empty_like(order)
    pos[order] = torch.arange(se.numel())
    return counts_all, order, pos


def build_torch(layout: int, topk_ids: torch.Tensor, num_experts: int, num_local: int,
                emap: Optional[torch.Tensor], valid_tokens: Optional[torch.Tensor], bufs: dict,
                *, block_m: int, t_max: int) -> None:
    """Fill `bufs` (the arena views of `padded_moe.layouts._carve`) for the layout whose code is
    `layout` (`padded_moe.layout_codes`), like the kernels' `LAYOUT` constexpr."""
    M, k = topk_ids.shape
    S, L = M * k, num_local
    se = sanitize_torch(topk_ids, num_experts, L, emap, valid_tokens).reshape(-1)
    bufs["slot_expert"].copy_(se)
    kept = se < L
    counts_all, order, pos = _fill_counts_and_rank(se, L)
    counts = counts_all[:L]
    starts = torch.cumsum(counts_all, 0) - counts_all
    rank = pos - starts[se.long()]
    slots = torch.arange(S, dtype=torch.int64)
    if layout == codes.GROUPED_CONTIGUOUS:
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
        bufs["offsets"].copy_(offsets)
        # Kept slots occupy sorted positions [0, offsets[L]) in exactly the layout's order.
        bufs["inv"].copy_(torch.where(kept, pos, S))
        bufs["src"].copy_(torch.where(slots < offsets[L], order, S))
    elif layout == codes.GROUPED_MASKED:
        clamped = counts.clamp(max=t_max)
        bufs["counts"].copy_(clamped)
        bufs["overflow"].copy_((counts - clamped).sum().reshape(1))
        fits = kept & (rank < t_max)
        bufs["inv"].copy_(torch.where(fits, se.long() * t_max + rank, L * t_max))
    else:
        _fill_indexed(bufs, se, kept, counts, rank, M, k, valid_tokens, block_m)


def _fill_indexed(bufs: dict, se, kept, counts, rank, M: int, k: int,
                  valid_tokens: Optional[torch.Tensor], block_m: int) -> None:
    S = M * k
    L = counts.numel()
    sizes = (counts + block_m - 1) // block_m * block_m
    poff = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
    sorted_ids = bufs["sorted_ids"]
    cap = sorted_ids.numel()
    staged = torch.full((cap + 1,), S, dtype=torch.int64)  # last entry absorbs dropped slots
    target = torch.where(kept, poff[se.long().clamp(max=max(L - 1, 0))] + rank, cap)
    staged[target[kept]] = torch.arange(S, dtype=torch.int64)[kept]
    sorted_ids.copy_(staged[:cap])
    block_start = torch.arange(bufs["block_expert"].numel(), dtype=torch.int64) * block_m
    owner = torch.searchsorted(poff[1:].contiguous(), block_start, right=True)
    bufs["block_expert"].copy_(torch.where(block_start < poff[L], owner, -1))
    bufs["num_padded"].copy_(poff[L:])
    n_tok = M if valid_tokens is None else int(valid_tokens.clamp(0, M)[0])
    bufs["act_count"].fill_(n_tok * k)


def permute_torch(hidden: torch.Tensor, inv: torch.Tensor, k: int, out_rows: torch.Tensor, row_limit: int) -> None:
    """Copy token rows to their kept destinations: `out_rows[inv[s]] = hidden[s // k]` where `inv[s] < row_limit`."""
    kept = inv < row_limit
    slots = torch.arange(inv.numel(), device=inv.device)
    out_rows[inv[kept].long()] = hidden[slots[kept] // k]


def unpermute_torch(out: torch.Tensor, y_rows: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
                    kept: torch.Tensor, valid_tokens: Optional[torch.Tensor]) -> None:
    """`out[t] = Σ_j kept · w[t,j] · y_rows[rows[t,j]]` in fp32 for t < valid_tokens.

    `rows`/`kept` are `[M, k]`. Dropped rows are selected away, never multiplied by zero.
    """
    M, k = rows.shape
    acc = torch.zeros(M, out.shape[1], dtype=torch.float32)
    if y_rows.shape[0] > 0:
        for j in range(k):
            y = y_rows[rows[:, j].long().clamp(0, y_rows.shape[0] - 1)].float()
            term = y * weights[:, j, None].float()
            acc = acc + torch.where(kept[:, j, None], term, torch.zeros((), dtype=torch.float32))
    n_tok = M if valid_tokens is None else int(valid_tokens.clamp(0, M)[0])
    out[:n_tok] = acc[:n_tok].to(out.dtype)
