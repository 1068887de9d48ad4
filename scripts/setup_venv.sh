#!/usr/bin/env bash
# Create .venv with what padded-moe's CPU test suite needs: torch==2.13.0 (the version CI tests on
# CPU; pip resolves it from the configured index) and triton==3.6.0, the compiler of the GPU
# machines, so the interpreter tests what the GPU runs. For a GPU machine install as README says
# instead (its torch build). Extra args: pip extras.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 triton==3.6.0
.venv/bin/pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
