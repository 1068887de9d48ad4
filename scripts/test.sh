#!/usr/bin/env bash
# Set up and run the test suite (CPU: torch paths + Triton kernels through the interpreter;
# tests marked gpu skip without CUDA). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
status=0
.venv/bin/python -m pytest -n 2 --timeout=900 -q "$@" || status=$?
# pytest exits 5 when it collected no test: that is a failure of the suite, not a pass.
if [ "$status" -eq 5 ]; then
    echo "no tests were collected" >&2
    exit 1
fi
exit "$status"
