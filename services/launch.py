"""The `radixserve` command line."""

from __future__ import annotations

import argparse
from importlib.metadata import version


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve", description="An SGLang-style LLM serving engine.")
    parser.add_argument("--version", action="version", version=f"radixserve {version('radixserve')}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("radix-demo", help="print a small simulated radix tree (no model needed)")
    args = parser.parse_args(argv)
    if args.command == "radix-demo":
        from engine.cache.radix_cache import demo

        demo()
