"""The `padded-moe` command: `--version`, `demo`, `plan`."""

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
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "demo":
        from padded_moe import demo

        return demo.run(args)
    if args.command == "plan":
        from padded_moe import planner

        return planner.run_cli(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
