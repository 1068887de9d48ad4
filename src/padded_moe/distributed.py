"""Expert parallelism (spec 04): the names of `padded_moe.ep`, importable from here as before.

The implementation is the package `padded_moe.ep` (see its docstring for the file map):
`ExpertParallel` (`ep.engine`), the wire format and buffer description (`ep.wire`), the launch
table (`ep.tiles`), the stages (`ep.stages`, `ep.launchers`) and the transports (`ep.transport`,
`ep.collectives`, `ep.inprocess`).
"""

from padded_moe.ep.engine import DispatchHandle, ExpertParallel, ReceiveBuffer
from padded_moe.ep.stages import (
    _decode_rows_torch,
    _receive_batched_torch,
    combine_batched_rows,
    combine_flat_rows,
    local_batched,
    local_flat,
    pack_rows,
    peer_counts,
    receive_batched,
    receive_flat,
    reduce_partials,
)
from padded_moe.ep.tiles import (
    EP_FREE_SMS,
    EP_OVERLAP_MIN_TOKENS,
    EP_TILES,
    INTERPRET_TILE,
    PACK_ONE_BLOCK_TOKENS,
    EPTile,
    route_block_columns,
)
from padded_moe.ep.wire import (
    FP8_BLOCK,
    FP8_MAX,
    FP8_WIRE_DTYPES,
    MODES,
    ROW_ALIGN,
    EPGeometry,
    WireFormat,
    _dequantize_fp8,
    _quantize_fp8,
    fp8_scale_columns,
    meta_columns,
)

__all__ = [
    "DispatchHandle", "ExpertParallel", "ReceiveBuffer", "EPGeometry", "WireFormat", "EPTile", "EP_TILES",
    "EP_FREE_SMS", "EP_OVERLAP_MIN_TOKENS", "INTERPRET_TILE", "PACK_ONE_BLOCK_TOKENS", "FP8_BLOCK", "FP8_MAX",
    "FP8_WIRE_DTYPES", "MODES", "ROW_ALIGN", "combine_batched_rows", "combine_flat_rows", "fp8_scale_columns",
    "local_batched", "local_flat", "meta_columns", "pack_rows", "peer_counts", "receive_batched", "receive_flat",
    "reduce_partials", "route_block_columns",
]
