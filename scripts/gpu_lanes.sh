#!/usr/bin/env bash
# Run gpu_check.sh stages in parallel lanes, one GPU each, and pack every log into $OUT/results.tgz.
# Usage: bash scripts/gpu_lanes.sh "gemm" "activation layouts experts"   (one quoted list per GPU)
set -uo pipefail
cd "$(dirname "$0")/.."
final="${OUT:-gpu-out}"
work=/tmp/gpu-lanes
rm -rf "$work"; mkdir -p "$work"
lane=0
for stages in "$@"; do
    # shellcheck disable=SC2086
    (CUDA_VISIBLE_DEVICES=$lane OUT="$work/gpu$lane" bash scripts/gpu_check.sh $stages > "$work/lane$lane.txt" 2>&1) &
    lane=$((lane + 1))
done
wait
for f in "$work"/lane*.txt; do echo "=== $f"; tail -n 60 "$f"; done
tar czf "$final/results.tgz" -C "$work" .
for f in "$work"/gpu*/summary.txt; do echo "== $f"; cat "$f"; done
