"""The invalid-expert-id guard of every kernel (spec 02), written once.

Routed ids come from user code and may be anything an int32/int64 holds (-1, E, 2^31-1, 2^32+1, ...).
Every kernel that reads a table indexed by an expert id checks the id first with `expert_id_ok`:
the comparison runs in the ids' own dtype (an int64 id is never narrowed into range first), and
callers mask the table load with the result, so an invalid id never forms an address.
The torch paths' twin is `padded_moe.expert_map.guarded_lookup`.
"""

import triton
import triton.language as tl  # noqa: F401 - the interpreter needs it in a jit function's globals


@triton.jit
def expert_id_ok(ids, mask, num_experts):
    """`mask & (0 <= ids < num_experts)`, elementwise, in the ids' own dtype."""
    return mask & (ids >= 0) & (ids < num_experts)
