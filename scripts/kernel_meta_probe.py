"""Probe: how Triton compiled each implementation's kernels for one peers-harness call.

Runs each implementation's call once (the harness's builders, weights and routing; `.peers` from
scripts/setup_peers.sh) with Triton's cache in a fresh directory, then lists every kernel compiled
there: warps, pipeline stages, shared memory, registers and local memory (cuobjdump), and whether Triton
warp-specialized it (a `ttg.warp_specialize` region in its TTGIR, `setmaxnreg` in its PTX), with its
wgmma and TMA instruction counts. Where two implementations run the same tile shape at different
speeds, this says whether they were compiled alike. A kernel compiled for an earlier case or
implementation of the run is listed there only.

    PYTHONPATH=src python3 scripts/kernel_meta_probe.py [--cases mixtral] [--tokens 8192]

Not part of the library.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

CACHE = tempfile.mkdtemp(prefix="triton-cache-")
os.environ["TRITON_CACHE_DIR"] = CACHE  # before Triton is imported: every kernel below compiles here

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / ".peers"), str(ROOT / ".peers" / "vendor"), str(ROOT / "benchmarks")]
import bench_peers as bp  # noqa: E402


def registers(cubin: Path) -> str:
    """cuobjdump's registers, stack and local memory per thread (spills land in local memory) of the
    kernel in `cubin`, or why there are none."""
    try:
        out = subprocess.run(["cuobjdump", "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as why:
        return f"cuobjdump: {why}"
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    return (f"regs {m.group(1)} stack {m.group(2)} local {local.group(1) if local else '?'}" if m
            else out[-200:])


def describe(json_path: Path) -> dict:
    meta = json.loads(json_path.read_text())
    stem = json_path.with_suffix("")
    ttgir = stem.with_suffix(".ttgir").read_text() if stem.with_suffix(".ttgir").exists() else ""
    ptx = stem.with_suffix(".ptx").read_text() if stem.with_suffix(".ptx").exists() else ""
    cubin = stem.with_suffix(".cubin")
    return {
        "name": meta.get("name", stem.name), "num_warps": meta.get("num_warps"),
        "num_stages": meta.get("num_stages"), "shared": meta.get("shared"),
        "warp_specialized": "ttg.warp_specialize" in ttgir, "setmaxnreg": ptx.count("setmaxnreg"),
        "wgmma": ptx.count("wgmma.mma_async"), "tma_loads": ptx.count("cp.async.bulk.tensor"),
        "cp_async": ptx.count("cp.async.ca") + ptx.count("cp.async.cg"),
        "resources": registers(cubin) if cubin.exists() else "no cubin",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="mixtral")
    p.add_argument("--tokens", default="8192")
    p.add_argument("--impls", default="padded_moe,triton_kernels")
    p.add_argument("--out", default="gpu-out/kernel_meta.json")
    args = p.parse_args()
    device = torch.device("cuda")
    report = []
    for case in bp.make_cases(SimpleNamespace(dsv4_topk=6, small=False, cases=args.cases)):
        W = bp.make_weights(case, device, 0)
        for T in [int(t) for t in args.tokens.split(",")]:
            x, ids, tw = bp.make_inputs(case, T, device, 0)
            for impl in args.impls.split(","):
                before = set(Path(CACHE).rglob("*.json"))
                builder = bp.BUILDERS[impl](case, W)
                builder.make(x, ids, tw).e2e()
                torch.cuda.synchronize()
                for path in sorted(set(Path(CACHE).rglob("*.json")) - before):
                    if path.name.startswith("__grp__") or not path.with_suffix(".ttgir").exists():
                        continue
                    row = {"case": case.name, "T": T, "impl": impl, **describe(path)}
                    report.append(row)
                    print(json.dumps(row), flush=True)
                del builder
                torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
