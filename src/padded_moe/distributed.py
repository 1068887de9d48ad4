"""Expert parallelism (spec 04): the names of `padded_moe.ep`, importable from here as before.

The implementation is the package `padded_moe.ep` (see its docstring for the file map):
`ExpertParallel` (`ep.engine`), the wire format and buffer description (`ep.wire`), the launch
table (`ep.tiles`), the stages (`ep.stages`, `ep.launchers`) and the transports (`ep.transport`,
`ep.collectives`, `ep.symm_mem`, `ep.inprocess`). Each name below is looked up in its home module
on first use (PEP 562), so there is one definition and no second list of imports to keep in step.
Tuning constants are read from `padded_moe.ep.tiles`: change them there, not here.
"""

import importlib

_HOME = {
    **dict.fromkeys(("DispatchHandle", "ExpertParallel", "ReceiveBuffer"), "engine"),
    **dict.fromkeys(("_decode_rows_torch", "_receive_batched_torch", "combine_batched_rows", "combine_flat_rows",
                     "local_batched", "local_flat", "pack_rows", "peer_counts", "receive_batched", "receive_flat",
                     "reduce_partials"), "stages"),
    **dict.fromkeys(("EP_FREE_SMS", "EP_OVERLAP_MIN_TOKENS", "EP_TILES", "INTERPRET_TILE", "PACK_ONE_BLOCK_TOKENS",
                     "EPTile", "route_block_columns"), "tiles"),
    **dict.fromkeys(("FP8_BLOCK", "FP8_MAX", "FP8_WIRE_DTYPES", "MODES", "ROW_ALIGN", "EPGeometry", "WireFormat",
                     "_dequantize_fp8", "_quantize_fp8", "fp8_scale_columns", "meta_columns"), "wire"),
}

__all__ = sorted(name for name in _HOME if not name.startswith("_"))


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'padded_moe.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(f"padded_moe.ep.{home}"), name)


def __dir__():
    return sorted(list(globals()) + list(_HOME))
