"""The scripts in examples/ run as their docstrings say (two CPU processes, gloo) and report success."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, needs, done", [
    ("expert_parallel.py", None, "matches the whole layer"),
    ("expert_parallel_hf.py", "transformers", "expert-parallel decoding matches one process"),
])
def test_example_runs_on_two_cpu_processes(script, needs, done, tmp_path):
    if needs:
        pytest.importorskip(needs)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1", TRITON_INTERPRET="0")
    # --standalone: a rendezvous on a free local port, so parallel test workers do not collide.
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "examples" / script)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert done in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
    # After the script reported success, gloo's teardown has aborted a process now and then on a
    # loaded CPU ("terminate called without an active exception", SIGABRT: exit code -6), the flake
    # tests/_spawn.py accepts after every rank saved its result. Only that failure passes here.
    teardown_abort = "terminate called without an active exception" in run.stderr and "exitcode: -6" in run.stderr
    assert run.returncode == 0 or teardown_abort, run.stdout[-2000:] + run.stderr[-4000:]
