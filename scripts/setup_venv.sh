#!/usr/bin/env bash
# Create .venv with what padded-moe needs. On a machine without a GPU, torch==2.13.0 is the CPU
# build this kind of machine keeps locally (never a multi-GB CUDA download). triton==3.6.0 matches
# the GPU machines' compiler so the interpreter tests what the GPU runs. Extra args: pip extras.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 triton==3.6.0
.venv/bin/pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
