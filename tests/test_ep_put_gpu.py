"""The symmetric-memory put transport on two GPUs (spec 04, Transports): back-to-back graph replays
with fresh tokens and routes, every result checked (no stale or torn rows), idle ranks included;
the planner's bytes and the default choice. (tests/test_distributed_gpu.py runs its model-shape
and graph tests over every transport of `GPU_TRANSPORTS`, this one included.)

    .venv/bin/pytest -q -rA tests/test_ep_put_gpu.py
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch

from _spawn import spawn_group
from padded_moe._graphs import capture_warm

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

SEED = int.from_bytes(os.urandom(4), "little")
REPLAYS = 1000
E, TOPK, HID = 32, 4, 512


def _expected(x, ids, w, world, mode):
    """Identity experts: flat returns x once per rank that got the token; batched returns, per
    rank, bf16(Σ w_j x) over its slots, summed in float32. Invalid ids (-1, >= E) go nowhere."""
    valid = (ids >= 0) & (ids < E)
    owner = torch.where(valid, ids.clamp(0, E - 1) // (E // world), -1)
    xf = x.float()
    out = torch.zeros_like(xf)
    for r in range(world):
        mine = owner == r
        if mode == "flat":
            out += torch.where(mine.any(1, keepdim=True), xf, 0.0)
        else:
            part = torch.zeros_like(xf)
            for j in range(ids.shape[1]):
                part += torch.where(mine[:, j:j + 1], w[:, j:j + 1] * xf, 0.0)
            out += part.to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def _stress_worker(rank, world, payload):
    from padded_moe.distributed import ExpertParallel
    from padded_moe.planner import plan

    dev = torch.device("cuda", rank)
    mode, T, ms = payload["mode"], payload["T"], payload["ms"]
    try:
        ep = ExpertParallel(None, E, TOPK, HID, T, mode=mode, dtype=torch.bfloat16)  # the default: symm_mem
        shapes = dict(num_experts=E, top_k=TOPK, hidden_size=HID, intermediate_size=HID)
        planned = plan(shapes, world, T, 139.0, mode=mode, dtype=torch.bfloat16, transport="symm_mem").bytes_of("ep")
        m = ms[rank]
        sx = torch.empty(m, HID, dtype=torch.bfloat16, device=dev)
        sids = torch.empty(m, TOPK, dtype=torch.int32, device=dev)
        sw = torch.empty(m, TOPK, dtype=torch.float32, device=dev)
        gen = torch.Generator(device=dev).manual_seed(payload["seed"] + rank)

        def refill():
            sx.copy_(torch.randn(m, HID, generator=gen, device=dev))
            ids = torch.rand(m, E, generator=gen, device=dev).argsort(1)[:, :TOPK].to(torch.int32)
            junk = torch.rand(m, TOPK, generator=gen, device=dev)
            ids = torch.where(junk < 0.1, -1, torch.where(junk > 0.95, E + 3, ids))  # dropped ids
            sids.copy_(ids)
            sw.copy_(torch.rand(m, TOPK, generator=gen, device=dev) + 0.1)

        def step():
            rb, h = ep.dispatch(sx, sids, sw)
            return ep.combine(rb.x, h)  # identity experts

        refill()
        graph, out = capture_warm(step)
        worst, bad = 0.0, []
        for i in range(REPLAYS):
            refill()
            graph.replay()
            want = _expected(sx, sids, sw, world, mode).float()
            err = float(((out.float() - want).abs().amax() / want.abs().amax().clamp(min=1e-6))) if m else 0.0
            worst = max(worst, err)
            if err > 1e-2 and len(bad) < 5:
                bad.append((i, err))
        torch.cuda.synchronize()
        eager = step()
        return dict(worst=worst, bad=bad, eager_equal=bool(torch.equal(eager, out)) if m else True,
                    transport=ep.transport_name, planned=planned, allocated=ep.buffer_bytes())
    except Exception:
        return dict(error=traceback.format_exc())


@pytest.mark.parametrize("mode", ["flat", "batched"])
@pytest.mark.parametrize("ms", [(16, 5), (16, 0), (0, 16)], ids=["uneven", "idle1", "idle0"])
def test_put_transport_replays_fresh_routes(mode, ms):
    """1,000 back-to-back graph replays of dispatch → combine with new tokens, routes and dropped
    ids on every replay: each result equals the torch expectation (an unconsumed or half-written
    row of an earlier call would not); the last eager call equals the last replay bit for bit."""
    results = spawn_group(2, _stress_worker, dict(seed=SEED, mode=mode, T=16, ms=ms), backend="nccl",
                          timeout=540)
    for rank, r in enumerate(results):
        assert "error" not in r, f"seed {SEED}, rank {rank}:\n{r.get('error')}"
        print(f"{mode} {ms} rank {rank}: worst rel err over {REPLAYS} replays {r['worst']:.2e}")
        assert not r["bad"] and r["worst"] <= 1e-2, f"seed {SEED}, rank {rank}: {r['bad']}"
        assert r["eager_equal"], f"seed {SEED}, rank {rank}: eager differs from the replay"
        assert r["transport"] == "symm_mem"
        assert r["planned"] == r["allocated"], (r["planned"], r["allocated"])
