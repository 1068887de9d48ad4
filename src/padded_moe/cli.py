"""The `padded-moe` command: `--version`, `demo`, `plan`, `build-native`."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from padded_moe import __version__


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="padded-moe", description=__doc__)
    parser.add_argument("--version", action="version", version=f"padded-moe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the masked activation and a preset's MoE layer, check against the reference")
    demo.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    demo.add_argument("--tokens", type=int, default=16, help="tokens in the layer demo")
    demo.add_argument("--seed", type=int, default=0)

    plan = sub.add_parser("plan", help="size every expert-parallel buffer and say whether it fits")
    from padded_moe import planner

    planner.add_arguments(plan)

    sub.add_parser("build-native", help="build the native CUDA kernels into their cache directory now "
                   "(nvcc, no GPU needed), so no first call waits for them")
    return parser


def _build_native() -> int:
    from padded_moe.kernels import native

    failed = 0
    for name, path, seconds, failure in native.build_all():
        if failure is None:
            print(f"{name}: {path} ({seconds:.1f} s)")
        else:
            failed += 1
            print(f"{name}: not built: {failure}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
        from padded_moe import demo

        return demo.run(args)
    if args.command == "plan":
        from padded_moe import planner

        return planner.run_cli(args)
    if args.command == "build-native":
        return _build_native()
    return 2


if __name__ == "__main__":
    sys.exit(main())
