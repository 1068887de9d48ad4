#!/usr/bin/env bash
# Build the hand-written MXFP4 decode probe kernel (scripts/mx_decode_cuda_probe.py) into .mx_decode_cuda/.
# Usage: bash scripts/mx_decode_cuda/build.sh   (nvcc >= 12.8; no GPU needed; a few seconds)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .mx_decode_cuda
nvcc -std=c++17 -O3 -arch=sm_90a -shared -Xcompiler -fPIC -cudart static \
    -o .mx_decode_cuda/libmx_decode.so scripts/mx_decode_cuda/mx_decode.cu
echo "built .mx_decode_cuda/libmx_decode.so"
