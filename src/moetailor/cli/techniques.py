"""Per-phase policy options for `generate` and `serve` (folding and skipping). Not a verb: the engine
verbs add them with ``add_policy_arguments(p)`` and apply them with ``apply_policy_arguments(llm, args)``."""
from __future__ import annotations

import argparse


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    from ..plans.techniques import SPEC_HELP

    p.add_argument("--prefill-policy", metavar="SPEC", default=None,
                   help=f"expert policy for prefill steps: {SPEC_HELP}")
    p.add_argument("--decode-policy", metavar="SPEC", default=None, help="expert policy for decode steps (same specs)")
    p.add_argument("--fold-stats", metavar="STATS", default=None,
                   help="statistics with fold tables (`moetailor calibrate MODEL --fold`) for fold policies and "
                        "skip; default: calibrated once per model and cached")


def apply_policy_arguments(llm, args) -> None:
    """Give ``llm`` the plan the policy options describe (no-op when neither is given)."""
    prefill, decode = getattr(args, "prefill_policy", None), getattr(args, "decode_policy", None)
    if not (prefill or decode):
        return
    if getattr(args, "plan", None) or getattr(args, "decode_plan", None) or getattr(args, "decode_model", None):
        raise ValueError("--prefill-policy/--decode-policy describe the plan themselves; drop --plan, --decode-plan "
                         "and --decode-model, or drop the policy options")
    from ..plans.techniques import plan_from_specs

    llm.set_plan(plan_from_specs(llm.model, prefill, decode, getattr(args, "fold_stats", None), llm.tokenizer))
