"""The `moetailor` command. Each verb lives in its own module in this package and exposes
``register(subparsers)``; verbs are discovered, so adding one never edits this file."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moetailor", description="Fit a MoE model's expert budget to each "
                                     "inference phase and each request.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    package = importlib.import_module(__package__)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name in ("main",):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        if hasattr(module, "register"):
            module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"moetailor {args.command}: error: {e}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
