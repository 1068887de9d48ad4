"""The layout codes of `padded_moe.layout_codes` as Triton constexprs, for `LAYOUT == INDEXED` in
kernel bodies (a jitted function may only read module globals that are constexprs)."""

import triton.language as tl

from padded_moe import layout_codes as _codes

INDEXED = tl.constexpr(_codes.INDEXED)
GROUPED_CONTIGUOUS = tl.constexpr(_codes.GROUPED_CONTIGUOUS)
GROUPED_MASKED = tl.constexpr(_codes.GROUPED_MASKED)
