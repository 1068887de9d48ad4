"""The collectives transport: `torch.distributed` all_to_all (NCCL on GPUs, gloo on CPU).

One collective per direction. Graph-safe exchanges move fixed `T`-row chunks with
`all_to_all_single`; with the own chunk kept home NCCL gets per-peer views with an empty own
chunk (it moves nothing to itself), while gloo, which has no list all_to_all, moves the whole
buffers (the own chunk's bytes then arrive but are never read). Exact splits (graph_safe=False)
move only the real rows, chunks back to back.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from padded_moe.ep.transport import Transport, check_exchange_args, check_stage


class CollectiveTransport(Transport):
    name = "nccl"
    overlaps_own_chunk = True

    def __init__(self, group=None):
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallel needs torch.distributed to be initialized "
                               "(dist.init_process_group) before construction")
        self.group = group
        self.backend = dist.get_backend(group)
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._peer_views: dict = {}

    @classmethod
    def from_group(cls, group) -> "CollectiveTransport":
        return cls(group)

    def default_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _views(self, stage: str, send: torch.Tensor, recv: torch.Tensor) -> tuple:
        """Per-peer chunk views with an empty own chunk (cached: the buffers are persistent)."""
        key = (stage, send.data_ptr(), recv.data_ptr(), tuple(send.shape), tuple(recv.shape))
        views = self._peer_views.get(stage)
        if views is None or views[0] != key:
            T = send.shape[0] // self.size

            def peer_views(full):
                return [c if d != self.rank else c[:0] for d, c in enumerate(full.split(T))]

            views = self._peer_views[stage] = (key, peer_views(send), peer_views(recv))
        return views[1], views[2]

    def exchange(self, stage: str, send: torch.Tensor, recv: torch.Tensor, *,
                 send_counts: Optional[list] = None, recv_counts: Optional[list] = None,
                 skip_own: bool = False) -> None:
        check_stage(stage)
        check_exchange_args(self, send, recv, send_counts, recv_counts, skip_own)
        if send_counts is not None:
            dist.all_to_all_single(recv[: sum(recv_counts)], send[: sum(send_counts)], recv_counts, send_counts,
                                   group=self.group)
            return
        if not skip_own:
            dist.all_to_all_single(recv, send, group=self.group)
            return
        if self.size == 1:
            return
        if self.backend == "nccl":
            send_views, recv_views = self._views(stage, send, recv)
            dist.all_to_all(recv_views, send_views, group=self.group)
        else:
            dist.all_to_all_single(recv, send, group=self.group)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.to(torch.int64).contiguous()
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        return recv
