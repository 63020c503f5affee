"""The `kimik3` console script: one subcommand per job; each parses arguments and calls one function."""

from __future__ import annotations

import argparse
import sys

from kimik3.cli import chat, convert, generate, inspect, memory, params, train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kimik3", description="Kimi K3 in readable, exact, fast PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (params, memory, inspect, convert, generate, chat, train):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"kimik3 {args.command}: error: {e}", file=sys.stderr)
        return 2
