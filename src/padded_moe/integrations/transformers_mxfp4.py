"""GPT-OSS MXFP4 checkpoints loaded straight into the plug-in's experts modules.

transformers' MXFP4 quantizer (`Mxfp4HfQuantizer`) loads a GPT-OSS MXFP4 checkpoint one of two ways:
it swaps the experts modules for `Mxfp4GptOssExperts` (triton_kernels, through the `kernels`
package and accelerate), which the plug-in cannot serve, or it dequantizes the experts into bf16
parameters (four times the bytes). `install()` (run by `register()`) adds a third way, taken when
the model is loaded with `experts_implementation="padded_moe"` and without
`Mxfp4Config(dequantize=True)`: the experts modules stay GPT-OSS's own, and each one receives its
MXFP4 weights, held once in the arrangement padded_moe's GEMMs read
(`integrations.transformers.hold_mxfp4`). Nothing changes for any other load.

The hooks are on transformers' quantizer class and on `modeling_utils.get_hf_quantizer` (which
decides per `from_pretrained` call); they hand over to transformers' own code in every other case.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from padded_moe.integrations.transformers import IMPLEMENTATION, hold_mxfp4

# Set for the duration of one `get_hf_quantizer` call whose model asks for our experts.
_REQUEST = threading.local()


def _pick(tensors: dict, name: str, layer: str) -> torch.Tensor:
    """The loader's tensor for checkpoint name `*name` (the tensor itself or a one-element list)."""
    for key, value in tensors.items():
        if key.endswith(name):
            return (value[0] if isinstance(value, (list, tuple)) else value).contiguous()
    raise ValueError(f"{layer}: the checkpoint has no {name} for it (got {sorted(tensors)})")


@functools.cache
def _load_op_class() -> type:
    """The conversion op (transformers' `ConversionOps`) that hands one experts weight to the module.
    Made once, and named as this module's `HoldMxfp4` (`__getattr__` below): transformers keeps the
    op on the loaded model, and `torch.save(model)` pickles it by that name."""
    from transformers.core_model_loading import ConversionOps, _IdentityOp

    class HoldMxfp4(ConversionOps):
        """`<proj>_blocks` / `<proj>_scales` of one experts module -> `hold_mxfp4(module, proj, ...)`,
        or, where the inner width is not a multiple of 64, the two tensors as the module's buffers
        (which the plug-in prepares at first use and keeps). The module's float parameter `<proj>`
        (never materialised) goes away."""

        def __init__(self, hf_quantizer):
            self.hf_quantizer = hf_quantizer

        def convert(self, input_dict, model=None, full_layer_name=None, missing_keys=None, **kwargs):
            from padded_moe.mxfp4 import from_gpt_oss, prepared_stands_alone

            owner, _, proj = full_layer_name.rpartition(".")
            module = model.get_submodule(owner)
            blocks = _pick(input_dict, f"{proj}_blocks", full_layer_name)
            scales = _pick(input_dict, f"{proj}_scales", full_layer_name)
            weight = from_gpt_oss(blocks, scales)  # checks both tensors' dtype and shape
            module._parameters.pop(proj, None)
            if prepared_stands_alone(weight.shape[-1]):
                with torch.no_grad():
                    hold_mxfp4(module, proj, weight)
            else:
                module.register_buffer(f"{proj}_blocks", blocks)
                module.register_buffer(f"{proj}_scales", scales)
            if missing_keys is not None:
                missing_keys.discard(full_layer_name)
            module._is_hf_initialized = True
            return {}  # the module holds the weight already; nothing for the loader to set

        @property
        def reverse_op(self):
            return _IdentityOp()  # `state_dict()` gives the checkpoint's tensors back itself

    HoldMxfp4.__module__, HoldMxfp4.__qualname__ = __name__, "HoldMxfp4"
    return HoldMxfp4


def __getattr__(name: str) -> Any:
    """`HoldMxfp4`, made on first use (it subclasses a transformers class, imported only then)."""
    if name == "HoldMxfp4":
        return _load_op_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install() -> bool:
    """Hook transformers' MXFP4 quantizer (idempotent). Returns False when this transformers has no
    MXFP4 quantizer of the expected shape (nothing is hooked then)."""
    try:
        import transformers.modeling_utils as modeling_utils
        from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer
    except ImportError:
        return False
    needed = ("validate_environment", "_process_model_before_weight_loading", "get_load_operations")
    if not all(hasattr(Mxfp4HfQuantizer, name) for name in needed) or not hasattr(modeling_utils, "get_hf_quantizer"):
        return False
    if vars(Mxfp4HfQuantizer).get("_padded_moe_hooked", False):
        return True
    hold = _load_op_class()
    original_get = modeling_utils.get_hf_quantizer
    validate, before_loading, load_operations = (getattr(Mxfp4HfQuantizer, name) for name in needed)

    @functools.wraps(original_get)
    def get_hf_quantizer(config, *args, **kwargs):
        _REQUEST.ours = getattr(config, "_experts_implementation", None) == IMPLEMENTATION
        try:
            return original_get(config, *args, **kwargs)
        finally:
            _REQUEST.ours = False

    @functools.wraps(validate)
    def validate_environment(self, *args, **kwargs):
        # Ours: a pre-quantized checkpoint, the model asks for padded_moe, and nobody asked for
        # bf16. Neither the kernels package nor accelerate is needed then.
        self._padded_moe = (getattr(_REQUEST, "ours", False) and self.pre_quantized
                            and not self.quantization_config.dequantize)
        if not self._padded_moe:
            return validate(self, *args, **kwargs)

    @functools.wraps(before_loading)
    def _process_model_before_weight_loading(self, model, **kwargs):
        if not getattr(self, "_padded_moe", False):
            return before_loading(self, model, **kwargs)
        # The experts modules stay the model's own (no swap for Mxfp4GptOssExperts).
        self.modules_to_not_convert = self.get_modules_to_not_convert(
            model, self.quantization_config.modules_to_not_convert, model._keep_in_fp32_modules)

    @functools.wraps(load_operations)
    def get_load_operations(self):
        operations = load_operations(self)
        if getattr(self, "_padded_moe", False):
            operations = dict(operations, deserialize=hold)
        return operations

    modeling_utils.get_hf_quantizer = get_hf_quantizer
    Mxfp4HfQuantizer.validate_environment = validate_environment
    Mxfp4HfQuantizer._process_model_before_weight_loading = _process_model_before_weight_loading
    Mxfp4HfQuantizer.get_load_operations = get_load_operations
    Mxfp4HfQuantizer._padded_moe_hooked = True
    return True
