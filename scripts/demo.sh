#!/usr/bin/env bash
# Set up and run `padded-moe demo` (tiny preset; CPU unless a GPU is present). Extra args go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
.venv/bin/padded-moe demo "$@"
