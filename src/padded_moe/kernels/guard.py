"""The invalid-expert-id guard of every kernel, written once.

Routed ids come from user code and may be anything an int32/int64 holds (-1, E, 2^31-1, 2^32+1, ...).
Every kernel that reads a table indexed by an expert id checks the id first with `expert_id_ok`:
the comparison runs in the ids' own dtype (an int64 id is never narrowed into range first), and
callers mask the table load with the result, so an invalid id never forms an address.
The torch paths' twin is `padded_moe.expert_map.guarded_lookup`. Counts and row bounds read from a
caller's buffer (`valid_tokens`, per-expert counts, offsets) are clamped the same way, in their own
dtype before they are narrowed (`clamp_count`).
"""

import triton
import triton.language as tl  # noqa: F401 - the interpreter needs it in a jit function's globals


@triton.jit
def expert_id_ok(ids, mask, num_experts):
    """`mask & (0 <= ids < num_experts)`, elementwise, in the ids' own dtype."""
    return mask & (ids >= 0) & (ids < num_experts)


@triton.jit
def slot_local_expert(ids_ptr, stride_im, stride_ik, map_ptr, vt_ptr, s, smask, E, L,
                      TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, HAS_VT: tl.constexpr):
    """The sanitized local expert of routed slots `s` (`t * TOP_K + j`): the id read from
    `topk_ids[t, j]`, range-checked in its own dtype, then mapped through the expert table when
    HAS_MAP (-1 = not local); `L` for a dropped slot (masked off, invalid id, non-local id, or token
    at/after `valid_tokens` when HAS_VT). Every kernel that routes slots itself calls this."""
    t = s // TOP_K
    j = s % TOP_K
    g = tl.load(ids_ptr + t.to(tl.int64) * stride_im + j * stride_ik, mask=smask, other=-1)
    # Range check before narrowing or reading the map; the map load is masked with it, so an
    # invalid id never forms an address.
    in_range = expert_id_ok(g, smask, E)
    safe = tl.where(in_range, g, 0).to(tl.int32)
    if HAS_MAP:
        loc = tl.load(map_ptr + safe, mask=in_range, other=-1)
    else:
        loc = safe
    keep = in_range & (loc >= 0)
    if HAS_VT:
        keep = keep & (t < tl.load(vt_ptr))
    return tl.where(keep, loc, L)


@triton.jit
def clamp_count(v, hi):
    """A count or row bound `v` read from a caller's buffer (int32 or int64), clamped to [0, hi]
    in its own dtype, then int32: narrowed only once in range, so a wide value (2^32 + 5, say)
    never wraps to a small one."""
    return tl.minimum(tl.maximum(v, 0), hi).to(tl.int32)
