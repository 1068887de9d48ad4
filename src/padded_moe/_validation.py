"""Typed argument checks shared by every public entry point.

Each raises TypeError or ValueError naming the argument and what was expected, never a bare
assert, so a caller can tell which of their tensors is wrong.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_dtype(name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        raise TypeError(f"{name} must have dtype in ({_names(allowed)}), got {str(t.dtype).replace('torch.', '')}")


def require_rank(name: str, t: torch.Tensor, ranks: Iterable[int]) -> None:
    ranks = tuple(ranks)
    if t.dim() not in ranks:
        want = " or ".join(f"{r}-D" for r in ranks)
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")


def require_same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {t.device}")


def require_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dimension (stride 1), got strides {tuple(t.stride())}"
        )


def require_bool(name: str, value: object) -> bool:
    """A flag: a bool, not 0 / 1 or a string (which `if value` would take)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def require_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def require_int(name: str, value: object, minimum: int = 1) -> int:
    """A plain int >= minimum (bool is an int subclass; a True expert count is a bug, not 1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def require_weight(name: str, value: object) -> object:
    """An expert weight: a float tensor or an `Mxfp4Tensor` (anything else, e.g. a list, is refused
    here rather than failing later on a missing `.shape`)."""
    from padded_moe.mxfp4 import Mxfp4Tensor

    if isinstance(value, Mxfp4Tensor):
        return value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or an Mxfp4Tensor, got {type(value).__name__}")
    require_dtype(name, value, FLOAT_DTYPES)
    return value


def require_real(name: str, value: object, *, optional: bool = False) -> object:
    """A real number (int or float, not bool, not NaN); None allowed when `optional`."""
    import numbers

    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        want = "a number or None" if optional else "a number"
        raise TypeError(f"{name} must be {want}, got {type(value).__name__} {value!r}")
    if value != value:  # NaN (also for a compiler's symbolic float, which math.isnan cannot take)
        raise ValueError(f"{name} must not be NaN")
    return value
