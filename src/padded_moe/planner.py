"""Scratch planner for expert parallelism, and the `padded-moe plan` command.

Sizes every buffer one rank needs for one MoE layer under `ExpertParallel` — the EP buffers from the
same description the transports allocate from (`padded_moe.ep.wire.ep_buffer_specs`, laid out in
storages by the transport's policy, `padded_moe.ep.transport.storage_plan`), the expert workspace exactly as
`fused_experts` (flat) / `batched_experts` (batched) allocates it, combine's output — plus the
layer's local weights, and says whether that fits the memory given. Worst case on one rank: flat
mode receives `R*T` tokens, so the GEMM buffers hold `R*T*k` rows (sizing them from `T*k`
under-sizes by a factor R); batched mode reserves `R*T` rows for *each* local expert.

`gpu_mem_gb` is the memory this layer may use (GiB, 2^30 bytes): the device memory minus what the
rest of the model (other layers' weights, KV cache, activations) already holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from padded_moe._util import itemsize
from padded_moe._validation import require_bool
from padded_moe.ep.transport import storage_plan, transport_names
from padded_moe.ep.wire import EPGeometry, WireFormat, ep_buffer_specs
from padded_moe.mxfp4 import HOPPER_KB, canonical_kept
from padded_moe.presets import PRESETS, MoEPreset, get_preset

GIB = 1 << 30
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_SEARCH_T = 1 << 24


@dataclass(frozen=True)
class Buffer:
    """One allocation: `group` is "ep" (reserved by ExpertParallel), "experts" (expert workspace),
    "combine" (transients of combine) or "weights"."""

    name: str
    shape: tuple
    dtype: torch.dtype
    group: str
    note: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class Plan:
    preset: str
    ranks: int
    max_tokens: int
    mode: str
    dtype: torch.dtype
    wire_dtype: torch.dtype
    weight_format: str
    num_local: int
    buffers: tuple
    gpu_mem_bytes: int
    max_tokens_that_fit: int = field(default=0)
    transport: str = field(default="nccl")

    def bytes_of(self, group: str) -> int:
        return sum(b.nbytes for b in self.buffers if b.group == group)

    @property
    def weights_bytes(self) -> int:
        return self.bytes_of("weights")

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.gpu_mem_bytes


def _resolve_shapes(preset_or_shapes) -> MoEPreset:
    if isinstance(preset_or_shapes, MoEPreset):
        return preset_or_shapes
    if isinstance(preset_or_shapes, str):
        return get_preset(preset_or_shapes)
    if isinstance(preset_or_shapes, dict):
        need = ("num_experts", "top_k", "hidden_size", "intermediate_size")
        missing = [k for k in need if k not in preset_or_shapes]
        if missing:
            raise ValueError(f"preset_or_shapes dict must have keys {need}, missing {missing}")
        d = dict(preset_or_shapes)
        return MoEPreset(d.pop("name", "custom"), d.pop("num_experts"), d.pop("top_k"), d.pop("hidden_size"),
                         d.pop("intermediate_size"), d.pop("activation", "silu"), **d)
    raise TypeError(f"preset_or_shapes must be a preset name, a MoEPreset or a dict of shapes, "
                    f"got {type(preset_or_shapes).__name__}")


def _weights(p: MoEPreset, L: int, weight_format: str, dtype: torch.dtype, keep_canonical: bool = False) -> list:
    G, K, N = p.w13_rows, p.hidden_size, p.intermediate_size
    if weight_format == "mxfp4":
        out = []
        # The canonical bytes (2 elements per byte + one E8M0 scale per 32 elements) stay next to
        # the prepared form only as `FusedMoE` keeps them: asked to, or where a width is padded.
        if canonical_kept(keep_canonical, K, N):
            out += [Buffer("w13 blocks (MXFP4)", (L, G, K // 2), torch.uint8, "weights"),
                    Buffer("w13 scales (E8M0)", (L, G, K // 32), torch.uint8, "weights"),
                    Buffer("w2 blocks (MXFP4)", (L, K, N // 2), torch.uint8, "weights"),
                    Buffer("w2 scales (E8M0)", (L, K, N // 32), torch.uint8, "weights")]
        # The GEMM's prepared arrangement (`Mxfp4Tensor.prepare_for`, done at load), K padded to
        # whole blocks.
        for name, rows, cols in (("w13", G, K), ("w2", K, N)):
            kp = -(-cols // HOPPER_KB) * HOPPER_KB
            # Its scales are bf16 factors (2 bytes) when every scale is at most FOLD_MAX_SCALE, as
            # in real checkpoints; counted at that size, an upper bound.
            out += [Buffer(f"{name} blocks (MXFP4, prepared)", (L, rows, kp // 2), torch.uint8, "weights"),
                    Buffer(f"{name} scales (bf16 factors, prepared)", (L, kp // 32, rows), torch.int16, "weights")]
    elif weight_format == "bf16":
        out = [Buffer("w13", (L, G, K), dtype, "weights"), Buffer("w2", (L, K, N), dtype, "weights")]
    else:
        raise ValueError(f"weight_format must be 'bf16' or 'mxfp4', got {weight_format!r}")
    if p.has_bias:
        out += [Buffer("w13 bias", (L, G), dtype, "weights"), Buffer("w2 bias", (L, K), dtype, "weights")]
    return out


def _ep_buffers(R: int, T: int, E: int, K: int, k: int, L: int, mode: str, dtype, fp8: bool, transport: str) -> list:
    """The EP buffers as `transport` allocates them: one row per storage of its policy."""
    specs = ep_buffer_specs(EPGeometry(R, T, E, WireFormat(K, k, dtype, fp8)), mode, L)
    by_name = {s.name: s for s in specs}
    out = []
    for st in storage_plan(transport, specs):
        first = by_name[st.buffers[0]]
        if len(st.buffers) == 1:
            out.append(Buffer(first.label, first.shape, first.dtype, "ep", first.note))
            continue
        rows = first.shape[0]
        shape = (rows, st.nbytes // rows) if st.nbytes % rows == 0 else (st.nbytes,)
        shared = ", ".join(by_name[n].label for n in st.buffers[1:])
        note = "; ".join(n for n in (first.note, f"{shared} reuses it") if n)
        out.append(Buffer(first.label, shape, torch.uint8, "ep", note))
    return out


def _expert_buffers(p: MoEPreset, R: int, T: int, L: int, mode: str, dtype) -> list:
    """The expert workspace as the pipeline allocates it: `experts.expert_workspace` and, in flat
    mode (fused_experts on R*T received tokens, GROUPED_CONTIGUOUS), the layout's `PermuteScratch`
    built on the meta device (its index arena and its permuted-rows buffer)."""
    from padded_moe.experts import expert_workspace
    from padded_moe.layouts import GemmLayout, PermuteScratch

    K, rows = p.hidden_size, R * T
    flat = mode == "flat"
    work = expert_workspace(rows, p.top_k, K, p.w13_rows, p.intermediate_size, num_local=None if flat else L)
    out = [Buffer(b.label, b.shape, dtype, "experts") for b in work]
    if flat:
        scratch = PermuteScratch(rows, p.top_k, p.num_experts, L, torch.device("meta"))
        permuted = scratch.permute_buffer(GemmLayout.GROUPED_CONTIGUOUS, K, dtype)
        arena = sum(t.untyped_storage().nbytes() for t in vars(scratch).values() if isinstance(t, torch.Tensor))
        out = [Buffer("permuted A", (permuted.numel() // K, K), dtype, "experts")] + out
        out.append(Buffer("layout metadata", (arena,), torch.uint8, "experts"))
    return out


def _combine_buffers(R: int, T: int, K: int, mode: str, dtype) -> list:
    # The partial sums travel in the EP buffers and are reduced in registers (CUDA path): only the
    # output is allocated. (The torch path's gathered partials are CPU-only transients.)
    return [Buffer("combine output", (T, K), dtype, "combine")]


def _buffers(p, R, T, mode, dtype, fp8, weight_format, transport, keep_canonical) -> tuple[list, int]:
    L = math.ceil(p.num_experts / R)  # the busiest rank (linear placement puts the remainder first)
    bufs = _weights(p, L, weight_format, dtype, keep_canonical)
    bufs += _ep_buffers(R, T, p.num_experts, p.hidden_size, p.top_k, L, mode, dtype, fp8, transport)
    bufs += _expert_buffers(p, R, T, L, mode, dtype)
    bufs += _combine_buffers(R, T, p.hidden_size, mode, dtype)
    return bufs, L


def plan(preset_or_shapes: Union[str, MoEPreset, dict], ranks: int, max_tokens: int, gpu_mem_gb: float, *,
         mode: str = "flat", dtype: torch.dtype = torch.bfloat16, dispatch_dtype: Optional[torch.dtype] = None,
         weight_format: Optional[str] = None, transport: Optional[str] = None,
         keep_canonical: bool = False) -> Plan:
    """Every buffer of one rank for `max_tokens` (T) tokens per rank on `ranks` (R) EP ranks, as
    `transport` allocates them (None: "nccl", the collectives. The planner sees no process group, so
    it never guesses; `ExpertParallel` picks "symm_mem" by itself on one CUDA node: plan that with
    transport="symm_mem"). MXFP4 weights are counted as `FusedMoE(..., keep_canonical=...)` holds
    them: the prepared form, plus the canonical bytes when kept."""
    p = _resolve_shapes(preset_or_shapes)
    for name, v, lo in (("ranks", ranks, 1), ("max_tokens", max_tokens, 1)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    if isinstance(gpu_mem_gb, bool) or not isinstance(gpu_mem_gb, (int, float)):
        raise TypeError(f"gpu_mem_gb must be a number of GiB, got {type(gpu_mem_gb).__name__}")
    if not (math.isfinite(gpu_mem_gb) and gpu_mem_gb > 0):
        raise ValueError(f"gpu_mem_gb must be a finite number of GiB > 0, got {gpu_mem_gb}")
    if mode not in ("flat", "batched"):
        raise ValueError(f"mode must be 'flat' or 'batched', got {mode!r}")
    if dispatch_dtype not in (None, dtype, torch.float8_e4m3fn):
        raise ValueError(f"dispatch_dtype must be None, dtype or torch.float8_e4m3fn, got {dispatch_dtype}")
    transport = "nccl" if transport is None else transport
    if transport not in transport_names():
        raise ValueError(f"transport must be one of {transport_names()}, got {transport!r}")
    fmt = weight_format or p.weight_format
    require_bool("keep_canonical", keep_canonical)
    fp8 = dispatch_dtype == torch.float8_e4m3fn
    mem = int(gpu_mem_gb * GIB)

    def total(T):
        return sum(b.nbytes for b in _buffers(p, ranks, T, mode, dtype, fp8, fmt, transport, keep_canonical)[0])

    bufs, L = _buffers(p, ranks, max_tokens, mode, dtype, fp8, fmt, transport, keep_canonical)
    return Plan(p.name, ranks, max_tokens, mode, dtype, torch.float8_e4m3fn if fp8 else dtype, fmt, L,
                tuple(bufs), mem, _largest_fitting(total, mem), transport)


def _largest_fitting(total, mem: int) -> int:
    """Largest T with total(T) <= mem (total grows with T); 0 when even T=1 does not fit."""
    if total(1) > mem:
        return 0
    lo, hi = 1, 2
    while hi < MAX_SEARCH_T and total(hi) <= mem:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= mem else (lo, mid)
    return lo


# ---------------------------------------------------------------------------- CLI
def add_arguments(parser) -> None:
    parser.add_argument("--preset", default="dsv4-flash", choices=sorted(PRESETS), help="model preset")
    parser.add_argument("--ranks", type=int, default=2, help="expert-parallel ranks R")
    parser.add_argument("--max-tokens", type=int, default=512, help="max tokens per rank T")
    parser.add_argument("--gpu-mem", type=float, default=139.0,
                        help="memory this MoE layer may use, GiB (device memory minus the rest of the model)")
    parser.add_argument("--mode", choices=("flat", "batched"), default="flat")
    parser.add_argument("--weight-format", choices=("bf16", "mxfp4"), default=None,
                        help="default: the preset's")
    parser.add_argument("--keep-canonical", action="store_true",
                        help="MXFP4: count the canonical bytes next to the prepared form (FusedMoE(keep_canonical=True))")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype")
    parser.add_argument("--dispatch-dtype", choices=("same", "fp8"), default="same",
                        help="wire format of dispatched rows")
    parser.add_argument("--transport", choices=transport_names(), default=None,
                        help="EP transport whose allocations to size (default: nccl; ExpertParallel picks symm_mem "
                             "by itself when every rank is on one CUDA node)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")


def _human(n: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def plan_to_dict(pl: Plan) -> dict:
    return dict(preset=pl.preset, ranks=pl.ranks, max_tokens=pl.max_tokens, mode=pl.mode, transport=pl.transport,
                dtype=_dtype_name(pl.dtype), wire_dtype=_dtype_name(pl.wire_dtype),
                weight_format=pl.weight_format, num_local=pl.num_local,
                buffers=[dict(name=b.name, shape=list(b.shape), dtype=_dtype_name(b.dtype), group=b.group,
                              bytes=b.nbytes, note=b.note) for b in pl.buffers],
                weights_bytes=pl.weights_bytes, total_bytes=pl.total_bytes, gpu_mem_bytes=pl.gpu_mem_bytes,
                fits=pl.fits, max_tokens_that_fit=pl.max_tokens_that_fit)


def verdict(pl: Plan) -> str:
    if pl.fits:
        return (f"Fits: {_human(pl.total_bytes)} of {_human(pl.gpu_mem_bytes)}; the largest T that fits is "
                f"{pl.max_tokens_that_fit}.")
    if pl.max_tokens_that_fit == 0:
        return (f"Does not fit: {_human(pl.total_bytes)} needed, {_human(pl.gpu_mem_bytes)} available; "
                f"even T=1 does not fit (the weights alone take {_human(pl.weights_bytes)}).")
    return (f"Does not fit: T={pl.max_tokens} tokens per rank on {pl.ranks} ranks ({pl.mode} mode) needs "
            f"{_human(pl.total_bytes)}, {_human(pl.gpu_mem_bytes)} available; the largest T that fits is "
            f"{pl.max_tokens_that_fit} (--max-tokens {pl.max_tokens_that_fit}).")


def run_cli(args) -> int:
    dtype = DTYPES[args.dtype]
    try:
        pl = plan(args.preset, args.ranks, args.max_tokens, args.gpu_mem, mode=args.mode, dtype=dtype,
                  dispatch_dtype=torch.float8_e4m3fn if args.dispatch_dtype == "fp8" else None,
                  weight_format=args.weight_format, transport=getattr(args, "transport", None),
                  keep_canonical=getattr(args, "keep_canonical", False))
    except (TypeError, ValueError) as exc:
        print(f"padded-moe plan: {exc}")
        return 2
    if getattr(args, "json", False):
        import json

        print(json.dumps(plan_to_dict(pl), indent=2))
        return 0 if pl.fits else 1
    _print_table(pl)
    return 0 if pl.fits else 1


def _print_table(pl: Plan) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (f"{pl.preset}: {pl.ranks} ranks, T={pl.max_tokens} tokens/rank, {pl.mode} mode, "
             f"{pl.transport} transport, "
             f"{_dtype_name(pl.dtype)} activations ({_dtype_name(pl.wire_dtype)} on the wire), "
             f"{pl.weight_format} weights, {pl.num_local} local experts")
    table = Table(title=title)
    for col in ("buffer", "shape", "dtype", "bytes", "group"):
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for b in pl.buffers:
        group = b.group + (f" ({b.note})" if b.note else "")
        table.add_row(b.name, "x".join(map(str, b.shape)), _dtype_name(b.dtype), _human(b.nbytes), group)
    for g in ("weights", "ep", "experts", "combine"):
        table.add_row(f"[bold]total {g}", "", "", f"[bold]{_human(pl.bytes_of(g))}", "")
    table.add_row("[bold]total", "", "", f"[bold]{_human(pl.total_bytes)}", f"of {_human(pl.gpu_mem_bytes)}")
    console = Console(width=140)
    console.print(table)
    console.print(verdict(pl))
