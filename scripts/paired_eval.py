"""Paired comparison of `moetailor eval` runs on the same prompts: accuracy of each, and for each
pair the prompts one answers and the other does not, with the two-sided exact sign test.

    python scripts/paired_eval.py build/q3-fid/eval-reap-50 build/q3-distill/eval-ean-50 \
        --against baseline/greedy/seed0

Every cell of the given `eval --out` directories is read (cells/*.json); cells on other prompts
(another task list, n or seed) are refused by their prompt count. Rows compare each cell to
--against (a cell key, or a unique part of one), so the columns read like `tune`'s "vs full".
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from moetailor.tuning.front import paired  # noqa: E402


def load_cells(dirs: list[str]) -> dict[str, list[bool]]:
    cells: dict[str, list[bool]] = {}
    for d in dirs:
        files = sorted(Path(d, "cells").glob("*.json"))
        if not files:
            raise SystemExit(f"{d}: no cells/*.json (is it a `moetailor eval --out` directory?)")
        for f in files:
            data = json.loads(f.read_text())
            if "generations" not in data:
                continue                       # a KL cell
            cells[f"{Path(d).name}:{f.stem}"] = [bool(row[2]) for row in data["generations"]]
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--against", default="baseline", help="the reference cell (a unique part of its key)")
    args = ap.parse_args()
    cells = load_cells(args.dirs)
    ref_keys = [k for k in cells if args.against in k]
    if len(ref_keys) != 1:
        raise SystemExit(f"--against {args.against!r} matches {len(ref_keys)} cells: {sorted(cells)}")
    ref = cells[ref_keys[0]]
    print(f"reference: {ref_keys[0]} ({sum(ref)}/{len(ref)} = {100 * sum(ref) / len(ref):.1f}%)")
    print(f"| cell | accuracy % | of reference | vs reference (p) |\n|---|---|---|---|")
    for key, correct in sorted(cells.items()):
        if len(correct) != len(ref):
            raise SystemExit(f"{key} has {len(correct)} prompts, the reference {len(ref)}: not the same prompts")
        g, lost, p = paired(correct, ref)
        acc = sum(correct) / len(correct)
        print(f"| {key} | {100 * acc:.1f} | {100 * acc / (sum(ref) / len(ref)):.1f}% | +{g}/-{lost} ({p:.2g}) |")


if __name__ == "__main__":
    main()
