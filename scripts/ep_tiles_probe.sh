#!/usr/bin/env bash
# Device probe: batched dispatch+combine at T=1024 under alternative EP launch shapes, with the
# kernel timeline of a chained graph replay (where NCCL starts relative to the overlapped kernels).
# Usage (on the 2-GPU machine): bash scripts/ep_tiles_probe.sh "--tile local_batched=2,4,2" ...
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
B="python3 benchmarks/bench_ep.py --modes batched --no-layer --iters 30 --tokens ${TOKENS:-1024} --timeline"
for variant in "" "$@"; do
    echo "=== variant: ${variant:-table}"
    # shellcheck disable=SC2086
    $B $variant --out "${OUT:-gpu-out}/probe" 2>&1 | grep -E "^timeline|^  \+|│ batched"
done
