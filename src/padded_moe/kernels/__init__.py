"""Triton kernels. The torch implementation of the same math is `padded_moe.torch_path`; dispatch
lives in the stage modules."""

from triton import knobs as _knobs

# Triton decides at `@triton.jit` time whether a kernel is interpreted; record that here.
INTERPRETED: bool = bool(_knobs.runtime.interpret)
