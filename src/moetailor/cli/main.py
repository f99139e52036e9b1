"""The `moetailor` command. Each verb lives in its own module in this package and exposes
``register(subparsers)``; verbs are discovered, so adding one never edits this file."""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import pkgutil
import re
import signal
import sys
import threading

from ..outputs import release_outputs

# the machine's state, not a bug: one line saying what to do, not a traceback
ENVIRONMENT_ERRORS = {errno.ENOSPC: "free disk space or write --out elsewhere",
                      errno.EDQUOT: "free space within your disk quota or write --out elsewhere",
                      errno.EROFS: "write --out to a writable file system",
                      errno.EACCES: "check the permissions, or write --out elsewhere",
                      errno.EMFILE: "raise the open-file limit (ulimit -n)"}


def _writer_errno(error: Exception) -> int | None:
    """The OS error number inside a writer's own exception (safetensors' ``SafetensorError`` says
    "I/O error: No space left on device (os error 28)"), or None."""
    if type(error).__name__ != "SafetensorError":
        return None
    found = re.search(r"\(os error (\d+)\)", str(error))
    return int(found.group(1)) if found else None


def _environment_error(command: str, code: int, filename) -> int:
    where = f" ({filename})" if filename else ""
    print(f"moetailor {command}: error: {os.strerror(code)}{where}; {ENVIRONMENT_ERRORS[code]} (partial outputs "
          "removed)", file=sys.stderr)
    return 2


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
        from .options import resolve_device_option
        resolve_device_option(args)   # a GPU torch does not see: exit 2 before any model loads
        result = args.func(args)
        if getattr(args, "report_peak_rss", False) and not result:   # verbs that run a model say what it took
            from ..memory import peak_rss_gib
            print(f"moetailor {args.command}: peak RSS {peak_rss_gib():.2f} GiB", file=sys.stderr)   # stdout may be data
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        message = " ".join(str(e).split()) or type(e).__name__   # one line, whatever the message holds
        print(f"moetailor {args.command}: error: {message}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in ENVIRONMENT_ERRORS:
            raise
        return _environment_error(args.command, e.errno, e.filename)
    except Exception as e:
        code = _writer_errno(e)   # safetensors' writer raises its own error type for a full disk
        if code not in ENVIRONMENT_ERRORS:
            raise
        return _environment_error(args.command, code, None)
    except KeyboardInterrupt:
        print(f"moetailor {args.command}: interrupted; partial outputs removed", file=sys.stderr)
        return 130
    except SystemExit as e:
        if e.code == 128 + signal.SIGTERM:
            print(f"moetailor {args.command}: terminated (SIGTERM); partial outputs removed", file=sys.stderr)
        raise
    finally:
        release_outputs()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
