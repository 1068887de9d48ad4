"""The one integer code of each GEMM layout.

`padded_moe.layouts.GemmLayout.code` returns these on the host; the Triton kernels compare their
`LAYOUT` constexpr against the same values (`padded_moe.kernels._codes`), and the torch path
against these. This module imports nothing, so every layer (kernels included) can read it without
importing upward. Adding a layout adds a name here with the same spelling as its `GemmLayout`
member.
"""

INDEXED = 0
GROUPED_CONTIGUOUS = 1
GROUPED_MASKED = 2
