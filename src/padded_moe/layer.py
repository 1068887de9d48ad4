"""`FusedMoE`: router + routed experts (+ optional shared experts) as one `nn.Module`.

The router turns logits into `(topk_weights, topk_ids)` with the functions of
`padded_moe.routing`; the experts run through `padded_moe.experts.fused_experts`, or through an
`ExpertParallel` dispatch → local experts → combine when `expert_parallel` is given.

The routed part of an eager decode-sized forward (up to `routing.GATE_KERNEL_MAX_TOKENS` tokens,
no expert parallelism, a named router, a plain `nn.Linear` gate) is Triton launches only: the gate
projection's kernel and the router kernel that finishes its logits (`routing.gate_sums`), then
`fused_experts`' kernels. It replays as one launch plan (`padded_moe.launch_plan`), keyed on
everything its host code reads, so its host time is one key lookup and the launches; shared experts
run beside it as the caller's module. Under `torch.compile` the same routed part
(`FusedMoE._one_step`, any token count) is one custom op, `moe_forward`, that runs this eager step;
with expert parallelism the experts are the op `ep_experts`. Both take the layer's tensors and
settings as arguments, so every layer of a model shares one compiled graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from padded_moe import routing
from padded_moe._ops import custom_op, register_fake
from padded_moe._util import cdiv
from padded_moe._validation import FLOAT_DTYPES, require_bool, require_dtype, require_int, require_real, require_tensor
from padded_moe.activation import ApplyMoEActivationConfig, MoEActivation, resolve_supported
from padded_moe.ep.engine import expert_parallel_of_op
from padded_moe.expert_map import check_valid_tokens, drop_rows_past
from padded_moe.experts import (batched_experts, eager_cache_off, fused_experts, layout_for_call, op_weight_from_parts,
                                op_weight_parts, plan_key_head, plan_options, planned_call)
from padded_moe.layouts import GemmLayout, select_gemm_layout
from padded_moe.mxfp4 import GROUP, HopperMxfp4, Mxfp4Tensor, canonical_kept, mark_sizes_static, quantize_expert_into
from padded_moe.presets import MoEPreset, get_preset

# Each MXFP4 weight and the names of its two canonical parameters.
_MXFP4_PARAMS = (("w13", "w13_blocks", "w13_scales"), ("w2", "w2_blocks", "w2_scales"))

RouterFn = Callable[[torch.Tensor, Optional[torch.Tensor]], "tuple[torch.Tensor, torch.Tensor]"]

# Router names (as used by the presets) and whether the gate has a bias / a correction bias.
ROUTERS = ("softmax", "softmax_renorm", "topk_softmax", "biased_sigmoid", "biased_sqrtsoftplus")
WEIGHT_FORMATS = ("bf16", "mxfp4")


class FusedMoE(nn.Module):
    """A MoE block. `forward(hidden_states [..., K], router_logits=None, token_ids=None, valid_tokens=None)`.

    `valid_tokens` (int32/int64 `[1]` on the hidden states' device) marks the first tokens of the
    flattened `[M, K]` input as the real ones, as for `fused_experts`: the routed experts compute
    only those, and output rows at or past it are unspecified (the router and any shared experts
    still run on every row). With expert parallelism those rows are not dispatched at all (their
    expert ids become -1 on the device). A count below 0 means none, above M means all.

    `router` is a name from `ROUTERS` or a callable `(logits, token_ids) -> (weights f32, ids i32)`.
    The biased routers take `routed_scaling_factor` and DeepSeek-V3's group-limited selection
    (`num_groups` = `n_group`, `topk_groups` = `topk_group`; 1 / 1: no groups).
    Without expert parallelism the layer holds all `num_experts`; with it, only this rank's.
    `weight_format="mxfp4"` stores the expert weights as MXFP4 only (activations stay in `dtype`):
    the parameters `w13_blocks`, `w13_scales`, `w2_blocks`, `w2_scales` (uint8, `Mxfp4Tensor`'s
    canonical form) instead of float `w13` / `w2`, plus the GEMM's prepared arrangement built from
    them (`prepare`), which then holds the experts alone: the canonical parameters are emptied
    (`state_dict()` rebuilds them) unless `keep_canonical=True` or a width is not a multiple of 64.
    `expert_weights()` returns them as `Mxfp4Tensor`s. `load_experts` takes float weights
    (quantized one expert at a time) or `Mxfp4Tensor`s (a checkpoint's bytes, as they are).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 activation: Union[str, MoEActivation] = "silu",
                 activation_config: Optional[ApplyMoEActivationConfig] = None,
                 router: Union[str, RouterFn] = "softmax_renorm", routed_scaling_factor: float = 1.0,
                 num_groups: int = 1, topk_groups: int = 1, weight_format: str = "bf16", has_bias: bool = False,
                 keep_canonical: bool = False, expert_parallel=None,
                 shared_experts: Optional[nn.Module] = None, layout: Optional[str] = None,
                 backend: str = "auto", dtype: torch.dtype = torch.bfloat16,
                 device: Union[str, torch.device, None] = None):
        super().__init__()
        _check_sizes(num_experts, top_k, hidden_size, intermediate_size, dtype)
        self.activation = resolve_supported(activation)
        self.activation_config = activation_config or ApplyMoEActivationConfig()
        if weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
        require_bool("keep_canonical", keep_canonical)
        if not callable(router) and router not in ROUTERS:
            raise ValueError(f"router must be a callable or one of {ROUTERS}, got {router!r}")
        routed_scaling_factor = require_real("routed_scaling_factor", routed_scaling_factor)
        scaled = isinstance(router, str) and router.startswith("biased_")
        if routed_scaling_factor != 1.0 and not scaled:
            # Only the biased routers scale their weights; ignoring the factor would be silent.
            raise ValueError(f"routed_scaling_factor is applied by the biased_* routers only; got "
                             f"{routed_scaling_factor} with router={router!r} (scale inside a callable router)")
        if (num_groups, topk_groups) != (1, 1) and not scaled:
            # Group-limited selection is the biased routers' step (DeepSeek-V3's n_group / topk_group).
            raise ValueError(f"num_groups / topk_groups apply to the biased_* routers only; got {num_groups} / "
                             f"{topk_groups} with router={router!r} (group inside a callable router)")
        num_groups, topk_groups = routing.check_groups(num_experts, top_k, num_groups, topk_groups)
        if expert_parallel is not None:
            _check_expert_parallel(expert_parallel, num_experts, top_k, hidden_size, dtype)
            if expert_parallel.mode == "batched":  # its buffers run GROUPED_MASKED, without biases
                if layout is not None:
                    select_gemm_layout(expert_parallel=True, batched_format=True, override=layout)
                if has_bias:
                    raise NotImplementedError("has_bias=True: expert biases are not supported in batched "
                                              "expert-parallel mode; use mode='flat'")
        self.num_experts, self.top_k = num_experts, top_k
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.router, self.routed_scaling_factor = router, routed_scaling_factor
        self.weight_format, self.layout, self.backend = weight_format, layout, backend
        self.expert_parallel = expert_parallel
        self.shared_experts = shared_experts
        self.num_local = expert_parallel.expert_map.num_local if expert_parallel is not None else num_experts
        factory = dict(dtype=dtype, device=device)
        self.gate = nn.Linear(hidden_size, num_experts, bias=(router == "topk_softmax"), **factory)
        if isinstance(router, str) and router.startswith("biased_"):
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
        else:
            self.e_score_correction_bias = None
        w13_rows = 2 * intermediate_size if self.activation.is_gated else intermediate_size
        self._w13_shape = (self.num_local, w13_rows, hidden_size)
        self._w2_shape = (self.num_local, hidden_size, intermediate_size)
        if weight_format == "mxfp4":
            for name, (L, rows, cols) in (("w13", self._w13_shape), ("w2", self._w2_shape)):
                if cols % GROUP != 0:
                    what = "hidden_size" if name == "w13" else "intermediate_size"
                    raise ValueError(f"weight_format='mxfp4' needs {what} to be a multiple of {GROUP} (one E8M0 "
                                     f"scale per {GROUP} elements), got {cols}")
            for name, shape in self._mxfp4_param_shapes():
                t = torch.empty(shape, dtype=torch.uint8, device=device)
                self.register_parameter(name, nn.Parameter(t, requires_grad=False))
        else:
            self.w13 = nn.Parameter(torch.empty(self._w13_shape, **factory), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(self._w2_shape, **factory), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.zeros(self.num_local, w13_rows, **factory), requires_grad=False) if has_bias else None
        self.w2_bias = nn.Parameter(torch.zeros(self.num_local, hidden_size, **factory), requires_grad=False) if has_bias else None
        self._mxfp4: dict = {}
        # MXFP4: whether the canonical parameters stay filled next to the prepared arrangement. Off,
        # they are emptied by `prepare()` (the device holds the weights once) wherever the prepared
        # form can stand alone (K of both weights whole 64-element blocks).
        self.keep_canonical = canonical_kept(keep_canonical, self._w13_shape[2], self._w2_shape[2])
        # Usable after construction, like nn.Linear; a meta-device layer is a shape only.
        if self.gate.weight.device.type != "meta":
            self.reset_parameters()

    # ----- construction helpers -------------------------------------------------------------

    @classmethod
    def from_preset(cls, preset: Union[str, MoEPreset], *, weight_format: Optional[str] = None, **kwargs) -> "FusedMoE":
        if isinstance(preset, str):
            p = get_preset(preset)
        elif isinstance(preset, MoEPreset):
            p = preset
        else:
            raise TypeError(f"preset must be a preset name or a MoEPreset, got {type(preset).__name__} {preset!r}")
        cfg = ApplyMoEActivationConfig(**p.activation_config)
        return cls(p.num_experts, p.top_k, p.hidden_size, p.intermediate_size, activation=p.activation,
                   activation_config=cfg, router=p.routing,
                   routed_scaling_factor=p.routing_config.get("routed_scaling_factor", 1.0),
                   num_groups=p.routing_config.get("num_groups", 1),
                   topk_groups=p.routing_config.get("topk_groups", 1),
                   weight_format=weight_format or p.weight_format, has_bias=p.has_bias, **kwargs)

    @property
    def local_experts(self) -> list:
        if self.expert_parallel is None:
            return list(range(self.num_experts))
        return list(self.expert_parallel.expert_map.local_experts)

    @torch.no_grad()
    def load_experts(self, w13: Union[torch.Tensor, Mxfp4Tensor], w2: Union[torch.Tensor, Mxfp4Tensor],
                     w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None) -> None:
        """Load global weights `[E, ·, ·]` (HF gate_up_proj / down_proj layout); keeps local experts.

        Float weights fit either format (an MXFP4 layer quantizes them one expert at a time, so
        no float copy of all local experts is made on its device); `Mxfp4Tensor`s (e.g.
        `from_gpt_oss` of a checkpoint) only an MXFP4 layer, which keeps their bytes as they are.
        Biases `[E, rows]` load into a layer built with `has_bias=True` (anything else is refused,
        never dropped); one left None keeps the layer's own."""
        want13 = (self.num_experts,) + self._w13_shape[1:]
        want2 = (self.num_experts,) + self._w2_shape[1:]
        for name, w in (("w13", w13), ("w2", w2)):
            if isinstance(w, Mxfp4Tensor):
                if self.weight_format != "mxfp4":
                    raise TypeError(f"{name} is an Mxfp4Tensor but this layer's weight_format is "
                                    f"{self.weight_format!r}; build it with weight_format='mxfp4' (or pass "
                                    f"{name}.dequantize())")
            else:
                require_tensor(name, w)
        if tuple(w13.shape) != want13 or tuple(w2.shape) != want2:
            raise ValueError(f"w13/w2 must be {want13} / {want2}, got {tuple(w13.shape)} / {tuple(w2.shape)}")
        for name, b, have, rows in (("w13_bias", w13_bias, self.w13_bias, want13[1]),
                                    ("w2_bias", w2_bias, self.w2_bias, want2[1])):
            if b is None:
                continue
            if have is None:
                raise ValueError(f"{name} given, but this layer has no biases: build it with has_bias=True")
            require_tensor(name, b)
            if tuple(b.shape) != (self.num_experts, rows):
                raise ValueError(f"{name} must be {(self.num_experts, rows)} (E, rows), got {tuple(b.shape)}")
        for name, w in (("w13", w13), ("w2", w2)):
            if isinstance(w, Mxfp4Tensor):
                continue
            # Checked before anything is written: a refused load leaves the layer as it was.
            require_dtype(name, w, FLOAT_DTYPES + (torch.float64,))
            if self.weight_format == "mxfp4":
                for e in (int(e) for e in self.local_experts):
                    if not bool(torch.isfinite(w[e]).all()):
                        raise ValueError(f"{name} must be finite to quantize to MXFP4 (expert {e} holds NaN or Inf)")
        idx = torch.tensor(self.local_experts, dtype=torch.long)
        if self.weight_format == "mxfp4":
            self._fill_canonical(keep_values=False)  # checked above: every local expert is written below
            for name, w in (("w13", w13), ("w2", w2)):
                blocks, scales = getattr(self, f"{name}_blocks"), getattr(self, f"{name}_scales")
                if isinstance(w, Mxfp4Tensor):
                    w = w.canonical()
                    blocks.copy_(w.blocks[idx.to(w.device)].to(blocks.device))
                    scales.copy_(w.scales[idx.to(w.device)].to(scales.device))
                else:
                    for local, e in enumerate(self.local_experts):
                        quantize_expert_into(w[int(e)].to(blocks.device), blocks[local], scales[local])
        else:
            self.w13.copy_(w13[idx].to(self.w13.device))
            self.w2.copy_(w2[idx].to(self.w2.device))
        if w13_bias is not None:
            self.w13_bias.copy_(w13_bias[idx.to(w13_bias.device)].to(self.w13_bias.device))
        if w2_bias is not None:
            self.w2_bias.copy_(w2_bias[idx.to(w2_bias.device)].to(self.w2_bias.device))
        self.prepare()

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """The construction-time initialisation (called by `__init__` off the meta device).

        Like `nn.Linear`: the gate and every expert matrix uniform in `±1/sqrt(fan_in)`, biases
        and the routing correction bias zero. Each expert is drawn from its own generator seeded
        by `(seed, global expert id)`, in place in the parameter's dtype, so no float copy of the
        whole weight is ever made, and an expert-parallel rank holds exactly the experts a
        single-device layer would. Deterministic for a seed on a given device type.
        """
        _init_uniform_(self.gate.weight, seed, stream=-1)
        if self.gate.bias is not None:
            self.gate.bias.zero_()
        self._fill_canonical(keep_values=False)  # every expert is written below
        for local, e in enumerate(self.local_experts):
            e = int(e)  # an ExpertMap lists its experts as a tensor
            for name, stream in (("w13", e), ("w2", e + self.num_experts)):
                if self.weight_format == "mxfp4":  # drawn in the layer's dtype, then quantized
                    blocks = getattr(self, f"{name}_blocks")
                    w = torch.empty(self._expert_shape(name), dtype=self.gate.weight.dtype, device=blocks.device)
                    _init_uniform_(w, seed, stream=stream)
                    quantize_expert_into(w, blocks[local], getattr(self, f"{name}_scales")[local])
                else:
                    _init_uniform_(getattr(self, name)[local], seed, stream=stream)
        for b in (self.w13_bias, self.w2_bias, self.e_score_correction_bias):
            if b is not None:
                b.zero_()
        self._mxfp4.clear()
        # Prepared now rather than at the first eager forward: a layer compiled (or captured)
        # straight after construction would otherwise trace the canonical bytes and run the slower
        # GEMM for good.
        self.prepare()

    @torch.no_grad()
    def randomize(self, seed: int = 0, std: float = 0.05) -> None:
        """Random normal weights (demos, tests, benchmarks), drawn on the weights' device so model-
        sized layers need no host copy; deterministic for a seed on a given device. Expert weights
        are drawn one expert at a time, so the float32 temporary is one expert's size."""
        mx = self.weight_format == "mxfp4"
        self._fill_canonical(keep_values=False)  # every expert is drawn below
        experts = ("w13", "w2") if mx else (self.w13, self.w2)
        params = (self.gate.weight, self.gate.bias) + experts + (self.w13_bias, self.w2_bias,
                                                                  self.e_score_correction_bias)
        generators: dict = {}

        def generator(device: torch.device) -> torch.Generator:  # one stream per device, in draw order
            if device not in generators:
                generators[device] = torch.Generator(device=device).manual_seed(seed)
            return generators[device]

        for p in params:
            if p is None:
                continue
            if isinstance(p, str):  # MXFP4 experts: each drawn as the float expert it replaces, then quantized
                blocks, scales = getattr(self, f"{p}_blocks"), getattr(self, f"{p}_scales")
                gen = generator(blocks.device)
                shape = self._expert_shape(p)
                for local in range(blocks.shape[0]):
                    w = torch.randn(shape, generator=gen, device=blocks.device, dtype=torch.float32).mul_(std)
                    quantize_expert_into(w.to(self.gate.weight.dtype), blocks[local], scales[local])
                continue
            gen = generator(p.device)
            pieces = p if p.dim() == 3 else (p,)
            for piece in pieces:
                piece.copy_(torch.randn(piece.shape, generator=gen, device=p.device, dtype=torch.float32).mul_(std))
        self.prepare()

    def expert_weights(self) -> tuple:
        """`(w13, w2)` in the layer's weight format: the float parameters, or for MXFP4 the
        `Mxfp4Tensor`s over the layer's parameters with their prepared arrangement (`prepare`)."""
        if self.weight_format == "bf16":
            return self.w13, self.w2
        if not self._mxfp4 and not torch.compiler.is_compiling():
            self.prepare()
        if self._mxfp4 and (torch.compiler.is_compiling() or self._prepared_is_current()):
            return self._mxfp4["w13"], self._mxfp4["w2"]
        # Other expert parameters swapped in (`torch.func.functional_call`): read as they are.
        # Compiled before `prepare()` ran, or on the meta device: the canonical bytes (a tensor made
        # inside a compiled graph must not be cached past it, CUDA-graph pools reuse its memory).
        return self._canonical("w13"), self._canonical("w2")

    def _expert_shape(self, name: str) -> tuple:
        """`[rows, in]` of one local expert of `w13` / `w2` as a float matrix."""
        return (self._w13_shape if name == "w13" else self._w2_shape)[1:]

    def _canonical(self, name: str) -> Mxfp4Tensor:
        """The MXFP4 parameters of `w13` / `w2` as an `Mxfp4Tensor` (views, no copy)."""
        return Mxfp4Tensor(getattr(self, f"{name}_blocks").detach(), getattr(self, f"{name}_scales").detach())

    @torch.no_grad()
    def prepare(self) -> None:
        """Build what the GEMMs read from the layer's MXFP4 parameters now (`prepare_for`: the
        prepared arrangement of the same bytes). Runs by itself at construction (`reset_parameters`)
        and after `load_experts`, `randomize`, `load_state_dict` and `.to()`; with
        `keep_canonical=True`, call it after changing the MXFP4 parameters in place, and before
        `torch.compile`. Without `keep_canonical`, it then empties the
        canonical parameters (size 0): the device holds the experts once, and `state_dict()`
        rebuilds their canonical bytes from the prepared form. Nothing to do for bf16."""
        if self.weight_format != "mxfp4" or self.w13_blocks.device.type == "meta":
            return
        if self._canonical_emptied():
            return  # the prepared form is all there is, and it is current
        self._mxfp4.clear()
        for name in ("w13", "w2"):
            # + the GEMM's arrangement (HopperMxfp4); alone, without a reference to the parameters
            q = self._canonical(name).prepare_for(keep_canonical=self.keep_canonical)
            self._hold_prepared(name, q)
        if not self.keep_canonical:
            for name, _ in self._mxfp4_param_shapes():
                p = getattr(self, name)
                p.data = p.data.new_empty(0)

    def _hold_prepared(self, name: str, q: Mxfp4Tensor) -> None:
        for t in (q.hopper.blocks, q.hopper.scales):
            # Like a parameter, a fixed address: CUDA graphs of a compiled forward read it
            # in place instead of copying it in before every replay.
            torch._dynamo.mark_static_address(t, guard=False)
        mark_sizes_static(q.hopper)  # held in a dict, not as buffers: sizes fixed by hand too
        self._mxfp4[name] = q

    def _prepared_is_current(self) -> bool:
        """Whether the held prepared form was built from the expert parameters the layer holds now:
        emptied by `prepare()` (the prepared form is all there is) or the very tensors it views, not
        others put in their place (`torch.func.functional_call` swaps parameters for one call)."""
        params = self._parameters  # where functional_call swaps them too; read directly, on every forward
        for name, blocks_name, scales_name in _MXFP4_PARAMS:
            q, blocks, scales = self._mxfp4[name], params[blocks_name], params[scales_name]
            if blocks.numel() == 0 and scales.numel() == 0:
                continue
            if q.blocks is None or q.blocks.data_ptr() != blocks.data_ptr() \
                    or q.scales.data_ptr() != scales.data_ptr():
                return False
        return True

    def _canonical_emptied(self) -> bool:
        """Whether `prepare()` emptied the canonical MXFP4 parameters (the prepared form holds the
        experts alone)."""
        return self.weight_format == "mxfp4" and self.w13_blocks.numel() == 0 and bool(self._mxfp4)

    def _fill_canonical(self, keep_values: bool = True) -> None:
        """Give emptied canonical parameters their full size again before something writes them (a
        load, an initialisation), holding the current weights rebuilt from the prepared form unless
        `keep_values` is False (the caller writes every byte). So what a load leaves unwritten (a key
        a partial state dict lacks, a tensor whose size mismatches, the experts after a failed one)
        keeps its value, as a plain parameter's would. The prepared form of the old weights is dropped."""
        if not self._canonical_emptied():
            return
        held = {name: q.canonical() for name, q in self._mxfp4.items()} if keep_values else {}
        self._mxfp4.clear()
        for pname, shape in self._mxfp4_param_shapes():
            p = getattr(self, pname)
            name, part = pname.split("_")  # "w13_blocks" -> the canonical blocks of w13
            p.data = getattr(held[name], part).to(p.dtype).reshape(shape).contiguous() if held \
                else p.data.new_empty(shape)

    def _mxfp4_param_shapes(self):
        """(name, shape) of the four canonical MXFP4 parameters: e2m1 codes two per byte, one E8M0
        scale per `GROUP` elements."""
        for (_, blocks, scales), (L, rows, cols) in zip(_MXFP4_PARAMS, (self._w13_shape, self._w2_shape)):
            yield blocks, (L, rows, cols // 2)
            yield scales, (L, rows, cols // GROUP)

    def _apply(self, fn, recurse=True):
        if self.weight_format == "mxfp4":
            # Checked on an empty byte tensor before anything is converted: a conversion that casts
            # every tensor would turn the MXFP4 bytes into numbers of another kind.
            probe = torch.empty(0, dtype=torch.uint8, device=self.gate.weight.device)
            if fn(probe).dtype != torch.uint8:
                raise TypeError("an MXFP4 layer's expert weights are bytes, which this conversion would cast "
                                "(Module.type casts every tensor); use .to(dtype), .float() or .half(), which "
                                "cast floating-point tensors only")
        emptied = self._canonical_emptied()
        module = super()._apply(fn, recurse)
        if emptied:  # `.to()` / `.cuda()`: the prepared form travels as the parameters would
            for name, q in list(self._mxfp4.items()):
                h = q.hopper
                self._hold_prepared(name, Mxfp4Tensor(None, None, HopperMxfp4(fn(h.blocks), fn(h.scales), h.k)))
        elif self._mxfp4:
            self.prepare()  # `.to()` / `.cuda()` moved the MXFP4 parameters: rebuild their arrangement
        return module

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._canonical_emptied():  # the canonical bytes, rebuilt from the prepared form
            for name, q in self._mxfp4.items():
                c = q.canonical()
                destination[f"{prefix}{name}_blocks"] = c.blocks
                destination[f"{prefix}{name}_scales"] = c.scales

    def _load_from_state_dict(self, *args, **kwargs):
        self._fill_canonical()  # full-size parameters to load into
        super()._load_from_state_dict(*args, **kwargs)
        self.prepare()  # the prepared arrangement of the old weights must not survive a load

    # ----- forward --------------------------------------------------------------------------

    def route(self, logits: torch.Tensor, token_ids: Optional[torch.Tensor] = None):
        if callable(self.router):
            return self.router(logits, token_ids)
        return self._named_router().route(logits, self.e_score_correction_bias, routing.softmax_topk,
                                          routing.biased_grouped_topk)

    def _named_router(self) -> "NamedRouter":
        return NamedRouter(self.router, self.top_k, float(self.routed_scaling_factor), self.num_groups,
                           self.topk_groups)

    def forward(self, hidden_states: torch.Tensor, router_logits: Optional[torch.Tensor] = None,
                token_ids: Optional[torch.Tensor] = None,
                valid_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        _check_forward_inputs(hidden_states, router_logits, self.hidden_size, self.num_experts, self.gate.weight.dtype)
        check_valid_tokens(valid_tokens, hidden_states)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        if router_logits is None and token_ids is None and self._one_step(x):
            out = self._routed_step(x, valid_tokens)
            if self.shared_experts is not None:
                out = out + self.shared_experts(x)
            return out.view(shape)
        return self._forward(x, router_logits, token_ids, valid_tokens).view(shape)

    def _routed_step(self, x: torch.Tensor, valid_tokens: Optional[torch.Tensor]) -> torch.Tensor:
        """Gate, router and routed experts of a `_one_step` forward: one op under `torch.compile`,
        else `moe_step` on the layer's tensors, a decode-sized one by its launch plan."""
        if torch.compiler.is_compiling():
            return self._one_step_op(x, valid_tokens)
        return planned_call(self._plan_key(x, valid_tokens), (x, valid_tokens), lambda: moe_step(
            x, valid_tokens, self.gate.weight, self.gate.bias, self.e_score_correction_bias, *self.expert_weights(),
            self.w13_bias, self.w2_bias, self._named_router(), self.activation, self.activation_config, self.layout,
            self.backend))

    def _forward(self, x: torch.Tensor, router_logits: Optional[torch.Tensor], token_ids: Optional[torch.Tensor],
                 valid_tokens: Optional[torch.Tensor]) -> torch.Tensor:
        routes = self._gate_routes(x) if router_logits is None and token_ids is None else None
        if routes is None:
            logits = self.gate(x) if router_logits is None else router_logits
            routes = self.route(logits, token_ids)
        topk_weights, topk_ids = routes
        out = self.experts(x, topk_weights, topk_ids, valid_tokens)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _gate_routes(self, x: torch.Tensor) -> Optional[tuple]:
        """`route(gate(x))` for a decode-sized batch by the gate kernel and the router kernel
        (`routing.gate_sums`), or None where those do not serve it."""
        if not isinstance(self.router, str) or not self._plain_gate():
            return None
        return self._named_router().gate_routes(x, self.gate.weight, self.gate.bias, self.e_score_correction_bias)

    def _plain_gate(self) -> bool:
        """Whether calling `self.gate` is exactly `F.linear` with its parameters: an `nn.Linear`
        (not a subclass or a replacement module) with no forward hooks of its own or global ones
        (nn.Module's own fast path checks the same registries)."""
        gate = self.gate
        return type(gate) is nn.Linear and not (gate._forward_hooks or gate._forward_pre_hooks
                                               or nn.modules.module._global_forward_hooks
                                               or nn.modules.module._global_forward_pre_hooks)

    def _one_step(self, x: torch.Tensor) -> bool:
        """Whether this forward (no logits or token ids given) is `moe_step` on the layer's tensors
        and settings (plus any shared experts, a module of the caller's, run beside it): a named
        router, a plain `nn.Linear` gate, no expert parallelism (its own exchange) and no gradient
        to record (the gate kernel and the ops have no backward). Its routed part replays a launch
        plan when eager and decode-sized, and is one op under `torch.compile`
        (`padded_moe::moe_forward`)."""
        if self.expert_parallel is not None or not isinstance(self.router, str) or not self._plain_gate() \
                or plan_options(self.activation, self.activation_config, self.layout, self.backend) is None:
            return False
        gate = self.gate
        return not (torch.is_grad_enabled() and (x.requires_grad or gate.weight.requires_grad
                                                 or (gate.bias is not None and gate.bias.requires_grad)))

    def _plan_key(self, x: torch.Tensor, valid_tokens: Optional[torch.Tensor]) -> Optional[tuple]:
        """The launch-plan key of a `_one_step` forward's routed part (see the module docstring), or None."""
        w13, w2 = self.expert_weights()
        return moe_step_plan_key(x, valid_tokens, (w13, w2, self.w13_bias, self.w2_bias, self.gate.weight,
                                                   self.gate.bias, self.e_score_correction_bias),
                                 plan_options(self.activation, self.activation_config, self.layout, self.backend),
                                 self._named_router(), eager_cache=True)

    def _one_step_op(self, x: torch.Tensor, valid_tokens: Optional[torch.Tensor]) -> torch.Tensor:
        """The compiled form of a `_one_step` forward: every tensor and setting the step reads is an
        argument of the op (none names this layer), so the layers of a model share one graph."""
        return torch.ops.padded_moe.moe_forward(*self._one_step_args(x, valid_tokens))

    def _one_step_args(self, x: torch.Tensor, valid_tokens: Optional[torch.Tensor]) -> tuple:
        """`padded_moe::moe_forward`'s arguments for this layer."""
        w13, w2 = self.expert_weights()
        r = self._named_router()
        return (x, valid_tokens, self.gate.weight, self.gate.bias, self.e_score_correction_bias,
                *op_weight_parts(w13), *op_weight_parts(w2), self.w13_bias, self.w2_bias,
                r.name, r.top_k, r.routed_scaling_factor, r.num_groups, r.topk_groups,
                *self._experts_settings())

    def _experts_settings(self) -> tuple:
        """The experts' settings as custom-op arguments: activation, its config's five fields, the
        layout and the backend (`activation_config=None` means the defaults, as eagerly)."""
        cfg = self.activation_config or ApplyMoEActivationConfig()
        return (self.activation.value, cfg.clamp_limit, cfg.alpha, cfg.beta, cfg.situ_beta, cfg.situ_linear_beta,
                _layout_name(self.layout), self.backend)

    def _ep_op_args(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> tuple:
        """`padded_moe::ep_experts`' arguments for this layer."""
        w13, w2 = self.expert_weights()
        return (x, topk_weights, topk_ids, self.expert_parallel.op_id, *op_weight_parts(w13), *op_weight_parts(w2),
                self.w13_bias, self.w2_bias, *self._experts_settings())

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                valid_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Routed experts only (no router, no shared experts) on `x [M, K]`; `valid_tokens` as in
        `forward`."""
        w13, w2 = self.expert_weights()
        if self.expert_parallel is not None:
            # Dispatch moves whole rows; padded ones are dropped at the source by the id guard.
            topk_ids = drop_rows_past(topk_ids, check_valid_tokens(valid_tokens, topk_ids))
            if torch.compiler.is_compiling():
                # One opaque op for dispatch → local experts → combine: the compiler never traces
                # the exchange (persistent buffers viewed with other dtypes, collectives, flags).
                # It names the ExpertParallel, not the layer: layers sharing one share a graph.
                return torch.ops.padded_moe.ep_experts(*self._ep_op_args(x, topk_weights, topk_ids))
            return ep_step(self.expert_parallel, x, topk_weights, topk_ids, w13, w2, self.w13_bias, self.w2_bias,
                           self.activation, self.activation_config, self.layout, self.backend)
        return fused_experts(x, w13, w2, topk_weights, topk_ids, layout=self.layout, w13_bias=self.w13_bias,
                             w2_bias=self.w2_bias, activation=self.activation,
                             activation_config=self.activation_config, valid_tokens=valid_tokens,
                             backend=self.backend)


@dataclass(frozen=True)
class NamedRouter:
    """A named router (`ROUTERS`) with its settings: what routing reads besides its input."""

    name: str
    top_k: int
    routed_scaling_factor: float
    num_groups: int
    topk_groups: int

    def route(self, source, correction_bias: Optional[torch.Tensor], softmax: Callable, biased: Callable):
        """The routing call on `source`: logits through `routing.softmax_topk` /
        `biased_grouped_topk`, or the gate kernel's sums through `gate_softmax_topk` /
        `gate_biased_topk` (the same arguments)."""
        if not self.name.startswith("biased_"):
            return softmax(source, self.top_k, self.name == "softmax_renorm",
                           topk_before_softmax=self.name == "topk_softmax")
        scoring = "sigmoid" if self.name == "biased_sigmoid" else "sqrtsoftplus"
        return biased(source, correction_bias, self.top_k, num_groups=self.num_groups, topk_groups=self.topk_groups,
                      scoring=scoring, routed_scaling_factor=self.routed_scaling_factor, renormalize=True)

    def gate_routes(self, x: torch.Tensor, gate_weight: torch.Tensor, gate_bias: Optional[torch.Tensor],
                    correction_bias: Optional[torch.Tensor]) -> Optional[tuple]:
        """`route(F.linear(x, gate_weight, gate_bias))` by the gate kernel and the router kernel
        (`routing.gate_sums`), or None where those do not serve it."""
        if self.name.startswith("biased_") and not routing.biased_groups_fit(gate_weight.shape[0], self.num_groups,
                                                                             self.topk_groups):
            return None
        sums = routing.gate_sums(x, gate_weight, gate_bias)
        if sums is None:
            return None
        return self.route(sums, correction_bias, routing.gate_softmax_topk, routing.gate_biased_topk)


def moe_step(x: torch.Tensor, valid_tokens: Optional[torch.Tensor], gate_weight: torch.Tensor,
             gate_bias: Optional[torch.Tensor], correction_bias: Optional[torch.Tensor], w13, w2,
             w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor], router: NamedRouter,
             activation, activation_config: Optional[ApplyMoEActivationConfig], layout, backend: str) -> torch.Tensor:
    """One `FusedMoE` forward with a plain `nn.Linear` gate and a named router, from its tensors
    and settings: the gate projection and routing (the gate kernel where it serves, else
    `F.linear` and the router), then `fused_experts`."""
    routes = router.gate_routes(x, gate_weight, gate_bias, correction_bias)
    if routes is None:
        routes = router.route(F.linear(x, gate_weight, gate_bias), correction_bias, routing.softmax_topk,
                              routing.biased_grouped_topk)
    topk_weights, topk_ids = routes
    return fused_experts(x, w13, w2, topk_weights, topk_ids, layout=layout, w13_bias=w13_bias, w2_bias=w2_bias,
                         activation=activation, activation_config=activation_config, valid_tokens=valid_tokens,
                         backend=backend)


def moe_step_plan_key(x: torch.Tensor, valid_tokens: Optional[torch.Tensor], tensors: tuple,
                      experts_options: Optional[tuple], router: NamedRouter, *, eager_cache: bool) -> Optional[tuple]:
    """The launch-plan key of `moe_step` (decode-sized: the gate kernel serves it, so the step is
    Triton launches only), or None: every value the step's host code reads that may change
    between calls (`experts.plan_key_head`): the long-lived `tensors`' identities (weights,
    biases, gate), the settings, the hidden states' signature, the environment."""
    if torch.compiler.is_compiling() or experts_options is None \
            or not 0 < x.shape[0] <= routing.GATE_KERNEL_MAX_TOKENS:
        return None
    head = plan_key_head(x, valid_tokens, tensors, experts_options + (router,), eager_cache=eager_cache)
    return None if head is None else head + ("moe_step",)


def ep_step(ep, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13, w2,
            w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor], activation,
            activation_config: Optional[ApplyMoEActivationConfig], layout, backend: str) -> torch.Tensor:
    """Routed experts with expert parallelism: `ep.dispatch` → this rank's experts → `ep.combine`."""
    common = dict(activation=activation, activation_config=activation_config, backend=backend)
    rb, handle = ep.dispatch(x, topk_ids, topk_weights)
    # The receive buffers have room for every token of every rank; the GEMM tiles are sized for the
    # rows a local expert is expected to receive when each rank routes as many tokens as this one.
    m, k = x.shape[0], topk_ids.shape[1]
    expected = cdiv(m * k, max(ep.num_local, 1)) if isinstance(m, int) else None
    if ep.mode == "flat":
        # INDEXED (a layout forced by the caller) sizes its tiles with its row blocks instead.
        hint = expected if layout_for_call(layout, expert_parallel=True) is not GemmLayout.INDEXED else None
        y = fused_experts(rb.x, w13, w2, rb.topk_weights, rb.topk_ids, expert_map=ep.expert_map,
                          valid_tokens=rb.valid_tokens, layout=layout, w13_bias=w13_bias, w2_bias=w2_bias,
                          expected_m=hint, **common)
    else:
        if w13_bias is not None:
            raise NotImplementedError("expert biases are not supported in batched expert-parallel mode; use mode='flat'")
        y = batched_experts(rb.x, rb.counts, w13, w2, expected_m=expected, **common)
    return ep.combine(y, handle)


def _layout_name(layout) -> Optional[str]:
    """A layout setting as a custom op's argument (`plan_options` has checked its type)."""
    return layout.value if isinstance(layout, GemmLayout) else layout


# ---------------------------------------------------------------------------------------------
# Custom ops: what torch.compile sees of a forward. Each takes the step's tensors and settings,
# never an object that names a layer: Dynamo specializes on such an id, so every layer instance
# would compile a graph of its own (and a model past the recompile limit would fall back).


@custom_op("padded_moe::moe_forward", mutates_args=())
def _moe_forward_op(x: torch.Tensor, valid_tokens: Optional[torch.Tensor], gate_weight: torch.Tensor,
                    gate_bias: Optional[torch.Tensor], correction_bias: Optional[torch.Tensor],
                    w13: torch.Tensor, w13_scales: Optional[torch.Tensor], w13_hopper_blocks: Optional[torch.Tensor],
                    w13_hopper_scales: Optional[torch.Tensor], w2: torch.Tensor, w2_scales: Optional[torch.Tensor],
                    w2_hopper_blocks: Optional[torch.Tensor], w2_hopper_scales: Optional[torch.Tensor],
                    w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor], router: str, top_k: int,
                    routed_scaling_factor: float, num_groups: int, topk_groups: int, activation: str,
                    clamp_limit: Optional[float], alpha: Optional[float], beta: Optional[float],
                    situ_beta: Optional[float], situ_linear_beta: Optional[float], layout: Optional[str],
                    backend: str) -> torch.Tensor:
    """`FusedMoE.forward(x [M, K], valid_tokens=)` of a `_one_step` layer as the compiler sees it:
    `moe_step`, a decode-sized one by its launch plan, with a fresh `[M, K]` output. The buffer
    cache stays off: a graph's warm-up may allocate from a CUDA-graph pool that a cache must
    never keep (plans made here allocate per call)."""
    r = NamedRouter(router, top_k, routed_scaling_factor, num_groups, topk_groups)
    cfg = ApplyMoEActivationConfig(clamp_limit, alpha, beta, situ_beta, situ_linear_beta)
    parts13 = (w13, w13_scales, w13_hopper_blocks, w13_hopper_scales)
    parts2 = (w2, w2_scales, w2_hopper_blocks, w2_hopper_scales)

    def call() -> torch.Tensor:
        return moe_step(x, valid_tokens, gate_weight, gate_bias, correction_bias, op_weight_from_parts(*parts13),
                        op_weight_from_parts(*parts2), w13_bias, w2_bias, r, activation, cfg, layout, backend)

    with eager_cache_off():
        # The key reads the op's arguments as they come: a replay builds no weight or config object.
        key = moe_step_plan_key(x, valid_tokens, parts13 + parts2 + (w13_bias, w2_bias, gate_weight, gate_bias,
                                                                     correction_bias),
                                plan_options(activation, cfg, layout, backend), r, eager_cache=False)
        return planned_call(key, (x, valid_tokens), call)


@register_fake("padded_moe::moe_forward")
def _(x, *args):
    return x.new_empty(x.shape)


@custom_op("padded_moe::ep_experts", mutates_args=())
def _ep_experts_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, ep_id: int,
                   w13: torch.Tensor, w13_scales: Optional[torch.Tensor], w13_hopper_blocks: Optional[torch.Tensor],
                   w13_hopper_scales: Optional[torch.Tensor], w2: torch.Tensor, w2_scales: Optional[torch.Tensor],
                   w2_hopper_blocks: Optional[torch.Tensor], w2_hopper_scales: Optional[torch.Tensor],
                   w13_bias: Optional[torch.Tensor], w2_bias: Optional[torch.Tensor], activation: str,
                   clamp_limit: Optional[float], alpha: Optional[float], beta: Optional[float],
                   situ_beta: Optional[float], situ_linear_beta: Optional[float], layout: Optional[str],
                   backend: str) -> torch.Tensor:
    """`FusedMoE.experts` with expert parallelism as the compiler sees it: `ep_step` on the
    `ExpertParallel` whose op id is `ep_id`, with a fresh `[m, K]` output."""
    ep = expert_parallel_of_op("ep_experts", ep_id)
    cfg = ApplyMoEActivationConfig(clamp_limit, alpha, beta, situ_beta, situ_linear_beta)
    with eager_cache_off():
        return ep_step(ep, x, topk_weights, topk_ids,
                       op_weight_from_parts(w13, w13_scales, w13_hopper_blocks, w13_hopper_scales),
                       op_weight_from_parts(w2, w2_scales, w2_hopper_blocks, w2_hopper_scales), w13_bias, w2_bias,
                       MoEActivation(activation), cfg, layout, backend)


@register_fake("padded_moe::ep_experts")
def _(x, *args):
    return x.new_empty(x.shape)


def _check_expert_parallel(ep, num_experts: int, top_k: int, hidden_size: int, dtype: torch.dtype) -> None:
    """The layer must describe the same experts, top-k, width and activation dtype as its
    `ExpertParallel`: its buffers and expert map were made for those (a dtype that differs would
    otherwise surface only at the first dispatch). Sizes that differ are a ValueError, a dtype a
    TypeError, as everywhere in the library."""
    from padded_moe.ep import ExpertParallel

    if not isinstance(ep, ExpertParallel):
        raise TypeError(f"expert_parallel must be an ExpertParallel or None, got {type(ep).__name__}")
    for name, mine in (("num_experts", num_experts), ("top_k", top_k), ("hidden_size", hidden_size)):
        theirs = getattr(ep, name)
        if theirs != mine:
            raise ValueError(f"{name}={mine} differs from the expert_parallel's {name}={theirs}")
    if dtype != ep.dtype:
        raise TypeError(f"dtype={dtype} differs from the expert_parallel's dtype={ep.dtype}")


def _check_sizes(num_experts, top_k, hidden_size, intermediate_size, dtype) -> None:
    require_int("num_experts", num_experts, 1)
    require_int("top_k", top_k, 1)
    require_int("hidden_size", hidden_size, 1)
    require_int("intermediate_size", intermediate_size, 1)
    if top_k > num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of torch.float32, torch.float16, torch.bfloat16, got {dtype!r}")


def _check_forward_inputs(hidden_states, router_logits, hidden_size: int, num_experts: int,
                          dtype: torch.dtype) -> None:
    """Shape and dtype checks on metadata only (no tensor reads), so forward stays traceable."""
    require_tensor("hidden_states", hidden_states)
    if hidden_states.dim() < 1 or hidden_states.shape[-1] != hidden_size:
        raise ValueError(f"hidden_states must be [..., hidden_size={hidden_size}], got shape {tuple(hidden_states.shape)}")
    if hidden_states.dtype != dtype:
        raise TypeError(f"hidden_states must have the layer's dtype {dtype}, got {hidden_states.dtype}")
    if router_logits is not None:
        require_tensor("router_logits", router_logits)
        tokens = hidden_states.numel() // hidden_size
        if tuple(router_logits.shape) != (tokens, num_experts):
            raise ValueError(f"router_logits must be [tokens={tokens}, num_experts={num_experts}], "
                             f"got shape {tuple(router_logits.shape)}")


def _init_uniform_(target: torch.Tensor, seed: int, *, stream: int) -> None:
    """Fill a `[out, in]` matrix uniform in ±1/sqrt(in), in place, from a generator of its own."""
    bound = 1.0 / math.sqrt(target.shape[-1])
    gen = torch.Generator(device=target.device).manual_seed((seed * 1_000_003 + stream + 1) & ((1 << 63) - 1))
    target.uniform_(-bound, bound, generator=gen)


def dense_weights(w) -> torch.Tensor:
    """A float copy of a weight for references (dequantizes MXFP4)."""
    return w.dequantize(torch.float32) if isinstance(w, Mxfp4Tensor) else w.detach().float()
