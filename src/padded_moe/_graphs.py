"""Capturing a call in a CUDA graph after warming it up, as every graph of an exchange needs."""

from __future__ import annotations

from typing import Callable, Optional

import torch


def capture_warm(fn: Callable[[], object], *, device: Optional[torch.device] = None,
                 side: Optional[torch.cuda.Stream] = None, warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run `fn` `warmups` times on a side stream, then capture one call of it in a CUDA graph;
    returns `(graph, what the captured call returned)`. The warm-up happens outside the capture
    because it compiles Triton kernels, creates NCCL communicators and fills caches, none of
    which a capture may do; on a side stream, as PyTorch's graph capture requires. Collectives in
    `fn` pair up across ranks when every rank calls this at the same point. The capture error
    mode is "thread_local", so other threads' CUDA calls during the capture are not errors."""
    side = torch.cuda.Stream(device) if side is None else side
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out
