"""Triton expert GEMM for the three GEMM layouts (`GemmLayout`): `out[row] = a[row'] @ w[e].T (+ bias[e])`.

One kernel, specialised by constexprs; `LAYOUT` is the layout's code (`padded_moe.layout_codes`):
- INDEXED: a program's rows are `sorted_ids[block]`; A row = id // A_DIV (top_k for GEMM1,
  1 for GEMM2), C row = id. Blocks at/after `num_padded` or with `block_expert` -1 exit at once.
- GROUPED_CONTIGUOUS: the tile -> (expert, first row) map is an in-kernel scan over the
  L+1 offsets (a few hundred int loads from L2 per program, no extra launch, no host sync).
  The grid is the worst case `cdiv(R, BM) + L` m-tiles; tiles past the real ones exit at once.
- GROUPED_MASKED: grid `L * cdiv(T_max, BM)` m-tiles; tiles at/past `counts[e]` exit.

With `GemmConfig.persistent` the grid is what the GPU holds at once and each program walks the
tiles with rows (`_walk`: INDEXED's blocks below `num_padded`, GROUPED_CONTIGUOUS's experts'
tiles), the same tiles with the same math; GROUPED_MASKED keeps one program per tile.

Row masks keep every load and store inside the valid rows, so padded rows (NaN in tests) are never
read and rows past a count/offset are never written. Weights are `[L, Nout, K]` in bf16/fp16/fp32,
or MXFP4 (`blocks [L, Nout, K/2]`, `scales [L, Nout, K/32]`) dequantized to the activation dtype in
registers. Accumulation is fp32; the bias is added in fp32 before the one final rounding.

Hopper paths, chosen per config (both GPU-verified against the same references):
- `tma`: in the grouped layouts A rows are contiguous per tile and each expert's weight is a
  contiguous `[Nout, K]` block, so both are read through TMA descriptors (hardware address
  generation and bounds, async copies). Rows of a tile past its expert's last row (and columns
  past `Nout`) are loaded but never stored: a GEMM output row depends only on its own A row. INDEXED
  gathers A rows, so it keeps pointer loads for A and reads only the weights through TMA.
- MXFP4 on a GPU goes through `tl.dot_scaled(..., "e2m1")`, whose Hopper lowering upcasts with a
  byte-permute lookup instead of our bit assembly. The interpreter has no `dot_scaled`, so CPU tests
  run `_dequant_mxfp4` (the same math, checked against the float64 reference on both sides).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from padded_moe import layout_codes as codes
from padded_moe.kernels._codes import GROUPED_CONTIGUOUS, INDEXED
from padded_moe.kernels._launch import launch as launch_kernel, ptr_key, resident_programs
from padded_moe.kernels.activation import ACT_SWIGLUOAI, _bias_act, _gate_up_rows
from padded_moe.kernels.guard import clamp_count, expert_id_ok
from padded_moe.layouts import BLOCK_128_MEAN_ROWS, default_block_m
from padded_moe.mxfp4 import warn_unprepared



@dataclass(frozen=True)
class GemmConfig:
    BM: int
    BN: int
    BK: int
    GROUP_M: int = 1
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False  # TMA descriptors for A (grouped layouts) and bf16 weights
    mx_native: bool = True  # MXFP4 through tl.dot_scaled (compiled only); False: _dequant_mxfp4
    # MXFP4 + dot_scaled only: compute out^T = W a^T, so the upcast weight tile is the MMA's
    # left operand (it can stay in registers) and the few token rows are its narrow N side.
    swap_ab: bool = False
    # MXFP4 weights carrying the prepared `HopperMxfp4` form: run `_expert_gemm_mx_hopper_kernel`
    # (bf16 tl.dot on weights upcast in registers, weights as the left operand; BK a multiple of
    # 64). False runs the tl.dot_scaled kernel above even for prepared weights (the benchmark
    # compares the two on the same weights).
    mx_hopper: bool = False
    # mx_hopper only, compiled bf16 activations: the upcast as inline PTX on packed bf16x2 pairs
    # (`_e2m1_planes_ptx`, about half the instructions of the portable float32 form). The
    # interpreter and other dtypes run the portable form.
    mx_ptx: bool = False
    # mx_hopper only: one pair of dots per loop iteration, each over half of BK (the low, then the
    # high nibble planes of all BK/64 layout blocks side by side), instead of a pair of K=32 dots
    # per block. Fewer, longer wgmma chains; the scales are widened per 32 columns.
    mx_wide: bool = False
    # mx_hopper, 4-plane weights only: the upcast weight tile is the MMA's right operand, stored
    # to shared memory once per K step (out = a W^T, token rows on the M side), so both wgmma
    # operands come from shared memory. On the H200 it was 1.6-3.2x slower than the
    # register-operand tile on every GPT-OSS and DeepSeek-V4 shape swept (storing the upcast tile
    # to shared memory every K step costs more than it saves), so no table entry or sweep list
    # uses it.
    mx_w_shared: bool = False
    # Persistent programs (as many as the GPU holds at once, see `launch`) that each walk tiles
    # `program, program + programs, ...` instead of one program per tile: the SM starts its next
    # tile without a new program's start-up, and the walk covers only tiles with rows (INDEXED's
    # blocks below `num_padded`, GROUPED_CONTIGUOUS's experts' tiles). Same tiles, same math per
    # tile: bit-identical outputs. GROUPED_MASKED launches one program per tile either way.
    persistent: bool = False
    # A tile whose valid rows all lie in its first BM/2 rows (an expert's last tile with its few
    # remaining rows, or a narrower INDEXED block) runs the main loop as a BM/2-row tile: half the
    # MMA work and A reads. The kernels decide per tile on the device (both loop bodies are compiled);
    # outputs are those of the full tile. Ignored for tiles under 32 rows (a half tile's tl.dot
    # needs 16).
    half_tail: bool = False
    # Persistent programs only (`_expert_gemm_kernel`): each program takes its next tile from a
    # device counter (an atomic add) instead of `program + i * programs`, so tiles start in order
    # however long each one takes, and the m-tiles that read one expert's weight tile start
    # together. Each program takes as many tiles as in the static walk. The counter is zeroed
    # before each launch. Same tiles, same math: bit-identical.
    dynamic: bool = False
    # A cap on registers per thread (ptxas `maxnreg`), None for none. ptxas allocates registers in
    # steps of 8 per thread, so a kernel a few registers over a step (e.g. 170 on 4 warps) holds one
    # block per SM fewer than at the step below (168: 3 blocks, 176: 2); a cap that costs no spills
    # gives the block back.
    maxnreg: Optional[int] = None

    def __post_init__(self):
        # Checked once here, where the config is made, rather than on every launch.
        if self.maxnreg is not None and (type(self.maxnreg) is not int or not 16 <= self.maxnreg <= 255):
            raise ValueError(f"config.maxnreg must be None or an int from 16 to 255 (registers per thread), "
                             f"got {self.maxnreg!r}")

    def short(self) -> str:
        tag = "".join(f"_{name}" for name, field, when in _SHORT_TAGS if getattr(self, field) == when)
        cap = "" if self.maxnreg is None else f"_r{self.maxnreg}"
        return f"BM{self.BM}_BN{self.BN}_BK{self.BK}_G{self.GROUP_M}_w{self.num_warps}_s{self.num_stages}{tag}{cap}"

    @classmethod
    def from_short(cls, name: str) -> "GemmConfig":
        """The config whose `short()` is `name`; ValueError for anything else."""
        m = re.fullmatch(r"BM(\d+)_BN(\d+)_BK(\d+)_G(\d+)_w(\d+)_s(\d+)((?:_[a-z]+)*)(?:_r(\d+))?", name)
        if m is None:
            raise ValueError(f"not a GemmConfig short name: {name!r}")
        tags = {t for t in m.group(7).split("_") if t}
        known = {tag: (field, when) for tag, field, when in _SHORT_TAGS}
        if tags - known.keys():
            raise ValueError(f"unknown tags {sorted(tags - known.keys())} in {name!r}")
        cap = None if m.group(8) is None else int(m.group(8))
        cfg = cls(*(int(g) for g in m.groups()[:6]), **{known[t][0]: known[t][1] for t in tags}, maxnreg=cap)
        if cfg.short() != name:
            raise ValueError(f"{name!r} reads back as {cfg.short()!r}")
        return cfg

    def planes_ok(self, planes: int) -> bool:
        """Whether this config can read prepared weights in the arrangement `planes` (2 or 4)."""
        return not (self.mx_wide and planes != 2) and not (self.mx_w_shared and planes != 4)


# `GemmConfig.short()`'s tags, in order: (tag, field, the field's value that adds the tag).
_SHORT_TAGS = (("tma", "tma", True), ("bitdq", "mx_native", False), ("swap", "swap_ab", True),
               ("hop", "mx_hopper", True), ("ptx", "mx_ptx", True), ("wide", "mx_wide", True),
               ("wsh", "mx_w_shared", True), ("pers", "persistent", True),
               ("half", "half_tail", True), ("dyn", "dynamic", True))


# Tuned for H200 (sm_90), keyed by (weight kind, regime). Regimes by rows per expert:
# decode <= 32 (weight-bandwidth bound: small BM, many programs), small below
# `layouts.BLOCK_128_MEAN_ROWS` (72), medium <= 512, prefill > 512 (compute bound: big tiles,
# grouped ordering so an expert's weight tile stays in L2).
# Each entry is the winner of `benchmarks/bench_gemm.py`'s H200 sweep for its regime (the sweep
# candidates are SWEEP below; measurements in notes.md). The bf16 medium and prefill tiles run as
# persistent programs (`GemmConfig.persistent`): on whole `fused_experts` calls (bench_tiles_ab,
# alternating graph replays, H200) 0.961x the time of one program per tile on DeepSeek-V4 at 8192
# tokens, 0.971x on Mixtral at 1024, 0.986-0.998x at 4096-8192, Qwen3-MoE 0.979x at 8192 and 1.02x
# at 4096. The prepared-MXFP4 tile does not: 1.02x on GPT-OSS and 1.11x on DeepSeek-V4 at 8192.
TUNED: dict[tuple[str, str], GemmConfig] = {
    ("bf16", "decode"): GemmConfig(32, 64, 128, 1, 4, 4),
    ("bf16", "small"): GemmConfig(64, 128, 64, 4, 4, 4, tma=True),
    ("bf16", "medium"): GemmConfig(128, 256, 64, 16, 8, 4, tma=True, persistent=True),
    ("bf16", "prefill"): GemmConfig(128, 256, 64, 8, 8, 4, tma=True, persistent=True),
    ("mxfp4", "decode"): GemmConfig(32, 64, 128, 1, 4, 4),
    ("mxfp4", "small"): GemmConfig(64, 128, 128, 4, 4, 3),
    ("mxfp4", "medium"): GemmConfig(128, 128, 64, 8, 4, 4),
    ("mxfp4", "prefill"): GemmConfig(256, 128, 64, 8, 8, 3),
}

# MXFP4 weights prepared with `Mxfp4Tensor.prepare_for()` (the Hopper kernel), from
# `bench_gemm.py --mxfp4-hopper`'s sweep (SWEEP_MXFP4_HOPPER) on the GPT-OSS shapes at 1 to 2048
# rows per expert. The inline-PTX upcast took 0.61x the portable form's time at 512 rows and 0.69x
# at 2048; decode's BN 64 also doubles the programs of a call that hits few experts (BM 16 decode
# tiles would read an expert's weights twice at 32 rows). Not adopted: BM128_BN128_BK64_w8_s4 with
# the inline-PTX upcast won the medium and prefill sweeps by 3-12% but gave non-finite outputs in
# two model-shape GPU tests (INDEXED at 1024 rows per expert, GROUPED_MASKED on DeepSeek-V4
# shapes), and so does the same tile with the portable upcast; the small entry stays the earlier
# one until its sweep winner passes those tests.
TUNED.update({
    ("mxfp4_hopper", "decode"): GemmConfig(32, 64, 64, 1, 4, 3, mx_hopper=True, mx_ptx=True),
    ("mxfp4_hopper", "small"): GemmConfig(64, 128, 128, 4, 4, 3, mx_hopper=True),
    ("mxfp4_hopper", "medium"): GemmConfig(128, 128, 128, 8, 8, 3, mx_hopper=True, mx_ptx=True),
    ("mxfp4_hopper", "prefill"): GemmConfig(128, 128, 128, 8, 8, 3, mx_hopper=True, mx_ptx=True),
})
# The 4-plane arrangement (the default of `prepare_for`; one dot per K step), from the sweep on it
# timed on INDEXED with `fused_experts`' default row blocks (128 rows from 256 rows per expert, else
# at most 64, which caps the tile's BM) on GPT-OSS (4 to 1024 rows per expert) and DeepSeek-V4 (64 to
# 1024) shapes. BN 256 takes 0.74x the time of BN 128 on GPT-OSS at 256 rows and 0.82-0.85x on both
# models at 1024; decode's BK 256 0.84x BK 128 on DeepSeek-V4 at 8 rows and 0.91x on GPT-OSS at 4
# (1.04x at 16). Each entry won its regime summed over both models, except medium on DeepSeek-V4 at
# 192 rows (64-row blocks), where BN 128 is 3-5% faster: `TUNED_NARROW`. Unchanged tiles moved by up
# to 8% between sweeps minutes apart, so small was settled on whole calls instead (the peers
# harness, alternating runs): BK 64 s4 took 0.965x the time of BK 128 s3 on GPT-OSS at 1024 tokens
# (the sweep had DeepSeek-V4 at 64 rows 4% faster with BK 128 s3). The decode tile's ~250 registers
# leave two blocks per SM; the same tile on 8 warps (128 registers), BK 128 and BN 64 were slower in
# whole calls (bench_tiles_ab, H100: 1.01-1.30x at 128 tokens, 1.09-1.22x on DeepSeek-V4 at 1024),
# and 4 stages gained 1-3% at 128 tokens but took 1.21x on DeepSeek-V4 at 1024, so occupancy is not
# what bounds it. The small tile without a fused activation takes 170 registers (2 blocks per SM);
# capped at 168 (`maxnreg`, 3 blocks, no spills) it was level in whole calls (H100: GPT-OSS at 1024
# tokens 0.997x, DeepSeek-V4 at 2048 1.01x), so it runs uncapped.
TUNED.update({
    ("mxfp4_hopper4", "decode"): GemmConfig(32, 128, 256, 1, 4, 3, mx_hopper=True, mx_ptx=True),
    ("mxfp4_hopper4", "small"): GemmConfig(64, 128, 64, 4, 4, 4, mx_hopper=True, mx_ptx=True, half_tail=True),
    ("mxfp4_hopper4", "medium"): GemmConfig(128, 256, 64, 8, 8, 3, mx_hopper=True, mx_ptx=True, half_tail=True),
    ("mxfp4_hopper4", "prefill"): GemmConfig(128, 256, 64, 8, 8, 3, mx_hopper=True, mx_ptx=True),
})
# `half_tail` on the prepared-MXFP4 medium tile (an expert's last tile of at most 64 rows runs as a
# 64-row tile): whole calls at 8192 tokens (bench_tiles_ab, alternating graph replays, H200) took
# 0.977x the time without it on GPT-OSS (256 rows per expert) and 0.967x on DeepSeek-V4 (192). On
# the small tile (a 64-row tile holding at most 32 rows runs as a 32-row tile: the MMA's token side
# halves, the upcast stays once per expert) GPT-OSS at 1024 tokens (32 +- 6 rows per expert) took
# 0.942x; DeepSeek-V4 at 2048 (48 rows) 1.00x. The decode tile (32 rows) gained nothing at 4-24
# rows per expert (1.00-1.01x), where the MMA is not what the time goes to. On
# the bf16 tiles it lost: 1.04-1.21x persistent (DeepSeek-V4 at 8192 tokens, Mixtral at 1024 and
# 8192, Qwen3-MoE at 4096 and 8192), level to 1.07x as one program per tile, so bf16 keeps full tiles.
# Entries for INDEXED calls whose row blocks hold fewer rows than the `TUNED` entry's BM (the tile
# then takes one block: a 64-row tile), where the sweep found another tile faster.
TUNED_NARROW: dict[tuple[str, str], GemmConfig] = {
    ("mxfp4_hopper4", "medium"): GemmConfig(128, 128, 128, 8, 8, 3, mx_hopper=True, mx_ptx=True),
}

# Every layout uses the same table. For GROUPED_MASKED a 64-row tile would waste less of a mostly
# empty slab's last tile, but on the H200 it made the full slab 1.4x slower and a 10%-valid call
# no faster than 128-row tiles: at T_max=512 both are bound by reading every expert's weights once.

# Under the interpreter every block op is a numpy call; small tiles keep CPU tests fast.
INTERPRET_CONFIG = GemmConfig(16, 32, 32, 1, 4, 1)
INTERPRET_HOPPER_CONFIG = GemmConfig(16, 32, 64, 1, 4, 1, mx_hopper=True)

# Sweep candidates per regime for the benchmark (the first of each is the table entry).
SWEEP: dict[str, list[GemmConfig]] = {
    "decode": [GemmConfig(32, 64, 128, 1, 4, 4), GemmConfig(32, 64, 256, 1, 4, 3, True),
               GemmConfig(32, 128, 128, 1, 4, 4), GemmConfig(16, 64, 128, 1, 4, 4, True)],
    "small": [GemmConfig(64, 128, 64, 4, 4, 4, True), GemmConfig(64, 256, 64, 4, 8, 3, True),
              GemmConfig(64, 128, 64, 4, 4, 4), GemmConfig(64, 128, 128, 4, 4, 3, True)],
    "medium": [GemmConfig(128, 256, 64, 16, 8, 4, True, persistent=True), GemmConfig(128, 256, 64, 16, 8, 4, True),
               GemmConfig(128, 256, 64, 8, 8, 4, True),
               GemmConfig(128, 256, 64, 8, 8, 3, True),
               GemmConfig(128, 128, 64, 8, 4, 4, True), GemmConfig(128, 256, 64, 8, 8, 3),
               GemmConfig(256, 128, 64, 8, 8, 3, True)],
    "prefill": [GemmConfig(128, 256, 64, 8, 8, 4, True, persistent=True), GemmConfig(128, 256, 64, 8, 8, 4, True),
                GemmConfig(128, 256, 64, 16, 8, 4, True),
                GemmConfig(256, 128, 64, 8, 8, 3, True), GemmConfig(128, 256, 64, 8, 8, 3, True),
                GemmConfig(256, 128, 64, 8, 8, 4, True), GemmConfig(128, 256, 64, 8, 8, 4)],
}
# MXFP4 candidates: tl.dot_scaled tiles, the table entry with the bit-assembly dequantization
# (dot_scaled was 1.9x faster in decode on the H200) and the operand-swapped dot_scaled (2-3x
# slower than unswapped there: Triton 3.6 does not keep the upcast operand in registers).
SWEEP_MXFP4: dict[str, list[GemmConfig]] = {
    "decode": [GemmConfig(32, 64, 128, 1, 4, 4), GemmConfig(16, 64, 128, 1, 4, 4),
               GemmConfig(32, 64, 128, 1, 4, 4, mx_native=False),
               GemmConfig(32, 128, 128, 1, 4, 4, swap_ab=True), GemmConfig(16, 128, 128, 1, 4, 4, swap_ab=True)],
    "small": [GemmConfig(64, 128, 128, 4, 4, 3), GemmConfig(64, 128, 64, 4, 4, 4),
              GemmConfig(64, 128, 64, 4, 4, 4, mx_native=False),
              GemmConfig(64, 128, 128, 4, 4, 3, swap_ab=True)],
    "medium": [GemmConfig(128, 128, 64, 8, 4, 4), GemmConfig(128, 128, 128, 8, 8, 3),
               GemmConfig(128, 128, 64, 8, 4, 4, mx_native=False)],
    "prefill": [GemmConfig(256, 128, 64, 8, 8, 3), GemmConfig(128, 256, 64, 8, 8, 3),
                GemmConfig(128, 256, 128, 8, 8, 3), GemmConfig(256, 128, 64, 8, 8, 3, mx_native=False)],
}


# Prepared-MXFP4 (Hopper kernel) candidates, the table entry first. BM is the MMA's N side (token
# rows), BN its M side (weight rows: 64 per warpgroup), BK covers BK/64 layout blocks per iteration.
# BM128_BN128_BK64_w8_s4 is left out, with either upcast: it gave non-finite outputs on two model
# shapes (see TUNED above) and stays out until that is understood.
_H = lambda bm, bn, bk, g, w, st, ptx=False, wide=False: GemmConfig(  # noqa: E731
    bm, bn, bk, g, w, st, mx_hopper=True, mx_ptx=ptx, mx_wide=wide)
SWEEP_MXFP4_HOPPER: dict[str, list[GemmConfig]] = {
    "decode": [_H(32, 64, 64, 1, 4, 3, True), _H(32, 128, 64, 1, 4, 3), _H(32, 128, 64, 1, 4, 3, True),
               _H(32, 64, 64, 1, 4, 4, True), _H(16, 64, 64, 1, 4, 3, True), _H(32, 64, 128, 1, 4, 3, True),
               _H(16, 128, 64, 1, 4, 4), _H(16, 128, 128, 1, 4, 4, True, True), _H(16, 128, 256, 1, 4, 3, True, True),
               _H(32, 128, 256, 1, 4, 3, True, True), _H(32, 128, 128, 1, 4, 3, True), _H(32, 128, 128, 1, 4, 4, True),
               _H(32, 64, 128, 1, 4, 4, True), _H(16, 128, 128, 1, 4, 3, True), _H(32, 128, 256, 1, 4, 3, True),
               _H(32, 128, 256, 1, 4, 2, True), _H(32, 256, 128, 1, 8, 3, True), _H(16, 128, 256, 1, 4, 3, True)],
    "small": [_H(64, 128, 128, 4, 4, 3), _H(64, 128, 64, 4, 4, 4), _H(64, 128, 64, 4, 4, 4, True),
              _H(64, 64, 64, 4, 4, 4, True), _H(32, 128, 128, 4, 4, 4),
              _H(64, 256, 128, 4, 8, 3), _H(64, 64, 128, 4, 4, 4), _H(128, 128, 128, 4, 8, 3),
              _H(64, 128, 128, 4, 4, 3, True), _H(64, 128, 256, 4, 4, 3, True, True), _H(64, 128, 128, 4, 4, 4, True),
              _H(64, 128, 256, 4, 8, 3, True), _H(64, 256, 64, 4, 8, 3, True), _H(64, 256, 128, 4, 8, 3, True),
              GemmConfig(64, 128, 64, 4, 4, 4, mx_hopper=True, mx_ptx=True, half_tail=True)],
    "medium": [_H(128, 128, 128, 8, 8, 3, True), _H(64, 128, 128, 8, 4, 3),
               _H(128, 256, 64, 8, 8, 3), _H(128, 64, 128, 8, 4, 3), _H(64, 256, 128, 8, 8, 3),
               _H(128, 128, 128, 8, 8, 3), _H(128, 128, 128, 8, 8, 3, True, True),
               _H(128, 256, 64, 8, 8, 3, True), _H(128, 256, 128, 8, 8, 3, True), _H(128, 256, 64, 8, 8, 4, True),
               _H(128, 256, 64, 4, 8, 3, True),
               GemmConfig(128, 256, 64, 8, 8, 3, mx_hopper=True, mx_ptx=True, half_tail=True)],
    "prefill": [_H(128, 128, 128, 8, 8, 3, True), _H(128, 256, 64, 8, 8, 3, True),
                _H(128, 256, 128, 8, 8, 3, True), _H(64, 256, 128, 8, 8, 3, True), _H(128, 128, 128, 16, 8, 4, True),
                _H(128, 128, 128, 8, 8, 3), _H(128, 128, 128, 8, 8, 3, True, True),
               _H(128, 256, 128, 8, 8, 4, True), _H(128, 128, 128, 8, 8, 4, True), _H(128, 256, 64, 8, 8, 4, True)],
}


def regime(rows_per_expert: float) -> str:
    """The tuning regime of a GEMM of `rows_per_expert` rows per expert. The medium regime (128-row
    tiles) starts where INDEXED blocks widen to 128 rows (`layouts.BLOCK_128_MEAN_ROWS`, which has
    the measurements), on every layout; on GROUPED_CONTIGUOUS (whole calls on the H200, the medium
    tile against the small one) bf16 DeepSeek-V4 took 0.87x at 72 and 0.81x at 96 rows, prepared
    MXFP4 0.90x at 72 (GPT-OSS), 0.84x at 80 and 0.82x at 96 (both models), 0.95x at 128 (GPT-OSS)."""
    if rows_per_expert <= 32:
        return "decode"
    if rows_per_expert < BLOCK_128_MEAN_ROWS:
        return "small"
    if rows_per_expert <= 512:
        return "medium"
    return "prefill"


def table_kind(mxfp4: bool, hopper: bool, planes: int = 2) -> str:
    """The weight kind that keys `TUNED`: bf16, mxfp4 (tl.dot_scaled), or the prepared arrangement."""
    if mxfp4 and hopper:
        return "mxfp4_hopper4" if planes == 4 else "mxfp4_hopper"
    return "mxfp4" if mxfp4 else "bf16"


def sweep_lists(kind: str) -> dict[str, list[GemmConfig]]:
    """The sweep candidates per regime for a `table_kind`."""
    if kind.startswith("mxfp4_hopper"):
        return SWEEP_MXFP4_HOPPER
    return SWEEP_MXFP4 if kind == "mxfp4" else SWEEP


def pick_config(rows_per_expert: float, mxfp4: bool, interpreted: bool, hopper: bool = False,
                planes: int = 2, block_rows: Optional[int] = None) -> GemmConfig:
    """The tuned config for the regime; one table serves every layout (see the note above
    INTERPRET_CONFIG). `hopper`: the MXFP4 weight carries its prepared `HopperMxfp4` form, in the
    arrangement `planes`. `block_rows`: an INDEXED call's rows per block (`TUNED_NARROW` applies
    when they are fewer than the entry's BM)."""
    hopper = hopper and mxfp4
    if interpreted:
        return INTERPRET_HOPPER_CONFIG if hopper else INTERPRET_CONFIG
    key = (table_kind(mxfp4, hopper, planes), regime(rows_per_expert))
    cfg = TUNED[key]
    if block_rows is not None and block_rows < cfg.BM and key in TUNED_NARROW:
        return TUNED_NARROW[key]
    return cfg


def default_config(cuda: bool, mxfp4: bool, w_hopper, layout: int, block_m: int,
                   rows_per_expert: float, t_max: Optional[int] = None) -> GemmConfig:
    """The config `launch` takes when none is given. `t_max`: GROUPED_MASKED's slab capacity, where
    `rows_per_expert` may be an expected count below it (`GroupedMaskedMeta.rows_per_expert`)."""
    from padded_moe.kernels import INTERPRETED

    interpreted = INTERPRETED and not cuda
    # The grouped layouts run the tile INDEXED runs for the same call. INDEXED sizes its row block
    # for an expert's routed rows (the mean plus its square root, `default_block_m`), takes the
    # regime of max(mean, block) (`IndexedMeta.rows_per_expert`) and caps the tile at the block.
    # GROUPED_CONTIGUOUS takes the same regime from its mean rows. At 32 mean rows (routed counts
    # about 17-53) its GEMMs with the decode tile, 32 rows, took 1.02-1.57x INDEXED's time (bf16:
    # GPT-OSS, Qwen3-MoE, Mixtral, DeepSeek-V4; prepared MXFP4 GPT-OSS GEMM1 1.16x: an expert past
    # 32 rows reads its weights twice), and 0.99-1.01x with INDEXED's 64-row small tile (one H100,
    # scripts/layout_tiles_probe.py). GROUPED_MASKED does the same, capped at its slab capacity
    # `t_max`, where it is given an expected count below that capacity (the mean of a layout built
    # from slots, or a batched buffer's `expected_m`); its tile then fits the rows the slabs hold,
    # not the room they have (DeepSeek-V4 MXFP4 at 24 mean rows in 37-row slabs: the capacity's
    # 64-row tile took 1.18-1.29x the GEMM time of INDEXED's 32-row tile on an H100). Without one
    # it takes the regime of `t_max`, a bound on its rows and all a batched buffer tells.
    block = default_block_m(rows_per_expert, 1) if not interpreted and layout != codes.INDEXED else None
    rows = rows_per_expert
    if block is not None and layout == codes.GROUPED_CONTIGUOUS:
        rows = max(rows_per_expert, block)
    elif block is not None and layout == codes.GROUPED_MASKED and t_max is not None:
        rows = min(max(rows_per_expert, block), t_max)  # no expected count (rows = t_max): t_max
    cfg = pick_config(rows, mxfp4, interpreted, hopper=w_hopper is not None,
                      planes=2 if w_hopper is None else w_hopper.planes,
                      block_rows=block_m if layout == codes.INDEXED else None)
    if block is not None and cfg.mx_hopper and regime(rows) == "decode":
        # And the prepared-MXFP4 decode tile takes the cap: on an H100 the 16-row tile took
        # 0.89-0.97x the 32-row tile's time on DeepSeek-V4 GEMMs at 1 and 8 rows per expert
        # (GROUPED_CONTIGUOUS and GROUPED_MASKED), level with INDEXED's. Other weights keep the
        # table's rows (a cap not measured for them).
        cfg = dataclasses.replace(cfg, BM=min(cfg.BM, block))
    return cfg


# GROUPED_MASKED as persistent programs over the m-tiles that hold rows: True or False forces it on
# or off (tests, benchmarks); None takes the rule of `grouped_walks`.
MASKED_WALK: Optional[bool] = None
# The rule, for both grouped layouts: a prepared-MXFP4 decode tile (BM <= 32) whose grid, sized
# from the buffer's shape (GROUPED_MASKED: every slab's capacity; GROUPED_CONTIGUOUS: every row,
# where a hint says far fewer are valid), holds at least this many times the m-tiles the expected
# rows need. GROUPED_MASKED, one H100, GEMMs alone
# (scripts/layout_tiles_probe.py), GPT-OSS and DeepSeek-V4 at 3-32 mean rows: with slabs 16x the
# largest count (9-19 times the expected m-tiles) the walk took 0.71-0.95x the time of one
# program per tile, whose two programs per SM (the tile's shared memory) must each start and
# retire; with slabs as large as the largest count (1-2 times) 0.99-1.10x. It lost wherever else
# it ran: the 64-row small tile 1.05-1.06x, bf16 1.00-1.05x. GROUPED_CONTIGUOUS with room for 16x
# the tokens and `expected_m`: 1.02-1.06x the time of the tokens alone where it walked.
GROUPED_WALK_MIN_RATIO = 4


def grouped_grid_m(layout: int, rows: int, num_local: int, t_max: int, bm: int) -> int:
    """The m-tiles of a grouped layout's grid, from shapes only (graph-safe): GROUPED_CONTIGUOUS's
    `rows` hold at most cdiv(rows, bm) + min(L, rows) tiles with rows in all; GROUPED_MASKED has
    every slab's whole capacity `t_max`."""
    if layout == codes.GROUPED_CONTIGUOUS:
        return triton.cdiv(rows, bm) + min(num_local, rows)
    return num_local * triton.cdiv(t_max, bm)


def grouped_walks(cfg: GemmConfig, hopper: bool, grid_m_tiles: int, num_local: int, rows_per_expert: float) -> bool:
    """Whether a grouped layout's launch runs as persistent programs over the m-tiles that hold
    rows (`_walk`) instead of one program per m-tile of its grid (`grid_m_tiles`, from shapes), for
    `rows_per_expert` expected rows on each of `num_local` experts."""
    expected = num_local * max(1, math.ceil(rows_per_expert / cfg.BM))
    return hopper and cfg.BM <= 32 and grid_m_tiles >= GROUPED_WALK_MIN_RATIO * expected


# The activation in GEMM1's epilogue against GEMM1 then the activation kernel, on whole
# `FusedMoE.experts` calls (benchmarks/bench_fusion.py on an H200, alternating graph replays, three
# runs; run-to-run spread about 2%): with tiles of up to 128 weight rows 0-3% faster on
# DeepSeek-V4 (bf16 and MXFP4), Qwen3-MoE and Mixtral from 16 to 1024 tokens. With 256-row tiles:
# 3-5% slower on GPT-OSS (prepared MXFP4, 256 rows per expert), and on DeepSeek-V4 bf16 and Mixtral
# at 8192 tokens when gate-first rows are read as two TMA tiles of 128 rows into two accumulators;
# read as one 256-row tile from a 4-D descriptor (GATE_UP_TMA = "one_tile": the plain kernel's
# loop) 3-4% faster on DeepSeek-V4 bf16 (8192 tokens), Mixtral (1024, 8192) and Qwen3-MoE (8192),
# and level with two tiles on every narrower tile. GPT-OSS on
# the prepared-MXFP4 kernel with 16-row tiles (16 and 128 tokens) was 1.2-2.9% slower in every run,
# and 1-2% faster with 32-row tiles (1024 tokens); the main loop compiles to the same instructions
# with and without the epilogue, and the cause is not established (the split of interleaved rows
# moves data between lanes there). `fused_experts` takes the epilogue where `epilogue_pays`
# (PADDED_MOE_FUSE_ACTIVATION=1: always).
EPILOGUE_MAX_BN = 128
EPILOGUE_MIN_BM_INTERLEAVED_PREPARED = 32

# How a bf16 TMA tile with a gated epilogue reads gate-first `w13` rows (the gate rows of its
# columns and, N rows further, their up rows): "one_tile", one [BN, BK] tile from a 4-D descriptor
# over [L, 2, N, K] (one MMA of the full width: on sm_90 the same loop as the plain kernel's, 4
# wgmma m64n256k16 per BK 64 step), or "two_tiles", two TMA tiles of BN/2 rows and two accumulators
# (two MMAs of half the width, 12 TMA copies per step instead of 8; slower on 256-row tiles, see
# above). For measurement (benchmarks/bench_fusion.py --gate-up-tile); set it before the first call,
# as launch plans keep what a call launched.
GATE_UP_TMA = "one_tile"


def epilogue_pays(cfg: GemmConfig, tile_m: int, interleaved: bool, read: str = "pointer") -> bool:
    """Whether the activation epilogue measured faster for this config, with `tile_m` rows per
    kernel tile, gate/up rows `interleaved` (swigluoai) and weight rows read as `weight_read` says."""
    if cfg.BN > EPILOGUE_MAX_BN and read != "tma_one_tile":
        return False
    return not (cfg.mx_hopper and interleaved and tile_m < EPILOGUE_MIN_BM_INTERLEAVED_PREPARED)


# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------


@triton.jit
def _tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile `pid` -> (m tile, n tile), GROUP_M m-tiles sharing each sweep over n (L2 reuse of weights)."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _dequant_mxfp4(packed, scales, BN: tl.constexpr, BK: tl.constexpr):
    """uint8 [BN, BK/2] nibble pairs + uint8 [BN, BK/32] E8M0 scales -> float32 [BN, BK].

    E2M1 -> fp32 by bit assembly (exponent e+126, mantissa bit at 22; code 1 is 0.5), scale by
    2^(s-127) built as fp32 bits (s=0 -> the subnormal 2^-127, s=255 -> NaN). Exact.
    """
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BN, BK)).to(tl.uint32)
    ex = (codes >> 1) & 3
    man = codes & 1
    mag = tl.where(ex > 0, ((ex + 126) << 23) | (man << 22), man * (126 << 23))
    val = (mag | ((codes >> 3) << 31)).to(tl.float32, bitcast=True)
    s = scales.to(tl.uint32)
    sbits = tl.where(s == 0, 0x400000, tl.where(s == 255, 0x7FC00000, s << 23))
    sf = sbits.to(tl.float32, bitcast=True)
    val = tl.reshape(val, (BN, BK // 32, 32)) * sf[:, :, None]
    return tl.reshape(val, (BN, BK))


@triton.jit
def _tile_rows(pid_m, ids_ptr, blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr, R_a, num_local, mk, T_max,
               LAYOUT: tl.constexpr, A_DIV: tl.constexpr, BLOCK_MB: tl.constexpr, SUB: tl.constexpr,
               ROWS: tl.constexpr, L_POW2: tl.constexpr, BM: tl.constexpr, TM: tl.constexpr,
               IN_LOOP: tl.constexpr):
    """Rows of m-tile `pid_m` for the layout: (live, expert, first row, A rows, C rows, row valid),
    the vectors over the first `TM` of its `BM` rows (TM = BM: all of them; the first row is the
    tile's own either way). GROUPED_CONTIGUOUS numbers only the m-tiles that hold rows, expert by
    expert (`_segment_tiles`); so does GROUPED_MASKED inside a persistent walk (`IN_LOOP`), which
    then visits no tile past a count, while one program per tile keeps the slab-by-slab numbering
    that a grid sized from `T_max` needs.

    `live` is 0 for a tile with nothing to compute (the caller returns at once); then the other
    values are unspecified. Every load here stays inside its metadata tensor for any tile of the
    launch grid. Rows with `valid` false are 0 in `a_rows` / `c_rows` and must be masked.
    """
    rm = tl.arange(0, TM)
    if LAYOUT == INDEXED:
        mb = pid_m // SUB
        row0 = mb * BLOCK_MB + (pid_m % SUB) * BM
        npad = tl.load(npad_ptr)
        e = tl.load(blk_exp_ptr + mb)
        live = expert_id_ok(e, row0 < npad, num_local).to(tl.int32)
        in_blk = (rm < ROWS) & (row0 + rm < npad)
        ids = tl.load(ids_ptr + row0 + rm, mask=in_blk, other=0)
        valid = in_blk & (ids >= 0) & (ids < mk)
        ids = tl.where(valid, ids, 0)
        a_rows = ids // A_DIV
        c_rows = ids
        row_start = row0 * 0
    elif LAYOUT == GROUPED_CONTIGUOUS or IN_LOOP:  # scan the experts' segments for this tile's expert
        ev, lo, hi, tiles = _segment_tiles(off_ptr, cnt_ptr, R_a, T_max, num_local, LAYOUT, L_POW2, BM)
        tile_end = tl.cumsum(tiles, 0)
        e = tl.sum((tile_end <= pid_m).to(tl.int32), 0)
        live = (e < num_local).to(tl.int32)
        mine = ev == e
        first_tile = tl.sum(tl.where(mine, tile_end - tiles, 0), 0)
        row_lo = tl.sum(tl.where(mine, lo, 0), 0)
        row_hi = tl.sum(tl.where(mine, hi, 0), 0)
        row_start = row_lo + (pid_m - first_tile) * BM
        rows = row_start + rm
        valid = rows < row_hi
        rows = tl.where(valid, rows, 0)
        a_rows = rows
        c_rows = rows
    else:  # GROUPED_MASKED
        tiles_per_e = tl.cdiv(T_max, BM)
        e = pid_m // tiles_per_e
        t0 = (pid_m % tiles_per_e) * BM
        cnt = clamp_count(tl.load(cnt_ptr + e), T_max)
        live = (t0 < cnt).to(tl.int32)
        valid = t0 + rm < cnt
        row_start = e * T_max + t0
        rows = tl.where(valid, row_start + rm, 0)
        a_rows = rows
        c_rows = rows
    return live, e, row_start, a_rows, c_rows, valid


@triton.jit
def _segment_tiles(off_ptr, cnt_ptr, R_a, T_max, num_local, LAYOUT: tl.constexpr, L_POW2: tl.constexpr,
                   BM: tl.constexpr):
    """Per expert slot `ev [L_POW2]` its rows [lo, hi) of the flat buffer and its m-tiles (0 past
    `num_local`): GROUPED_CONTIGUOUS from the offsets (clamped into the buffer and ordered),
    GROUPED_MASKED from the counts (slab e's first `count` rows, the count clamped to [0, T_max])."""
    ev = tl.arange(0, L_POW2)
    ein = ev < num_local
    if LAYOUT == GROUPED_CONTIGUOUS:
        lo = clamp_count(tl.load(off_ptr + ev, mask=ein, other=0), R_a)
        hi = clamp_count(tl.maximum(tl.load(off_ptr + ev + 1, mask=ein, other=0), lo), R_a)
    else:
        lo = ev * T_max
        hi = lo + clamp_count(tl.load(cnt_ptr + ev, mask=ein, other=0), T_max)
    return ev, lo, hi, tl.where(ein, (hi - lo + BM - 1) // BM, 0)


@triton.jit
def _program_tile(tile, N, num_pid_m, ids_ptr, blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr, R_a, num_local, mk, T_max,
                  LAYOUT: tl.constexpr, A_DIV: tl.constexpr, BLOCK_MB: tl.constexpr, SUB: tl.constexpr,
                  ROWS: tl.constexpr, L_POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  GROUP_M: tl.constexpr, IN_LOOP: tl.constexpr, TM: tl.constexpr):
    """Tile `tile`, shared by both GEMM kernels: `_tile_rows`' values for its m-tile (the expert as
    int64), its first output column `n0`, the columns `rn` and their mask `n_ok`. `IN_LOOP` (a
    persistent program, which cannot return early): a dead tile gets expert 0 and no valid rows,
    so its bias loads stay in bounds and it stores nothing. `TM`: as in `_tile_rows`."""
    pid_m, pid_n = _tile_ids(tile, num_pid_m, tl.cdiv(N, BN), GROUP_M)
    live, e, row_start, a_rows, c_rows, valid = _tile_rows(
        pid_m, ids_ptr, blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr, R_a, num_local, mk, T_max,
        LAYOUT, A_DIV, BLOCK_MB, SUB, ROWS, L_POW2, BM, TM, IN_LOOP)
    if IN_LOOP:
        e = tl.where(live != 0, e, 0)
        valid = valid & (live != 0)
    n0 = pid_n * BN
    rn = n0 + tl.arange(0, BN)
    return live, e.to(tl.int64), n0, rn, rn < N, row_start, a_rows, c_rows, valid


@triton.jit
def _walk(N, num_pid_m, npad_ptr, off_ptr, cnt_ptr, R_a, T_max, num_local, LAYOUT: tl.constexpr,
          BLOCK_MB: tl.constexpr, SUB: tl.constexpr, L_POW2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """(tiles, m-tiles) a persistent program walks: the m-tiles that hold rows times the n-tiles.
    INDEXED: the blocks below `num_padded`; the grouped layouts: the experts' tiles from the offsets
    or counts (a capacity-sized buffer's worst-case grid is mostly empty). The m-tiles come first in
    `_tile_rows`' order either way, so the walk visits no tile without rows."""
    if LAYOUT == INDEXED:
        num_pid_m = tl.minimum(num_pid_m, tl.cdiv(tl.load(npad_ptr), BLOCK_MB) * SUB)
    else:
        _, _, _, tiles = _segment_tiles(off_ptr, cnt_ptr, R_a, T_max, num_local, LAYOUT, L_POW2, BM)
        num_pid_m = tl.minimum(num_pid_m, tl.sum(tiles, 0))
    return num_pid_m * tl.cdiv(N, BN), num_pid_m


@triton.jit
def _store_tile(acc, bias_ptr, e64, stride_be, c_ptr, c_rows, stride_cm, rn, n_ok, valid, HAS_BIAS: tl.constexpr):
    """The epilogue of both GEMM kernels: fp32 `acc [BM, BN]` plus the expert's bias, rounded once
    to `c`'s dtype, stored at the tile's valid rows and columns only."""
    if HAS_BIAS:
        b = tl.load(bias_ptr + e64 * stride_be + rn, mask=n_ok, other=0.0)
        acc += b.to(tl.float32)[None, :]
    c_ptrs = c_ptr + c_rows.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _weight_rows(n0, N, ACT: tl.constexpr, GATED: tl.constexpr, M_SIDE: tl.constexpr, BN: tl.constexpr):
    """The BN weight rows of the tile whose output columns start at `n0`, and their mask. Without
    a gated activation in the epilogue they are the columns. With one (`GATED`: BN/2 activation
    columns) they are the columns' gate and up rows:
    - interleaved gate/up rows (swigluoai): the contiguous range from 2*n0, gate of column i at
      tile row 2i and up at 2i+1;
    - gate-first halves, weight rows on the MMA's N side (`_expert_gemm_kernel`): side by side as
      above (a thread holds pairs of adjacent accumulator columns, so the split moves no data);
    - gate-first halves, weight rows on the M side (`M_SIDE`, the prepared-MXFP4 kernel): the
      gate rows of the columns, then their up rows (two contiguous halves keep its scale loads,
      along N, vectorized and asynchronous; the split goes through shared memory once per tile).
      Placing each column's gate and up in accumulator rows r and r+8 (one thread) made the split
      free but measured 3% slower on DeepSeek-V4 MXFP4 at 128 tokens.
    Plain arithmetic on one arange, so the rows keep the layout the loads and the MMA expect."""
    j = tl.arange(0, BN)
    if GATED:
        if ACT == ACT_SWIGLUOAI:
            col = n0 + j // 2
            wr = 2 * n0 + j
        else:
            if M_SIDE:
                up = (j >= BN // 2).to(tl.int32)
                col = n0 + j - up * (BN // 2)
            else:
                up = j % 2
                col = n0 + j // 2
            wr = col + up * N
    else:
        col = n0 + j
        wr = col
    return wr, col < N


@triton.jit
def _gate_up_split(acc, ACT: tl.constexpr, M_SIDE: tl.constexpr, HALVES: tl.constexpr, BM: tl.constexpr,
                   BN_OUT: tl.constexpr):
    """The gates and ups `[BM, BN_OUT]` of a tile whose rows `_weight_rows` placed (or, with
    `HALVES`, a 4-D TMA tile: the columns' gate rows, then their up rows): from `acc [BM, 2*BN_OUT]`,
    or with `M_SIDE` from the prepared-MXFP4 kernel's `acc^T [2*BN_OUT, BM]`."""
    if M_SIDE:
        acc = tl.trans(acc)
    if HALVES and ACT != ACT_SWIGLUOAI:  # the gates, then the ups
        g, u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN_OUT)), (0, 2, 1)))
    else:  # gate and up of a column side by side
        g, u = tl.split(tl.reshape(acc, (BM, BN_OUT, 2)))
    return g, u


@triton.jit
def _store_act_tile(acc, acc_u, bias_ptr, e64, stride_be, c_ptr, c_rows, stride_cm, rn, n_ok, valid, N,
                    limit, alpha, beta, situ_beta, situ_lambda, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                    HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr, FAST: tl.constexpr):
    """GEMM1's epilogue with the activation (`ACT` >= 0) on `[BM, BN_OUT]` accumulators: the gates
    `acc` and ups `acc_u` (`_gate_up_split`; `acc` alone for a non-gated activation); biases, the
    rounding GEMM1's output buffer would apply, the activation (`_bias_act`, as the decode kernels
    do), then stored at the valid rows: the layout path's math without its `[rows, 2N]` buffer."""
    g_rows, u_rows = _gate_up_rows(rn, N, ACT)
    y = _bias_act(acc, acc_u, bias_ptr + e64 * stride_be, g_rows, u_rows, n_ok, c_ptr, limit, alpha, beta,
                  situ_beta, situ_lambda, HAS_BIAS, ACT, HAS_LIMIT, HAS_LAMBDA, FAST)
    c_ptrs = c_ptr + c_rows.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _expert_gemm_kernel(
    a_ptr, a_half_ptr, w_ptr, s_ptr, bias_ptr, c_ptr,
    ids_ptr, blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr, tile_ctr_ptr,
    N, K, R_a, num_local, mk, T_max, num_pid_m,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_be, stride_cm, W_ROWS,
    limit, alpha, beta, situ_beta, situ_lambda,
    LAYOUT: tl.constexpr, W_MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr, A_DIV: tl.constexpr,
    BLOCK_MB: tl.constexpr, SUB: tl.constexpr, ROWS: tl.constexpr, L_POW2: tl.constexpr,
    FP32_DOT: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr, MX_NATIVE: tl.constexpr,
    SWAP_AB: tl.constexpr,
    A_FMT: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr, FAST: tl.constexpr,
    GATED: tl.constexpr, TWO_ACC: tl.constexpr, W_DESC4: tl.constexpr,
    PERSISTENT: tl.constexpr, HALF_TAIL: tl.constexpr, DYNAMIC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BN_OUT: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """`N` counts output columns (activation columns with `ACT` >= 0), `W_ROWS` the weight's rows
    per expert; a tile reads BN weight rows for BN_OUT output columns (`_weight_rows`). TMA weights
    with a gated activation whose gate half comes first (`GATE_UP_TMA`): TWO_ACC reads the gate and
    up rows as two TMA tiles into two accumulators; W_DESC4 reads one tile of both from a 4-D
    descriptor over the weight viewed as [L, 2, N, K] (gate rows, then up rows).

    PERSISTENT: `GemmConfig.persistent` (the grid is what the GPU holds at once; each program
    walks tiles `program_id + i * programs`, `_walk`).

    HALF_TAIL: `GemmConfig.half_tail` (a tile whose valid rows all lie in its first BM/2 runs as a
    BM/2-row tile; `a_half_ptr` is A's descriptor with BM/2-row blocks when A_DESC, else `a_ptr`).

    DYNAMIC (with PERSISTENT): `GemmConfig.dynamic`, each program's next tile from the zeroed int32
    counter `tile_ctr_ptr` (tiles start in order; each program still takes as many as its walk).
    """
    if PERSISTENT:
        tiles, live_m = _walk(N, num_pid_m, npad_ptr, off_ptr, cnt_ptr, R_a, T_max, num_local, LAYOUT, BLOCK_MB,
                              SUB, L_POW2, BM, BN_OUT)
        for walked in tl.range(tl.program_id(0), tiles, tl.num_programs(0)):
            tile = walked
            if DYNAMIC:  # as many tiles per program as the walk: the counter hands out 0 .. tiles-1 once each
                tile = tl.atomic_add(tile_ctr_ptr, 1, sem="relaxed")
            _expert_gemm_tile(tile, live_m, a_ptr, a_half_ptr, w_ptr, s_ptr, bias_ptr, c_ptr, ids_ptr, blk_exp_ptr,
                npad_ptr, off_ptr, cnt_ptr, N, K, R_a, num_local, mk, T_max, stride_am, stride_we, stride_wn, stride_wk,
                stride_se, stride_sn, stride_be, stride_cm, W_ROWS, limit, alpha, beta, situ_beta, situ_lambda, LAYOUT,
                W_MXFP4, HAS_BIAS, A_DIV, BLOCK_MB, SUB, ROWS, L_POW2, FP32_DOT, A_DESC, W_DESC, MX_NATIVE, SWAP_AB,
                A_FMT, ACT, HAS_LIMIT, HAS_LAMBDA, FAST, GATED, TWO_ACC, W_DESC4, HALF_TAIL, BM, BN,
                BN_OUT, BK, GROUP_M, True)
    else:
        _expert_gemm_tile(tl.program_id(0), num_pid_m, a_ptr, a_half_ptr, w_ptr, s_ptr, bias_ptr, c_ptr, ids_ptr,
            blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr, N, K, R_a, num_local, mk, T_max, stride_am, stride_we, stride_wn,
            stride_wk, stride_se, stride_sn, stride_be, stride_cm, W_ROWS, limit, alpha, beta, situ_beta, situ_lambda,
            LAYOUT, W_MXFP4, HAS_BIAS, A_DIV, BLOCK_MB, SUB, ROWS, L_POW2, FP32_DOT, A_DESC, W_DESC, MX_NATIVE, SWAP_AB,
            A_FMT, ACT, HAS_LIMIT, HAS_LAMBDA, FAST, GATED, TWO_ACC, W_DESC4, HALF_TAIL, BM, BN, BN_OUT, BK,
            GROUP_M, False)


@triton.jit
def _expert_gemm_tile(
    tile, num_pid_m,
    a_ptr, a_half_ptr, w_ptr, s_ptr, bias_ptr, c_ptr,
    ids_ptr, blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr,
    N, K, R_a, num_local, mk, T_max,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_be, stride_cm, W_ROWS,
    limit, alpha, beta, situ_beta, situ_lambda,
    LAYOUT: tl.constexpr, W_MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr, A_DIV: tl.constexpr,
    BLOCK_MB: tl.constexpr, SUB: tl.constexpr, ROWS: tl.constexpr, L_POW2: tl.constexpr,
    FP32_DOT: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr, MX_NATIVE: tl.constexpr,
    SWAP_AB: tl.constexpr,
    A_FMT: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr, FAST: tl.constexpr,
    GATED: tl.constexpr, TWO_ACC: tl.constexpr, W_DESC4: tl.constexpr, HALF_TAIL: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BN_OUT: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    IN_LOOP: tl.constexpr,
):
    """One tile of `_expert_gemm_kernel` (`tile` < the m-tiles `num_pid_m` times the n-tiles)."""
    live, e64, n0, rn, n_ok, row_start, a_rows, c_rows, valid = _program_tile(
        tile, N, num_pid_m, ids_ptr, blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr, R_a, num_local, mk, T_max,
        LAYOUT, A_DIV, BLOCK_MB, SUB, ROWS, L_POW2, BM, BN_OUT, GROUP_M, IN_LOOP, BM)
    if not IN_LOOP:
        if live == 0:
            return
    half: tl.constexpr = False  # without HALF_TAIL only the full-tile body is compiled
    if HALF_TAIL:
        half = _in_first_half(valid, BM)
    if half:
        _expert_gemm_head(tile, num_pid_m, live, e64, n0, rn, n_ok, a_half_ptr, w_ptr, s_ptr, bias_ptr, c_ptr, ids_ptr,
            blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr, N, K, R_a, num_local, mk, T_max, stride_am, stride_we, stride_wn,
            stride_wk, stride_se, stride_sn, stride_be, stride_cm, W_ROWS, limit, alpha, beta, situ_beta, situ_lambda,
            LAYOUT, W_MXFP4, HAS_BIAS, A_DIV, BLOCK_MB, SUB, ROWS, L_POW2, FP32_DOT, A_DESC, W_DESC, MX_NATIVE,
            SWAP_AB, A_FMT, ACT, HAS_LIMIT, HAS_LAMBDA, FAST, GATED, TWO_ACC, W_DESC4, BM, BM // 2, BN, BN_OUT, BK,
            GROUP_M, IN_LOOP)
    else:
        _expert_gemm_rows(live, e64, n0, rn, n_ok, row_start, a_rows, c_rows, valid, a_ptr, w_ptr, s_ptr, bias_ptr,
            c_ptr, N, K, stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_be, stride_cm,
            W_ROWS, limit, alpha, beta, situ_beta, situ_lambda, W_MXFP4, HAS_BIAS, FP32_DOT, A_DESC, W_DESC,
            MX_NATIVE, SWAP_AB, A_FMT, ACT, HAS_LIMIT, HAS_LAMBDA, FAST, GATED, TWO_ACC, W_DESC4, BM, BN, BN_OUT,
            BK, IN_LOOP)


@triton.jit
def _expert_gemm_head(
    tile, num_pid_m, live, e64, n0, rn, n_ok,
    a_ptr, w_ptr, s_ptr, bias_ptr, c_ptr, ids_ptr, blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr,
    N, K, R_a, num_local, mk, T_max,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_be, stride_cm, W_ROWS,
    limit, alpha, beta, situ_beta, situ_lambda,
    LAYOUT: tl.constexpr, W_MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr, A_DIV: tl.constexpr,
    BLOCK_MB: tl.constexpr, SUB: tl.constexpr, ROWS: tl.constexpr, L_POW2: tl.constexpr,
    FP32_DOT: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr, MX_NATIVE: tl.constexpr,
    SWAP_AB: tl.constexpr, A_FMT: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr, FAST: tl.constexpr,
    GATED: tl.constexpr, TWO_ACC: tl.constexpr, W_DESC4: tl.constexpr,
    BM: tl.constexpr, TM: tl.constexpr, BN: tl.constexpr, BN_OUT: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr, IN_LOOP: tl.constexpr,
):
    """The first `TM` rows of a BM-row tile run as a TM-row tile (`_expert_gemm_rows`): the half
    tile of `GemmConfig.half_tail` (`a_ptr`: a descriptor of TM-row blocks when A_DESC)."""
    _, _, _, _, _, row_start, a_rows, c_rows, valid = _program_tile(
        tile, N, num_pid_m, ids_ptr, blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr, R_a, num_local, mk, T_max,
        LAYOUT, A_DIV, BLOCK_MB, SUB, ROWS, L_POW2, BM, BN_OUT, GROUP_M, IN_LOOP, TM)
    _expert_gemm_rows(live, e64, n0, rn, n_ok, row_start, a_rows, c_rows, valid, a_ptr, w_ptr, s_ptr, bias_ptr,
        c_ptr, N, K, stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_be, stride_cm,
        W_ROWS, limit, alpha, beta, situ_beta, situ_lambda, W_MXFP4, HAS_BIAS, FP32_DOT, A_DESC, W_DESC,
        MX_NATIVE, SWAP_AB, A_FMT, ACT, HAS_LIMIT, HAS_LAMBDA, FAST, GATED, TWO_ACC, W_DESC4, TM, BN, BN_OUT,
        BK, IN_LOOP)


@triton.jit
def _in_first_half(valid, BM: tl.constexpr):
    """Whether a tile's valid rows (`valid [BM]`) all lie in its first BM/2 (e.g. an expert's last
    tile holding its few remaining rows): `GemmConfig.half_tail` runs such a tile as BM/2 rows."""
    return tl.max(((tl.arange(0, BM) >= BM // 2) & valid).to(tl.int32), 0) == 0


@triton.jit
def _expert_gemm_rows(
    live, e64, n0, rn, n_ok, row_start, a_rows, c_rows, valid,
    a_ptr, w_ptr, s_ptr, bias_ptr, c_ptr, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_be, stride_cm, W_ROWS,
    limit, alpha, beta, situ_beta, situ_lambda,
    W_MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr, A_DESC: tl.constexpr, W_DESC: tl.constexpr, MX_NATIVE: tl.constexpr,
    SWAP_AB: tl.constexpr,
    A_FMT: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr, FAST: tl.constexpr,
    GATED: tl.constexpr, TWO_ACC: tl.constexpr, W_DESC4: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BN_OUT: tl.constexpr, BK: tl.constexpr, IN_LOOP: tl.constexpr,
):
    """The main loop and epilogue of one tile of `_expert_gemm_kernel` over `BM` rows (`a_rows`,
    `c_rows`, `valid`, from `_program_tile`; `a_ptr` a descriptor of BM-row blocks when A_DESC)."""
    k_end = K
    if IN_LOOP:  # a dead tile of a persistent program: no steps
        k_end = tl.where(live != 0, K, 0)
    wr, wr_ok = _weight_rows(n0, N, ACT, GATED, False, BN)

    # ---- main loop ------------------------------------------------------------------------
    rk = tl.arange(0, BK)
    if not A_DESC:
        a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
    if SWAP_AB:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    elif TWO_ACC:
        acc = tl.zeros((BM, BN_OUT), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN_OUT), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    if W_MXFP4:
        rkb = tl.arange(0, BK // 2)
        rks = tl.arange(0, BK // 32)
        b_base = w_ptr + e64 * stride_we + wr.to(tl.int64)[:, None] * stride_wn
        s_base = s_ptr + e64 * stride_se + wr.to(tl.int64)[:, None] * stride_sn
    else:
        w_base, w_row0 = _weight_rows_setup(w_ptr, e64, n0, wr, stride_we, stride_wn, W_ROWS, GATED, TWO_ACC,
                                            W_DESC)
    for k0 in range(0, k_end, BK):
        k_ok = k0 + rk < K
        if A_DESC:
            # Grouped layouts: the tile's rows are contiguous from `row_start`; rows past the
            # expert's end are read (zeros past the buffer) but their outputs are never stored.
            a = a_ptr.load([row_start, k0])
        else:
            a = tl.load(a_base + (k0 + rk)[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        if W_MXFP4:
            kb_ok = k0 // 2 + rkb < K // 2
            packed = tl.load(b_base + (k0 // 2 + rkb)[None, :], mask=wr_ok[:, None] & kb_ok[None, :], other=0)
            ks_ok = k0 // 32 + rks < K // 32
            sc = tl.load(s_base + (k0 // 32 + rks)[None, :], mask=wr_ok[:, None] & ks_ok[None, :], other=127)
            if SWAP_AB:  # lhs [BN, BK/2] packed along K with its scales [BN, BK/32], as stored
                acc = tl.dot_scaled(packed, sc, "e2m1", tl.trans(a), None, A_FMT, acc)
            elif MX_NATIVE:
                # rhs [BK/2, BN] packed along K, scales [BN, BK/32] (not transposed).
                acc = tl.dot_scaled(a, None, A_FMT, tl.trans(packed), sc, "e2m1", acc)
            else:
                w = tl.trans(_dequant_mxfp4(packed, sc, BN, BK).to(a.dtype))
                if FP32_DOT:
                    acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, w, acc)
        else:
            if TWO_ACC:  # rows past an expert's half are read but never stored
                wg = tl.trans(w_ptr.load([w_row0, k0]))
                wu = tl.trans(w_ptr.load([w_row0 + N, k0]))
                acc = _dot_fp32_or(a, wg, acc, FP32_DOT)
                acc_u = _dot_fp32_or(a, wu, acc_u, FP32_DOT)
            else:
                w = _weight_operand(w_ptr, w_base, w_row0, e64, n0, k0, rk, k_ok, wr_ok, stride_wk, W_DESC, W_DESC4,
                                    BN, BK)
                acc = _dot_fp32_or(a, w, acc, FP32_DOT)

    if SWAP_AB:
        acc = tl.trans(acc)
    if TWO_ACC:
        _store_act_tile(acc, acc_u, bias_ptr, e64, stride_be, c_ptr, c_rows, stride_cm, rn, n_ok, valid, N, limit,
                        alpha, beta, situ_beta, situ_lambda, HAS_BIAS, ACT, HAS_LIMIT, HAS_LAMBDA, FAST)
    else:
        _tile_epilogue(acc, bias_ptr, e64, stride_be, c_ptr, c_rows, stride_cm, rn, n_ok, valid, N, limit, alpha,
                       beta, situ_beta, situ_lambda, HAS_BIAS, ACT, HAS_LIMIT, HAS_LAMBDA, FAST, GATED, W_DESC4,
                       BM, BN_OUT)


@triton.jit
def _weight_rows_setup(w_ptr, e64, n0, wr, stride_we, stride_wn, W_ROWS, GATED: tl.constexpr,
                       TWO_ACC: tl.constexpr, W_DESC: tl.constexpr):
    """(`w_base`, `w_row0`) for `_weight_operand`: the pointers to the tile's weight rows `wr`
    (pointer reads), or the tile's first row in the `[L*W_ROWS, K]` descriptor view (W_DESC: its
    rows are contiguous there except for TWO_ACC's two halves, gate rows from n0 and up rows from
    N + n0). The value a read does not use is 0."""
    if W_DESC:
        if GATED and not TWO_ACC:
            w_row0 = (e64 * W_ROWS + 2 * n0).to(tl.int32)
        else:
            w_row0 = (e64 * W_ROWS + n0).to(tl.int32)
        w_base = 0
    else:
        w_base = w_ptr + e64 * stride_we + wr.to(tl.int64)[None, :] * stride_wn
        w_row0 = 0
    return w_base, w_row0


@triton.jit
def _weight_operand(w_ptr, w_base, w_row0, e64, n0, k0, rk, k_ok, wr_ok, stride_wk, W_DESC: tl.constexpr,
                    W_DESC4: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A tile's 16/32-bit weights for K step `k0` as the MMA's right operand `[BK, BN]`."""
    if W_DESC4:  # [1, 2, BN/2, BK] -> [BN, BK]; rows past the expert's half read as zeros
        w = tl.trans(tl.reshape(w_ptr.load([e64.to(tl.int32), 0, n0, k0]), (BN, BK)))
    elif W_DESC:  # weights viewed as [L*W_ROWS, K]; rows past the expert's are never stored
        w = tl.trans(w_ptr.load([w_row0, k0]))
    else:
        w = tl.load(w_base + (k0 + rk)[:, None] * stride_wk, mask=k_ok[:, None] & wr_ok[None, :], other=0.0)
    return w


@triton.jit
def _tile_epilogue(acc, bias_ptr, e64, stride_be, c_ptr, c_rows, stride_cm, rn, n_ok, valid, N,
                   limit, alpha, beta, situ_beta, situ_lambda, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                   HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr, FAST: tl.constexpr, GATED: tl.constexpr,
                   HALVES: tl.constexpr, BM: tl.constexpr, BN_OUT: tl.constexpr):
    """One accumulator's store: the activation epilogue (`ACT` >= 0; gated tiles split into gates and
    ups as `_gate_up_split` says, `HALVES` for a 4-D TMA tile) or the plain one."""
    if ACT >= 0:
        acc_u = acc  # unused unless gated
        if GATED:
            acc, acc_u = _gate_up_split(acc, ACT, False, HALVES, BM, BN_OUT)
        _store_act_tile(acc, acc_u, bias_ptr, e64, stride_be, c_ptr, c_rows, stride_cm, rn, n_ok, valid, N, limit,
                        alpha, beta, situ_beta, situ_lambda, HAS_BIAS, ACT, HAS_LIMIT, HAS_LAMBDA, FAST)
    else:
        _store_tile(acc, bias_ptr, e64, stride_be, c_ptr, c_rows, stride_cm, rn, n_ok, valid, HAS_BIAS)


@triton.jit
def _e2m1_plane(p32, f, SHIFT: tl.constexpr, FOLDED: tl.constexpr):
    """One nibble plane of packed bytes (`p32`: the bytes as uint32 [BN, C]; SHIFT 0 = low nibbles,
    4 = high) times its scale factor `f` (float32 2^(s-127), [BN, 1] or [BN, C]) -> float32 [BN, C].

    The 3 magnitude bits go to float32 bits 24..22 and the sign to bit 31: that float is the e2m1
    value times 2^-126 for every code (e=0 lands on the float32 subnormals, where m=1 is 2^-127,
    i.e. 0.5 * 2^-126). Multiplying by 2^126 first restores the value exactly, so the scale multiply
    is the same float32 product as `dequantize_mxfp4` (a single 2^(s-1) factor would overflow
    float32 for s > 128). FOLDED: `f` already is 2^(s-1) (folded scales, s <= 128), one multiply.
    """
    bits = ((p32 << (22 - SHIFT)) & 0x01C00000) | ((p32 << (28 - SHIFT)) & 0x80000000)
    v = bits.to(tl.float32, bitcast=True)
    if not FOLDED:
        v = v * 8.507059173023462e37  # 2^126
    return v * f


def _ptx_scaled(out: int, scale: str, folded: bool) -> list[str]:
    """Register u (a bf16x2 pair of code values times 2^-126) times 2^126 (register k) unless the
    scales are folded, then times the bf16x2 `scale` (an operand or register), into output
    operand `out`."""
    return ([] if folded else ["mul.rn.bf16x2 u, u, k;"]) + [f"mul.rn.bf16x2 ${out}, u, {scale};"]


def _ptx_block(regs: str, lines: list[str]) -> str:
    """An inline-PTX body: scratch registers `regs` plus k = bf16x2 (2^126, 2^126), then `lines`."""
    head = ["{", f".reg .b32 {regs}, k;", "mov.b32 k, 0x7E807E80;"]
    return "\n        ".join(head + lines) + "\n        }"


def _e2m1_ptx_asm(folded: bool) -> str:
    """The PTX body of `_e2m1_planes_ptx`: the same instructions for each output register, which
    differ only in the source pair (t0: bytes 0-1, t1: bytes 2-3), the plane (low nibble: shifts
    6/12; high nibble: 2/8) and the scale operand. Folded scales (2^(s-1)) need no multiply by
    2^126 first."""
    lines = ["prmt.b32 t0, $4, 0, 0x4140;", "prmt.b32 t1, $4, 0, 0x4342;"]
    for out, (src, shift, scale) in enumerate((("t0", 6, 5), ("t1", 6, 6), ("t0", 2, 7), ("t1", 2, 8))):
        lines += [f"shl.b32 u, {src}, {shift};", "and.b32 u, u, 0x01C001C0;",
                  f"shl.b32 v, {src}, {shift + 6};", "and.b32 v, v, 0x80008000;", "or.b32 u, u, v;"]
        lines += _ptx_scaled(out, f"${scale}", folded)
    return _ptx_block("t0, t1, u, v", lines)


_E2M1_PTX_ASM = tl.constexpr(_e2m1_ptx_asm(False))
_E2M1_PTX_FOLDED_ASM = tl.constexpr(_e2m1_ptx_asm(True))


@triton.jit
def _e2m1_planes_ptx(packed, sc_lo, sc_hi, FOLDED: tl.constexpr):
    """Both nibble planes of uint8 `packed` [BN, 32] as bf16, times bf16 scales `sc_lo` / `sc_hi`
    (2^(s-127) broadcast to [BN, 32]), four bytes per call, two elements per register op.

    Each pair of bytes is spread to one byte per 16-bit half (prmt); per half the same bit
    placement as `_e2m1_plane`, but in bf16 (bits 8..6 and 15): the value times 2^-126, subnormal
    codes included. Then two bf16x2 multiplies, by 2^126 and by the scale: both exact (e2m1 values
    and their scaled products have 2 significant bits; bf16 keeps subnormals down to 2^-133), so
    the result equals `dequantize_mxfp4(q, bf16)`, inf and NaN included. FOLDED: the scales are
    2^(s-1) (s <= 128) and one multiply does both, as exactly.
    """
    return tl.inline_asm_elementwise(
        asm=_E2M1_PTX_FOLDED_ASM if FOLDED else _E2M1_PTX_ASM,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[packed, sc_lo, sc_hi],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _scale_bf16(s):
    """E8M0 bytes -> bf16 2^(s-127), same shape (s=0: the bf16 subnormal 2^-127; 255: NaN)."""
    s16 = s.to(tl.uint16)
    b = tl.where(s16 == 0, 0x40, tl.where(s16 == 255, 0x7FC0, s16 << 7)).to(tl.uint16)
    return b.to(tl.bfloat16, bitcast=True)


@triton.jit
def _per_row(x, PER_COLUMN: tl.constexpr):
    """Scales [BN, C] as they are (one per column), or [BN] (one per row) as [BN, 1]."""
    if PER_COLUMN:
        y = x
    else:
        y = x[:, None]
    return y


@triton.jit
def _factor_bf16(s, FOLDED: tl.constexpr):
    """Scales as bf16 factors: folded ones are their bf16 bits already (2^(s-1)), E8M0 bytes give 2^(s-127)."""
    if FOLDED:
        f = s.to(tl.bfloat16, bitcast=True)
    else:
        f = _scale_bf16(s)
    return f


@triton.jit
def _factor_f32(s, FOLDED: tl.constexpr):
    """`_factor_bf16` as float32 (the same power of two)."""
    if FOLDED:
        f = (s.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        f = _scale_factor(s)
    return f


@triton.jit
def _upcast_planes(packed, s_lo, s_hi, dtype: tl.constexpr, UPCAST_PTX: tl.constexpr, PER_COLUMN: tl.constexpr,
                   FOLDED: tl.constexpr):
    """Both nibble planes of uint8 `packed` [BN, C] in `dtype`, each times its scales (`s_lo` /
    `s_hi`: [BN, C] with PER_COLUMN, else [BN] for the whole plane): E8M0 bytes, or with FOLDED
    the int16 bf16 bits of 2^(s-1) (`HopperMxfp4.folded`)."""
    if UPCAST_PTX:
        shape: tl.constexpr = packed.shape
        w_lo, w_hi = _e2m1_planes_ptx(packed, tl.broadcast_to(_per_row(_factor_bf16(s_lo, FOLDED), PER_COLUMN), shape),
                                      tl.broadcast_to(_per_row(_factor_bf16(s_hi, FOLDED), PER_COLUMN), shape), FOLDED)
    else:
        # Rounded to the activation dtype like `dequantize_mxfp4(q, a.dtype)` (exact for bf16).
        p32 = packed.to(tl.uint32)
        w_lo = _e2m1_plane(p32, _per_row(_factor_f32(s_lo, FOLDED), PER_COLUMN), 0, FOLDED).to(dtype)
        w_hi = _e2m1_plane(p32, _per_row(_factor_f32(s_hi, FOLDED), PER_COLUMN), 4, FOLDED).to(dtype)
    return w_lo, w_hi


def _four_plane_ptx_asm(folded: bool) -> str:
    """The PTX body of `_upcast_pairs`: one 32-bit word of the 4-plane arrangement
    (`mxfp4.FOUR_PLANE_BITS`, both 16-bit halves at once) -> four bf16x2 pairs, plane p's pair
    being the code's value times 2^-126 (planes 0-2: one shift and one mask; plane 3: three
    pieces), then times 2^126 unless the scales are folded, then times the group's scale ($5: a
    16-bit register holding its bf16 bits, paired with itself; ptxas folds the pairing into the
    multiply's operand, where a 32-bit factor cost an extract and a prmt per word)."""
    lines = ["mov.b32 s, {$5, $5};"]
    lines += ["and.b32 u, $4, 0x81C081C0;"] + _ptx_scaled(0, "s", folded)
    lines += ["shl.b32 u, $4, 3;", "and.b32 u, u, 0x81C081C0;"] + _ptx_scaled(1, "s", folded)
    lines += ["shl.b32 u, $4, 6;", "and.b32 u, u, 0x81C081C0;"] + _ptx_scaled(2, "s", folded)
    lines += ["shl.b32 u, $4, 1;", "and.b32 u, u, 0x80008000;", "shr.b32 v, $4, 5;", "and.b32 v, v, 0x01000100;",
              "or.b32 u, u, v;", "shr.b32 v, $4, 4;", "and.b32 v, v, 0x00C000C0;", "or.b32 u, u, v;"]
    lines += _ptx_scaled(3, "s", folded)
    return _ptx_block("u, v, s", lines)


_FOUR_PLANE_PTX_ASM = tl.constexpr(_four_plane_ptx_asm(False))
_FOUR_PLANE_PTX_FOLDED_ASM = tl.constexpr(_four_plane_ptx_asm(True))


@triton.jit
def _four_plane(w32, f, P: tl.constexpr, FOLDED: tl.constexpr):
    """Plane P of 16-bit words `w32` (zero-extended to uint32) times `f` as float32: the code's
    sign to bit 31 and its magnitude to bits 24..22 (value times 2^-126, as `_e2m1_plane`)."""
    if P == 3:
        bits = ((w32 << 17) & 0x80000000) | ((w32 << 11) & 0x01000000) | ((w32 << 12) & 0x00C00000)
    else:
        bits = (w32 << (16 + 3 * P)) & 0x81C00000
    v = bits.to(tl.float32, bitcast=True)
    if not FOLDED:
        v = v * 8.507059173023462e37  # 2^126
    return v * f


@triton.jit
def _bf16_halves(v):
    """An int32 holding a bf16 pair -> [.., 2] bf16 (low half first): register renaming only."""
    lo = (v & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    hi = (v >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _portable_pair(lo16, hi16, f, P: tl.constexpr, dtype: tl.constexpr, FOLDED: tl.constexpr):
    """Plane P of both halves as [.., 2] `dtype` (rounded like `dequantize_mxfp4(q, dtype)`)."""
    return tl.join(_four_plane(lo16, f, P, FOLDED).to(dtype), _four_plane(hi16, f, P, FOLDED).to(dtype))


@triton.jit
def _upcast_pairs(words, s, dtype: tl.constexpr, UPCAST_PTX: tl.constexpr, FOLDED: tl.constexpr):
    """int32 `words` [BN, W] of the 4-plane arrangement with their groups' scales `s` [BN, W/4]
    (E8M0 bytes, or folded bf16 bits) -> the weight tile [BN, 8W] in `dtype`, in K order.

    Each word gives four (plane) pairs of neighbouring elements; the joins put a word's pairs
    last, and the permute orders them by element (32g + 8p + 2c + h). Each pair stays in one
    register, where the MMA's register operand wants it, so the reorder moves no data.
    """
    BN: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    G: tl.constexpr = W // 4
    if UPCAST_PTX:  # the bf16 factor's bits for the inline PTX, else the float32 factor
        f = _factor_bf16(s, FOLDED).to(tl.int16, bitcast=True)
    else:
        f = _factor_f32(s, FOLDED)
    f = tl.reshape(tl.broadcast_to(f[:, :, None], (BN, G, 4)), (BN, W))  # each word's group factor
    if UPCAST_PTX:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            asm=_FOUR_PLANE_PTX_FOLDED_ASM if FOLDED else _FOUR_PLANE_PTX_ASM,
            constraints="=r,=r,=r,=r,r,h",
            args=[words, f],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
        q = tl.join(tl.join(_bf16_halves(p0), _bf16_halves(p1)), tl.join(_bf16_halves(p2), _bf16_halves(p3)))
    else:
        w32 = words.to(tl.uint32, bitcast=True)
        lo16 = w32 & 0xFFFF
        hi16 = w32 >> 16
        q = tl.join(tl.join(_portable_pair(lo16, hi16, f, 0, dtype, FOLDED),
                            _portable_pair(lo16, hi16, f, 1, dtype, FOLDED)),
                    tl.join(_portable_pair(lo16, hi16, f, 2, dtype, FOLDED),
                            _portable_pair(lo16, hi16, f, 3, dtype, FOLDED)))
    q = tl.reshape(q, (BN, G, 4, 2, 2, 2))  # (n, g, c, h, p mod 2, p div 2)
    q = tl.permute(q, (0, 1, 5, 4, 2, 3))  # (n, g, p div 2, p mod 2, c, h): element 32g + 8p + 2c + h
    return tl.reshape(q, (BN, 8 * W))


@triton.jit
def _scale_factor(s):
    """E8M0 bytes -> float32 2^(s-127) built as bits (s=0: the subnormal 2^-127; 255: NaN)."""
    s32 = s.to(tl.uint32)
    return tl.where(s32 == 0, 0x400000, tl.where(s32 == 255, 0x7FC00000, s32 << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _block_scales(s_base, stride_sg, k0, n_ok, K_PAD, K_TAIL: tl.constexpr, HI: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, S_ONE: tl.constexpr):
    """E8M0 scale of every column of one nibble plane of a WIDE iteration, [BN, BK/2]: block b's
    low plane is scale group k0/32 + 2b, its high plane the next one. One byte per block is
    loaded, then widened over its 32 columns."""
    NB: tl.constexpr = BK // 64
    blocks = tl.arange(0, NB)
    ok = n_ok[:, None]
    if K_TAIL:
        ok = ok & (k0 + 64 * blocks < K_PAD)[None, :]
    s = tl.load(s_base[:, None] + (k0 // 32 + 2 * blocks + HI)[None, :] * stride_sg, mask=ok, other=S_ONE)
    return tl.reshape(tl.broadcast_to(s[:, :, None], (BN, NB, 32)), (BN, BK // 2))


@triton.jit
def _dot_fp32_or(a, b, acc, FP32_DOT: tl.constexpr):
    """acc += a @ b, in exact float32 with FP32_DOT (fp32 activations, or the interpreter, whose
    bf16 tl.dot is wrong in 3.6), else on the operands' own dtype."""
    if FP32_DOT:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _dot_planes(acc, w_lo, w_hi, x_lo, x_hi, FP32_DOT: tl.constexpr):
    """acc^T += W_lo x_lo^T + W_hi x_hi^T (the weight planes are the MMA's left operand)."""
    acc = _dot_fp32_or(w_lo, tl.trans(x_lo), acc, FP32_DOT)
    return _dot_fp32_or(w_hi, tl.trans(x_hi), acc, FP32_DOT)


@triton.jit
def _byte_strided_rows(w_ptr, e64, rows64, stride_e, stride_r, WORDS: tl.constexpr):
    """Pointers to the starts of packed-weight rows from strides in bytes, whatever the tensor's
    element type: int32 pointers when the rows are read as words (`WORDS`), else bytes. Launchers
    pass the strides in bytes because the compiler learns a row's alignment from its stride being a
    multiple of 16: GPT-OSS's rows are 1440 bytes but 360 words, and counted in words every weight
    word would be its own 4-byte copy instead of four sharing a 16-byte one."""
    rows = w_ptr.to(tl.pointer_type(tl.uint8)) + e64 * stride_e + rows64 * stride_r
    if WORDS:
        rows = rows.to(tl.pointer_type(tl.int32))
    return rows


@triton.jit
def _expert_gemm_mx_hopper_kernel(
    a_ptr, w_ptr, s_ptr, bias_ptr, c_ptr,
    ids_ptr, blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr,
    N, K, K_PAD, R_a, num_local, mk, T_max, num_pid_m,
    stride_am, stride_we, stride_wn, stride_se, stride_sg, stride_be, stride_cm,
    limit, alpha, beta, situ_beta, situ_lambda,
    LAYOUT: tl.constexpr, HAS_BIAS: tl.constexpr, A_DIV: tl.constexpr,
    BLOCK_MB: tl.constexpr, SUB: tl.constexpr, ROWS: tl.constexpr, L_POW2: tl.constexpr,
    FP32_DOT: tl.constexpr, K_TAIL: tl.constexpr, UPCAST_PTX: tl.constexpr, WIDE: tl.constexpr,
    FOLDED: tl.constexpr, PLANES: tl.constexpr, W_SHARED: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr, FAST: tl.constexpr,
    GATED: tl.constexpr, HAS_K: tl.constexpr, PERSISTENT: tl.constexpr, HALF_TAIL: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BN_OUT: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """MXFP4 weights in the `HopperMxfp4` arrangement (mxfp4.py): per 64-element K block, byte j
    holds columns j (low nibble) and 32+j (high nibble); scales are `[L, K_PAD/32, N]`. PLANES=4:
    int32 words of eight codes upcast into the whole [BN, BK] tile in K order (`_upcast_pairs`),
    one dot per iteration; with W_SHARED that tile is the right operand instead (acc [BM, BN] +=
    x @ W^T: Triton stores it to shared memory, and the dot's wgmmas read both operands there).

    WIDE: the NB = BK/64 blocks of an iteration are one tile of BK/2 bytes; its low nibbles are
    columns kb + 64*b + j and its high nibbles those + 32 (block b, byte j), so one dot per plane
    covers the whole iteration, with the activation columns loaded in the same order.

    The weight tile is the left operand: acc^T [BN, BM] += W_plane [BN, 32] @ x_plane^T [32, BM]
    for the two planes of each block, so on sm90 the upcast values can feed wgmma from registers
    and the few token rows of decode are the MMA's narrow N side. The upcast is a mask, shifts
    and two float32 multiplies per element (`_e2m1_plane`; `_e2m1_planes_ptx` with UPCAST_PTX),
    no shuffles. BK is a multiple of 64; a loop iteration covers BK/64 blocks.

    With the activation in the epilogue (`ACT` >= 0) `N` counts activation columns and a tile's BN
    weight rows serve BN_OUT of them, as in `_expert_gemm_kernel`.

    PERSISTENT, HALF_TAIL: as in `_expert_gemm_kernel`.
    """
    if PERSISTENT:
        tiles, live_m = _walk(N, num_pid_m, npad_ptr, off_ptr, cnt_ptr, R_a, T_max, num_local, LAYOUT, BLOCK_MB,
                              SUB, L_POW2, BM, BN_OUT)
        # Not flattened with the K loop (as the bf16 walk can be): fused, the accumulator's reset
        # for the next tile lands in the epilogue's branch while the register-operand wgmma groups
        # of the K steps are in flight, and ptxas then serializes every wgmma (advisory C7515;
        # Triton 3.6, sm_90 compiles of the prefill tile on all three layouts).
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0)):
            _expert_gemm_mx_hopper_tile(tile, live_m, a_ptr, w_ptr, s_ptr, bias_ptr, c_ptr, ids_ptr, blk_exp_ptr,
                npad_ptr, off_ptr, cnt_ptr, N, K, K_PAD, R_a, num_local, mk, T_max, stride_am, stride_we, stride_wn,
                stride_se, stride_sg, stride_be, stride_cm, limit, alpha, beta, situ_beta, situ_lambda, LAYOUT,
                HAS_BIAS, A_DIV, BLOCK_MB, SUB, ROWS, L_POW2, FP32_DOT, K_TAIL, UPCAST_PTX, WIDE, FOLDED, PLANES,
                W_SHARED, ACT, HAS_LIMIT, HAS_LAMBDA, FAST, GATED, HAS_K, HALF_TAIL, BM, BN, BN_OUT, BK, GROUP_M, True)
    else:
        _expert_gemm_mx_hopper_tile(tl.program_id(0), num_pid_m, a_ptr, w_ptr, s_ptr, bias_ptr, c_ptr, ids_ptr,
            blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr, N, K, K_PAD, R_a, num_local, mk, T_max, stride_am, stride_we,
            stride_wn, stride_se, stride_sg, stride_be, stride_cm, limit, alpha, beta, situ_beta, situ_lambda, LAYOUT,
            HAS_BIAS, A_DIV, BLOCK_MB, SUB, ROWS, L_POW2, FP32_DOT, K_TAIL, UPCAST_PTX, WIDE, FOLDED, PLANES, W_SHARED,
            ACT, HAS_LIMIT, HAS_LAMBDA, FAST, GATED, HAS_K, HALF_TAIL, BM, BN, BN_OUT, BK, GROUP_M, False)


@triton.jit
def _expert_gemm_mx_hopper_tile(
    tile, num_pid_m,
    a_ptr, w_ptr, s_ptr, bias_ptr, c_ptr,
    ids_ptr, blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr,
    N, K, K_PAD, R_a, num_local, mk, T_max,
    stride_am, stride_we, stride_wn, stride_se, stride_sg, stride_be, stride_cm,
    limit, alpha, beta, situ_beta, situ_lambda,
    LAYOUT: tl.constexpr, HAS_BIAS: tl.constexpr, A_DIV: tl.constexpr,
    BLOCK_MB: tl.constexpr, SUB: tl.constexpr, ROWS: tl.constexpr, L_POW2: tl.constexpr,
    FP32_DOT: tl.constexpr, K_TAIL: tl.constexpr, UPCAST_PTX: tl.constexpr, WIDE: tl.constexpr,
    FOLDED: tl.constexpr, PLANES: tl.constexpr, W_SHARED: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr, FAST: tl.constexpr,
    GATED: tl.constexpr, HAS_K: tl.constexpr, HALF_TAIL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BN_OUT: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, IN_LOOP: tl.constexpr,
):
    """One tile of `_expert_gemm_mx_hopper_kernel` (`tile` < the m-tiles `num_pid_m` times the n-tiles)."""
    live, e64, n0, rn, n_ok, row_start, a_rows, c_rows, valid = _program_tile(
        tile, N, num_pid_m, ids_ptr, blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr, R_a, num_local, mk, T_max,
        LAYOUT, A_DIV, BLOCK_MB, SUB, ROWS, L_POW2, BM, BN_OUT, GROUP_M, IN_LOOP, BM)
    if not IN_LOOP:
        if live == 0:
            return
    half: tl.constexpr = False  # without HALF_TAIL only the full-tile body is compiled
    if HALF_TAIL:
        half = _in_first_half(valid, BM)
    if half:
        _, _, _, _, _, _, h_a_rows, h_c_rows, h_valid = _program_tile(
            tile, N, num_pid_m, ids_ptr, blk_exp_ptr, npad_ptr, off_ptr, cnt_ptr, R_a, num_local, mk, T_max,
            LAYOUT, A_DIV, BLOCK_MB, SUB, ROWS, L_POW2, BM, BN_OUT, GROUP_M, IN_LOOP, BM // 2)
        _expert_gemm_mx_hopper_rows(live, e64, n0, rn, n_ok, h_a_rows, h_c_rows, h_valid, a_ptr, w_ptr, s_ptr,
            bias_ptr, c_ptr, N, K, K_PAD, stride_am, stride_we, stride_wn, stride_se, stride_sg, stride_be,
            stride_cm, limit, alpha, beta, situ_beta, situ_lambda, HAS_BIAS, FP32_DOT, K_TAIL, UPCAST_PTX,
            WIDE, FOLDED, PLANES, W_SHARED, ACT, HAS_LIMIT, HAS_LAMBDA, FAST, GATED, HAS_K, BM // 2, BN, BN_OUT,
            BK, IN_LOOP)
    else:
        _expert_gemm_mx_hopper_rows(live, e64, n0, rn, n_ok, a_rows, c_rows, valid, a_ptr, w_ptr, s_ptr, bias_ptr,
            c_ptr, N, K, K_PAD, stride_am, stride_we, stride_wn, stride_se, stride_sg, stride_be, stride_cm, limit,
            alpha, beta, situ_beta, situ_lambda, HAS_BIAS, FP32_DOT, K_TAIL, UPCAST_PTX, WIDE, FOLDED, PLANES,
            W_SHARED, ACT, HAS_LIMIT, HAS_LAMBDA, FAST, GATED, HAS_K, BM, BN, BN_OUT, BK, IN_LOOP)


@triton.jit
def _expert_gemm_mx_hopper_rows(
    live, e64, n0, rn, n_ok, a_rows, c_rows, valid,
    a_ptr, w_ptr, s_ptr, bias_ptr, c_ptr, N, K, K_PAD,
    stride_am, stride_we, stride_wn, stride_se, stride_sg, stride_be, stride_cm,
    limit, alpha, beta, situ_beta, situ_lambda,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr, K_TAIL: tl.constexpr, UPCAST_PTX: tl.constexpr, WIDE: tl.constexpr,
    FOLDED: tl.constexpr, PLANES: tl.constexpr, W_SHARED: tl.constexpr,
    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_LAMBDA: tl.constexpr, FAST: tl.constexpr,
    GATED: tl.constexpr, HAS_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BN_OUT: tl.constexpr, BK: tl.constexpr, IN_LOOP: tl.constexpr,
):
    """The main loop and epilogue of one tile of `_expert_gemm_mx_hopper_kernel` over `BM` rows."""
    k_end = K_PAD
    if IN_LOOP:  # a dead tile of a persistent program: no steps
        k_end = tl.where(live != 0, K_PAD, 0)
    elif HAS_K:
        # A loop that may run zero times leaves a path on which the accumulators are defined by
        # plain moves; ptxas then serializes every wgmma of the loop (advisory C7515). The host
        # knows K > 0 (HAS_K), so the zero-trip path goes away.
        tl.assume(K_PAD > 0)
    wr, wr_ok = _weight_rows(n0, N, ACT, GATED, not W_SHARED, BN)

    rh = tl.arange(0, 32)
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am
    w_base = _byte_strided_rows(w_ptr, e64, wr.to(tl.int64)[:, None], stride_we, stride_wn, PLANES == 4)
    s_base = s_ptr + e64 * stride_se + wr
    if W_SHARED:
        acc = tl.zeros((BM, BN), dtype=tl.float32)  # out = a W^T: token rows on the MMA's M side
    else:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    # The scale of masked rows and padding blocks: 1 (E8M0 127), or folded 2^126 (bf16 bits 253 << 7).
    S_ONE: tl.constexpr = 32384 if FOLDED else 127
    if WIDE:
        cols = tl.arange(0, BK // 2)
        # Masks are constant over each block's 32 columns, so the loads stay vectorized.
        blk_col = 64 * (cols // 32)  # each column's block start, relative to the iteration's k0
        x_off = blk_col + cols % 32
    if PLANES == 4:
        wi = tl.arange(0, BK // 8)
        gi = tl.arange(0, BK // 32)
        kk = tl.arange(0, BK)
    for k0 in range(0, k_end, BK):
        if PLANES == 4:
            # One dot per iteration over the whole tile in K order. Triton waits for each of the
            # per-plane dots below before the next; this one it leaves pending.
            w_ok = wr_ok[:, None]
            s_ok = wr_ok[:, None]
            if K_TAIL:  # the last iteration may hold blocks past K_PAD: they read nothing
                # (per 64-element block: a mask constant over 8 words keeps the loads vectorized)
                w_ok = w_ok & (k0 + 64 * (wi // 8) < K_PAD)[None, :]
                s_ok = s_ok & (k0 + 32 * gi < K_PAD)[None, :]
            words = tl.load(w_base + (k0 // 8 + wi)[None, :], mask=w_ok, other=0)
            # Masked scales read as 0 (a zero factor, not S_ONE): zero-filled async copies, no stores.
            # They scale only zero codes (past K_PAD) or rows never stored (past N).
            s = tl.load(s_base[:, None] + (k0 // 32 + gi)[None, :] * stride_sg, mask=s_ok, other=0)
            x_ok = valid[:, None]
            if K_TAIL:  # without a tail every column of every iteration is inside K: no per-column test
                x_ok = x_ok & (k0 + kk < K)[None, :]
            x = tl.load(a_base + (k0 + kk)[None, :], mask=x_ok, other=0.0)
            wt = _upcast_pairs(words, s, x.dtype, UPCAST_PTX, FOLDED)
            if W_SHARED:
                acc = _dot_fp32_or(x, tl.trans(wt), acc, FP32_DOT)
            else:
                acc = _dot_fp32_or(wt, tl.trans(x), acc, FP32_DOT)
        elif WIDE:
            kblk = k0 + blk_col
            w_ok = wr_ok[:, None]
            if K_TAIL:  # the last iteration may hold blocks past K_PAD: they read nothing
                w_ok = w_ok & (kblk < K_PAD)[None, :]
            packed = tl.load(w_base + (k0 // 2 + cols)[None, :], mask=w_ok, other=0)
            s_lo = _block_scales(s_base, stride_sg, k0, wr_ok, K_PAD, K_TAIL, 0, BN, BK, S_ONE)
            s_hi = _block_scales(s_base, stride_sg, k0, wr_ok, K_PAD, K_TAIL, 1, BN, BK, S_ONE)
            x_lo = tl.load(a_base + (k0 + x_off)[None, :], mask=valid[:, None] & (kblk < K)[None, :], other=0.0)
            x_hi = tl.load(a_base + (k0 + x_off + 32)[None, :], mask=valid[:, None] & (kblk + 32 < K)[None, :],
                           other=0.0)
            w_lo, w_hi = _upcast_planes(packed, s_lo, s_hi, x_lo.dtype, UPCAST_PTX, True, FOLDED)
            acc = _dot_planes(acc, w_lo, w_hi, x_lo, x_hi, FP32_DOT)
        else:
            for j in tl.static_range(BK // 64):
                kb = k0 + j * 64
                w_ok = wr_ok
                if K_TAIL:  # the last iteration may hold blocks past K_PAD: they read nothing
                    w_ok = wr_ok & (kb < K_PAD)
                s_lo = tl.load(s_base + (kb // 32) * stride_sg, mask=w_ok, other=S_ONE)
                s_hi = tl.load(s_base + (kb // 32 + 1) * stride_sg, mask=w_ok, other=S_ONE)
                # K is a multiple of 32, so each 32-column half of a block is wholly inside or past
                # K: one scalar condition per half keeps the row loads vectorizable.
                packed = tl.load(w_base + (kb // 2 + rh)[None, :], mask=w_ok[:, None], other=0)
                x_lo = tl.load(a_base + (kb + rh)[None, :], mask=valid[:, None] & (kb < K), other=0.0)
                x_hi = tl.load(a_base + (kb + 32 + rh)[None, :], mask=valid[:, None] & (kb + 32 < K), other=0.0)
                w_lo, w_hi = _upcast_planes(packed, s_lo, s_hi, x_lo.dtype, UPCAST_PTX, False, FOLDED)
                acc = _dot_planes(acc, w_lo, w_hi, x_lo, x_hi, FP32_DOT)

    if ACT >= 0 and GATED:
        acc, acc_u = _gate_up_split(acc, ACT, not W_SHARED, not W_SHARED, BM, BN_OUT)
    else:
        if not W_SHARED:
            acc = tl.trans(acc)
        acc_u = acc  # unused
    if ACT >= 0:
        _store_act_tile(acc, acc_u, bias_ptr, e64, stride_be, c_ptr, c_rows, stride_cm, rn, n_ok, valid, N, limit,
                        alpha, beta, situ_beta, situ_lambda, HAS_BIAS, ACT, HAS_LIMIT, HAS_LAMBDA, FAST)
    else:
        _store_tile(acc, bias_ptr, e64, stride_be, c_ptr, c_rows, stride_cm, rn, n_ok, valid, HAS_BIAS)


# ---------------------------------------------------------------------------------------------
# Host launch
# ---------------------------------------------------------------------------------------------


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def indexed_tiling(block_m: int, bm: int) -> tuple[int, int, int]:
    """(kernel BM, kernel tiles per metadata block, valid rows per kernel tile) for INDEXED.

    A kernel tile never spans two metadata blocks (each block has one expert): a power-of-two
    block_m >= 16 is split into tiles of min(bm, block_m); any other block_m gets one tile of the
    next power of two >= 16 with the extra rows masked off (tl.dot needs M >= 16).
    """
    if _is_pow2(block_m) and block_m >= 16:
        t = min(bm, block_m)
        return t, block_m // t, t
    return max(16, triton.next_power_of_2(block_m)), 1, block_m


def _tma_ok(t: torch.Tensor, rows: int, bk: int) -> bool:
    """A TMA descriptor over `t` viewed as `[rows, K]`: 16-byte aligned base and row stride,
    contiguous last dim, at least 16 bytes per block row."""
    es = t.element_size()
    return (rows > 0 and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(-2) * es) % 16 == 0 and bk * es >= 16)


def weight_rows_tma_ok(w: torch.Tensor, bk: int) -> bool:
    """Whether TMA can read `w [L, rows, K]` as `[L * rows, K]`: each expert's rows follow the
    previous expert's, 16-byte aligned (`_tma_ok`), blocks of `bk` columns."""
    return w.stride(0) == w.shape[1] * w.stride(1) and _tma_ok(w, w.shape[0] * w.shape[1], bk)


def rows_descriptor(w: torch.Tensor, block_rows: int, bk: int) -> TensorDescriptor:
    """TMA descriptor of `w [L, rows, K]` viewed as `[L * rows, K]` (`weight_rows_tma_ok`), blocks of
    `[block_rows, bk]`."""
    return TensorDescriptor(w, [w.shape[0] * w.shape[1], w.shape[2]], [w.stride(1), 1], [block_rows, bk])


def gate_up_descriptor(w: torch.Tensor, block_n: int, bk: int) -> TensorDescriptor:
    """TMA descriptor of gate-first `w13 [L, 2N, K]` viewed as `[L, 2, N, K]`, blocks of
    `[1, 2, block_n, bk]`: a column block's gate rows, then its up rows, past N read as zeros."""
    n = w.shape[1] // 2
    return TensorDescriptor(w, [w.shape[0], 2, n, w.shape[2]], [w.stride(0), n * w.stride(1), w.stride(1), 1],
                            [1, 2, block_n, bk])


def weight_read(cfg: GemmConfig, a2: torch.Tensor, w, gated: bool, interleaved: bool) -> str:
    """How `_expert_gemm_kernel`'s tiles read weight rows: "pointer" (masked loads: MXFP4 bytes,
    another dtype than `a2`, or no TMA), "tma" (one descriptor tile of contiguous rows, also the
    interleaved gate/up rows of swigluoai), or, for gate-first rows under a gated epilogue (a
    column's gate row and, N rows further, its up row), "tma_two_tiles" / "tma_one_tile" as
    GATE_UP_TMA says. `w` is the canonical weight (the prepared-MXFP4 kernel has its own reads)."""
    if GATE_UP_TMA not in ("two_tiles", "one_tile"):
        raise ValueError(f"kernels.gemm.GATE_UP_TMA must be 'two_tiles' or 'one_tile', got {GATE_UP_TMA!r}")
    if not (cfg.tma and w.dtype == a2.dtype and weight_rows_tma_ok(w, cfg.BK)):
        return "pointer"
    return "tma_" + GATE_UP_TMA if gated and not interleaved else "tma"


def launch(a2: torch.Tensor, w, w_scales: Optional[torch.Tensor], out2: torch.Tensor, *,
           layout: int, num_local: int, bias: Optional[torch.Tensor] = None,
           sorted_ids=None, block_expert=None, num_padded=None, block_m: int = 1, a_div: int = 1,
           mk: int = 0, offsets=None, counts=None, t_max: int = 1,
           rows_per_expert: float = 1.0, config: Optional[GemmConfig] = None,
           w_hopper=None, epilogue=None) -> torch.Tensor:
    """Launch on flattened `a2 [rows, K]` / `out2 [rows_out, N]`. `w` is the float weight or the
    MXFP4 blocks (then `w_scales` is set, and `w_hopper` is the weight's prepared `HopperMxfp4`
    form when it has one; `w` is None for a weight that holds only its prepared form, and then
    `w_scales` is any tensor that marks it MXFP4). `epilogue` (an `ActivationEpilogue`): GEMM1 with
    the activation applied before the store, `out2 [rows_out, N]` with N the activation's width
    (half the weight's rows when gated). All metadata stays on the device."""
    mx = w_scales is not None
    w_rows = (w_hopper.blocks if w is None else w).shape[1]
    gated = epilogue is not None and epilogue.activation.is_gated
    N = w_rows // 2 if gated else w_rows
    K = a2.shape[1]
    if num_local == 0 or N == 0 or out2.shape[0] == 0:
        return out2
    cfg = config or default_config(a2.is_cuda, mx, w_hopper, layout, block_m, rows_per_expert, t_max)
    if mx and w_hopper is None and config is None and a2.is_cuda:
        warn_unprepared(a2.device)
    hopper = mx and cfg.mx_hopper
    if mx and not hopper and w is None:
        raise ValueError("config.mx_hopper=False (the tl.dot_scaled kernel) reads the canonical MXFP4 bytes, which "
                         "this weight does not hold (prepare_for(keep_canonical=False)); use its canonical() form")
    if hopper and w_hopper is None:
        raise ValueError("config.mx_hopper needs the weight's prepared form: call Mxfp4Tensor.prepare_for() "
                         "once after loading (or pass a config with mx_hopper=False)")
    if hopper and cfg.mx_wide and cfg.mx_w_shared:
        raise ValueError("config.mx_wide (2 planes) and config.mx_w_shared (4 planes) exclude each other")
    if hopper and not cfg.planes_ok(w_hopper.planes):
        need = 2 if cfg.mx_wide else 4
        raise ValueError(f"config.{'mx_wide' if cfg.mx_wide else 'mx_w_shared'} needs the {need}-plane prepared "
                         f"arrangement, got planes={w_hopper.planes}")
    if hopper and (cfg.BK % 64 != 0 or w_hopper.k != K):
        raise ValueError(f"config.BK must be a multiple of 64 for mx_hopper and the prepared weight's K "
                         f"({w_hopper.k}) must equal a's K ({K}); got BK={cfg.BK}")
    if gated and (cfg.BN < 32 or cfg.BN % 2):
        raise ValueError(f"config.BN must be an even number >= 32 with a gated activation in the epilogue "
                         f"(each tile computes BN/2 activation columns), got {cfg.BN}")
    BN_OUT = cfg.BN // 2 if gated else cfg.BN
    if epilogue is not None:
        act_floats, act_flags = epilogue.kernel_args(fast=a2.is_cuda and out2.dtype != torch.float32)
    else:
        act_floats = (0.0, 1.0, 0.0, 1.0, 1.0)
        act_flags = dict(ACT=-1, HAS_LIMIT=False, HAS_LAMBDA=False, FAST=False)
    act_flags["GATED"] = gated
    BM, SUB, ROWS = cfg.BM, 1, cfg.BM
    # Grids are sized from shapes only (graph-safe), but tightly: experts hold at most
    # cdiv(rows, tile) + min(L, rows) tiles in all, so a decode call on 256 experts launches a few
    # programs per n-tile instead of one per expert that would exit at once.
    if layout == codes.INDEXED:
        BM, SUB, ROWS = indexed_tiling(block_m, cfg.BM)
        num_blocks = min(block_expert.numel(), triton.cdiv(mk, block_m) + min(num_local, mk))
        num_pid_m = num_blocks * SUB
    else:
        num_pid_m = grouped_grid_m(layout, a2.shape[0], num_local, t_max, BM)
    if num_pid_m == 0:
        return out2
    half_tail = cfg.half_tail and BM >= 32
    BK = cfg.BK
    if mx:
        BK = max(32, BK)
    dummy = out2  # stands in for pointers a layout does not use (never dereferenced)
    meta_ptrs = tuple(dummy if t is None else t for t in (sorted_ids, block_expert, num_padded, offsets, counts))
    grid = (num_pid_m * triton.cdiv(N, BN_OUT),)
    # Persistent programs walk the tiles with rows (`_walk`): where the config says so, and on the
    # grouped layouts where `grouped_walks` finds the grid mostly empty (GROUPED_MASKED: whatever
    # the config says, unless MASKED_WALK forces it).
    sparse = layout != codes.INDEXED and grouped_walks(cfg, hopper, num_pid_m, num_local, rows_per_expert)
    if layout == codes.GROUPED_MASKED:
        walk = sparse if MASKED_WALK is None else MASKED_WALK
    else:
        walk = cfg.persistent or sparse
    if cfg.dynamic and (hopper or not cfg.persistent):
        raise ValueError("config.dynamic needs config.persistent and the bf16 / dot_scaled kernel "
                         f"(mx_hopper=False), got {cfg.short()}")
    if hopper:
        hb, hs = w_hopper.blocks, w_hopper.scales
        k_pad = w_hopper.k_padded
        ptrs = (a2, hb, hs, bias if bias is not None else dummy, out2) + meta_ptrs
        ints = (N, K, k_pad, a2.shape[0], num_local, mk, t_max, num_pid_m,  # weight strides in bytes
                a2.stride(0), hb.stride(0) * hb.element_size(), hb.stride(1) * hb.element_size(), hs.stride(0),
                hs.stride(1),
                bias.stride(0) if bias is not None else 0, out2.stride(0))
        constexprs = dict(
            LAYOUT=layout, HAS_BIAS=bias is not None, A_DIV=a_div,
            BLOCK_MB=block_m, SUB=SUB, ROWS=ROWS, L_POW2=max(2, triton.next_power_of_2(num_local)),
            # K_TAIL: some iteration holds columns past K (the weights' padded blocks, or past K_PAD)
            FP32_DOT=a2.dtype == torch.float32 or not a2.is_cuda, K_TAIL=k_pad % BK != 0 or K != k_pad,
            UPCAST_PTX=cfg.mx_ptx and a2.is_cuda and a2.dtype == torch.bfloat16, WIDE=cfg.mx_wide,
            FOLDED=w_hopper.folded, PLANES=w_hopper.planes, W_SHARED=cfg.mx_w_shared, **act_flags, HAS_K=K > 0,
            PERSISTENT=walk, HALF_TAIL=half_tail, BM=BM, BN=cfg.BN, BN_OUT=BN_OUT, BK=BK, GROUP_M=cfg.GROUP_M)
        key, args = ints + act_floats + ptr_key(*ptrs), ptrs + ints + act_floats
        grid = _grid(_expert_gemm_mx_hopper_kernel, grid, key, args, constexprs, cfg, walk)
        launch_kernel(_expert_gemm_mx_hopper_kernel, grid, key, args, constexprs, num_warps=cfg.num_warps,
                      num_stages=cfg.num_stages, maxnreg=cfg.maxnreg)
        return out2
    a_desc = cfg.tma and layout != codes.INDEXED and _tma_ok(a2, a2.shape[0], BK)
    read = weight_read(cfg, a2, w, gated, gated and epilogue.activation.interleaved)
    w_desc = read != "pointer"
    w_desc4, two_acc = read == "tma_one_tile", read == "tma_two_tiles"
    a_arg = TensorDescriptor(a2, [a2.shape[0], K], [a2.stride(0), 1], [BM, BK]) if a_desc else a2
    a_half = TensorDescriptor(a2, [a2.shape[0], K], [a2.stride(0), 1], [BM // 2, BK]) if a_desc and half_tail else a_arg
    if w_desc4:
        w_arg = gate_up_descriptor(w, BN_OUT, BK)
    elif w_desc:
        w_arg = rows_descriptor(w, BN_OUT if two_acc else cfg.BN, BK)
    else:
        w_arg = w
    # tl.dot_scaled: compiled 16-bit activations only (the interpreter has no dot_scaled).
    mx_native = cfg.mx_native and mx and a2.is_cuda and a2.dtype in (torch.bfloat16, torch.float16)
    dynamic = walk and cfg.dynamic
    tile_ctr = torch.zeros(1, dtype=torch.int32, device=a2.device) if dynamic else dummy
    ptrs = (a2, w, w_scales if mx else dummy, bias if bias is not None else dummy, out2) + meta_ptrs + (tile_ctr,)
    ints = (N, K, a2.shape[0], num_local, mk, t_max, num_pid_m,
            a2.stride(0), w.stride(0), w.stride(1), w.stride(2),
            w_scales.stride(0) if mx else 0, w_scales.stride(1) if mx else 0,
            bias.stride(0) if bias is not None else 0, out2.stride(0), w_rows)
    constexprs = dict(
        LAYOUT=layout, W_MXFP4=mx, HAS_BIAS=bias is not None, A_DIV=a_div,
        BLOCK_MB=block_m, SUB=SUB, ROWS=ROWS, L_POW2=max(2, triton.next_power_of_2(num_local)),
        # fp32 operands: exact IEEE dot. Interpreter: triton 3.6's interpreted tl.dot returns
        # garbage for bf16 operands, so upcast there (exact: products of bf16 fit in fp32).
        FP32_DOT=a2.dtype == torch.float32 or not a2.is_cuda,
        A_DESC=a_desc, W_DESC=w_desc, MX_NATIVE=mx_native, SWAP_AB=mx_native and cfg.swap_ab,
        A_FMT="fp16" if a2.dtype == torch.float16 else "bf16", **act_flags, TWO_ACC=two_acc, W_DESC4=w_desc4,
        PERSISTENT=walk, HALF_TAIL=half_tail, DYNAMIC=dynamic, BM=BM, BN=cfg.BN, BN_OUT=BN_OUT,
        BK=BK, GROUP_M=cfg.GROUP_M)
    # The key: every int and float argument, every pointer's dtype and alignment, and the weight's
    # expert count (a TMA descriptor's shape); constexprs and options are added by `launch`.
    key = ints + act_floats + (w.shape[0],) + ptr_key(*ptrs)
    args = (a_arg, a_half, w_arg) + ptrs[2:] + ints + act_floats
    grid = _grid(_expert_gemm_kernel, grid, key, args, constexprs, cfg, walk)
    launch_kernel(_expert_gemm_kernel, grid, key, args, constexprs, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, maxnreg=cfg.maxnreg)
    return out2


def _grid(fn, tiles: tuple[int], key: tuple, args: tuple, constexprs: dict, cfg: GemmConfig,
          walk: bool) -> tuple[int]:
    """One program per tile, or for persistent programs (`walk`) as many as the GPU holds at once
    (from the compiled kernel's registers and shared memory), never more than the tiles."""
    if not walk:
        return tiles
    resident = resident_programs(fn, key, args, constexprs, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                 maxnreg=cfg.maxnreg)
    return (max(1, min(tiles[0], resident)),)
