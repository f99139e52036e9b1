"""Grouped routing (DeepSeek-V3 style): group-balanced vs unconstrained expert selection in masked
mode, and fold targets inside vs across routing groups, measured as held-out KL from the full model.

    .venv/bin/python scripts/grouped_selection.py --out build/grouped
    .venv/bin/python scripts/grouped_selection.py --model build/grouped-trained --out build/grouped-trained-eval

The models are tiny: random, or a small character-level model trained here for minutes
(``scripts/train_tiny_grouped.py``); task accuracy would be meaningless, so quality is the teacher-forced next-token KL(full || configuration) on the bundled
held-out text (char tokenizer), the prefix run under the configuration's prefill policy and the
scored half under its decode policy (``eval.metrics.HeldoutScorer``). Every plan prunes both phases
(the masked router = what a pruned checkpoint computes), so the numbers are the selection's effect.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

SHAPES = {  # name: tiny_grouped_model overrides
    "16e-4g-top4-tg2": {},
    "64e-8g-top8-tg4": dict(num_experts=64, top_k=8, n_group=8, topk_group=4, hidden=64, layers=4),
}


def run(shape: str, seed: int, criteria: list[str], keeps: list[float], tokens: int, path: str | None = None) -> list[dict]:
    from moetailor.calibration import calibrate
    from moetailor.data.corpus import bundled_documents
    from moetailor.eval.metrics import HeldoutScorer, heldout_windows
    from moetailor.models.tiny import char_tokenizer, tiny_grouped_model
    from moetailor.plans.criteria import make_plan
    from moetailor.routing import LayerPolicy, PhasePolicy, RoutingController
    import moetailor.routing.router as router

    if path is None:
        model, tok = tiny_grouped_model(seed=seed, **SHAPES[shape]), char_tokenizer()
    else:  # a saved model (scripts/train_tiny_grouped.py): seeds vary the calibration sample only
        from moetailor.models.loading import load_model, load_tokenizer
        model, tok = load_model(path), load_tokenizer(path)
    stats = calibrate(model, tok, "mix", tokens, seed=seed, batch_tokens=1024, seq_len=128, fold=True,
                      all_experts=True, progress=False)
    ctl = RoutingController.of(model)
    ctl.fold_tables.update(stats.fold_tables())
    scorer = HeldoutScorer(model, heldout_windows(tok, bundled_documents("heldout"), 4, 64))
    rows = []
    for criterion in criteria:
        for keep in keeps:
            plans = {mode: make_plan(stats, model, criterion, keep=keep, phase="both", groups=mode)
                     for mode in ("balanced", "ignore")}
            for mode, plan in plans.items():
                s = scorer.score(plan.prefill, plan.decode)
                rows.append({"shape": shape, "seed": seed, "criterion": criterion, "keep": keep,
                             "selection": mode, "kl": s.kl,
                             "unreachable": sum(len(v) for v in plan.meta["groups"].get("unreachable", {}).values()),
                             "per_group": plan.meta["groups"]["per_group"]})
            # plan+fold on the balanced pool: fold targets inside the source's group (moetailor) vs anywhere
            folded = PhasePolicy({i: LayerPolicy(keep=p.keep, pool_mode="fold")
                                  for i, p in plans["balanced"].decode.layers.items()})
            for where in ("same group", "any group"):
                original = router.same_group_only
                if where == "any group":
                    router.same_group_only = lambda loss, sem: loss  # measurement only: lift the restriction
                ctl._cache.clear()
                try:
                    s = scorer.score(folded, folded)
                finally:
                    router.same_group_only = original
                    ctl._cache.clear()
                rows.append({"shape": shape, "seed": seed, "criterion": criterion, "keep": keep,
                             "selection": f"balanced+fold ({where})", "kl": s.kl})
    return rows


def summarise(rows: list[dict]) -> str:
    keys = sorted({(r["shape"], r["criterion"], r["keep"]) for r in rows})
    kinds = ["balanced", "ignore", "balanced+fold (same group)", "balanced+fold (any group)"]
    lines = ["| shape | criterion | keep | " + " | ".join(f"KL {k}" for k in kinds) +
             " | balanced better (seeds) | unreachable kept experts (ignore, mean) |",
             "|---|---|---|" + "---|" * (len(kinds) + 2)]
    for shape, criterion, keep in keys:
        cell = [r for r in rows if (r["shape"], r["criterion"], r["keep"]) == (shape, criterion, keep)]
        mean = {k: statistics.mean(r["kl"] for r in cell if r["selection"] == k) for k in kinds}
        seeds = sorted({r["seed"] for r in cell})
        by = {(r["seed"], r["selection"]): r for r in cell}
        wins = sum(by[(s, "balanced")]["kl"] < by[(s, "ignore")]["kl"] for s in seeds)
        dead = statistics.mean(by[(s, "ignore")]["unreachable"] for s in seeds)
        lines.append(f"| {shape} | {criterion} | {keep} | " + " | ".join(f"{mean[k]:.4f}" for k in kinds) +
                     f" | {wins}/{len(seeds)} | {dead:.1f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="build/grouped")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--criteria", default="reap,frequency")
    ap.add_argument("--keeps", default="0.5,0.75")
    ap.add_argument("--tokens", type=int, default=8192, help="calibration tokens per model")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--model", help="a saved grouped checkpoint instead of random tiny models (e.g. the output of "
                    "scripts/train_tiny_grouped.py)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0, rows = time.time(), []
    for shape in ([f"trained ({Path(args.model).name})"] if args.model else args.shapes.split(",")):
        for seed in range(args.seeds):
            rows += run(shape, seed, args.criteria.split(","), [float(k) for k in args.keeps.split(",")], args.tokens,
                        args.model)
            print(f"{shape} seed {seed} done ({time.time() - t0:.0f} s)", flush=True)
    (out / "grouped_selection.json").write_text(json.dumps(rows, indent=1))
    table = summarise(rows)
    (out / "grouped_selection.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
