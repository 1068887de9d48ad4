"""Two source trees of the library compared on the same whole calls, in alternating rounds.

A kernel change is judged on whole calls against the code it replaces, on the same card in the same
minutes: runs a minute apart drift by as much as the differences such a change makes. Two versions
of one package cannot share a process, so each tree gets a worker process (its `src/` first on
`PYTHONPATH`) that builds the same layer (`FusedMoE.from_preset`, seed 0), the same inputs and
routing per token count, and captures `FusedMoE.experts` in a CUDA graph per token count. The
driver then asks the workers in turn to time their replays, round after round, so drift hits both
trees alike; only one worker runs at a time. The outputs are compared first: bitwise equality is
reported, and a relative L2 difference over 2e-2 marks the row WRONG.

    python benchmarks/bench_trees_ab.py --tree-a .ab/main --tree-b . --preset gpt-oss-120b \
        --weights mxfp4 --tokens 1,16,128,1024,8192

A tree is a directory holding `src/padded_moe` (a checkout, or `git archive REV src | tar -x -C DIR`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(args) -> None:
    """Build the layer and one captured call per token count, save the outputs, then time the
    replays of all of them each time the driver writes `time` on stdin."""
    import torch

    sys.path.insert(0, str(HERE))
    from _common import bench_us, captured, random_layer

    import padded_moe

    layer = random_layer(args.preset, args.weights)
    gen = torch.Generator(device="cuda").manual_seed(1)
    graphs, outs = {}, {}
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, layer.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        tw, ids = layer.route(layer.gate(x), None)
        graph, out = captured(lambda: layer.experts(x, tw, ids))
        out.fill_(float("nan"))  # poisoned: the replay must write every row
        graph.replay()
        torch.cuda.synchronize()
        graphs[T], outs[T] = (graph, x, tw, ids, out), out.cpu()
    torch.save(outs, args.save)
    print("ready", padded_moe.__file__, flush=True)  # the driver checks the package came from its tree
    while sys.stdin.readline().strip() == "time":
        times = {T: bench_us(g[0].replay, warmup_ms=10, rep_ms=100) for T, g in graphs.items()}
        print(json.dumps(times), flush=True)


def worker_command(args, save: Path) -> list:
    """The command line of a worker: this script with the driver's layer and token arguments."""
    return [sys.executable, __file__, "--worker", "--save", str(save), "--preset", args.preset,
            "--weights", args.weights, "--tokens", args.tokens]


def reply(proc, prefix: str):
    """The worker's next stdout line starting with `prefix` (None once it has exited); what else
    it prints on the way is passed through."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
        print(line, end="")
    return None


def compare_rows(outs: dict, times: dict) -> list:
    """One table row per token count: both trees' median and fastest replay, b / a, and how their
    outputs compare (`bitwise`; `ok` within a relative L2 difference of 2e-2; else `WRONG`, which a
    NaN left in either output also is). `outs[tree][T]` the output, `times[tree][T]` the round times."""
    import torch

    rows = []
    for T in sorted(times["a"]):
        a, b = outs["a"][T].double(), outs["b"][T].double()
        finite = bool(torch.isfinite(a).all() and torch.isfinite(b).all())
        diff = ((b - a).norm() / a.norm().clamp(min=1e-30)).item() if finite else float("nan")
        same = finite and torch.equal(outs["a"][T], outs["b"][T])
        check = "bitwise" if same else ("ok" if finite and diff <= 2e-2 else "WRONG")
        ma, mb = statistics.median(times["a"][T]), statistics.median(times["b"][T])
        rows.append([T, round(ma, 1), round(mb, 1), round(mb / ma, 3), round(min(times["a"][T]), 1),
                     round(min(times["b"][T]), 1), f"{diff:.1e}", check])
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree-a", help="the baseline tree (holds src/padded_moe); required")
    p.add_argument("--tree-b", help="the changed tree; required")
    p.add_argument("--preset", default="gpt-oss-120b")
    p.add_argument("--weights", default="mxfp4", choices=("bf16", "mxfp4"))
    p.add_argument("--tokens", default="1,16,128,1024,8192", help="comma list of token counts")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="bench-out/trees-ab")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--save", help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = parser().parse_args()
    if args.worker:
        worker(args)
        return
    if args.tree_a is None or args.tree_b is None:
        raise SystemExit("--tree-a and --tree-b are required")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_trees_ab times CUDA graphs: it needs a GPU")
    trees = {"a": Path(args.tree_a).resolve(), "b": Path(args.tree_b).resolve()}
    for name, tree in trees.items():
        if not (tree / "src" / "padded_moe" / "__init__.py").is_file():
            raise SystemExit(f"--tree-{name} {tree} holds no src/padded_moe")
    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="trees-ab-"))
    procs = {}
    for name, tree in trees.items():
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "src"), os.environ.get("PYTHONPATH", "")]))
        procs[name] = subprocess.Popen(worker_command(args, tmp / f"{name}.pt"), env=env, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        # one build at a time: the second worker compiles while nothing is timed, and the first is ready
        ready = reply(procs[name], "ready")
        if ready is None:
            raise SystemExit(f"worker for tree {name} ({tree}) failed to start")
        imported = Path(ready.split(maxsplit=1)[1].strip()).resolve()
        if not imported.is_relative_to(tree / "src"):
            raise SystemExit(f"worker for tree {name} imported padded_moe from {imported}, not from {tree / 'src'} "
                             "(an installed copy ahead of PYTHONPATH?)")
    outs = {name: torch.load(tmp / f"{name}.pt") for name in trees}
    shutil.rmtree(tmp)
    times = {name: {} for name in trees}
    for _ in range(args.rounds):
        for name, proc in procs.items():
            proc.stdin.write("time\n")
            proc.stdin.flush()
            line = reply(proc, "{")
            if line is None:
                raise SystemExit(f"worker for tree {name} stopped while timing")
            for T, us in json.loads(line).items():
                times[name].setdefault(int(T), []).append(us)
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()

    sys.path.insert(0, str(HERE))
    from _common import print_table, write_report

    rows = compare_rows(outs, times)
    headers = ["T", "a median us", "b median us", "b / a", "a min us", "b min us", "rel diff", "check"]
    title = (f"{args.preset} {args.weights}: FusedMoE.experts graph replays, {args.rounds} alternating rounds "
             f"(a = {trees['a']}, b = {trees['b']})")
    print_table(title, headers, rows)
    write_report(args.out, "bench_trees_ab", "Two source trees on whole calls, alternating rounds", title,
                 headers, rows, extra={"trees": {k: str(v) for k, v in trees.items()}, "wall_s": time.time() - t0})
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
