"""Expert parallelism: the names of `padded_moe.ep`, importable from here as before.

It serves every public name of `padded_moe.ep` (`padded_moe.ep.__all__`: the engine, the transports and
their registry, the buffer description) and the stage, tile and wire names below.

The implementation is the package `padded_moe.ep` (see its docstring for the file map):
`ExpertParallel` (`ep.engine`), the wire format and buffer description (`ep.wire`), the launch
table (`ep.tiles`), the stages (`ep.stages`, `ep.launchers`) and the transports (`ep.transport`,
`ep.collectives`, `ep.symm_mem`, `ep.inprocess`). Each name below is looked up in its home module
on first use (PEP 562), so there is one definition and no second list of imports to keep in step.
Tuning constants are read from `padded_moe.ep.tiles`: change them there, not here.
"""

import importlib

# The stage, tile and wire names `padded_moe.ep.__all__` does not carry (its own names come from there).
_HOME = {
    **dict.fromkeys(("_decode_rows_torch", "_receive_batched_torch", "combine_batched_rows", "combine_flat_rows",
                     "local_batched", "local_flat", "pack_rows", "peer_counts", "receive_batched", "receive_flat",
                     "reduce_partials"), "stages"),
    **dict.fromkeys(("EP_FREE_SMS", "EP_OVERLAP_MIN_TOKENS", "EP_TILES", "INTERPRET_TILE", "PACK_ONE_BLOCK_TOKENS",
                     "EPTile", "route_block_columns"), "tiles"),
    **dict.fromkeys(("FP8_BLOCK", "FP8_MAX", "FP8_WIRE_DTYPES", "MODES", "ROW_ALIGN", "_dequantize_fp8",
                     "_quantize_fp8", "fp8_scale_columns", "meta_columns"), "wire"),
}

_EP = importlib.import_module("padded_moe.ep")  # its names load lazily too: importing it is cheap

__all__ = sorted({name for name in _HOME if not name.startswith("_")} | set(_EP.__all__))


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is not None:
        return getattr(importlib.import_module(f"padded_moe.ep.{home}"), name)
    if name in _EP.__all__:
        return getattr(_EP, name)
    raise AttributeError(f"module 'padded_moe.distributed' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_HOME) | set(_EP.__all__))
