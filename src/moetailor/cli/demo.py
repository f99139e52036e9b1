"""`moetailor demo`: the main job on the bundled model, end to end in about a minute.

Runs task prompts (10 per task by default: 60, so a 5-point difference means something) through
the engine twice — the full model, then phase-aware (full prefill, a 50% decode pool from the
bundled REAP plan, calibrated on the model's workload: the task domain) — and prints what the plan
was calibrated on, sample outputs, accuracy and length per task, and decode throughput with the
expert traffic each decode step read.
"""
from __future__ import annotations

import time
from pathlib import Path

from ..tables import print_table

BUNDLED_PLAN = Path(__file__).resolve().parent.parent / "assets" / "plans" / "reference-reap-50.json"


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the bundled model: full vs phase-aware decode, outputs and throughput")
    p.add_argument("--model", default="reference", help="checkpoint directory or 'reference'")
    p.add_argument("--plan", default=str(BUNDLED_PLAN), help="decode plan (default: bundled 50%% REAP plan)")
    p.add_argument("--per-task", type=int, default=10, help="prompts per task (default 10: 60 prompts)")
    p.set_defaults(func=run)


def _decode_summary(llm) -> dict:
    steps = [s for s in llm.step_log if s.phase == "decode"]
    seconds = sum(s.seconds for s in steps)
    tokens = sum(s.num_tokens for s in steps)
    distinct = [sum(s.distinct_experts.values()) / max(1, len(s.distinct_experts)) for s in steps]
    return {"tokens_per_s": tokens / seconds if seconds else 0.0,
            "distinct_per_layer": sum(distinct) / max(1, len(distinct)),
            "mib_per_step": sum(s.expert_bytes for s in steps) / max(1, len(steps)) / 2**20}


def run(args) -> int:
    from ..calibration.calibrate import describe_calibration
    from ..engine import LLM, SamplingParams
    from ..data.tasks import TASKS, eval_examples, extract_answer, score
    from ..models import describe
    from ..models.loading import load_checked
    from ..plans import Plan
    from ..plans.plan import describe_phase

    t0 = time.time()
    llm = LLM(args.model)
    facts = describe(llm.model)
    print(f"model: {facts['architecture']}, {facts['layers']} layers, {facts['routed_experts_per_layer']} routed "
          f"experts top-{facts['top_k']}, {facts['parameters_total'] / 1e6:.1f}M parameters")
    plan = load_checked(args.plan, Plan, llm.model)
    shown = f"bundled {BUNDLED_PLAN.name}" if Path(args.plan).resolve() == BUNDLED_PLAN else args.plan
    decode = plan.phase_aware()
    what = describe_phase(decode, "decode")
    print(f"decode plan: {shown} ({plan.meta.get('criterion', '?')}; decode {what})")
    calibration = plan.meta.get("calibration") or ({"data": plan.meta["stats_data"], "tokens": plan.meta.get("stats_tokens")}
                                                   if plan.meta.get("stats_data") else None)
    print(f"plan calibrated on: {describe_calibration(calibration) if calibration else 'not recorded in the plan'}")

    examples = [ex for task in TASKS.values() for ex in eval_examples(task, args.per_task, seed=0)]
    sampling = SamplingParams(max_tokens=160, temperature=0.0)
    results = {}
    for name, config in (("full", None), ("phase-aware", decode)):
        llm.set_plan(config)
        llm.step_log.clear()
        outputs = llm.generate([ex.prompt for ex in examples], sampling)
        results[name] = (outputs, _decode_summary(llm))

    rows = []
    shown = set()
    for i, ex in enumerate(examples):   # the first two prompts of each task, as examples
        if sum(1 for t in shown if t[0] == ex.task) >= 2:
            continue
        shown.add((ex.task, i))
        row = [ex.task, ex.prompt.strip().replace("\n", " ")[:34]]
        for name in results:
            out = results[name][0][i]
            answer = extract_answer(out.text)
            row += [(answer or "—")[:18], "yes" if score(ex, out.text) else "no", len(out.token_ids)]
        rows.append(tuple(row))
    print_table(f"sample prompts: full model vs phase-aware (full prefill; decode {what})",
                ["task", "prompt", "full answer", "ok", "len", "phase-aware answer", "ok", "len"], rows)
    per_task = []
    for task in TASKS:
        idx = [i for i, ex in enumerate(examples) if ex.task == task]
        row = [task, len(idx)]
        for name, (outputs, _) in results.items():
            ok = sum(score(examples[i], outputs[i].text) for i in idx)
            lengths = sorted(len(outputs[i].token_ids) for i in idx)
            row += [f"{ok}/{len(idx)}", lengths[min(len(lengths) - 1, int(0.9 * len(lengths)))]]
        per_task.append(tuple(row))
    print_table("per task: correct answers and p90 output length",
                ["task", "prompts", "full correct", "full p90", "phase-aware correct", "phase-aware p90"], per_task)
    summary = []
    for name, (outputs, dec) in results.items():
        acc = sum(score(ex, o.text) for ex, o in zip(examples, outputs)) / len(examples)
        summary.append((name, f"{acc:.0%}", f"{dec['tokens_per_s']:.0f}", f"{dec['distinct_per_layer']:.1f}",
                        f"{dec['mib_per_step']:.1f}"))
    print_table(f"decode at batch {len(examples)} (engine, {llm.config.dtype})",
                ["configuration", "accuracy", "decode tok/s", "distinct experts / layer / step",
                 "expert MiB read / step"], summary)
    print(f"done in {time.time() - t0:.0f} s")
    return 0
