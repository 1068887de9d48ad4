"""Expert parallelism (spec 04): dispatch → local experts → combine across ranks.

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

`padded_moe.distributed` re-exports the public names.
"""

from padded_moe.ep.engine import DispatchHandle, ExpertParallel, ReceiveBuffer
from padded_moe.ep.inprocess import InProcessTransport, InProcessWorld
from padded_moe.ep.transport import TRANSPORTS, Transport, default_name, storage_plan, transport_names
from padded_moe.ep.wire import BufferSpec, EPGeometry, WireFormat, ep_buffer_specs

__all__ = [
    "BufferSpec", "DispatchHandle", "EPGeometry", "ExpertParallel", "InProcessTransport", "InProcessWorld",
    "ReceiveBuffer", "TRANSPORTS", "Transport", "WireFormat", "default_name", "ep_buffer_specs", "storage_plan",
    "transport_names",
]
