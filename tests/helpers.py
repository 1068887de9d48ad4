"""Helpers shared by tests (import as `from helpers import ...`; tests/ is on sys.path)."""

import torch

# Tolerances for ‖out − ref‖ / ‖ref‖ against a float64 reference, by compute dtype.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

SENTINEL = -12345.0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN or Inf anywhere in `out` is an infinite error."""
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def devices():
    """CPU always; CUDA when present."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
