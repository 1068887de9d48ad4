"""The activation in GEMM1's epilogue against GEMM1 then the activation op, on whole calls.

For each model preset and token count, `FusedMoE.experts` (its own router's routing) is captured
in a CUDA graph twice, with the epilogue (the default) and with `PADDED_MOE_FUSE_ACTIVATION=0`,
and the two replays are timed in turn, round after round, so clock drift hits both alike. The
outputs must be equal bit for bit (the epilogue rounds to bf16 before the activation, as GEMM1's
output buffer does). Also reported: the `[slots, 2N]` buffer the epilogue does not write and read,
and which of the two `fused_experts` takes by default (`PADDED_MOE_FUSE_ACTIVATION` unset).

    python benchmarks/bench_fusion.py --cases gpt-oss-120b:mxfp4,dsv4-flash:bf16 --tokens 16,128,1024,8192

Calls of at most 4 tokens take the decode path, which already applies the activation in GEMM1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_us, captured, print_table, random_layer, write_report  # noqa: E402

from padded_moe import experts as ex  # noqa: E402
from padded_moe.gemm import FUSE_ENV  # noqa: E402

DEFAULT_CASES = "gpt-oss-120b:mxfp4,dsv4-flash:bf16,dsv4-flash:mxfp4,qwen3-30b-a3b:bf16,mixtral-8x7b:bf16"
TWO_STEPS = "two steps"


def settings(gate_up_tile: str) -> list:
    """(column name, PADDED_MOE_FUSE_ACTIVATION, GATE_UP_TMA): the epilogue per tile arrangement
    asked for, then the two steps (which read no gate-first tiles)."""
    tiles = ("two_tiles", "one_tile") if gate_up_tile == "both" else (gate_up_tile,)
    named = len(tiles) > 1
    return [(f"epilogue {t}" if named else "epilogue", "1", t) for t in tiles] + [(TWO_STEPS, "0", "two_tiles")]


def capture_with(setting: str, gate_up_tile: str, call):
    """The call captured with `PADDED_MOE_FUSE_ACTIVATION=setting` and `GATE_UP_TMA=gate_up_tile`
    (both restored: they are read when the kernels launch, so the graph keeps what it captured)."""
    from padded_moe.kernels import gemm as kg

    with mock.patch.dict(os.environ, {FUSE_ENV: setting}), mock.patch.object(kg, "GATE_UP_TMA", gate_up_tile):
        return captured(call)


def default_choice(call) -> str:
    """Which of the two an eager call takes with the variable unset: the activation op runs
    only without the epilogue (the pipeline's own decision, observed, not restated)."""
    calls, real = [], ex.apply_moe_activation
    with mock.patch.dict(os.environ), mock.patch.object(ex, "apply_moe_activation",
                                                        lambda *a, **kw: calls.append(1) or real(*a, **kw)):
        os.environ.pop(FUSE_ENV, None)
        call()
    return "two steps" if calls else "epilogue"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=DEFAULT_CASES, help="comma list of preset:weights (bf16 or mxfp4)")
    p.add_argument("--tokens", default="16,128,1024,8192")
    p.add_argument("--rounds", type=int, default=3)
    from padded_moe.kernels import gemm as kg

    p.add_argument("--gate-up-tile", default=kg.GATE_UP_TMA, choices=("two_tiles", "one_tile", "both"),
                   help="how bf16 TMA tiles read gate-first w13 rows with the epilogue (kernels.gemm.GATE_UP_TMA, "
                        "whose value is the default); both: one epilogue column per arrangement")
    p.add_argument("--out", default="bench-out/fusion")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fusion times CUDA graphs: it needs a GPU")
    runs = settings(args.gate_up_tile)
    t0 = time.time()
    rows = []
    for case in args.cases.split(","):
        preset, _, weights = case.partition(":")
        layer = random_layer(preset, weights or "bf16")
        gen = torch.Generator(device="cuda").manual_seed(1)
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
            tw, ids = layer.route(layer.gate(x), None)
            call = lambda: layer.experts(x, tw, ids)  # noqa: E731
            graphs = []
            for name, setting, tile in runs:
                graph, out = capture_with(setting, tile, call)
                graph.replay()
                torch.cuda.synchronize()
                graphs.append((name, graph, out.clone()))
            equal = all(torch.equal(g[2], graphs[-1][2]) for g in graphs[:-1])
            default = default_choice(call)
            times = {name: [] for name, _, _ in graphs}
            for _ in range(args.rounds):
                for name, graph, _ in graphs:
                    times[name].append(bench_us(graph.replay, warmup_ms=10, rep_ms=100))
            med = {n: statistics.median(times[n]) for n, _, _ in runs}
            plain = med[TWO_STEPS]
            saved_mb = T * layer.top_k * 2 * layer.intermediate_size * 2 / 1e6
            rows.append([f"{preset} {weights or 'bf16'}", T] + [round(med[n], 1) for n, _, _ in runs]
                        + [round(plain / med[n], 3) for n, _, _ in runs[:-1]]
                        + [round(saved_mb, 1), "yes" if equal else "NO", default])
            del graphs
        del layer
        torch.cuda.empty_cache()
    headers = (["case", "T"] + [f"{n} us" for n, _, _ in runs] + [f"two steps / {n}" for n, _, _ in runs[:-1]]
               + ["GEMM1 buffer MB", "bit-equal", "default"])
    print_table(f"Activation in GEMM1's epilogue vs GEMM1 + activation op ({args.rounds} alternating rounds, "
                f"graph replay of FusedMoE.experts; gate-first TMA tiles: {args.gate_up_tile})", headers, rows)
    write_report(args.out, "bench_fusion", "Activation in GEMM1's epilogue vs two steps",
                 "Graph replays of `FusedMoE.experts` with the epilogue (default) and with "
                 f"{FUSE_ENV}=0, timed in alternating rounds; medians. Gate-first TMA tiles: "
                 f"{args.gate_up_tile}.", headers, rows,
                 extra={"wall_s": time.time() - t0})
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
