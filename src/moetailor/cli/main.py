"""The `moetailor` command. Each verb lives in its own module in this package and exposes
``register(subparsers)``; verbs are discovered, so adding one never edits this file."""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import pkgutil
import signal
import sys
import threading


# the machine's state, not a bug: one line saying what to do, not a traceback
ENVIRONMENT_ERRORS = {errno.ENOSPC: "free disk space or write --out elsewhere",
                      errno.EDQUOT: "free space within your disk quota or write --out elsewhere",
                      errno.EROFS: "write --out to a writable file system",
                      errno.EACCES: "check the permissions, or write --out elsewhere",
                      errno.EMFILE: "raise the open-file limit (ulimit -n)"}


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


def _terminated(signum, frame) -> None:
    """SIGTERM ends a verb the way Ctrl-C does: as an exception, so every ``finally`` runs and
    temporary outputs (``.OUT.tmp-PID``) are removed before the process exits."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        result = args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        message = " ".join(str(e).split()) or type(e).__name__   # one line, whatever the message holds
        print(f"moetailor {args.command}: error: {message}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in ENVIRONMENT_ERRORS:
            raise
        where = f" ({e.filename})" if e.filename else ""
        print(f"moetailor {args.command}: error: {os.strerror(e.errno)}{where}; "
              f"{ENVIRONMENT_ERRORS[e.errno]} (partial outputs removed)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"moetailor {args.command}: interrupted; partial outputs removed", file=sys.stderr)
        return 130
    except SystemExit as e:
        if e.code == 128 + signal.SIGTERM:
            print(f"moetailor {args.command}: terminated (SIGTERM); partial outputs removed", file=sys.stderr)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
