"""The `megalab` command: `megalab doctor`, `megalab notebooks` (and the exercise tools)."""

from __future__ import annotations

import argparse
import sys


def _doctor(args: argparse.Namespace) -> int:
    from megalab.doctor import report

    print(report())
    return 0


def _notebooks(args: argparse.Namespace) -> int:
    from megalab.notebooks import execute_all

    return execute_all(args.paths, timeout=args.timeout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megalab", description="megalab: build Megatron-LM's ideas yourself")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="what this machine can run: versions, GPUs, FP8, flash-attn, Triton")
    p.set_defaults(func=_doctor)

    p = sub.add_parser("notebooks", help="re-execute notebooks in place, top to bottom, in a clean kernel")
    p.add_argument("paths", nargs="*", default=["course"], help="notebooks or folders (default: course)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per cell")
    p.set_defaults(func=_notebooks)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
