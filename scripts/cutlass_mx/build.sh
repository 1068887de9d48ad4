#!/usr/bin/env bash
# Build the CUTLASS mixed-input probe library (scripts/cutlass_mx_probe.py) into .cutlass_mx/.
# Usage: bash scripts/cutlass_mx/build.sh CUTLASS_DIR   (a CUTLASS >= 4.4 checkout; nvcc >= 12.8)
# About 2 minutes on a CPU; no GPU needed. The library links the CUDA runtime statically.
set -euo pipefail
cutlass="${1:?usage: build.sh CUTLASS_DIR}"
cd "$(dirname "$0")/../.."
mkdir -p .cutlass_mx
nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -shared -Xcompiler -fPIC \
    -I"$cutlass/include" -I"$cutlass/tools/util/include" \
    -o .cutlass_mx/libmx_gemm.so scripts/cutlass_mx/mx_gemm.cu
echo "built .cutlass_mx/libmx_gemm.so"
