"""`python -m moetailor.kernels`: build the native CPU kernels for this processor now (``make setup`` runs
it, so the first `moetailor demo` or `serve` starts at once), or say that they are built. Exit 0 either
way: without a compiler the engine runs on torch's kernels."""
from __future__ import annotations

import sys

from . import _HEADERS, _SOURCES, _module, build_name


def main() -> int:
    ops = _module()
    if ops is None:
        print("moetailor: the native CPU kernels are not built (disabled by MOETAILOR_NATIVE=0, or no compiler); "
              "the engine runs on torch's kernels", file=sys.stderr)
    else:
        print(f"moetailor: native CPU kernels ready ({build_name(_SOURCES + _HEADERS)})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
