"""Expert parallelism: dispatch → local experts → combine across ranks.

Files, in the order data flows through them:

- `wire.py`: the wire format of a dispatched row (`WireFormat`: x, then in-band int32 meta), the
  sizes every stage shares (`EPGeometry`), fp8 wire helpers, and the ONE buffer description
  (`ep_buffer_specs`: name, shape, dtype, exchanged or not) that transports allocate from and
  the planner sizes;
- `tiles.py`: launch shapes of the kernels on CUDA (the H200 table `EP_TILES`), the K split,
  the capped grids of the kernels that overlap an exchange;
- `stages.py`: pack / receive / local / combine / reduce, each with its torch implementation;
  `launchers.py`: their Triton launchers (kernels in `padded_moe.kernels.ep`);
- `transport.py`: the transport interface, storage policies and the registry (which transport a
  name means, which one is the default); `collectives.py`: torch.distributed all_to_all (NCCL,
  gloo); `inprocess.py`: R ranks as threads of one process (the tests' double);
- `engine.py`: `ExpertParallel`, which runs the stages around the transport's exchanges.

`padded_moe.distributed` re-exports the public names. The names below load on first use, so
`padded_moe.ep.wire` / `padded_moe.ep.transport` (what the planner reads) import no orchestrator.
"""

import importlib

_LAZY = {
    "DispatchHandle": "engine", "ExpertParallel": "engine", "ReceiveBuffer": "engine",
    "InProcessTransport": "inprocess", "InProcessWorld": "inprocess",
    "TRANSPORTS": "transport", "Transport": "transport", "default_name": "transport", "storage_plan": "transport",
    "transport_names": "transport",
    "BufferSpec": "wire", "EPGeometry": "wire", "WireFormat": "wire", "ep_buffer_specs": "wire",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"padded_moe.ep.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'padded_moe.ep' has no attribute {name!r}")
