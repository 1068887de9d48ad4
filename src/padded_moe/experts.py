"""The fused expert call: layout → (permute) → GEMM1 → activation → GEMM2 → unpermute.

On the Triton backend GEMM1 applies the activation (`MoEActivation`) in its epilogue (`expert_gemm(activation=)`)
where that is measured faster (`PADDED_MOE_FUSE_ACTIVATION` overrides) and writes only the
activation's `[rows, N]`; otherwise GEMM1 writes `[rows, 2N]` and the activation op follows.
The activation always receives the layout's valid-prefix count, so rows that hold padding
(dropped slots, tokens past `valid_tokens`, capacity past an expert's count) are never activated,
and the GEMMs skip them by reading their bounds on the device. With a scratch object every
intermediate buffer is allocated once, so steady-state calls allocate nothing and the whole call
captures in a CUDA graph.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from padded_moe._ops import custom_op, register_fake
from padded_moe._util import cdiv, next_pow2
from padded_moe._validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    require_dtype,
    require_last_dim_contiguous,
    require_rank,
    require_tensor,
    require_weight,
)
from padded_moe.activation import (
    ApplyMoEActivationConfig,
    MoEActivation,
    apply_moe_activation,
    resolve_supported,
)
from padded_moe.decode import DECODE_ENV, decode_allowed, decode_experts, fits_decode
from padded_moe.expert_map import ExpertMap, check_topk_ids, check_valid_tokens
from padded_moe import backends
from padded_moe.backends import BACKEND_ENV, effective_backend, resolve_backend
from padded_moe.gemm import FUSE_ENV, check_bias, check_weight_storage, expert_gemm, fuse_activation_mode
from padded_moe.layouts import (
    LAYOUT_ENV,
    GemmLayout,
    GroupedMaskedMeta,
    PermuteScratch,
    build_layout_resolved,
    check_expected_m,
    permute,
    select_gemm_layout,
    unpermute,
)
from padded_moe.mxfp4 import HopperMxfp4, Mxfp4Tensor


def _check_weights(act: Optional[MoEActivation], w13, w2, x: torch.Tensor, x_name: str) -> tuple[int, int]:
    """Return (num_local, N) after checking w13 [L, 2N|N, K] and w2 [L, K, N] against the
    activations `x` (named `x_name`: K its last dimension, its dtype unless a weight is MXFP4, its
    device). `act` None (a callable activation): w13's width is the callable's business, N is w2's."""
    hidden_size = x.shape[-1]
    for name, w in (("w13", w13), ("w2", w2)):
        require_weight(name, w)
        check_weight_storage(w, x, name=name, a_name=x_name)
    s13, s2 = tuple(w13.shape), tuple(w2.shape)
    if len(s13) != 3 or len(s2) != 3:
        raise ValueError(f"w13 and w2 must be 3-D [L, out, in], got shapes {s13} and {s2}")
    num_local, rows13, k13 = s13
    if k13 != hidden_size:
        raise ValueError(f"w13 must be [L, 2N, K] with K = hidden size {hidden_size}, got {s13}")
    n = s2[2] if act is None else rows13 // 2 if act.is_gated else rows13
    if act is not None and act.is_gated and rows13 % 2:
        raise ValueError(f"w13's rows must be even (gate and up) for gated {act.value}, got {s13}")
    if s2 != (num_local, hidden_size, n):
        raise ValueError(f"w2 must have shape {(num_local, hidden_size, n)} (L, K, N), got {s2}")
    return num_local, n


@dataclass(frozen=True)
class WorkspaceBuffer:
    """One intermediate buffer of the expert pipeline. `name` keys it on a `PermuteScratch`
    (`PermuteScratch.workspace`); `label` names it in the planner's table; `returned` marks the
    buffer handed back to the caller (never taken from the eager cache, whose buffers the next
    call overwrites)."""

    name: str
    label: str
    shape: tuple
    returned: bool = False


def expert_workspace(num_tokens: int, top_k: int, hidden_size: int, w13_rows: int, n: int, *,
                     num_local: Optional[int] = None) -> tuple[WorkspaceBuffer, ...]:
    """The buffers `fused_experts` (flat: `num_local` None, `[M*k, .]` rows) or `batched_experts`
    (`[L, T, .]` slabs with `T = num_tokens`, `top_k` unused) allocates besides the layout's
    own (`PermuteScratch`): the one description both allocate from and the planner sizes (the
    worst case: a call whose GEMM1 applies the activation allocates no GEMM1 output)."""
    if num_local is None:
        rows = (num_tokens * top_k,)
        return (WorkspaceBuffer("gemm1", "GEMM1 out", rows + (w13_rows,)),
                WorkspaceBuffer("act", "activation out", rows + (n,)),
                WorkspaceBuffer("gemm2", "GEMM2 out", rows + (hidden_size,)),
                WorkspaceBuffer("out", "experts out (unpermuted)", (num_tokens, hidden_size), returned=True))
    rows = (num_local, num_tokens)
    return (WorkspaceBuffer("gemm1", "GEMM1 out", rows + (w13_rows,)),
            WorkspaceBuffer("act", "activation out", rows + (n,)),
            WorkspaceBuffer("out", "GEMM2 out = experts out", rows + (hidden_size,), returned=True))


def _allocate(scratch: Optional[PermuteScratch], buf: WorkspaceBuffer, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """`buf` from the scratch (allocated there on first use), or a fresh tensor without one."""
    if scratch is None:
        return torch.empty(buf.shape, dtype=dtype, device=device)
    return scratch.workspace(buf.name, buf.shape, dtype)


def layout_for_call(layout, expert_parallel: bool) -> GemmLayout:
    """The layout a `fused_experts` call runs for its `layout` argument (None: the library's
    choice, or `PADDED_MOE_GEMM_LAYOUT`), with or without an expert map."""
    override = layout.value if isinstance(layout, GemmLayout) else layout
    return select_gemm_layout(expert_parallel=expert_parallel, batched_format=False, override=override)


def fused_experts(hidden_states: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  activation: Union[str, MoEActivation, RowFunction],
                  activation_config: Optional[ApplyMoEActivationConfig] = None,
                  expert_map: Optional[ExpertMap] = None,
                  layout: Union[None, str, GemmLayout] = None,
                  w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None,
                  valid_tokens: Optional[torch.Tensor] = None,
                  backend: str = "auto", scratch=None,
                  output_transform: Optional[RowFunction] = None,
                  expected_m: Optional[int] = None) -> torch.Tensor:
    """Routed MoE experts on `hidden_states [M, K]`; returns `[M, K]` in the input's dtype.

    `topk_ids` hold global expert ids; ids outside `[0, E)` and (with `expert_map`) non-local ids
    are dropped. `layout=None` picks INDEXED without expert parallelism and GROUPED_CONTIGUOUS
    with it (docs/usage.md, "GEMM layouts"); a string or `GemmLayout` overrides (validated). With `valid_tokens`
    (int32 `[1]` on device) only the first rows are real; output rows at or past it are not
    written (their contents are unspecified).

    `expected_m` (an int >= 0, GROUPED_CONTIGUOUS): about how many rows each local expert
    receives, for a buffer with room for far more tokens than it holds (an expert-parallel receive
    buffer, a padded batch behind `valid_tokens`); the GEMMs then run the tiles sized for that many
    rows instead of for `M*k / L`. Every valid row is computed whatever the hint says. INDEXED
    (the default without `expert_map`) refuses it: pass `layout="grouped_contiguous"`.

    Under `torch.compile` the whole call is one opaque custom op (`padded_moe::fused_experts`)
    that returns a fresh tensor; `scratch` is then not used (the compiler owns that memory).

    MXFP4 weights (`Mxfp4Tensor`) run fastest prepared: call `w13 = w13.prepare_for()` (and the
    same for `w2`) once after loading — it adds the GEMM's arrangement of the same bytes
    (`HopperMxfp4`), which every later call uses. Unprepared weights still work, on the slower
    `tl.dot_scaled` kernel; `FusedMoE` and the transformers plug-in prepare theirs.

    A model whose activation is not a `MoEActivation` passes it as a callable `activation(h) -> g`
    (and a model with a norm between GEMM2 and the router weighting passes `output_transform(y)
    -> y'`). The contract of both: called once per call, eagerly, with GEMM1's (GEMM2's) output
    rows `h [M*k, W]` (`y [M*k, K]`) in the layout's row order, in the activation dtype; return a
    tensor of the same row count and dtype, `[M*k, N]` with `N = w2.shape[2]` (`[M*k, K]`). The
    function must be row-wise (output row i depends on input row i only): GEMM2 (unpermute) reads
    only the rows of valid slots, so only those rows of the result are ever used, and the other
    rows of the input (dropped slots, tokens at/after `valid_tokens`, padding) hold unspecified
    values, possibly NaN. The rows are not compacted to the valid ones, because their number is
    only known on the device (reading it would cost a host sync per call). A callable cannot
    travel through the custom op, so under `torch.compile` such a call leaves the graph and runs
    eagerly (a graph break: `fullgraph=True` refuses it), the callable included; `activation_config`
    must then be None.
    """
    if scratch is None and output_transform is None and expert_map is None:
        # Inside `eager_cache_off` (a custom op's implementation) the call allocates its buffers,
        # and so does its plan: the key says which.
        key = _plan_key(hidden_states, topk_weights, topk_ids, valid_tokens, (w13, w2, w13_bias, w2_bias),
                        plan_options(activation, activation_config, layout, backend, expected_m),
                        eager_cache=not eager_cache_is_off())
        return planned_call(key, (hidden_states, topk_weights, topk_ids, valid_tokens), lambda: _fused_experts(
            hidden_states, w13, w2, topk_weights, topk_ids, activation, activation_config, None, layout,
            w13_bias, w2_bias, valid_tokens, backend, None, None, expected_m))
    return _fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, activation, activation_config, expert_map,
                          layout, w13_bias, w2_bias, valid_tokens, backend, scratch, output_transform, expected_m)


def _fused_experts(hidden_states, w13, w2, topk_weights, topk_ids, activation, activation_config, expert_map, layout,
                   w13_bias, w2_bias, valid_tokens, backend, scratch, output_transform, expected_m=None) -> torch.Tensor:
    """`fused_experts` without the launch-plan shortcut: checks, then the pipeline."""
    custom = callable(activation) and not isinstance(activation, (str, MoEActivation))
    act = None if custom else resolve_supported(activation)
    if output_transform is not None and not callable(output_transform):
        raise TypeError(f"output_transform must be a callable or None, got {type(output_transform).__name__}")
    if custom and activation_config is not None:
        raise ValueError("activation_config applies to the library's activations (MoEActivation); "
                         "a callable activation takes none")
    require_tensor("hidden_states", hidden_states)
    require_dtype("hidden_states", hidden_states, FLOAT_DTYPES)
    require_rank("hidden_states", hidden_states, (2,))
    require_last_dim_contiguous("hidden_states", hidden_states)
    require_tensor("topk_ids", topk_ids)
    require_dtype("topk_ids", topk_ids, INDEX_DTYPES)
    num_tokens, hidden_size = hidden_states.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must be [M={num_tokens}, k], got shape {tuple(topk_ids.shape)}")
    require_tensor("topk_weights", topk_weights)
    require_dtype("topk_weights", topk_weights, FLOAT_DTYPES + (torch.float64,))
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    num_local, n = _check_weights(act, w13, w2, hidden_states, "hidden_states")
    check_bias(w13_bias, hidden_states, num_local, w13.shape[1], name="w13_bias", a_name="hidden_states")
    check_bias(w2_bias, hidden_states, num_local, hidden_size, name="w2_bias", a_name="hidden_states")
    if expert_map is not None and not isinstance(expert_map, ExpertMap):
        raise TypeError(f"expert_map must be an ExpertMap or None, got {type(expert_map).__name__} (a vLLM-style "
                        f"table tensor converts once: ExpertMap.from_table(table))")
    if expert_map is not None and expert_map.num_local != num_local:
        raise ValueError(f"expert_map has {expert_map.num_local} local experts but w13 holds {num_local}")
    if scratch is not None and not isinstance(scratch, PermuteScratch):
        raise TypeError(f"scratch must be a PermuteScratch or None, got {type(scratch).__name__}")
    cfg = _activation_config(activation_config)
    chosen = layout_for_call(layout, expert_parallel=expert_map is not None)
    check_expected_m(expected_m, chosen)
    num_experts, table = _experts_table(expert_map, num_local, topk_ids.device)
    check_topk_ids(topk_ids)
    check_valid_tokens(valid_tokens, topk_ids)
    if custom or output_transform is not None:
        step = _Step(activation if custom else act, output_transform)
        return _eager_pipeline(hidden_states, w13, w2, topk_weights, topk_ids, step, cfg, chosen, num_experts,
                               num_local, table, w13_bias, w2_bias, valid_tokens, backend, scratch,
                               expected_m=expected_m)
    decode = _auto_layout(layout) and decode_allowed(hidden_states, w13, w2, backend)
    # Prefill of the expert shapes and rows per expert where the native kernel measured faster
    # (`AUTO_NATIVE_ROWS`: its tiles skip rows in steps of 64 where Triton's 128-row tiles pad) runs
    # it (at that many slots the decode path never applies). Eager calls only: the compiler would
    # have to trace the library's loading and guard on the slot count.
    if (expert_map is None and not torch.compiler.is_compiling() and _auto_layout(layout)
            and effective_backend(backend) == "auto"
            and backends.auto_native(hidden_states.device, w13, w2, act, topk_ids.numel(), num_local)):
        chosen, backend, decode = GemmLayout.GROUPED_CONTIGUOUS, "cuda", False
    if torch.compiler.is_compiling():
        w13_t, w13_s, *w13_h = op_weight_parts(w13)
        w2_t, w2_s, *w2_h = op_weight_parts(w2)
        return torch.ops.padded_moe.fused_experts(
            hidden_states, w13_t, w13_s, w2_t, w2_s, topk_weights, topk_ids, table, num_experts,
            act.value, cfg.clamp_limit, cfg.alpha, cfg.beta, cfg.situ_beta, cfg.situ_linear_beta, chosen.value,
            w13_bias, w2_bias, valid_tokens, backend, *w13_h, *w2_h, decode, expected_m=expected_m)
    # Eager calls skip the dispatcher (tens of µs of host time per call).
    return _pipeline(hidden_states, w13, w2, topk_weights, topk_ids, _Step(act), cfg, chosen, num_experts,
                     num_local, table, w13_bias, w2_bias, valid_tokens, backend, scratch, decode=decode,
                     expected_m=expected_m)


def _auto_layout(layout) -> bool:
    """Whether the layout is `fused_experts`' own choice (no argument, no variable): only then may
    the call take the decode path (`padded_moe.decode`), which uses no layout."""
    return layout is None and os.environ.get(LAYOUT_ENV, "").strip().lower() in ("", "auto")


def _launch_plans():
    """The process's launch plans (`padded_moe.launch_plan`), made on the first CUDA call: importing
    the kernels' modules any earlier would fix Triton's interpreter choice too soon."""
    global _PLANS
    if _PLANS is None:
        from padded_moe.launch_plan import LaunchPlans

        _PLANS = LaunchPlans(enabled=os.environ.get("PADDED_MOE_LAUNCH_PLANS", "1") != "0")
    return _PLANS


_PLANS = None
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def planned_call(key: Optional[tuple], inputs: tuple, call: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`call()`, or the replay of its launch plan once it has one (`padded_moe.launch_plan`); a
    None key (plans do not apply) always runs `call()`."""
    if key is None:
        return call()
    plans = _launch_plans()
    plan = plans.get(key)
    if plan is not None:
        return plan.run(inputs)
    return plans.call(key, key[0], inputs, call)


def _plan_key(x, topk_weights, topk_ids, valid_tokens, weights: tuple, options: Optional[tuple], *,
              eager_cache: bool = True) -> Optional[tuple]:
    """The key under which a call may replay a launch plan: every value the call's host code
    reads (shapes, strides, dtypes, devices, 16-byte alignment of the per-call tensors, the
    addresses of `weights` — weights, biases, expert table, each a tensor, an `Mxfp4Tensor` or
    None — the `options` (hashable plain values, None when an option is of an unusual type),
    whether the eager buffer cache is used, the layout variable, device, stream, thread). None where
    plans do not apply — not CUDA, graph capture, the compiler tracing, launch hooks, the eager
    cache switched off around a call that would use it, or an argument of an unusual type — and the
    full path checks and runs the call."""
    # First, so that the compiler never traces the checks below (a guard on the token count).
    if torch.compiler.is_compiling():
        return None
    if type(topk_ids) is not torch.Tensor or type(topk_weights) is not torch.Tensor:
        return None
    head = plan_key_head(x, valid_tokens, weights, options, eager_cache=eager_cache)
    return None if head is None else head + (_input_key(topk_weights), _input_key(topk_ids))


def plan_key_head(x, valid_tokens, weights: tuple, options: Optional[tuple], *, eager_cache: bool = True) -> Optional[tuple]:
    """`_plan_key`'s part every planned call shares (`fused_experts`, `FusedMoE.forward`): the
    device, stream, thread and environment, the options, the long-lived tensors' identities, and
    the hidden states' and count's signature; None where plans do not apply."""
    if options is None or type(x) is not torch.Tensor or not x.is_cuda \
            or (valid_tokens is not None and type(valid_tokens) is not torch.Tensor) or x.shape[0] == 0:
        return None
    from padded_moe.kernels import _launch

    if not _launch.fast_path() or torch.cuda.is_current_stream_capturing() \
            or (eager_cache and eager_cache_is_off()):
        return None
    weight_keys = tuple(_weight_key(w) for w in weights)
    if False in weight_keys:
        return None
    device = torch.cuda.current_device()
    return (device, _launch.current_stream(device), threading.get_ident(), os.environ.get(LAYOUT_ENV),
            os.environ.get(DECODE_ENV), os.environ.get(FUSE_ENV), os.environ.get(BACKEND_ENV), eager_cache,
            options, weight_keys, _input_key(x), None if valid_tokens is None else _input_key(valid_tokens))


def plan_options(activation, activation_config, layout, backend, expected_m=None) -> Optional[tuple]:
    """`fused_experts`' options as a plan key's part, or None when one is of a type plans skip (a
    callable activation, a subclass): the full path then checks them."""
    if not isinstance(activation, (str, MoEActivation)) or not isinstance(backend, str) \
            or not (activation_config is None or type(activation_config) is ApplyMoEActivationConfig) \
            or not (layout is None or isinstance(layout, (str, GemmLayout))) \
            or not (expected_m is None or type(expected_m) is int):
        return None
    return activation, activation_config, layout, backend, expected_m


def _input_key(t: torch.Tensor) -> tuple:
    return t.device, t.dtype, t.shape, t.stride(), t.data_ptr() & 15


def _weight_key(w) -> object:
    """A weight's (or bias's) identity for a plan key, None for None, False for a type plans skip."""
    if w is None:
        return None
    if type(w) in _PLAIN:
        return w.device, w.dtype, w.shape, w.stride(), w.data_ptr()
    if type(w) is Mxfp4Tensor:
        h = w.hopper
        hk = None if h is None else (_weight_key(h.blocks), _weight_key(h.scales), h.k)
        if w.blocks is None:  # the prepared form only
            return hk if hk[0] and hk[1] else False
        if type(w.blocks) in _PLAIN and type(w.scales) in _PLAIN:
            return _weight_key(w.blocks), _weight_key(w.scales), hk
    return False


def _activation_config(cfg: Optional[ApplyMoEActivationConfig]) -> ApplyMoEActivationConfig:
    cfg = ApplyMoEActivationConfig() if cfg is None else cfg
    if not isinstance(cfg, ApplyMoEActivationConfig):
        raise TypeError(f"activation_config must be an ApplyMoEActivationConfig, got {type(cfg).__name__}")
    return cfg


def _experts_table(expert_map: Optional[ExpertMap], num_local: int,
                   device: torch.device) -> tuple[int, Optional[torch.Tensor]]:
    """`(E, map table on device or None)`; None means every expert is local (no map read)."""
    if expert_map is None or expert_map.is_identity:
        return (num_local if expert_map is None else expert_map.num_experts), None
    if torch.compiler.is_compiling():
        # No caching while tracing: a tensor made inside a compiled graph must not outlive it.
        table = expert_map.map
        return expert_map.num_experts, table if table.device == device else table.to(device)
    return expert_map.num_experts, expert_map.map_for(device)


def op_weight_parts(w) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """A weight as tensors a custom op can take: `(float weight, None, None, None)`, `(blocks,
    scales, prepared blocks, prepared scales)` (the last two None for an unprepared Mxfp4Tensor),
    or for an Mxfp4Tensor that holds only its prepared form `(prepared blocks, None, prepared
    blocks, prepared scales)` (the first one stands for the weight's experts and rows)."""
    if not isinstance(w, Mxfp4Tensor):
        return w, None, None, None
    h = w.hopper
    if w.blocks is None:
        return h.blocks, None, h.blocks, h.scales
    return w.blocks, w.scales, None if h is None else h.blocks, None if h is None else h.scales


def op_weight_from_parts(t: torch.Tensor, scales: Optional[torch.Tensor], h_blocks: Optional[torch.Tensor] = None,
                       h_scales: Optional[torch.Tensor] = None):
    if scales is None:
        if h_blocks is None:
            return t
        return Mxfp4Tensor(None, None, HopperMxfp4.unpadded(h_blocks, h_scales))
    h = None if h_blocks is None else HopperMxfp4(h_blocks, h_scales, t.shape[-1] * 2)
    return Mxfp4Tensor(t, scales, h)


RowFunction = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Step:
    """What runs between the GEMMs: a `MoEActivation` or a model's own row function, and an
    optional row function on GEMM2's output (see `fused_experts`)."""

    activation: Union[MoEActivation, RowFunction]
    output_transform: Optional[RowFunction] = None


def _row_function(name: str, fn: RowFunction, x: torch.Tensor, width: int, out: torch.Tensor) -> torch.Tensor:
    """`fn(x)` checked against its contract, in `out` when given (the scratch's buffer)."""
    y = fn(x)
    want = (x.shape[0], width)
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != want or y.dtype != x.dtype:
        got = f"{y.dtype} {tuple(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"{name} must return a {x.dtype} tensor of shape {want}, got {got}")
    return out.copy_(y) if out is not None else y.contiguous()


def _pipeline(hidden_states, w13, w2, topk_weights, topk_ids, step: _Step, cfg: ApplyMoEActivationConfig,
              layout: Union[GemmLayout, str], num_experts: int, num_local: int, table, w13_bias, w2_bias,
              valid_tokens, backend: str, scratch, eager_cache: bool = True, decode: bool = False,
              expected_m: Optional[int] = None) -> torch.Tensor:
    """layout → (permute) → GEMM1 → activation → GEMM2 → (output transform) → unpermute, on
    checked arguments; with `decode` (the decode path is allowed) and few enough slots, the decode
    path's two kernels instead (`padded_moe.decode`)."""
    num_tokens, hidden_size = hidden_states.shape
    device, dtype = hidden_states.device, hidden_states.dtype
    buffers = scratch
    if scratch is None and eager_cache:
        buffers = _eager_scratch(topk_ids, num_experts, num_local)
    workspace = {b.name: b for b in expert_workspace(num_tokens, topk_ids.shape[1], hidden_size, w13.shape[1],
                                                     w2.shape[2])}

    def allocate(name: str) -> torch.Tensor:
        b = workspace[name]
        return _allocate(scratch if b.returned else buffers, b, dtype, device)

    if decode and fits_decode(num_tokens, topk_ids.numel()):
        # Of the layout path's buffers only the activation's output and the result.
        return decode_experts(hidden_states, w13, w2, topk_weights, topk_ids, step.activation, cfg, num_experts,
                              table, w13_bias, w2_bias, valid_tokens, allocate("act"), allocate("out"))
    meta = build_layout_resolved(layout, topk_ids, num_experts, num_local, table, valid_tokens=valid_tokens,
                                 scratch=buffers, expected_m=expected_m)
    act, gemm2, out = (allocate(name) for name in ("act", "gemm2", "out"))
    impl = resolve_backend(backend, device, meta.layout, w13)
    # A backend that reads GEMM1's rows from their tokens needs no permuted copy.
    gather = impl.gathers(meta.layout, w13)
    x = hidden_states if gather else permute(hidden_states, meta)
    mode = fuse_activation_mode()
    if isinstance(step.activation, MoEActivation) and impl.fuses(step.activation, w13) \
            and (mode == "on" or (mode == "auto" and impl.epilogue_pays(x, w13, meta, step.activation))):
        expert_gemm(x, w13, meta, stage="w13", bias=w13_bias, out=act, backend=backend,
                    activation=step.activation, activation_config=cfg, gather=gather)
    else:
        gemm1 = allocate("gemm1")
        expert_gemm(x, w13, meta, stage="w13", bias=w13_bias, out=gemm1, backend=backend, gather=gather)
        if isinstance(step.activation, MoEActivation):
            apply_moe_activation(step.activation, act, gemm1, activation_config=cfg,
                                 valid_token_counts=meta.activation_counts)
        else:
            act = _row_function("activation", step.activation, gemm1, act.shape[1], act)
    expert_gemm(act, w2, meta, stage="w2", bias=w2_bias, out=gemm2, backend=backend)
    if step.output_transform is not None:
        gemm2 = _row_function("output_transform", step.output_transform, gemm2, hidden_size, gemm2)
    unpermute(out, gemm2, topk_weights, meta)
    return out


# A callable cannot cross the custom op: under torch.compile the call leaves the graph here.
_eager_pipeline = torch.compiler.disable(_pipeline)


# Eager calls of up to this many slots (tokens × k) reuse cached layout and intermediate buffers:
# there the host cost of allocating and carving them is a large part of the call. Bigger calls
# allocate per call (the caching allocator makes that cheap next to their kernels, and the memory
# goes back to the pool).
EAGER_CACHE_SLOTS = 4096
_eager_buffers: dict = {}
_no_cache = threading.local()


class eager_cache_off:
    """Within this block (this thread), eager calls do not use or fill the buffer cache: custom ops
    that run the pipeline inside a compiled graph use it, because the graph's warm-up may allocate
    from a CUDA-graph memory pool that a cache must never keep."""

    def __enter__(self):
        self._prev = getattr(_no_cache, "on", False)
        _no_cache.on = True

    def __exit__(self, *exc):
        _no_cache.on = self._prev


def eager_cache_is_off() -> bool:
    """Whether this thread is inside an `eager_cache_off` block."""
    return getattr(_no_cache, "on", False)


def _eager_scratch(topk_ids: torch.Tensor, num_experts: int, num_local: int) -> Optional[PermuteScratch]:
    """Buffers this thread's eager calls on the current CUDA stream reuse: calls on one stream run in
    order, so the next call's kernels start only after the previous call's finished reading them.
    None during graph capture and under torch.compile (memory there belongs to the graph)."""
    device = topk_ids.device
    M, k = topk_ids.shape
    if device.type != "cuda" or M * k > EAGER_CACHE_SLOTS or torch.compiler.is_compiling() \
            or eager_cache_is_off() or torch.cuda.is_current_stream_capturing():
        return None
    key = (device, torch.cuda.current_stream(device).cuda_stream, threading.get_ident(), k, num_experts, num_local)
    tokens, buffers = _eager_buffers.get(key, (0, None))
    if tokens < M:
        # Sized for the call (slots rounded up to a power of two), grown when a bigger call comes:
        # the cache never holds more than twice what the largest call so far needed, so a small
        # model or a decode loop does not carry a 4096-slot workspace. No block_m: each call gets
        # the block a call without the cache would (`PermuteScratch.block_for`).
        tokens = cdiv(min(EAGER_CACHE_SLOTS, next_pow2(max(M * k, 64))), k)
        buffers = PermuteScratch(tokens, k, num_experts, num_local, device)
        _eager_buffers[key] = (tokens, buffers)
    return buffers


# ---------------------------------------------------------------------------------------------
# Custom ops: what torch.compile sees. Each runs the eager pipeline on real tensors; the fake
# implementations give the compiler shapes only, so no Triton launch, host-side config choice or
# layout metadata is ever traced, and every buffer the pipeline makes lives and dies inside the op.


@custom_op("padded_moe::fused_experts", mutates_args=())
def _fused_experts_op(hidden: torch.Tensor, w13: torch.Tensor, w13_scales: Optional[torch.Tensor],
                      w2: torch.Tensor, w2_scales: Optional[torch.Tensor], topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, expert_table: Optional[torch.Tensor], num_experts: int,
                      activation: str, clamp_limit: Optional[float], alpha: Optional[float],
                      beta: Optional[float], situ_beta: Optional[float], situ_linear_beta: Optional[float],
                      layout: str, w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor],
                      valid_tokens: Optional[torch.Tensor], backend: str,
                      w13_hopper_blocks: Optional[torch.Tensor] = None, w13_hopper_scales: Optional[torch.Tensor] = None,
                      w2_hopper_blocks: Optional[torch.Tensor] = None,
                      w2_hopper_scales: Optional[torch.Tensor] = None, decode: bool = False,
                      expected_m: Optional[int] = None) -> torch.Tensor:
    def call() -> torch.Tensor:
        cfg = ApplyMoEActivationConfig(clamp_limit, alpha, beta, situ_beta, situ_linear_beta)
        w13w = op_weight_from_parts(w13, w13_scales, w13_hopper_blocks, w13_hopper_scales)
        w2w = op_weight_from_parts(w2, w2_scales, w2_hopper_blocks, w2_hopper_scales)
        return _pipeline(hidden, w13w, w2w, topk_weights, topk_ids, _Step(MoEActivation(activation)), cfg, layout,
                         num_experts, w13.shape[0], expert_table, w13_bias, w2_bias, valid_tokens, backend, None,
                         # A compiled graph's memory (CUDA-graph pools included) must not leak into a
                         # cache that outlives the call.
                         eager_cache=False, decode=decode, expected_m=expected_m)

    # A plan made here holds no memory (every buffer is a per-call allocation), so it is safe
    # inside a compiled graph; under CUDA-graph capture the key is None and the call runs in full.
    # The key reads the op's arguments as they come: a replay builds no weight or config object.
    weights = (w13, w13_scales, w13_hopper_blocks, w13_hopper_scales, w2, w2_scales, w2_hopper_blocks,
               w2_hopper_scales, w13_bias, w2_bias, expert_table)
    options = (activation, clamp_limit, alpha, beta, situ_beta, situ_linear_beta, layout, backend, num_experts, decode,
               expected_m)
    key = _plan_key(hidden, topk_weights, topk_ids, valid_tokens, weights, options, eager_cache=False)
    return planned_call(key, (hidden, topk_weights, topk_ids, valid_tokens), call)


@register_fake("padded_moe::fused_experts")
def _fused_experts_fake(hidden, *args, **kwargs) -> torch.Tensor:
    return hidden.new_empty(hidden.shape)


def masked_meta_from_counts(counts: torch.Tensor, max_tokens_per_expert: int,
                            expected_m: Optional[int] = None) -> GroupedMaskedMeta:
    """GROUPED_MASKED metadata for a buffer that arrives already batched per expert (no slots);
    `expected_m`: the rows a slab is expected to hold (it picks the GEMM tile), None: unknown."""
    empty = torch.empty(0, dtype=torch.int32, device=counts.device)
    # Clamp in the counts' own dtype before narrowing: an int64 count of 2**40 must mean "every
    # row", not wrap to 0 in int32. A count past T cannot be honoured (the buffer has T rows).
    counts32 = counts.clamp(0, max_tokens_per_expert).to(torch.int32)
    return GroupedMaskedMeta(
        num_tokens=0, top_k=0, num_local=counts.shape[0], slot_expert=empty,
        activation_counts=counts32, counts=counts32, inv=empty,
        overflow=torch.zeros(1, dtype=torch.int32, device=counts.device),
        max_tokens_per_expert=max_tokens_per_expert, expected_m=expected_m)


def batched_experts(x: torch.Tensor, counts: torch.Tensor, w13, w2, *, activation: Union[str, MoEActivation],
                    activation_config: Optional[ApplyMoEActivationConfig] = None,
                    backend: str = "auto", out: Optional[torch.Tensor] = None,
                    expected_m: Optional[int] = None) -> torch.Tensor:
    """Experts over a batched receive buffer `x [L, T, K]`, expert `e` valid on rows `[0, counts[e])`.

    GROUPED_MASKED throughout; returns `[L, T, K]` whose rows past each count are untouched
    (left as they were in `out` when given, unspecified otherwise). Router weights are not
    applied here (expert parallelism's combine applies them). `expected_m` (an int >= 0, like
    DeepGEMM's masked GEMM takes it): about how many rows a slab holds, which picks the GEMM tiles;
    without it they are sized for `T`. Every count is honoured either way.
    """
    act = resolve_supported(activation)
    require_tensor("x", x)
    require_dtype("x", x, FLOAT_DTYPES)
    require_rank("x", x, (3,))
    require_tensor("counts", counts)
    require_dtype("counts", counts, INDEX_DTYPES)
    num_local, max_rows, hidden_size = x.shape
    check_expected_m(expected_m, GemmLayout.GROUPED_MASKED)
    if tuple(counts.shape) != (num_local,):
        raise ValueError(f"counts must be 1-D of length L={num_local}, got shape {tuple(counts.shape)}")
    if _check_weights(act, w13, w2, x, "x")[0] != num_local:
        raise ValueError(f"w13 must hold L={num_local} experts (x's first dim), got {tuple(w13.shape)}")
    cfg = _activation_config(activation_config)
    if out is None:  # contiguous whatever x's strides (empty_like would copy a permuted x's)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype \
            or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of x's shape {tuple(x.shape)} on {x.device}")
    if torch.compiler.is_compiling():
        w13_t, w13_s, *w13_h = op_weight_parts(w13)
        w2_t, w2_s, *w2_h = op_weight_parts(w2)
        torch.ops.padded_moe.batched_experts(x, counts, w13_t, w13_s, w2_t, w2_s, act.value, cfg.clamp_limit,
                                             cfg.alpha, cfg.beta, cfg.situ_beta, cfg.situ_linear_beta,
                                             backend, out, *w13_h, *w2_h, expected_m=expected_m)
        return out
    _batched_pipeline(x, counts, w13, w2, act, cfg, backend, out, expected_m)
    return out


def _batched_pipeline(x, counts, w13, w2, act: MoEActivation, cfg: ApplyMoEActivationConfig, backend: str,
                      out: torch.Tensor, expected_m: Optional[int] = None) -> None:
    num_local, max_rows, hidden_size = x.shape
    meta = masked_meta_from_counts(counts, max_rows, expected_m)
    # `out` is the caller's (or batched_experts' fresh) buffer; the others are allocated per call.
    h, act_out, _ = (_allocate(None, b, x.dtype, x.device)
                     for b in expert_workspace(max_rows, 0, hidden_size, w13.shape[1], w2.shape[2], num_local=num_local))
    expert_gemm(x, w13, meta, stage="w13", out=h, backend=backend)
    apply_moe_activation(act, act_out, h, activation_config=cfg, valid_token_counts=meta.counts)
    expert_gemm(act_out, w2, meta, stage="w2", out=out, backend=backend)


@custom_op("padded_moe::batched_experts", mutates_args={"out"})
def _batched_experts_op(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scales: Optional[torch.Tensor],
                        w2: torch.Tensor, w2_scales: Optional[torch.Tensor], activation: str,
                        clamp_limit: Optional[float], alpha: Optional[float], beta: Optional[float],
                        situ_beta: Optional[float], situ_linear_beta: Optional[float], backend: str,
                        out: torch.Tensor, w13_hopper_blocks: Optional[torch.Tensor] = None,
                        w13_hopper_scales: Optional[torch.Tensor] = None,
                        w2_hopper_blocks: Optional[torch.Tensor] = None,
                        w2_hopper_scales: Optional[torch.Tensor] = None, expected_m: Optional[int] = None) -> None:
    cfg = ApplyMoEActivationConfig(clamp_limit, alpha, beta, situ_beta, situ_linear_beta)
    _batched_pipeline(x, counts, op_weight_from_parts(w13, w13_scales, w13_hopper_blocks, w13_hopper_scales),
                      op_weight_from_parts(w2, w2_scales, w2_hopper_blocks, w2_hopper_scales),
                      MoEActivation(activation), cfg, backend, out, expected_m)


@register_fake("padded_moe::batched_experts")
def _batched_experts_fake(*args, **kwargs) -> None:
    return None
