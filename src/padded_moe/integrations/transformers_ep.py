"""Expert parallelism for loaded HF transformers MoE models.

Topology: one process per rank, data-parallel attention and expert-parallel experts (DP = EP).
Every rank loads the same checkpoint and runs its own batch through the dense parts (embeddings,
attention, norms, routers, shared experts, LM head); `enable_expert_parallel` then replaces each
sparse MoE block's experts module by an `ExpertParallelExperts`, a `FusedMoE` that holds only this
rank's `num_experts / R` experts and reaches the others through `ExpertParallel` (dispatch → local
experts → combine). The block's own router and shared experts keep running in HF's code; only the
experts call changes.

Every MoE layer call is a collective over the group, so the ranks must make the same sequence of
layer calls. A rank with no tokens in a step (an idle data-parallel rank) calls `idle_step(model)`
instead of the model: it joins every MoE layer's dispatch and combine with zero tokens, in the
order a forward pass visits them, and serves the tokens the other ranks route to its experts.
HF models cannot run a zero-length batch themselves (their attention reshapes fail), hence the
separate entry point.

transformers is not imported here; the plug-in helpers are imported when first needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from padded_moe._graphs import capture_warm
from padded_moe._validation import FLOAT_DTYPES, require_int

MODES = ("flat", "batched")


class ExpertParallelExperts(nn.Module):
    """Drop-in for an HF experts module: `forward(hidden_states [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H]` (HF's experts contract), computed by `self.moe`, a `FusedMoE`
    with `expert_parallel`. Collective: every rank must call it (see `idle`).

    `graph_tokens` is set by `capture_decode_graphs`: calls with at most that many tokens replay a
    CUDA graph of dispatch → experts → combine, padded to `graph_tokens` rows whose ids are -1.
    """

    def __init__(self, moe: nn.Module, *, family: str, source_class: str):
        super().__init__()
        self.moe = moe
        self.family = family
        self.source_class = source_class
        self.graph_tokens: Optional[int] = None
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._static: dict = {}

    @property
    def expert_parallel(self):
        return self.moe.expert_parallel

    def extra_repr(self) -> str:
        ep = self.expert_parallel
        return (f"family={self.family}, source={self.source_class}, experts={self.moe.num_local}/"
                f"{self.moe.num_experts} on rank {ep.ep_rank} of {ep.ep_size}, mode={ep.mode}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        ids = top_k_index.reshape(x.shape[0], -1)
        # The routed experts take fp32 router weights; HF routers may return them in the model dtype.
        weights = top_k_weights.reshape(ids.shape).to(torch.float32)
        ep_dtype = self.expert_parallel.dtype
        if self._graph is not None and x.shape[0] <= self.graph_tokens:
            out = self._replay(x.to(ep_dtype), ids, weights)
        else:
            out = self.moe.experts(x.to(ep_dtype), weights, ids)
        return out.to(hidden_states.dtype).reshape(shape)

    def idle(self) -> None:
        """Join this layer's dispatch and combine with zero tokens (an idle data-parallel rank)."""
        moe, dev = self.moe, self.expert_parallel.device
        x = torch.empty(0, moe.hidden_size, dtype=self.expert_parallel.dtype, device=dev)
        ids = torch.empty(0, moe.top_k, dtype=torch.int32, device=dev)
        weights = torch.empty(0, moe.top_k, dtype=torch.float32, device=dev)
        if self._graph is not None:
            self._replay(x, ids, weights)
        else:
            moe.experts(x, weights, ids)

    # ----- CUDA graph of the decode step -------------------------------------------------------

    def _fill(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Copy a call's tokens into the static rows; the rest become padding that routes nowhere
        (id -1 is dropped by the id guard and combine returns zeros for it)."""
        s, m = self._static, x.shape[0]
        s["x"][:m].copy_(x)
        s["x"][m:].zero_()
        s["ids"][:m].copy_(ids)
        s["ids"][m:].fill_(-1)
        s["w"][:m].copy_(weights)
        s["w"][m:].zero_()

    def _replay(self, x, ids, weights) -> torch.Tensor:
        self._fill(x, ids, weights)
        self._graph.replay()
        # The static output is rewritten by the next replay: hand out a copy.
        return self._static["out"][: x.shape[0]].clone()

    def _capture(self, tokens: int, side: torch.cuda.Stream) -> None:
        moe, ep = self.moe, self.expert_parallel
        dev = ep.device
        self._static = dict(x=torch.zeros(tokens, moe.hidden_size, dtype=ep.dtype, device=dev),
                            ids=torch.full((tokens, moe.top_k), -1, dtype=torch.int64, device=dev),
                            w=torch.zeros(tokens, moe.top_k, dtype=torch.float32, device=dev))
        s = self._static
        # Every rank warms up and captures here, at the same layer, so the collectives pair up.
        self._graph, s["out"] = capture_warm(lambda: moe.experts(s["x"], s["w"], s["ids"]), device=dev, side=side)
        self.graph_tokens = tokens


@dataclass
class ExpertParallelModel:
    """What `enable_expert_parallel` did: the model family, the replaced experts modules by name
    (in forward order) and the `ExpertParallel` objects they share (one per distinct shape)."""

    model: nn.Module
    family: str
    layers: dict = field(default_factory=dict)
    expert_parallel: tuple = ()

    def idle_step(self) -> None:
        idle_step(self.model)

    def capture_decode_graphs(self, tokens: int) -> None:
        capture_decode_graphs(self.model, tokens)


# ---------------------------------------------------------------------------------------------
# Finding and checking the experts modules
# ---------------------------------------------------------------------------------------------

def _family(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", None) or type(model).__name__)


def _is_experts_module(module: nn.Module) -> bool:
    """HF's experts contract: 3-D `down_proj` and `gate_up_proj` (or `up_proj` when ungated), or the
    MXFP4 form of them (GPT-OSS checkpoint tensors, or the prepared form a model loaded as MXFP4
    holds instead of its float parameters)."""
    from padded_moe.integrations.transformers import holds_mxfp4

    if isinstance(module, ExpertParallelExperts):
        return False
    if holds_mxfp4(module):
        return True
    down = getattr(module, "down_proj", None)
    up = getattr(module, "gate_up_proj", None)
    if up is None:
        up = getattr(module, "up_proj", None)
    three_d = lambda t: isinstance(t, torch.Tensor) and t.dim() == 3  # noqa: E731
    return three_d(down) and three_d(up)


def _top_k(model: nn.Module, parent: nn.Module) -> Optional[int]:
    """Experts per token: the block's router `top_k` (HF routers carry it), else the config's."""
    for child in parent.children():
        k = getattr(child, "top_k", None)
        if isinstance(k, int) and not isinstance(k, bool):
            return k
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        k = getattr(cfg, "num_experts_per_tok", None)
        if isinstance(k, int):
            return k
    return None


def _refuse(family: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"enable_expert_parallel: model family {family!r} is not supported: {why}")


def _check_module(family: str, name: str, module: nn.Module, plan) -> None:
    from padded_moe.integrations.transformers import FUSED

    cls = type(module).__qualname__
    if plan.path != FUSED:
        raise _refuse(family, f"the experts module {name} ({cls}) has a gate or a post-expert norm that "
                              f"padded_moe runs only in torch between its GEMMs (plan {plan.family!r}); "
                              f"FusedMoE needs one of its own activations")


def _check_format(name: str, module: nn.Module, weight_format: str) -> None:
    """An MXFP4 checkpoint's experts stay MXFP4: `FusedMoE` keeps their bytes as they are."""
    from padded_moe.integrations.transformers import holds_mxfp4

    if holds_mxfp4(module) and weight_format != "mxfp4":
        raise ValueError(f"weight_format must be 'mxfp4' for the experts module {name}, which holds an MXFP4 "
                         f"checkpoint (*_blocks / *_scales), got {weight_format!r}")


def _float_dtype(model: nn.Module, module: nn.Module, w2) -> torch.dtype:
    """The experts' activation dtype: the float weights', else (an MXFP4 checkpoint) the module's
    float tensors' (its biases), else the model's."""
    if isinstance(w2, torch.Tensor):
        return w2.dtype
    # (not the 1-byte float dtypes of MXFP4 scales, float8_e8m0fnu)
    floats = [t.dtype for t in list(module.parameters()) + list(module.buffers()) if t.dtype in FLOAT_DTYPES]
    return floats[0] if floats else getattr(model, "dtype", torch.get_default_dtype())


# ---------------------------------------------------------------------------------------------
# The public functions
# ---------------------------------------------------------------------------------------------

@torch.no_grad()
def enable_expert_parallel(model: nn.Module, group=None, *, max_tokens_per_rank: int, mode: str = "flat",
                           placement: str = "linear", weight_format: str = "bf16", layout: Optional[str] = None,
                           backend: str = "auto", dispatch_dtype: Optional[torch.dtype] = None,
                           graph_safe: bool = True, transport: Optional[str] = None) -> ExpertParallelModel:
    """Serve `model` (an HF transformers MoE model, loaded on every rank) with expert parallelism.

    Each sparse MoE block's experts module is replaced, in place, by an `ExpertParallelExperts`
    that keeps this rank's experts of the same weights (`FusedMoE.load_experts`) and exchanges
    tokens with the other ranks of `group` (a process group; None = the default group, which must
    be initialized). The block's router, shared experts and activation settings are the model's.
    Collective: every rank of `group` calls it, with the same model and arguments.

    `max_tokens_per_rank` bounds the tokens (batch × sequence) one rank feeds the model in one
    forward; the receive buffers are sized for it, shared by all layers of one shape. `mode`,
    `placement`, `dispatch_dtype`, `graph_safe` and `transport` (a name; None = the default) go to
    `ExpertParallel`; `weight_format`
    ("bf16" or "mxfp4": quantize the local experts), `layout` and `backend` to `FusedMoE`. The
    exchange runs in the experts' dtype (a float dtype); inputs of another dtype are cast.

    Experts modules holding an MXFP4 checkpoint (GPT-OSS `*_blocks` / `*_scales`) need
    weight_format="mxfp4": their local experts' bytes are copied as they are, never through floats.

    Raises NotImplementedError naming the model family when the model has no experts module in
    HF's contract, or one whose gate padded_moe cannot fuse (see `experts_plan`); ValueError /
    TypeError naming the argument for bad arguments (weight_format other than "mxfp4" for an
    MXFP4 checkpoint included). Returns an
    `ExpertParallelModel`; the model itself is modified.
    """
    from padded_moe.distributed import ExpertParallel
    from padded_moe.integrations.transformers import expert_weights, experts_plan
    from padded_moe.layer import WEIGHT_FORMATS, FusedMoE

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    require_int("max_tokens_per_rank", max_tokens_per_rank)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    family = _family(model)
    found = [(name, m) for name, m in model.named_modules() if _is_experts_module(m)]
    if not found:
        raise _refuse(family, f"{type(model).__name__} has no sparse MoE experts module (3-D gate_up_proj / "
                              f"down_proj parameters, HF's experts contract)")
    # Check every module before touching any, so a refusal leaves the model as it was.
    plans = []
    for name, module in found:
        plan = experts_plan(module)
        _check_module(family, name, module, plan)
        _check_format(name, module, weight_format)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        k = _top_k(model, parent)
        if k is None:
            raise _refuse(family, f"cannot tell how many experts per token {name} receives (no router "
                                  f"top_k, no config.num_experts_per_tok)")
        plans.append((name, module, plan, parent, attr, k))

    shared: dict = {}  # (E, k, K, dtype, device) -> ExpertParallel: layers run one after another
    result = ExpertParallelModel(model, family)
    for name, module, plan, parent, attr, k in plans:
        w13, w2, b13, b2 = expert_weights(module, prepared=False)  # views: FusedMoE copies its experts out
        num_experts, hidden, inter = w2.shape[0], w2.shape[1], w2.shape[2]
        dtype, device = _float_dtype(model, module, w2), w2.device
        if dtype not in FLOAT_DTYPES:
            raise _refuse(family, f"experts module {name} has {dtype} weights; expected one of {FLOAT_DTYPES}")
        key = (num_experts, k, hidden, dtype, device)
        ep = shared.get(key)
        if ep is None:
            ep = shared[key] = ExpertParallel(group, num_experts, k, hidden, max_tokens_per_rank, mode=mode,
                                              placement=placement, dtype=dtype, graph_safe=graph_safe,
                                              dispatch_dtype=dispatch_dtype, backend=backend, device=device,
                                              transport=transport)
        moe = FusedMoE(num_experts, k, hidden, inter, activation=plan.activation,
                       activation_config=plan.activation_config, weight_format=weight_format,
                       has_bias=b13 is not None, expert_parallel=ep, layout=layout, backend=backend,
                       dtype=dtype, device=device)
        moe.load_experts(w13, w2, None if b13 is None else b13.detach(), None if b2 is None else b2.detach())
        adapter = ExpertParallelExperts(moe, family=plan.family, source_class=type(module).__qualname__)
        setattr(parent, attr, adapter)  # drops the module holding all experts' weights
        result.layers[name] = adapter
    result.expert_parallel = tuple(shared.values())
    return result


def _adapters(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]


@torch.no_grad()
def idle_step(model: nn.Module) -> None:
    """One forward's worth of MoE collectives for a rank with no tokens in this step.

    Calls every `ExpertParallelExperts` of `model` with zero tokens, in module order — the order
    in which the supported HF models call their MoE blocks — so the rank pairs each dispatch and
    combine of the ranks that do run the model, and computes what they route to its experts.
    Call it once per model forward the other ranks make (prefill or decode).
    """
    layers = _adapters(model)
    if not layers:
        raise ValueError("model has no expert-parallel experts; call enable_expert_parallel(model, ...) first")
    for layer in layers:
        layer.idle()


@torch.no_grad()
def capture_decode_graphs(model: nn.Module, tokens: int) -> None:
    """Capture, per MoE layer, a CUDA graph of dispatch → local experts → combine for up to `tokens`
    tokens per rank (a decode step: one token per sequence). Later calls with at most `tokens`
    tokens replay the graph (the call's tokens, then padding rows that route nowhere); longer ones
    (prefill) run eagerly. Collective: every rank calls it at the same point, with the same
    `tokens`; it runs two idle warm-up exchanges per layer.

    The experts must be on a CUDA device and `ExpertParallel` graph-safe (the default).
    """
    tokens = require_int("tokens", tokens)
    layers = _adapters(model)
    if not layers:
        raise ValueError("model has no expert-parallel experts; call enable_expert_parallel(model, ...) first")
    for layer in layers:
        ep = layer.expert_parallel
        if ep.device.type != "cuda":
            raise ValueError(f"capture_decode_graphs needs CUDA experts, got device {ep.device}")
        if not ep.graph_safe:
            raise ValueError("capture_decode_graphs needs graph_safe=True (enable_expert_parallel's default)")
        if tokens > ep.max_tokens_per_rank:
            raise ValueError(f"tokens must be <= max_tokens_per_rank={ep.max_tokens_per_rank}, got {tokens}")
    side = torch.cuda.Stream(layers[0].expert_parallel.device)
    for layer in layers:
        layer._capture(tokens, side)


def plan_memory(model: nn.Module, ranks: int, max_tokens_per_rank: int, *, mode: str = "flat",
                weight_format: str = "bf16", dispatch_dtype: Optional[torch.dtype] = None) -> dict:
    """Bytes one rank holds after `enable_expert_parallel(model, <group of `ranks`>, ...)`, from a
    model not yet converted (it may live on the meta device: only shapes and dtypes are read).

    Returns a dict: `dense` (every parameter and buffer outside the experts modules: each rank
    keeps them all), `experts` (the local experts of every MoE layer as `FusedMoE` holds them —
    with weight_format="mxfp4" the GEMM's prepared arrangement of their MXFP4 bytes, and the canonical
    bytes too where `FusedMoE` keeps them (a width not whole 64-element blocks) — plus each
    layer's router-sized gate matrix, which `FusedMoE` allocates and this path leaves unused),
    `exchange` (the `ExpertParallel` buffers, once per distinct layer shape, as the layers share
    them), `workspace` (the largest one layer's expert and combine buffers, which exist one layer
    at a time) and `total`. Attention activations and the KV cache are not included.
    Per-layer numbers come from `padded_moe.planner.plan`.
    """
    from padded_moe.integrations.transformers import expert_weights, experts_plan
    from padded_moe.planner import plan as plan_layer

    require_int("ranks", ranks)
    require_int("max_tokens_per_rank", max_tokens_per_rank)
    family = _family(model)
    experts = [(name, m) for name, m in model.named_modules() if _is_experts_module(m)]
    if not experts:
        raise _refuse(family, f"{type(model).__name__} has no sparse MoE experts module")
    inside = {id(t) for _, m in experts for t in list(m.parameters()) + list(m.buffers())}
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    dense = sum(nbytes(t) for t in list(model.parameters()) + list(model.buffers()) if id(t) not in inside)
    expert_bytes, exchange, workspace, seen = 0, 0, 0, set()
    for name, module in experts:
        plan = experts_plan(module)
        _check_module(family, name, module, plan)
        _check_format(name, module, weight_format)
        w13, w2, b13, _ = expert_weights(module, prepared=False)
        dtype = _float_dtype(model, module, w2)
        E, K, N = w2.shape[0], w2.shape[1], w2.shape[2]
        k = _top_k(model, model.get_submodule(name.rpartition(".")[0]))
        shapes = dict(num_experts=E, top_k=k, hidden_size=K, intermediate_size=N, activation=plan.activation,
                      has_bias=b13 is not None)
        layer = plan_layer(shapes, ranks, max_tokens_per_rank, float(1 << 20), mode=mode, dtype=dtype,
                           dispatch_dtype=dispatch_dtype, weight_format=weight_format)
        expert_bytes += layer.weights_bytes + E * K * dtype.itemsize
        key = (E, k, K, dtype)
        if key not in seen:
            seen.add(key)
            exchange += layer.bytes_of("ep")
        workspace = max(workspace, layer.bytes_of("experts") + layer.bytes_of("combine"))
    total = dense + expert_bytes + exchange + workspace
    return dict(family=family, ranks=ranks, max_tokens_per_rank=max_tokens_per_rank, moe_layers=len(experts),
                dense=dense, experts=expert_bytes, exchange=exchange, workspace=workspace, total=total)


__all__ = ["ExpertParallelExperts", "ExpertParallelModel", "enable_expert_parallel", "idle_step",
           "capture_decode_graphs", "plan_memory"]
