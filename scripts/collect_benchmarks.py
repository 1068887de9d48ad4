"""Assemble docs/benchmarks.md from the per-benchmark reports a device run wrote.

Usage: python scripts/collect_benchmarks.py RUN_DIR [RUN_DIR ...]   (each holding bench/*.md|png)
Later directories win for a benchmark present in several runs. PNGs are copied to docs/bench/.
"""

import glob
import os
import shutil
import sys

ORDER = ["activation", "permute", "gemm", "layer", "ep"]


def main(run_dirs: list) -> None:
    found: dict = {}
    for run in run_dirs:
        for md in glob.glob(os.path.join(run, "bench", "*.md")):
            found[os.path.splitext(os.path.basename(md))[0]] = md
    os.makedirs("docs/bench", exist_ok=True)
    parts = ["# Benchmarks\n\nLatest tables from device runs (see notes.md for the run log). "
             "Ratios are measured in the same run as the numbers they compare.\n"]
    for name in sorted(found, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
        md = found[name]
        png = md[:-3] + ".png"
        if os.path.exists(png):
            shutil.copy(png, os.path.join("docs/bench", os.path.basename(png)))
        with open(md) as f:
            parts.append(f.read().replace(f"]({name}.png)", f"](bench/{name}.png)"))
    with open("docs/benchmarks.md", "w") as f:
        f.write("\n".join(parts))
    print("wrote docs/benchmarks.md with", ", ".join(found))


if __name__ == "__main__":
    main(sys.argv[1:])
