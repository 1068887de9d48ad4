"""Launch shapes of the expert-parallel kernels on CUDA (the H200 table) and the K tiling.

Benchmarks override entries of `EP_TILES` and the module constants in place (`bench_ep.py --tile`,
`--free-sms`, `--overlap-min-tokens`): the launchers read them from this module at every call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from padded_moe._platform import num_sms


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class EPTile:
    """Launch shape of one EP kernel on CUDA: rows per program, warps, and the programs per SM the
    K split aims for (more programs put more bytes in flight when T is small); for the kernels
    that overlap a collective, the most programs per SM the grid may have."""
    rows: int
    num_warps: int = 4
    per_sm: int = 4


# Per stage, for the H200 (benchmarks/bench_ep_kernels.py sweeps alternatives on one GPU;
# `bench_ep.py --tile STAGE=R,W,S --profile` times one in the two-GPU run).
# combine_batched: 4 rows and 8 programs per SM took 31.7 µs at T=1024 in the sweep, where the
# 8-row tile had taken 50.9 µs in the profile of bench_ep. reduce: 4 rows, 8 per SM 6.2 µs vs
# 7.3-7.6 for 8 rows / 4 per SM (bench_ep --profile, T=1024); in the same probe no other candidate
# beat the table (recv_batched 1/2/4 rows, 4/8 warps: 13.7-15.0 µs).
# local_batched and combine_own (the own chunk's combine) run while the all_to_all is in flight.
# With a full-machine grid they took every SM first and NCCL's kernel only started as they drained
# (bench_ep --timeline: no overlap); one program per SM on every SM did not help either (NCCL's
# CTAs did not share an SM with ours). So their grid leaves EP_FREE_SMS SMs idle for NCCL's CTAs
# and loops over the row blocks. 66 = half of the H200's 132 SMs; in the probes (notes.md runs
# 21-22) 50 and 66 free SMs were within 2 µs of each other with the 8-16-warp tiles below, and
# 16/32/48/66 gave 196-222 µs in no clear order with 4-warp tiles. A GPU with fewer SMs keeps
# half of them free.
EP_FREE_SMS = 66
# The pack packs up to this many tokens in one block per peer (no route-count kernel).
PACK_ONE_BLOCK_TOKENS = 32
# Both modes keep their own chunk out of the all_to_all (and overlap it) from this many
# max_tokens_per_rank on. Below that, the plain sequence (fewer launches) was faster in batched
# mode, in steady-state graph replays:
# - T=16 / 128: 39-40 / 59 µs either way, but the plain sequence's ratio to the raw all_to_all was
#   higher (0.75 vs 0.64 and 0.87 vs 0.81);
# - T=1024: the overlap saved 14 µs (168 vs 182 µs) in batched mode and 5-7 µs (142-146 vs
#   148-151) in flat mode.
# 512 sits between the measured sizes (not measured itself); flat's overlap was not measured below
# 1024. The environment variable PADDED_MOE_EP_OVERLAP_MIN_TOKENS overrides it at construction.
EP_OVERLAP_MIN_TOKENS = 512
EP_TILES: dict = {
    "pack": EPTile(8), "recv_flat": EPTile(8), "recv_batched": EPTile(2),
    "combine_flat": EPTile(8), "combine_batched": EPTile(4, 4, 8), "reduce": EPTile(4, 4, 8),
    "local_batched": EPTile(8, 16, 1), "combine_own": EPTile(16, 16, 1), "local_flat": EPTile(8, 16, 1),
}
INTERPRET_TILE = EPTile(16)  # the interpreter prefers few, large programs


def _tile(stage: str, device: torch.device) -> EPTile:
    return EP_TILES[stage] if device.type == "cuda" else INTERPRET_TILE


def _k_tiles(device: torch.device, K: int, elem_size: int, row_programs: int, *,
             group: int = 0, split: bool = True, per_sm: int = 4) -> tuple[int, int, int]:
    """(BK, K_PER_PROG, KS): columns per inner step, per program, programs along K.

    On CUDA, K is split across programs until the grid has ~4 programs per SM (small T still
    spreads its bytes over the machine); fp8 slices are one scale block (`group`) wide.
    """
    if group:
        bk = group
    else:
        bk = min(_next_pow2(max(K, 1)), (1024 // elem_size) if device.type == "cuda" else 256)
    if not split or device.type != "cuda":
        return bk, _cdiv(K, bk) * bk, 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ks = max(1, min(_cdiv(K, bk), (per_sm * num_sms(idx)) // max(row_programs, 1)))
    kpp = _cdiv(_cdiv(K, ks), bk) * bk
    return bk, kpp, _cdiv(K, kpp)


def _overlap_min_tokens() -> int:
    """EP_OVERLAP_MIN_TOKENS, or the PADDED_MOE_EP_OVERLAP_MIN_TOKENS environment variable."""
    raw = os.environ.get("PADDED_MOE_EP_OVERLAP_MIN_TOKENS")
    if raw is None:
        return EP_OVERLAP_MIN_TOKENS
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"PADDED_MOE_EP_OVERLAP_MIN_TOKENS must be an integer, got {raw!r}") from None


def _capped_grid(device: torch.device, row_programs: int, k_programs: int = 1) -> int:
    """Row programs for a kernel that overlaps a collective: at most one program per SM outside
    the `EP_FREE_SMS` left to the collective (at most half the SMs on a smaller GPU), with
    `k_programs` along K, the programs looping over the row blocks; uncapped off CUDA."""
    if device.type != "cuda":
        return row_programs
    idx = device.index if device.index is not None else torch.cuda.current_device()
    sms = num_sms(idx)
    return max(1, min(row_programs, (sms - min(EP_FREE_SMS, sms // 2)) // max(k_programs, 1)))


def route_block_columns(max_tokens: int) -> int:
    """Columns of the pack's per-block route counts for up to `max_tokens` tokens (the smallest
    pack tile of any device sets the number of blocks)."""
    return max(1, _cdiv(max_tokens, min(EP_TILES["pack"].rows, INTERPRET_TILE.rows)))


def _pack_blocks(m: int, T: int, device) -> tuple:
    """(tile, rows per block, blocks, blocks for T, routed): the pack's token blocks, shared by
    `local_flat` (which reads the same route counts)."""
    tile = _tile("pack", device)
    routed = m > PACK_ONE_BLOCK_TOKENS
    # Up to PACK_ONE_BLOCK_TOKENS tokens: one block per peer, positions from its own cumsum, no
    # route-count launch (at T=16 that launch and its gap were ~1.7 of ~35 µs).
    bt = tile.rows if routed else max(tile.rows, _next_pow2(max(m, 1)))
    nb = max(1, _cdiv(m, bt))
    return tile, bt, nb, max(nb, _cdiv(T, bt)), routed
