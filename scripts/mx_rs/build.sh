#!/usr/bin/env bash
# Build the RS-form MXFP4 grouped GEMM probe (scripts/mx_rs_probe.py) into .mx_rs/.
# Usage: bash scripts/mx_rs/build.sh   (nvcc >= 12.8; no GPU needed; under a minute: it compiles the
# library's grouped_gemm.cu too, whose helpers the probe includes)
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .mx_rs
nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -shared -Xcompiler -fPIC -cudart static -Xptxas -v \
    -I src/padded_moe/kernels/native -o .mx_rs/libmx_rs.so scripts/mx_rs/mx_rs_gemm.cu
echo "built .mx_rs/libmx_rs.so"
