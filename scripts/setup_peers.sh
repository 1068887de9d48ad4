#!/usr/bin/env bash
# Copy the peer-comparison harness into .peers (an ignored folder) and adapt it to this library:
# its padded_moe runner builds canonical Mxfp4Tensor weights, and our MXFP4 weights are prepared
# once at load (`prepare_for()`, as triton_kernels' swizzle is done once when the harness builds
# it), so the copy prepares them. Without that the harness times the unprepared kernel.
#   bash scripts/setup_peers.sh [HARNESS_DIR]   (default: ../shared/peers)
set -euo pipefail
cd "$(dirname "$0")/.."
src="${1:-../shared/peers}"
[ -f "$src/bench_peers.py" ] || { echo "no bench_peers.py in $src" >&2; exit 2; }
rm -rf .peers && cp -r "$src" .peers && chmod -R u+w .peers
python3 - <<'PY'
import re, sys
p = ".peers/bench_peers.py"
s = open(p).read()
pat = r"(self\.(w13|w2) = pm\.Mxfp4Tensor\(W\.\2_blocks, W\.\2_scales\))(?!\.prepare_for)"
s, n = re.subn(pat, r"\1.prepare_for()", s)
if n != 2:
    sys.exit(f"{p}: expected the two Mxfp4Tensor constructions of the padded_moe runner, found {n}; adapt by hand")
open(p, "w").write(s)
print(f"{p}: MXFP4 weights prepared at build ({n} places)")
PY
