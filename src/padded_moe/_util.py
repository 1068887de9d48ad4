"""Small integer and dtype helpers every host-side module uses (no torch device work, no triton).

Host code takes these instead of `triton.cdiv` / `triton.next_power_of_2` so that modules which
must import without Triton (the torch path, the planner) and the kernel launchers share one
definition.
"""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for ints, `b > 0`."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """The smallest multiple of `b` that is `>= a`."""
    return cdiv(a, b) * b


def even_split(items: int, cap: int) -> int:
    """The fewest parts, at most `cap`, that share `items` (>= 1) as evenly as whole numbers allow:
    a striding grid of this many programs gives each the same number of items, give or take one
    round, so none runs a last round alone."""
    return cdiv(items, cdiv(items, max(1, cap)))


def next_pow2(n: int) -> int:
    """The smallest power of two `>= n` (1 for `n <= 1`)."""
    return 1 << max(0, (n - 1).bit_length())


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    return dtype.itemsize
