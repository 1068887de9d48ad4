"""HF transformers plug-in: run HF MoE experts modules on padded_moe.

`register()` adds ``"padded_moe"`` to transformers' `ExpertsInterface`, so
``AutoModelForCausalLM.from_config(cfg, experts_implementation="padded_moe")`` or
``model.set_experts_implementation("padded_moe")`` routes every experts module through
`padded_moe_experts_forward`: we receive the module, its flat hidden states, `top_k_index` and
`top_k_weights`, and replace the expert computation. The routing formula stays HF's; for the
top-k routers whose formula `padded_moe.routing` computes (`_ROUTERS`: Mixtral, Qwen3-MoE, OLMoE,
GPT-OSS through `fused_topk`; DeepSeek-V3, DeepSeek-V3.2, GLM-4-MoE, and DeepSeek-V4 with its steps
in bfloat16, through `biased_grouped_topk`)
the plug-in also runs it as one kernel instead of torch's several, with HF's output dtypes, when
the model's experts implementation is "padded_moe". MXFP4 experts are read as MXFP4 (never
dequantized) from either checkpoint form: GPT-OSS's `*_blocks` / `*_scales`, or the packed FP4
codes of transformers' quantized `FP8Experts` (DeepSeek-V4's checkpoints), and held once, prepared.

Each call is served one of two ways (see `experts_plan` and docs/transformers.md):

- fused: the module's gate is a `MoEActivation` (detected from the class that defines
  `_apply_gate` and the module's activation attributes), so `fused_experts` runs the whole thing;
- composed: the gate is unknown (or the module has a post-expert norm), so `fused_experts` runs
  with the module's own `_apply_gate` (or `act_fn`) as its activation callable (and the norm as
  its `output_transform`), eagerly in torch between our GEMMs.

transformers is imported only inside `register()` and the helpers it installs, so importing this
module costs nothing when transformers is absent.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

IMPLEMENTATION = "padded_moe"

# Fused path: the gate is a `MoEActivation`.  Composed path: the module's gate runs in torch.
FUSED = "fused"
COMPOSED = "composed"


@dataclass(frozen=True)
class ExpertsPlan:
    """How one experts module is run.

    `family` names the detected model family (for logs and docs); `activation` is a `MoEActivation` name
    or None when the module's own gate must run in torch; `activation_config` holds the
    `ApplyMoEActivationConfig` for it.
    """

    family: str
    path: str
    activation: Optional[str] = None
    activation_config: Any = None


# ---------------------------------------------------------------------------------------------
# Detecting the activation
# ---------------------------------------------------------------------------------------------

def _act_name(act_fn: Any) -> Optional[str]:
    """`MoEActivation` base name of an HF activation module, or None when it is not one we implement.

    Exact type checks (not isinstance) so a subclass that changes `forward` is not mistaken for
    the function its parent computes.
    """
    from torch import nn
    from transformers import activations as hf

    kind = type(act_fn)
    if kind in (hf.SiLUActivation, nn.SiLU):
        return "silu"
    if kind is hf.GELUActivation:
        return "gelu"  # both its torch and python variants are the exact erf GELU
    if kind in (hf.GELUTanh, hf.NewGELUActivation):
        return "gelu_tanh"
    if kind is hf.ReLUSquaredActivation:
        return "relu2"
    return None


def _limit(value: Any) -> Optional[float]:
    """An HF clamp bound as a float; None or inf mean "no clamp" to `ApplyMoEActivationConfig.clamp_limit`."""
    if value is None:
        return None
    value = float(value)
    return None if value == math.inf else value


def _config(**fields) -> Any:
    from padded_moe.activation import ApplyMoEActivationConfig

    return ApplyMoEActivationConfig(**fields)


# Each entry reads the module's own attributes (set from its config at construction), so per-layer
# values such as Step-3.7's limits are honoured.  Returning None sends the module to the composed
# path (e.g. a DeepSeek-V4 config whose hidden_act is not silu).

def _deepseek_v4(m) -> Optional[Tuple[str, Any]]:
    # gate.clamp(max=L), up.clamp(-L, L), act_fn(gate) * up  ==  the library's silu with clamp_limit L.
    if _act_name(m.act_fn) != "silu":
        return None
    return "silu", _config(clamp_limit=_limit(m.limit))


def _gpt_oss(m) -> Optional[Tuple[str, Any]]:
    # Interleaved gate/up, gate.clamp(max=L), up.clamp(-L, L), gate*sigmoid(alpha*gate)*(up+1).
    return "swigluoai", _config(clamp_limit=float(m.limit), alpha=float(m.alpha), beta=1.0)


def _minimax_m3(m) -> Optional[Tuple[str, Any]]:
    # GPT-OSS's gate on packed (gate rows first) weights.
    return "swigluoai_uninterleave", _config(clamp_limit=float(m.swiglu_limit),
                                             alpha=float(m.swiglu_alpha), beta=1.0)


def _step3p7(m) -> Optional[Tuple[str, Any]]:
    # act_fn(gate).clamp(max=L) * up.clamp(-L, L) on layers with a limit; transformers 5.24 gives
    # the others L = inf, 5.25 gives them None (no clamp).
    if _act_name(m.act_fn) != "silu":
        return None
    limit = float("inf") if m.limit is None else float(m.limit)
    return "swiglustep", _config(clamp_limit=limit)


def _fp8_experts(m) -> Optional[Tuple[str, Any]]:
    # transformers' quantized experts (`FP8Experts`; DeepSeek-V4's FP4 checkpoints load into it), on
    # packed halves. Its `_apply_gate` picks one of four gates from the module's attributes.
    if getattr(m, "gate_softcap", None) is not None:
        return None  # tanh soft caps: no kernel (not a `MoEActivation`), the module's own gate runs
    act = _act_name(getattr(m, "act_fn", None))
    limit = _limit(getattr(m, "limit", None))
    if getattr(m, "swiglu_alpha", None) is not None:
        # gate.clamp(max=L), up.clamp(-L, L), gate * sigmoid(alpha * gate) * (up + 1)
        if limit is None:
            return None
        return "swigluoai_uninterleave", _config(clamp_limit=limit, alpha=float(m.swiglu_alpha), beta=1.0)
    if limit is not None and getattr(m, "limit_after_act", False):
        # act_fn(gate).clamp(max=L) * up.clamp(-L, L)
        return ("swiglustep", _config(clamp_limit=limit)) if act == "silu" else None
    if limit is not None:
        # gate.clamp(max=L), up.clamp(-L, L), act_fn(gate) * up
        return ("silu", _config(clamp_limit=limit)) if act == "silu" else None
    if act is None or act == "relu2":
        return None
    return act, _config()


# (module, class) that defines `_apply_gate` -> (family, reader).
_KNOWN_GATES: dict = {
    ("transformers.models.deepseek_v4.modeling_deepseek_v4", "DeepseekV4Experts"):
        ("deepseek_v4", _deepseek_v4),
    ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts"):
        ("gpt_oss", _gpt_oss),
    ("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl", "MiniMaxM3VLExperts"):
        ("minimax_m3", _minimax_m3),
    ("transformers.models.step3p7.modeling_step3p7", "Step3p7Experts"):
        ("step3p7", _step3p7),
    ("transformers.integrations.finegrained_fp8", "FP8Experts"):
        ("fp8_experts", _fp8_experts),
}


def _gate_owner(cls: type) -> Optional[type]:
    """The class in `cls`'s MRO that defines `_apply_gate` (None when nothing does)."""
    for klass in cls.__mro__:
        if "_apply_gate" in vars(klass):
            return klass
    return None


def _default_gate() -> Callable:
    from transformers.integrations.moe import _default_apply_gate

    return _default_apply_gate


def _plan_default_gate(module) -> ExpertsPlan:
    """`act_fn(gate) * up` on packed halves (Mixtral, Qwen3-MoE, OLMoE, ...)."""
    act = _act_name(getattr(module, "act_fn", None))
    if act is None or act == "relu2":  # gated relu2 has no kernel (`activation_supported` is False)
        return ExpertsPlan("default_gate", COMPOSED)
    return ExpertsPlan("default_gate", FUSED, act, _config())


def _plan_ungated(module) -> ExpertsPlan:
    act = _act_name(getattr(module, "act_fn", None))
    if act is None:
        return ExpertsPlan("ungated", COMPOSED)
    return ExpertsPlan("ungated", FUSED, act + "_no_mul", _config())


def _member(module, name: str) -> Any:
    """`getattr(module, name, None)` for an instance member (attribute, parameter, buffer,
    submodule), without nn.Module's exception path for absent names (a few µs each)."""
    members = module.__dict__
    if name in members:
        return members[name]
    for table in ("_parameters", "_buffers", "_modules"):
        found = members.get(table)
        if found is not None and name in found:
            return found[name]
    return None


# Every instance member a plan reads (the gate readers above, `experts_plan` below).
_PLAN_MEMBERS = ("act_fn", "limit", "alpha", "swiglu_limit", "swiglu_alpha", "gate_softcap", "limit_after_act",
                 "has_gate", "has_post_expert_norm")


def experts_plan(module: torch.nn.Module) -> ExpertsPlan:
    """Decide how `module` (an HF experts module) runs; called every forward, so an eager call
    reuses the module's last plan while its class, the class's `_apply_gate` and every member a
    plan reads are the same objects (a changed limit, say, makes a new plan).

    Detection is by the class that defines `_apply_gate`, never by name guessing: a subclass that
    overrides `_apply_gate` is unknown and takes the composed path, one that inherits it keeps
    its parent's mapping.
    """
    if torch.compiler.is_compiling():
        return _experts_plan(module)
    cls = type(module)
    key = (cls, getattr(cls, "_apply_gate", None)) + tuple(_member(module, name) for name in _PLAN_MEMBERS)
    hit = module.__dict__.get("_padded_moe_plan")
    if hit is not None and len(hit[0]) == len(key) and all(a is b for a, b in zip(hit[0], key)):
        return hit[1]
    plan = _experts_plan(module)
    module.__dict__["_padded_moe_plan"] = (key, plan)
    return plan


def _experts_plan(module: torch.nn.Module) -> ExpertsPlan:
    """`experts_plan` computed afresh."""
    if not getattr(module, "has_gate", True):
        plan = _plan_ungated(module)
    else:
        gate = getattr(type(module), "_apply_gate", None)
        owner = _gate_owner(type(module))
        known = _KNOWN_GATES.get((owner.__module__, owner.__qualname__)) if owner is not None else None
        if gate is None or gate is _default_gate():
            plan = _plan_default_gate(module)
        elif known is not None:
            family, reader = known
            found = reader(module)
            plan = ExpertsPlan(family, FUSED, *found) if found is not None else ExpertsPlan(family, COMPOSED)
        else:
            plan = ExpertsPlan(f"custom:{type(module).__qualname__}", COMPOSED)
    # A norm between GEMM2 and the router weighting has no place inside fused_experts.
    if getattr(module, "has_post_expert_norm", False) and plan.path == FUSED:
        plan = ExpertsPlan(plan.family, COMPOSED, plan.activation, plan.activation_config)
    return plan


# ---------------------------------------------------------------------------------------------
# Weights in our layout (`w13 [E, 2N, K]`, `w2 [E, K, N]`)
# ---------------------------------------------------------------------------------------------

def _cached(module, slot: str, source: tuple, convert: Callable[..., Any]) -> Any:
    """`convert(*source)`, recomputed only when a tensor of `source` changes (storage, in-place
    version, shape): an MXFP4 weight's values and its scales, each of which may be replaced alone.

    MXFP4 checkpoint tensors whose inner width is not a multiple of 64 keep a prepared copy here
    (the others are held once, `hold_mxfp4`); converting on every forward would cost a full weight
    conversion per token step.

    Under `torch.compile` the cached value is read as it is: the compiler can neither compare data
    pointers nor keep a conversion out of the graph (it would convert the weights on every call), so
    the cache must be filled before tracing, by `prepare_experts(model)` or one eager forward.
    """
    if torch.compiler.is_compiling():
        hit = module.__dict__.get("_padded_moe_cache", {}).get(slot)
        if hit is None:
            raise RuntimeError(
                f"padded_moe: {type(module).__name__} needs its weights converted before torch.compile traces it "
                "(a transposed or MXFP4 checkpoint): call padded_moe.integrations.transformers.prepare_experts(model) "
                "once after loading the model (or run one eager forward), then compile")
        return hit[1]
    cache = module.__dict__.setdefault("_padded_moe_cache", {})
    key = tuple((t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device) for t in source)
    hit = cache.get(slot)
    if hit is not None and hit[0] == key:
        return hit[1]
    value = convert(*source)
    cache[slot] = (key, value)
    return value


# MXFP4 experts come in two checkpoint forms (`_Form`):
# - GPT-OSS's: `<proj>_blocks` uint8 [E, out, K/32, 16] and `<proj>_scales` uint8 E8M0 [E, out, K/32];
# - packed FP4 (transformers' `FP8Experts` with expert_dtype="fp4", DeepSeek-V4's checkpoints):
#   `<proj>` int8 [E, out, K/2] and `<proj>_scale_inv` [E, out, K/32], E8M0 as float8_e8m0fnu or
#   uint8 bytes, or as float32 powers of two.
# Both keep two e2m1 codes per byte with the even element in the low nibble: our canonical
# `Mxfp4Tensor`, up to a reshape and the scales' dtype.
#
# Held once: the prepared arrangement (`Mxfp4Tensor.prepare_for`) as buffers
# `_padded_moe_<proj>_blocks` / `_scales` (so `.to()` moves them), the K and the checkpoint form in
# a module attribute, and no checkpoint tensors next to them: `state_dict()` gives those back in
# their own form in place of the prepared buffers, and `load_state_dict` takes them. (Persistent
# buffers, because transformers' `from_pretrained` re-creates every non-persistent buffer after
# loading.)
_HELD = "_padded_moe_mxfp4"
_PROJS = ("gate_up_proj", "up_proj", "down_proj")
GPT_OSS_FORM = "gpt_oss"
# Dtypes of packed FP4 values (two e2m1 codes per byte): transformers allocates int8.
_PACKED_FP4_DTYPES = tuple(d for d in (torch.int8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None)


@dataclass(frozen=True)
class _Form:
    """How one weight's MXFP4 bytes sit in a checkpoint: `kind` GPT_OSS_FORM or "packed", and for
    packed weights the dtype their scales had (float8_e8m0fnu, uint8 or float32)."""

    kind: str
    scale_dtype: Any = None

    def names(self, proj: str) -> tuple:
        """The two checkpoint tensors' names (values, scales)."""
        return (f"{proj}_blocks", f"{proj}_scales") if self.kind == GPT_OSS_FORM else (proj, f"{proj}_scale_inv")

    def read(self, values: torch.Tensor, scales: torch.Tensor, where: str) -> Any:
        """The canonical `Mxfp4Tensor` of the two tensors (a view of the values; the scales viewed
        as their E8M0 bytes, or computed from float powers of two)."""
        from padded_moe.mxfp4 import Mxfp4Tensor, from_gpt_oss

        if self.kind == GPT_OSS_FORM:
            return from_gpt_oss(values, scales)
        return Mxfp4Tensor(values.view(torch.uint8), _e8m0_bytes(scales, where))

    def write(self, weight) -> tuple:
        """Inverse of `read`: the two tensors in this form."""
        from padded_moe.mxfp4 import to_gpt_oss

        if self.kind == GPT_OSS_FORM:
            return to_gpt_oss(weight)
        q = weight.canonical()
        if self.scale_dtype == torch.uint8:
            scales = q.scales
        elif self.scale_dtype.is_floating_point and self.scale_dtype.itemsize == 1:  # float8_e8m0fnu
            scales = q.scales.view(self.scale_dtype)
        else:
            scales = torch.exp2(q.scales.to(torch.float32) - 127.0).to(self.scale_dtype)
        return q.blocks.view(torch.int8), scales


def _e8m0_bytes(scales: torch.Tensor, where: str) -> torch.Tensor:
    """E8M0 bytes (uint8) of MXFP4 scales stored as float8_e8m0fnu, uint8, or float powers of two."""
    if scales.dtype == torch.uint8:
        return scales
    if scales.dtype.is_floating_point and scales.dtype.itemsize == 1:  # float8_e8m0fnu: the bytes themselves
        return scales.view(torch.uint8)
    if scales.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{where}: MXFP4 scales must be E8M0 (float8_e8m0fnu or uint8) or float powers of two, "
                        f"got {scales.dtype}")
    mantissa, exponent = torch.frexp(scales.float())
    byte = exponent.to(torch.int32) + 126  # s = 0.5 * 2^e = 2^(byte - 127)
    if not bool(((mantissa == 0.5) & (byte >= 0) & (byte <= 254)).all()):
        raise ValueError(f"{where}: float MXFP4 scales must be powers of two in [2^-127, 2^127] (E8M0), got "
                         f"other values")
    return byte.to(torch.uint8)


def _mxfp4_source(module, proj: str) -> Optional[tuple]:
    """`(values, scales, form)` when the module holds `proj` as MXFP4 checkpoint tensors, else None.
    Packed FP8-format experts (float8 values) raise NotImplementedError: neither bf16 nor MXFP4."""
    blocks, scales = _member(module, f"{proj}_blocks"), _member(module, f"{proj}_scales")
    if isinstance(blocks, torch.Tensor) and isinstance(scales, torch.Tensor):
        return blocks, scales, _Form(GPT_OSS_FORM)
    values, scale_inv = _member(module, proj), _member(module, f"{proj}_scale_inv")
    if not (isinstance(values, torch.Tensor) and isinstance(scale_inv, torch.Tensor)):
        return None
    if values.dtype in _PACKED_FP4_DTYPES:
        return values, scale_inv, _Form("packed", scale_inv.dtype)
    if values.dtype.is_floating_point and values.dtype.itemsize == 1:
        raise NotImplementedError(
            f"padded_moe runs bf16 and MXFP4 experts; {type(module).__name__}.{proj} holds FP8 ({values.dtype}) "
            "experts. Load the checkpoint with dequantize=True for bf16, or choose another experts implementation")
    return None


def holds_mxfp4(module) -> bool:
    """Whether an experts module holds MXFP4 experts: checkpoint tensors of either form (GPT-OSS's
    `*_blocks` / `*_scales`, packed FP4 `*` / `*_scale_inv`) or the prepared form they were turned
    into (`hold_mxfp4`)."""
    if module.__dict__.get(_HELD):
        return True
    try:
        return any(_mxfp4_source(module, proj) is not None for proj in _PROJS)
    except NotImplementedError:
        return False


def hold_mxfp4(module: torch.nn.Module, proj: str, weight, form: str = GPT_OSS_FORM, scale_dtype=None) -> None:
    """Make HF experts module `module` hold MXFP4 weight `proj` (an `Mxfp4Tensor` `[E, out, in]`)
    once, in the arrangement the GEMMs read, and drop its checkpoint tensors if it had them (their
    bytes live on in the prepared form; `state_dict()` gives them back in `form`: GPT_OSS_FORM,
    or "packed" with scales of `scale_dtype`). `in` must be a multiple of 64
    (`mxfp4.prepared_stands_alone`)."""
    from padded_moe.mxfp4 import Mxfp4Tensor, prepared_stands_alone

    if not isinstance(weight, Mxfp4Tensor):
        raise TypeError(f"weight must be an Mxfp4Tensor, got {type(weight).__name__}")
    if not prepared_stands_alone(weight.shape[-1]):
        raise ValueError(f"holding {proj} prepared alone needs its inner width a multiple of 64, got "
                         f"{weight.shape[-1]}")
    if form not in (GPT_OSS_FORM, "packed"):
        raise ValueError(f"form must be {GPT_OSS_FORM!r} or 'packed', got {form!r}")
    fmt = _Form(form, scale_dtype if form == "packed" else None)
    if form == "packed" and not isinstance(scale_dtype, torch.dtype):
        raise TypeError(f"scale_dtype must be a torch.dtype for packed weights, got {type(scale_dtype).__name__}")
    h = weight.prepare_for(keep_canonical=False).hopper
    for name in fmt.names(proj):
        module._buffers.pop(name, None)
        module._parameters.pop(name, None)
        module.__dict__.pop(name, None)
    for part in ("blocks", "scales"):
        tensor = getattr(h, part)
        # A fixed address, like a parameter: CUDA graphs of a compiled forward read it in place.
        torch._dynamo.mark_static_address(tensor, guard=False)
        module.register_buffer(f"_padded_moe_{proj}_{part}", tensor)
    module.__dict__.setdefault(_HELD, {})[proj] = (h.k, fmt)
    if not module.__dict__.get("_padded_moe_state_hooks"):
        module._register_state_dict_hook(_held_state_dict)
        module._register_load_state_dict_pre_hook(_held_load_state_dict, with_module=True)
        module.__dict__["_padded_moe_state_hooks"] = True


def _held(module, proj: str) -> Any:
    """The held prepared `Mxfp4Tensor` of `proj`, or None. Eager calls reuse the object while the
    module's buffers are the same tensors (building one costs a few µs per weight and forward)."""
    entry = module.__dict__.get(_HELD, {}).get(proj)
    if entry is None:
        return None
    from padded_moe.mxfp4 import HopperMxfp4, Mxfp4Tensor

    blocks, scales = module._buffers[f"_padded_moe_{proj}_blocks"], module._buffers[f"_padded_moe_{proj}_scales"]
    if torch.compiler.is_compiling():
        return Mxfp4Tensor(None, None, HopperMxfp4(blocks, scales, entry[0]))
    built = module.__dict__.setdefault("_padded_moe_held_objects", {})
    weight = built.get(proj)
    if weight is None or weight.hopper.blocks is not blocks or weight.hopper.scales is not scales:
        weight = built[proj] = Mxfp4Tensor(None, None, HopperMxfp4(blocks, scales, entry[0]))
    return weight


def _held_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """State-dict hook: each held weight as its checkpoint tensors (rebuilt from the prepared form)
    in place of the prepared buffers."""
    for proj, (_, fmt) in module.__dict__.get(_HELD, {}).items():
        for part in ("blocks", "scales"):
            state_dict.pop(f"{prefix}_padded_moe_{proj}_{part}", None)
        for name, tensor in zip(fmt.names(proj), fmt.write(_held(module, proj))):
            state_dict[prefix + name] = tensor


def _held_load_state_dict(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                          error_msgs) -> None:
    """Load pre-hook: checkpoint tensors of a held weight replace its prepared form (the load then
    finds the new prepared buffers in the state dict, as themselves)."""
    for proj, (_, fmt) in list(module.__dict__.get(_HELD, {}).items()):
        names = tuple(prefix + n for n in fmt.names(proj))
        if not all(n in state_dict for n in names):
            continue  # the prepared buffers are then missing keys, as any absent weight is
        values, scales = (state_dict.pop(n) for n in names)
        device = getattr(module, f"_padded_moe_{proj}_blocks").device
        weight = fmt.read(values.to(device), scales.to(device), f"{type(module).__name__}.{proj}")
        have = tuple(_held(module, proj).shape)
        if tuple(weight.shape) != have:
            # Refused as PyTorch refuses any parameter of another size: reported, the weight kept.
            error_msgs.append(f"size mismatch for {names[0]}: copying an expert weight of shape {tuple(weight.shape)} "
                              f"(E, out, in) from checkpoint, the shape in current model is {have}.")
        else:
            with torch.no_grad():
                hold_mxfp4(module, proj, weight, fmt.kind, fmt.scale_dtype)
        for part in ("blocks", "scales"):
            state_dict[f"{prefix}_padded_moe_{proj}_{part}"] = getattr(module, f"_padded_moe_{proj}_{part}")


def _mxfp4_weight(module, proj: str, prepared: bool) -> Any:
    """An `Mxfp4Tensor` of `proj` when the module holds MXFP4 experts (`holds_mxfp4`, already
    `[E, out, in]`, so no transpose), else None. With `prepared`, the arrangement the GEMMs read:
    checkpoint tensors are turned into it once (`hold_mxfp4`: the module then holds them once), or,
    where the inner width is not a multiple of 64, prepared and cached next to them; else the
    checkpoint's bytes (a view of the tensors, or rebuilt from the prepared form: a copy)."""
    held = _held(module, proj)
    if held is not None:
        return held if prepared else held.canonical()
    source = _mxfp4_source(module, proj)
    if source is None:
        return None
    from padded_moe.mxfp4 import GROUP, prepared_stands_alone

    values, scales, fmt = source
    where = f"{type(module).__name__}.{proj}"
    if not prepared:
        return fmt.read(values.detach(), scales.detach(), where)
    # K from the scales' shape ([E, out, K/32] in both forms): no read (for float scales a host
    # check) on the cached route's every call.
    if not torch.compiler.is_compiling() and prepared_stands_alone(scales.shape[-1] * GROUP):
        with torch.no_grad():
            hold_mxfp4(module, proj, fmt.read(values.detach(), scales.detach(), where), fmt.kind, fmt.scale_dtype)
        return _held(module, proj)
    return _cached(module, f"{proj}_mxfp4", (values, scales),
                   lambda v, s: fmt.read(v.detach(), s.detach(), where).prepare_for())


def _weight(module, proj: str, prepared: bool) -> Any:
    mx = _mxfp4_weight(module, proj, prepared)
    if mx is not None:
        return mx
    w = getattr(module, proj)
    if getattr(module, "is_transposed", False):
        ours = w.detach().transpose(1, 2)
        if not prepared or ours.is_contiguous():
            return ours
        if type(w) not in (torch.Tensor, torch.nn.Parameter):
            # A tensor subclass (DTensor, a sharded parameter) owns its storage: keep a copy beside it.
            return _cached(module, proj, (w,), _untransposed)
        return _relaid(module, proj, w)
    return w


def _untransposed(w: torch.Tensor) -> torch.Tensor:
    """A transposed weight `[E, in, out]` as a contiguous `[E, out, in]` copy."""
    return w.detach().transpose(1, 2).contiguous()


def _relaid(module, proj: str, w: torch.Tensor) -> torch.Tensor:
    """A transposed weight (GPT-OSS's `[E, in, out]`) held once in our layout: its storage is
    rewritten to a contiguous `[E, out, in]`, and the module's tensor becomes the transposed view of
    it (same object, shape and values; a strided tensor to HF's own code). Returns our contiguous
    view. The old storage is freed unless something else holds it; the copy exists only while one
    weight is re-laid. Refused while the compiler traces (it would copy on every call) or a CUDA
    graph captures (the captured copy would read freed memory on every replay)."""
    if torch.compiler.is_compiling() or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        what = "torch.compile traces it" if torch.compiler.is_compiling() else "a CUDA graph captures it"
        raise RuntimeError(
            f"padded_moe: {type(module).__name__}.{proj} needs its weights re-laid before {what} "
            "(a transposed checkpoint): call padded_moe.integrations.transformers.prepare_experts(model) once after "
            "loading the model (or run one eager forward) first")
    # Outside inference mode: a parameter whose data became an inference tensor could never take a
    # gradient again.
    with torch.inference_mode(False), torch.no_grad():
        ours = _untransposed(w)
        w.data = ours.transpose(1, 2)
    return ours


def expert_weights(module: torch.nn.Module, prepared: bool = True):
    """`(w13, w2, w13_bias, w2_bias)` of an HF experts module in padded_moe's layout. `prepared`:
    as the GEMMs read them (contiguous, MXFP4 prepared; cached on the module); else views of the
    module's tensors with no copy made (to copy experts out of it)."""
    has_gate = getattr(module, "has_gate", True)
    w13 = _weight(module, "gate_up_proj" if has_gate else "up_proj", prepared)
    w2 = _weight(module, "down_proj", prepared)
    b13 = b2 = None
    if getattr(module, "has_bias", False):
        b13 = getattr(module, "gate_up_proj_bias" if has_gate else "up_proj_bias")
        b2 = module.down_proj_bias
    return w13, w2, b13, b2


def prepare_experts(model: torch.nn.Module) -> int:
    """Convert the weights of every HF experts module of `model` that padded_moe reads in another
    form (GPT-OSS's transposed bf16 parameters, re-laid in place; MXFP4 checkpoint tensors, held
    prepared) as the first eager forward would. Call it once after loading (and again after changing
    those weights) before `torch.compile`, which cannot make the conversion itself. Returns how many
    experts modules it converted; a model with none (packed bf16 weights) needs no call."""
    count = 0
    with torch.no_grad():
        for module in model.modules():
            mxfp4 = holds_mxfp4(module)
            if not (mxfp4 or hasattr(module, "down_proj")):
                continue
            if getattr(module, "is_transposed", False) or mxfp4:
                expert_weights(module)
                count += 1
    return count


# ---------------------------------------------------------------------------------------------
# The experts forward
# ---------------------------------------------------------------------------------------------

def _module_activation(module, plan: ExpertsPlan) -> Any:
    """What `fused_experts` runs between the GEMMs: the plan's `MoEActivation`, else the
    module's own gate (`_apply_gate`, or `act_fn` for ungated experts) as a row function."""
    if plan.activation is not None:
        return plan.activation
    return module._apply_gate if getattr(module, "has_gate", True) else module.act_fn


def padded_moe_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor,
                               top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The `ExpertsInterface` entry: same contract as transformers' `grouped_mm_experts_forward`.

    `hidden_states [T, H]`, `top_k_index [T, k]` (ids outside `[0, num_experts)` — expert-parallel
    sentinels — contribute nothing), `top_k_weights [T, k]`; returns `[T, H]` in the hidden dtype.
    The GEMM layout follows `PADDED_MOE_GEMM_LAYOUT` (docs/usage.md, "Environment variables") when set.
    """
    from padded_moe.experts import fused_experts

    shape = hidden_states.shape
    hidden = hidden_states.reshape(-1, shape[-1])
    ids = top_k_index.reshape(-1, top_k_index.shape[-1])
    # HF routers may hand the weights over in the model dtype: the combine reads them as they are
    # and multiplies in fp32 (the same values a cast would give, without a kernel per layer).
    weights = top_k_weights.reshape(ids.shape)
    plan = experts_plan(self)
    w13, w2, b13, b2 = expert_weights(self)
    # The composed path is fused_experts too, given the module's own gate and post-expert norm
    # (eager: a callable cannot enter the custom op).
    norm = self.post_expert_norm if getattr(self, "has_post_expert_norm", False) else None
    out = fused_experts(hidden, w13, w2, weights, ids, activation=_module_activation(self, plan),
                        activation_config=plan.activation_config if plan.activation is not None else None,
                        w13_bias=b13, w2_bias=b2, output_transform=norm)
    return out.to(hidden_states.dtype).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------

# HF experts classes that follow the `ExpertsInterface` contract (gate_up_proj / down_proj /
# _apply_gate) but are not decorated with `@use_experts_implementation` in transformers 5.24, so
# `experts_implementation=` never reaches them.  `register()` lets them dispatch to us.
_UNDECORATED = (
    ("transformers.models.step3p7.modeling_step3p7", "Step3p7Experts"),
)


# HF top-k routers whose formula `routing.fused_topk` (softmax routers) or `routing.biased_grouped_topk`
# (DeepSeek-V3's sigmoid, bias-corrected, group-limited router, which DeepSeek-V3.2 and GLM-4-MoE share)
# computes: (module, class, which formula: `_router_forward`'s kind). Each returns `(router_logits,
# router_scores, router_indices)` like the original: scores in the logits' dtype (float32 for Mixtral,
# as HF leaves them; float32 logits for DeepSeek-V3's), indices int64.
_ROUTERS = (
    ("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter", "mixtral"),
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter", "softmax_norm_flag"),
    ("transformers.models.olmoe.modeling_olmoe", "OlmoeTopKRouter", "softmax_norm_flag"),
    ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssTopKRouter", "gpt_oss"),
    ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter", "deepseek_v3"),
    ("transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32TopkRouter", "deepseek_v3"),
    ("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeTopkRouter", "deepseek_v3"),
    ("transformers.models.deepseek_v4.modeling_deepseek_v4", "DeepseekV4TopKRouter", "deepseek_v4"),
)

# DeepSeek-V4's `score_fn` (an `ACT2FN` module, by class name) -> `biased_grouped_topk`'s scoring.
_V4_SCORING = {"SqrtSoftplusActivation": "sqrtsoftplus", "Sigmoid": "sigmoid"}


def _router_forward(kind: str) -> Callable:
    """The forward of an `_ROUTERS` class under the plug-in: HF's gate projection, then
    `fused_topk` or `biased_grouped_topk` (one kernel on CUDA) for the rest of HF's formula."""
    from padded_moe.routing import biased_grouped_topk, fused_topk

    def forward(self, hidden_states):
        if kind == "deepseek_v4":  # the model dtype's projection and steps (bfloat16 rounded as torch does)
            flat = hidden_states.reshape(-1, self.hidden_dim)
            logits = torch.nn.functional.linear(flat, self.weight)
            scoring = _V4_SCORING.get(type(self.score_fn).__name__)
            if scoring is None or logits.dtype not in (torch.float32, torch.bfloat16):
                return type(self)._padded_moe_original_forward(self, hidden_states)
            scores, ids = biased_grouped_topk(logits, self.e_score_correction_bias, self.top_k, scoring=scoring,
                                              routed_scaling_factor=self.routed_scaling_factor, renormalize=True,
                                              weights_dtype=logits.dtype, ids_dtype=torch.int64,
                                              compute_dtype=logits.dtype)
            return logits, scores, ids
        if kind == "deepseek_v3":  # float32 projection; sigmoid, bias-corrected group-limited top-k
            flat = hidden_states.view(-1, self.hidden_dim)
            logits = torch.nn.functional.linear(flat.type(torch.float32), self.weight.type(torch.float32))
            scores, ids = biased_grouped_topk(logits, self.e_score_correction_bias, self.top_k, self.num_group,
                                              self.topk_group, scoring="sigmoid",
                                              routed_scaling_factor=self.routed_scaling_factor,
                                              renormalize=bool(self.norm_topk_prob), ids_dtype=torch.int64)
            return logits, scores, ids
        if kind == "gpt_oss":  # F.linear with the bias; top-k of the logits, softmax over the k
            logits = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
            flat = logits.reshape(-1, logits.shape[-1])
            scores, ids = fused_topk(flat, self.top_k, topk_before_softmax=True, weights_dtype=logits.dtype,
                                     ids_dtype=torch.int64)
            shape = logits.shape[:-1] + (self.top_k,)
            return logits, scores.reshape(shape), ids.reshape(shape)
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        if kind == "mixtral":  # always renormalised, scores left in float32
            scores, ids = fused_topk(logits, self.top_k, renormalize=True, ids_dtype=torch.int64)
        else:  # Qwen3-MoE / OLMoE: renormalised iff norm_topk_prob, scores in the logits' dtype
            scores, ids = fused_topk(logits, self.top_k, renormalize=bool(self.norm_topk_prob),
                                     weights_dtype=logits.dtype, ids_dtype=torch.int64)
        return logits, scores, ids

    return forward


def _install_dispatch(cls: type, replacement: Optional[Callable] = None) -> None:
    """Make class `cls` run `replacement` (default: `padded_moe_experts_forward`) when its config
    asks for "padded_moe", and its original forward otherwise (so the class behaves as before for
    every other implementation name, including HF's default). Instances made before this call keep
    the original forward (they never saw their config)."""
    if vars(cls).get("_padded_moe_dispatch", False):
        return
    replacement = padded_moe_experts_forward if replacement is None else replacement
    original_init, original_forward = cls.__init__, cls.forward

    @functools.wraps(original_init)
    def __init__(self, config, *args, **kwargs):
        original_init(self, config, *args, **kwargs)
        self._padded_moe_config = config

    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        config = getattr(self, "config", None)
        if config is None:
            config = getattr(self, "_padded_moe_config", None)
        if getattr(config, "_experts_implementation", None) == IMPLEMENTATION:
            return replacement(self, *args, **kwargs)
        return original_forward(self, *args, **kwargs)

    cls.__init__, cls.forward = __init__, forward
    cls._padded_moe_dispatch = True
    cls._padded_moe_original_forward = original_forward  # for a replacement that hands a case back


def _allow_set_experts_implementation(module) -> None:
    """`PreTrainedModel.set_experts_implementation` skips models whose source lacks the decorator;
    mark the classes of a module we made dispatchable as settable."""
    from transformers import PreTrainedModel

    for value in vars(module).values():
        ours = isinstance(value, type) and value.__module__ == module.__name__
        if ours and issubclass(value, PreTrainedModel):
            value._can_set_experts_implementation_cached_value = True


def register() -> None:
    """Add "padded_moe" to transformers' experts implementations. Idempotent.

    Raises ImportError when transformers (>= 5, with `ExpertsInterface`) is not installed.
    """
    import importlib

    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("padded_moe.integrations.transformers needs transformers >= 5 "
                          "(transformers.integrations.moe.ExpertsInterface)") from err
    ExpertsInterface.register(IMPLEMENTATION, padded_moe_experts_forward)
    try:  # transformers' quantized experts (FP8Experts) dispatch through an interface of their own
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:  # pragma: no cover - depends on the transformers version
        FP8ExpertsInterface = None
    if FP8ExpertsInterface is not None:
        FP8ExpertsInterface.register(IMPLEMENTATION, padded_moe_experts_forward)
    for module_name, class_name in _UNDECORATED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # an older transformers without this model
            continue
        cls = getattr(module, class_name, None)
        if cls is not None:
            _install_dispatch(cls)
            _allow_set_experts_implementation(module)
    for module_name, class_name, kind in _ROUTERS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a transformers without this model
            continue
        cls = getattr(module, class_name, None)
        if cls is not None:
            _install_dispatch(cls, _router_forward(kind))
    from padded_moe.integrations.transformers_mxfp4 import install

    install()  # GPT-OSS MXFP4 checkpoints load as MXFP4 when the model asks for "padded_moe"


def is_registered() -> bool:
    """Whether `register()` has run in this process."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    return ExpertsInterface._global_mapping.get(IMPLEMENTATION) is padded_moe_experts_forward


__all__ = ["IMPLEMENTATION", "ExpertsPlan", "experts_plan", "expert_weights", "prepare_experts",
           "padded_moe_experts_forward", "register", "is_registered"]

# Expert parallelism for whole models lives in its own module; re-exported here so one import
# serves both uses of the plug-in (it imports this module lazily, so the order is safe).
from padded_moe.integrations.transformers_ep import (  # noqa: E402
    ExpertParallelExperts, ExpertParallelModel, capture_decode_graphs, enable_expert_parallel, idle_step,
    plan_memory)

__all__ += ["ExpertParallelExperts", "ExpertParallelModel", "enable_expert_parallel", "idle_step",
            "capture_decode_graphs", "plan_memory"]
