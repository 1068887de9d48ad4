"""Host side of the native grouped GEMM (`grouped_gemm.cu`): argument checks and the launches.

`launch(a, w, out, offsets=..., counts=..., bias=..., epilogue=...)` computes, for each local
expert `e`, the rows the layout gives it: GROUPED_CONTIGUOUS (`a [R, K]`, `offsets [L + 1]` int64:
rows `offsets[e] .. offsets[e+1]`) or GROUPED_MASKED (`a [L, T, K]`, `counts [L]` int32: rows
`0 .. counts[e]` of slab `e`), `out[row] = a[row] @ w[e].T (+ bias[e])` in bf16, fp32
accumulation, one rounding. `w` is bf16 `[L, N, K]`, or an `Mxfp4Tensor` holding its canonical
bytes, which the kernel upcasts to bf16 in shared memory (exact: an e2m1 value times a power of
two), so the result is that of the dequantized bf16 weight. With `epilogue` (an
`ActivationEpilogue`, GEMM1; its activation one of `EPILOGUE_ACTIVATIONS`) the activation is
applied before the store, as the Triton kernel's epilogue does: the sum plus bias rounded to bf16
(what the activation op would read from GEMM1's buffer), then the activation's formula in fp32 (the
sigmoid through the approximate tanh, as the Triton kernels do for 16-bit outputs); `out` then has
the activation's width. Other rows of `out` are not written.

MXFP4 weights in their prepared form (`Mxfp4Tensor.prepare_for()`: 4-plane words, folded scales;
`takes_rs`) run the RS kernel instead (`launch_rs`, which `launch` calls for them): the consumer
warpgroups upcast the words into wgmma's register operand, the weights on the MMA's M side and up
to 256 (or 320: `RS_WIDE`) of an expert's rows on its N side, so the weights are upcast once per
chunk of that many rows. Its results are those of the dequantized weight with fp32 accumulation and
one rounding, as the Triton kernel's (bit-equal to it in the runs so far). Its activation epilogue
takes the silu family with interleaved gate / up rows (`RS_EPILOGUE`) or gate / up halves
(`RS_EPILOGUE_SPLIT`); for the other activations the backend runs GEMM1 and the activation op with
these weights (`CudaBackend.fuses`).

What the kernel needs, refused with `NotImplementedError` (the caller picked this kernel, so a
call it cannot run is an unsupported combination, not bad input): bf16 `a`, `w` and `out` (or
MXFP4 `w` with its canonical bytes, rows 16-byte aligned, in the 128-row configurations); the last
dimension contiguous everywhere; int64 offsets or int32 counts (what `build_layout` makes); strides
of `a` and `w` in multiples of 8 elements and their data 16-byte aligned (TMA reads); at most 1024
local experts; K a multiple of 8; an even number of output columns; a bias of float32 or bf16.
"""

from __future__ import annotations

from typing import Optional

import torch

from padded_moe._util import cdiv
from padded_moe.kernels import native
from padded_moe.kernels._launch import launch_native
from padded_moe.mxfp4 import Mxfp4Tensor

ENTRY = "pmoe_grouped_gemm"
RS_ENTRY = "pmoe_mx_rs_gemm"
# The RS kernel: pipeline stages, rows of a tile's chunk, weight rows of a tile. Stages 3 and 4 took
# within 5% of each other's time at 192-512 rows per expert (H100, scripts/mx_rs_probe.py); 4 was
# ahead at 24-32 rows.
RS_STAGES = 4
RS_CHUNK_ROWS = 256
RS_BLOCK_N = 128
# Wide chunks: 5 boxes of 64 rows (320 rows: the fifth box an MMA of its own), in RS_WIDE_STAGES
# stages (shared memory holds no more). They upcast each weight once for an expert of 257-320 rows,
# where 256-row chunks upcast it again for the few rows past 256. RS_WIDE None: taken where the rows
# per expert (`rs_wide`) lie in RS_WIDE_ROWS, low bound included, high excluded; True / False:
# always / never. Measured (H100, scripts/mx_rs_probe.py, GEMMs at 8192 tokens, Triton time / this):
# GPT-OSS (mean 256 rows, max 285-305) 1.13-1.19x with them against 1.04-1.11x without; DeepSeek-V4
# (mean 192, max 234-242) 0.98-1.15x with them against 1.10-1.24x without (3 stages, no row past 256).
RS_WIDE_CHUNK_ROWS = 320
RS_WIDE_STAGES = 3
RS_WIDE_ROWS = (224, 320)
RS_WIDE = None
# The RS kernel's walk over an expert's tiles: column tiles first (True: the CTAs running together
# share a chunk of rows) or chunks first (False).
RS_COLUMNS_FIRST = True
# The RS kernel's CTAs: persistent (True: one per SM, each walking tiles b, b + SMs, ...) or one per
# tile of the bound (False: the block scheduler hands out the tiles in order as SMs free up, so CTAs
# whose tiles take different times do not drift apart). One CTA per tile took 3-25% more time in
# every case measured (H100, scripts/mx_rs_probe.py, GPT-OSS and DeepSeek-V4 GEMMs).
RS_PERSISTENT = True
# The RS kernel's MMA of a chunk's last, partial box: in 16-row pieces (True: an m64n16 MMA per piece
# that holds rows, so the box costs its rows rounded up to 16) or whole (False: rounded up to 64).
# Whole calls on an H100 (bench_native_gemm.py, INDEXED Triton time / this): GPT-OSS at 8192 tokens
# (256 rows per expert, half the experts 1-49 rows into a fifth box) 1.08-1.09x in pieces against
# 1.02-1.05x whole; DeepSeek-V4 at 144 and 192 rows within 1% either way.
RS_TAIL_PIECES = True
# The persistent RS kernel's tile walk (RS_PERSISTENT): from a counter zeroed before each launch
# (True: a CTA whose tiles ran short takes the next one) or static (False: CTA b takes tiles b,
# b + SMs, ...). Chunks of 4 or 5 boxes make tile times differ, which the static walk leaves to the
# tail; measured (as above)
# within -2% to +1% of the static walk's time on whole calls (GPT-OSS 8192: 3600 against 3630 µs in
# one run, 4000 against 3970 in another; DeepSeek-V4 144 / 192 rows 1.00 / 0.98x), with kernel times
# 3% lower at GPT-OSS 8192 (torch.profiler, 3416 against 3532 µs): on, at the noise's edge.
RS_DYNAMIC = True
# Whether the backend's GEMM1 on GROUPED_CONTIGUOUS reads each row from its token (`gather_src`: cp.async
# by the producer warpgroup) instead of a permuted copy of the hidden states (`CudaBackend.gathers`;
# `fused_experts` then skips `permute`): in the RS kernel (RS_GATHER), with bf16 weights (GATHER_BF16).
# Bit-equal to the permuted path, but slower: whole calls at 8192 tokens on an H100
# (bench_native_gemm.py, INDEXED Triton time / this) 0.68-0.70x gathering against 1.07-1.12x from
# the permuted copy (GPT-OSS and DeepSeek-V4 MXFP4), DeepSeek-V4 bf16 0.69x against 1.09x: GEMM1 took
# 2.1-2.4x its time, whether a thread's copies arrived on completion or after waiting for its
# group, so the cp.async feed itself is short of the TMA boxes' rate. One-row TMA boxes (bit-equal)
# were slower still: 4.8-5.2x the permuted path's whole-call time (about 40 ns per box per SM). Off.
RS_GATHER = False
GATHER_BF16 = False
# Whether the backend applies gated activations with interleaved gate / up rows (swigluoai) in the
# RS kernel's epilogue (`rs_fuses`): bit-equal to GEMM1 followed by the activation op, and 3-9% less
# time than the two steps on GPT-OSS's GEMM1 (H100, scripts/mx_rs_probe.py). False: the two steps.
RS_EPILOGUE = True
# The same for gate / up halves (silu: DeepSeek-V4, Qwen3-MoE, Mixtral): a tile's 64 gate rows and
# its 64 up rows loaded as two boxes. Bit-equal to the two steps too, but not faster on DeepSeek-V4's
# whole calls (H100, bench_native_gemm.py: 1.06-1.09x INDEXED Triton against 1.11-1.13x for the two
# steps; its GEMM1 alone 1% faster than the two steps), so off.
RS_EPILOGUE_SPLIT = False
MAX_LOCAL_EXPERTS = 1024  # the experts' chunk prefix lives in shared memory (`kMaxExperts`)
# The kernel's configurations, by index (`PMOE_GG_CONFIGS`): (pipeline stages, persistent, weight
# rows per tile, consumer warpgroups). A tile has that many output columns (half as many with a
# gated epilogue) over a chunk of 64 rows per consumer warpgroup; MXFP4 weights run in the 128-row
# tiles only.
CONFIGS = ((4, True, 128, 4), (4, False, 128, 4), (5, True, 64, 4), (4, True, 256, 2))
# The configuration `launch` runs unless told otherwise, by the rows a call may hold per expert
# (`default_config`): 128-row tiles below WIDE_TILE_ROWS rows per expert, or for MXFP4 weights;
# the tiles of 256 weight rows over two consumer warpgroups from there. Measured (H100, GEMMs alone
# at 8192 tokens, bench_native_gemm.py): the wide tiles walking from the counter took less than
# the default's time at 512 rows per expert (Qwen3-MoE: 0.92-0.94x) and at 2048 (Mixtral: 0.90-0.95x),
# and 1.09-1.10x at 192 (DeepSeek-V4, whose last 128-row chunk leaves one of two warpgroups idle).
DEFAULT_CONFIG = 0
WIDE_CONFIG = 3
WIDE_TILE_ROWS = 512
# How persistent CTAs walk the tiles with bf16 weights (`launch`'s `dynamic`): in order from a
# counter zeroed before each launch, or statically, CTA b taking tiles b, b + grid, ... The static
# walk lets CTAs drift apart once tile times differ, so the chunks that share a weight tile stop
# running together and read it from memory again. None: the configurations in DYNAMIC_CONFIGS walk
# from the counter (the wide tiles: 0.72-0.99x their static walk's time in the same run), the
# others statically (configuration 0: 0.88-1.18x, no consistent gain); True / False: every
# persistent configuration one way.
DYNAMIC_WALK = None
DYNAMIC_CONFIGS = (WIDE_CONFIG,)
# A's rows in L2: evict last (True: an expert's rows are read again by the CTAs of its other column
# tiles) or normal (False: rows that outgrow L2, kept last, could push out the weight tiles). Normal
# lines measured no better, even for Mixtral's 58 MB of rows per expert (wide tiles from the
# counter: 0.94-1.07x the time of evict-last over the three bf16 presets' GEMMs).
ROWS_EVICT_LAST = True
# Which TMA loads carry their L2 policy operand (a mask of POLICY_WEIGHTS, the weight tile's
# evict-normal, and POLICY_ROWS, A's rows' policy above), per configuration; LOAD_POLICIES' absent
# configurations carry both. Loads without the operand are open to Hopper's L2 request coalescer,
# which merges reads of the same sectors by SMs at about the same time, as the Triton GEMM's are;
# with it they were hardly ever merged (Nsight Compute, H100). Configuration 3 from the counter
# took 0.91-0.94x (dense), 0.94x (DeepSeek-V4 GEMM1), 0.94-0.95x (Mixtral) and 0.90-0.99x (Qwen3-MoE)
# of its time with both policies (two H100 runs, equal rows per expert). Configuration 0, whose rows
# are read by up to 32 column tiles in turn, gained nothing consistent without either or one of them
# (0.97-1.11x over the same cases; 1.05-1.09x without either in an earlier run), so it keeps both.
POLICY_WEIGHTS, POLICY_ROWS = 1, 2
LOAD_POLICIES = {WIDE_CONFIG: 0}
# Epilogue modes (`grouped_gemm.cu`): plain, gated with the gate half first, gated with gate and up
# interleaved (swigluoai).
PLAIN, GATED_SPLIT, GATED_PAIRS = 0, 1, 2
# The activations the epilogue computes (the silu family: one formula); the others run as GEMM1
# then the activation op (the backend's `fuses`).
EPILOGUE_ACTIVATIONS = frozenset({"silu", "swigluoai", "swigluoai_uninterleave"})
_MAX_INT32 = 2 ** 31 - 1
GROUP_ROWS = 64  # rows of one consumer warpgroup (wgmma M)


def load_policies(config: int) -> int:
    """The load-policy mask configuration `config` launches with (`LOAD_POLICIES`)."""
    return LOAD_POLICIES.get(config, POLICY_WEIGHTS | POLICY_ROWS)


def chunk_rows(config: int) -> int:
    """Rows of a tile's chunk in configuration `config` (`pmoe_gg_pass_rows`)."""
    return GROUP_ROWS * CONFIGS[config][3]


def runs_mxfp4(config: int) -> bool:
    """Whether configuration `config` takes MXFP4 weights: the producer warps upcast a weight row
    per thread, 128 rows."""
    return CONFIGS[config][2] == 128


def default_config(rows_per_expert: float, mxfp4: bool) -> int:
    """The configuration for a call whose buffer holds `rows_per_expert` rows per local expert on
    average (its shape: the counts live on the device). Graph-safe: shapes only."""
    wide = WIDE_TILE_ROWS is not None and rows_per_expert >= WIDE_TILE_ROWS
    if wide and (runs_mxfp4(WIDE_CONFIG) or not mxfp4):
        return WIDE_CONFIG
    return DEFAULT_CONFIG


def _refuse(why: str) -> None:
    raise NotImplementedError(f"the native grouped GEMM (backend 'cuda') {why}")


def check(a: torch.Tensor, w, out: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """Raise NotImplementedError naming the first thing the kernel cannot take (`w` a bf16 tensor
    or an Mxfp4Tensor)."""
    mx = isinstance(w, Mxfp4Tensor)
    if mx and not w.holds_canonical:
        _refuse("reads MXFP4 weights' canonical bytes, which this weight does not hold "
                "(prepare_for(keep_canonical=False)); pass its canonical() form")
    dense = () if mx else (("w", w),)
    for name, t in (("a", a), *dense, ("out", out)):
        if t.dtype != torch.bfloat16:
            _refuse(f"needs bf16 {name}, got {t.dtype}")
        if t.stride(-1) != 1:
            _refuse(f"needs {name} with a contiguous last dimension, got strides {tuple(t.stride())}")
    for name, t in (("a", a), *dense):
        if any(s % 8 for s in t.stride()[:-1]) or t.data_ptr() % 16:
            _refuse(f"needs {name}'s strides in multiples of 8 elements and its data 16-byte aligned "
                    f"(TMA), got strides {tuple(t.stride())}")
    if mx and (any(s % 16 for s in w.blocks.stride()[:-1]) or w.blocks.data_ptr() % 16):
        _refuse(f"reads MXFP4 codes in 16-byte rows: their strides must be multiples of 16 bytes and their "
                f"data 16-byte aligned, got strides {tuple(w.blocks.stride())}")
    if out.data_ptr() % 4 or any(s % 2 for s in out.stride()[:-1]):
        _refuse(f"needs out's strides even and its data 4-byte aligned, got strides {tuple(out.stride())}")
    K = w.shape[2]
    if K % 8 or K == 0:
        _refuse(f"needs K (a's last dimension) a positive multiple of 8, got {K}")
    if out.shape[-1] % 2:
        _refuse(f"needs an even number of output columns, got {out.shape[-1]}")
    _check_rows_experts_bias(a, w.shape[0], bias)


def _check_rows_experts_bias(a: torch.Tensor, L: int, bias: Optional[torch.Tensor]) -> None:
    """What both kernels refuse alike: more rows than 32-bit coordinates address, more than
    MAX_LOCAL_EXPERTS experts, a bias of another dtype than float32 / bf16 or with a strided last
    dimension."""
    if max(a.shape[:-1]) > _MAX_INT32:
        _refuse("addresses rows with 32-bit coordinates; a has more rows than that")
    if L > MAX_LOCAL_EXPERTS:
        _refuse(f"takes at most {MAX_LOCAL_EXPERTS} local experts, got {L}")
    if bias is not None:
        if bias.dtype not in (torch.float32, torch.bfloat16):
            _refuse(f"needs a float32 or bf16 bias, got {bias.dtype}")
        if bias.stride(-1) != 1:
            _refuse(f"needs bias with a contiguous last dimension, got strides {tuple(bias.stride())}")


def _epilogue_args(epilogue, w_rows: int) -> tuple:
    """(mode, activation id, has_limit, limit, alpha, beta) of the kernel's epilogue."""
    if epilogue is None:
        return (PLAIN, -1, 0, 0.0, 1.0, 0.0)
    act = epilogue.activation
    if act.value not in EPILOGUE_ACTIVATIONS:
        _refuse(f"applies only {sorted(EPILOGUE_ACTIVATIONS)} in its epilogue, got {act.value}")
    if w_rows % 2:
        raise ValueError(f"w's rows must be even (gate and up) for gated {act.value}, got {w_rows}")
    (limit, alpha, beta, _, _), flags = epilogue.kernel_args(fast=True)
    mode = GATED_PAIRS if act.interleaved else GATED_SPLIT
    return (mode, flags["ACT"], int(flags["HAS_LIMIT"]), limit, alpha, beta)


def _rows_geometry(a: torch.Tensor, out: torch.Tensor, offsets, counts) -> tuple:
    """(slabs, rows per slab, a's slab and row strides, out's slab and row strides) of a
    GROUPED_CONTIGUOUS call (`offsets`: one slab of the rows both buffers have) or a GROUPED_MASKED
    one; refuses metadata of other dtypes than build_layout's."""
    if offsets is not None and (offsets.dtype != torch.int64 or not offsets.is_contiguous()):
        _refuse(f"reads offsets as contiguous int64 (what build_layout makes), got {offsets.dtype}")
    if counts is not None and (counts.dtype != torch.int32 or not counts.is_contiguous()):
        _refuse(f"reads counts as contiguous int32 (what build_layout makes), got {counts.dtype}")
    if offsets is not None:
        rows = min(a.shape[0], out.shape[0])
        return 1, rows, rows * a.stride(0), a.stride(0), 0, out.stride(0)
    return a.shape[0], a.shape[1], a.stride(0), a.stride(1), out.stride(0), out.stride(1)


def _chunk_bound(flat: bool, rows: int, L: int, chunk: int) -> int:
    """The most chunks of `chunk` rows the experts can hold, from shapes (the counts are on the
    device): a flat buffer of R rows at most cdiv(R, chunk) + L (each expert's last one partial), a
    slab of T rows cdiv(T, chunk) per expert."""
    return cdiv(rows, chunk) + min(L, rows) if flat else L * cdiv(rows, chunk)


def launch(a: torch.Tensor, w, out: torch.Tensor, *, offsets: Optional[torch.Tensor] = None,
           counts: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, epilogue=None,
           config: Optional[int] = None, dynamic: Optional[bool] = None, gather_src: Optional[torch.Tensor] = None,
           top_k: int = 1) -> torch.Tensor:
    """Fill `out` at the rows of each expert (see the module docstring). Exactly one of `offsets`
    (`a` 2-D) and `counts` (`a` 3-D) is given; the caller (`expert_gemm`) has checked the shapes.
    Prepared MXFP4 weights (`takes_rs`) without a config or walk, and without an epilogue or with
    one `rs_fuses` takes, run `launch_rs`. `gather_src`, `top_k`: as `launch_rs`'s (`a` the token
    rows), with bf16 weights or in the RS kernel.
    `dynamic`: the tile walk of a persistent configuration with bf16 weights (None: `DYNAMIC_WALK`,
    and where that is None `DYNAMIC_CONFIGS`); True elsewhere is refused."""
    if (offsets is None) == (counts is None):
        raise ValueError("exactly one of offsets (GROUPED_CONTIGUOUS) and counts (GROUPED_MASKED) must be given")
    if config is not None and not (isinstance(config, int) and 0 <= config < len(CONFIGS)):
        raise ValueError(f"config must be an int in [0, {len(CONFIGS)}), got {config!r}")
    if config is None and dynamic is None and takes_rs(w) \
            and (epilogue is None or rs_fuses(epilogue.activation)):
        return launch_rs(a, w, out, offsets=offsets, counts=counts, bias=bias, epilogue=epilogue,
                         gather_src=gather_src, top_k=top_k)
    if gather_src is not None and isinstance(w, Mxfp4Tensor):
        _refuse("gathers rows with bf16 weights, or with MXFP4 weights in the RS kernel only: prepared (takes_rs), no "
                "config or walk, and no epilogue or one rs_fuses takes")
    check(a, w, out, bias)
    slabs, rows, stride_as, stride_ar, stride_os, stride_or, gather = _geometry(a, out, offsets, counts, gather_src,
                                                                                top_k)
    if config is None:
        per_expert = rows / max(w.shape[0], 1) if offsets is not None else rows
        config = default_config(per_expert, isinstance(w, Mxfp4Tensor))
    block_n = CONFIGS[config][2]
    if isinstance(w, Mxfp4Tensor) and not runs_mxfp4(config):
        _refuse(f"runs MXFP4 weights in 128-row tiles only; configuration {config} has {block_n}")
    walks = CONFIGS[config][1] and not isinstance(w, Mxfp4Tensor)  # the walks a counter can drive
    if dynamic is None:
        dynamic = walks and (config in DYNAMIC_CONFIGS if DYNAMIC_WALK is None else bool(DYNAMIC_WALK))
    elif dynamic and not walks:
        _refuse(f"walks tiles from a counter in persistent configurations with bf16 weights only; configuration "
                f"{config} is {'persistent' if CONFIGS[config][1] else 'one CTA per tile'} with "
                f"{'MXFP4' if isinstance(w, Mxfp4Tensor) else 'bf16'} weights")
    L, w_rows, K = w.shape
    ep = _epilogue_args(epilogue, w_rows)
    N = out.shape[-1]
    width = w_rows if ep[0] == PLAIN else w_rows // 2
    if N != width:
        raise ValueError(f"out has {N} columns, the weight's {w_rows} rows give {width}")
    if L == 0 or N == 0 or rows == 0 or slabs == 0:
        return out
    bias_kind = native.DTYPE_CODES[bias.dtype] if bias is not None else 0
    stride_be = bias.stride(0) if bias is not None else 0
    # One CTA per tile (expert, chunk of rows, block_n weight rows); the grid is the tiles' bound
    # from shapes (`_chunk_bound`). A tile has block_n output columns, half as many when gated.
    chunks = _chunk_bound(offsets is not None, rows, L, chunk_rows(config))
    tile_cols = block_n if ep[0] == PLAIN else block_n // 2
    grid = (chunks * cdiv(N, tile_cols),)
    if grid[0] >= 2 ** 30:  # the kernel's tile ids are 32-bit, its non-persistent step 2^30
        _refuse(f"numbers its tiles in 30 bits; this call would need {grid[0]}")
    if isinstance(w, Mxfp4Tensor):
        q, qs = w.blocks, w.scales
        dense = (None, 0, 0)
        mx = (1, q, qs, q.stride(0), q.stride(1), qs.stride(0), qs.stride(1))
    else:
        dense = (w, w.stride(0), w.stride(1))
        mx = (0, None, None, 0, 0, 0, 0)
    # A fresh zeroed counter per launch (a memset, which a CUDA graph captures): launches on other
    # streams never share one.
    counter = torch.zeros(1, dtype=torch.int32, device=a.device) if dynamic else None
    launch_native(native.GROUPED.entry(ENTRY), grid,
                  (config, a, stride_as, stride_ar, slabs, rows, *dense, L, w_rows, offsets, counts, bias, stride_be,
                   bias_kind, out, stride_os, stride_or, K, N, *ep, *mx, counter, int(ROWS_EVICT_LAST),
                   load_policies(config), *gather))
    return out


def takes_rs(w) -> bool:
    """Whether `w` runs the RS kernel: an Mxfp4Tensor with its prepared form in 4 planes with
    folded scales (what `prepare_for()` makes for scales up to `mxfp4.FOLD_MAX_SCALE`)."""
    h = getattr(w, "hopper", None) if isinstance(w, Mxfp4Tensor) else None
    return h is not None and h.planes == 4 and h.folded


def rs_fuses(activation) -> bool:
    """Whether the RS kernel's epilogue applies `activation` (a `MoEActivation`) where the backend
    asks: the silu family while `RS_EPILOGUE` is on, with gate / up halves also `RS_EPILOGUE_SPLIT`."""
    return (RS_EPILOGUE and activation.value in EPILOGUE_ACTIVATIONS
            and (activation.interleaved or RS_EPILOGUE_SPLIT))


def rs_wide(rows: int, L: int, flat: bool) -> bool:
    """Whether the RS kernel runs wide chunks (`RS_WIDE`, else `RS_WIDE_ROWS`) for rows per expert
    estimated from shapes: a flat buffer's rows over the L experts, a slab's rows."""
    if RS_WIDE is not None:
        return bool(RS_WIDE)
    per_expert = rows / max(L, 1) if flat else rows
    return RS_WIDE_ROWS[0] <= per_expert < RS_WIDE_ROWS[1]


def launch_rs(a: torch.Tensor, w: Mxfp4Tensor, out: torch.Tensor, *, offsets: Optional[torch.Tensor] = None,
              counts: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, epilogue=None,
              stages: Optional[int] = None, wide: Optional[bool] = None, gather_src: Optional[torch.Tensor] = None,
              top_k: int = 1) -> torch.Tensor:
    """`launch` for prepared MXFP4 weights (`takes_rs`): `out[row] = a[row] @ W[e].T (+ bias[e])`
    at each expert's rows, W the dequantized weight. Same layouts and arguments as `launch`;
    `epilogue` (GEMM1) one of the silu family; `wide`: chunks of
    RS_WIDE_CHUNK_ROWS rows instead of RS_CHUNK_ROWS (None: `rs_wide`); `stages` 3 or 4, 3 only for
    wide chunks (None: `RS_STAGES`, `RS_WIDE_STAGES` for wide chunks).
    `gather_src` (int32, GROUPED_CONTIGUOUS only: the layout's `src`): `a` holds the token rows
    `[T, K]` and row r of `out` is computed from `a[gather_src[r] // top_k]` (a slot outside
    [0, T * top_k) as a row of zeros), read as the kernel loads it: no permuted copy."""
    if (offsets is None) == (counts is None):
        raise ValueError("exactly one of offsets (GROUPED_CONTIGUOUS) and counts (GROUPED_MASKED) must be given")
    if stages not in (None, 3, 4):
        raise ValueError(f"stages must be 3 or 4, got {stages!r}")
    if not takes_rs(w):
        _refuse("runs MXFP4 weights in the RS kernel only in their prepared form with 4 planes and folded scales "
                "(Mxfp4Tensor.prepare_for())")
    h = w.hopper
    for name, t in (("a", a), ("out", out)):
        if t.dtype != torch.bfloat16:
            _refuse(f"needs bf16 {name}, got {t.dtype}")
        if t.stride(-1) != 1 or any(st % 8 for st in t.stride()[:-1]) or t.data_ptr() % 16:
            _refuse(f"needs {name} with a contiguous last dimension, other strides in multiples of 8 elements and "
                    f"its data 16-byte aligned (TMA reads, 16-byte stores), got strides {tuple(t.stride())}")
    L, w_rows, K = w.shape
    words, scales = h.blocks, h.scales
    ep = _epilogue_args(epilogue, w_rows)
    width = w_rows if ep[0] == PLAIN else w_rows // 2
    if width % 8:
        _refuse(f"needs its output columns a multiple of 8, got {width}")
    if words.stride(-1) != 1 or scales.stride(-1) != 1 or any(st % 4 for st in words.stride()[:-1]) \
            or any(st % 8 for st in scales.stride()[:-1]) or words.data_ptr() % 16 or scales.data_ptr() % 16:
        _refuse(f"reads the prepared words and scales by TMA: rows contiguous, strides multiples of 16 bytes, data "
                f"16-byte aligned; got strides {tuple(words.stride())} and {tuple(scales.stride())}")
    if out.shape[-1] != width:
        raise ValueError(f"out has {out.shape[-1]} columns, the weight's {w_rows} rows give {width}")
    if a.shape[-1] != K:
        raise ValueError(f"a has {a.shape[-1]} columns, the weight's K is {K}")
    _check_rows_experts_bias(a, L, bias)
    slabs, rows, stride_as, stride_ar, stride_os, stride_or, gather = _geometry(a, out, offsets, counts, gather_src,
                                                                                top_k)
    if L == 0 or w_rows == 0 or rows == 0 or slabs == 0:
        return out
    asked = wide
    if wide is None:
        wide = rs_wide(rows, L, offsets is not None)
    if stages is None:
        stages = RS_WIDE_STAGES if wide else RS_STAGES
    elif stages == 4 and wide:
        why = "asked for" if asked else "chosen by RS_WIDE / RS_WIDE_ROWS for these shapes"
        raise ValueError(f"stages must be 3 with wide chunks (shared memory holds no more), got 4; wide chunks {why}")
    # The tiles' bound from shapes, as `launch`'s: chunks of RS_CHUNK_ROWS (wide: RS_WIDE_CHUNK_ROWS)
    # rows times the weight's tiles of RS_BLOCK_N rows; the kernel launches min(this, SMs) persistent
    # CTAs (`RS_PERSISTENT`), else this many.
    chunk = RS_WIDE_CHUNK_ROWS if wide else RS_CHUNK_ROWS  # the kernel's chunks: chunk / GROUP_ROWS boxes
    chunks = _chunk_bound(offsets is not None, rows, L, chunk)
    grid = (chunks * cdiv(width, RS_BLOCK_N if ep[0] == PLAIN else RS_BLOCK_N // 2),)
    if grid[0] >= 2 ** 30:  # tile ids are 32-bit; a persistent CTA's last step passes the bound
        _refuse(f"numbers its tiles in 30 bits; this call would need {grid[0]}")
    bias_kind = native.DTYPE_CODES[bias.dtype] if bias is not None else 0
    stride_be = bias.stride(0) if bias is not None else 0
    # A fresh zeroed counter per launch (a memset, which a CUDA graph captures), as `launch`'s; one CTA
    # per tile (RS_PERSISTENT off) walks nothing.
    counter = torch.zeros(1, dtype=torch.int32, device=a.device) if RS_DYNAMIC and RS_PERSISTENT else None
    launch_native(native.GROUPED.entry(RS_ENTRY), grid,
                  (stages, a, stride_as, stride_ar, slabs, rows, K, words, words.stride(0), words.stride(1), scales,
                   scales.stride(0), scales.stride(1), L, w_rows, h.k_padded, offsets, counts, bias, stride_be,
                   bias_kind, out, stride_os, stride_or, int(RS_COLUMNS_FIRST), int(RS_PERSISTENT),
                   chunk // GROUP_ROWS, *ep, int(RS_TAIL_PIECES), counter, *gather))
    return out


def _geometry(a: torch.Tensor, out: torch.Tensor, offsets, counts, gather_src: Optional[torch.Tensor],
              top_k: int) -> tuple:
    """`_rows_geometry`'s (slabs, rows, a's and out's strides) and the kernels' gather arguments (the
    slots, top_k and a's token rows; none when the rows are a's own). Gathering, `a` holds the token
    rows and the flat buffer's rows are out's, each with its slot in `gather_src`."""
    if gather_src is None:
        return (*_rows_geometry(a, out, offsets, counts), (None, 1, 0))
    _check_gather(a, gather_src, top_k, offsets)
    _, out_rows, _, _, stride_os, stride_or = _rows_geometry(out, out, offsets, counts)
    rows = min(out_rows, gather_src.shape[0]) if a.shape[0] else 0
    return 1, rows, a.shape[0] * a.stride(0), a.stride(0), stride_os, stride_or, (gather_src, top_k, a.shape[0])


def _check_gather(a: torch.Tensor, src: torch.Tensor, top_k: object, offsets: Optional[torch.Tensor]) -> None:
    """What gathered rows need (`gather_src`): a flat layout, int32 slots, a positive top_k, token
    rows `a` 2-D and slots that 32 bits count. The 16-byte pieces the kernels copy need K a multiple
    of 8: `check` refuses other K for bf16 weights, and an MXFP4 weight's K is one of 32."""
    if offsets is None:
        raise ValueError("gather_src gathers the rows of a flat GROUPED_CONTIGUOUS buffer: give offsets, not counts")
    if not isinstance(src, torch.Tensor) or src.dtype != torch.int32 or src.dim() != 1 or not src.is_contiguous():
        got = f"{src.dtype} {tuple(src.shape)}" if isinstance(src, torch.Tensor) else type(src).__name__
        raise ValueError(f"gather_src must be a contiguous 1-D int32 tensor (the layout's src), got {got}")
    if src.device != a.device:
        raise ValueError(f"gather_src must be on a's device {a.device}, got {src.device}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if a.dim() != 2:
        raise ValueError(f"a must be the token rows [T, K] when gathering, got shape {tuple(a.shape)}")
    if a.shape[0] * top_k > _MAX_INT32:
        _refuse(f"counts gathered slots in 32 bits; {a.shape[0]} tokens x top_k {top_k} is more")
