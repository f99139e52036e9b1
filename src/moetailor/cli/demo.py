"""`moetailor demo`: the main job on the bundled model, end to end in about a minute.

Task prompts (10 per task: 60) run through the engine twice, full and phase-aware (a 50% decode pool
from the bundled REAP plan); it prints the calibration data, samples, accuracy and length per task,
and decode throughput with its expert traffic. Then what the pool buys, on a random model with
published layer shapes whose experts must stream from memory (the bundled one is not bound by them).
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
    p.add_argument("--speed-steps", type=int, default=16,
                   help="timed decode steps per cell of the real-shaped speed table (default 16)")
    p.set_defaults(func=run)


def _decode_summary(llm) -> dict:
    """Decode speed as the median step's tokens per second: a step stalled by another process (on a shared
    machine one can take seconds) would otherwise set the whole figure (a total over steps read 75 tok/s for
    one run and 4,794 for the other of the same demo)."""
    import statistics

    steps = [s for s in llm.step_log if s.phase == "decode"]
    rates = [s.num_tokens / s.seconds for s in steps if s.seconds > 0]
    distinct = [sum(s.distinct_experts.values()) / max(1, len(s.distinct_experts)) for s in steps]
    return {"tokens_per_s": statistics.median(rates) if rates else 0.0,
            "step_s": statistics.median(s.seconds for s in steps) if steps else 0.0,
            "distinct_per_layer": sum(distinct) / max(1, len(distinct)),
            "mib_per_step": sum(s.expert_bytes for s in steps) / max(1, len(steps)) / 2**20}


def run(args) -> int:
    from ..calibration.calibrate import describe_calibration
    from ..data.tasks import TASKS, eval_examples, extract_answer, score
    from ..models import describe
    from ..models.loading import load_checked
    from ..plans import Plan
    from ..plans.plan import describe_phase
    from ..serving import LLM, SamplingParams

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

    by_task = {task: [i for i, ex in enumerate(examples) if ex.task == task] for task in TASKS}
    rows = []
    for i in (i for idx in by_task.values() for i in idx[:2]):   # the first two prompts of each task, as examples
        ex = examples[i]
        row = [ex.task, ex.prompt.strip().replace("\n", " ")[:34]]
        for name in results:
            out = results[name][0][i]
            answer = extract_answer(out.text)
            row += [(answer or "—")[:18], "yes" if score(ex, out.text) else "no", len(out.token_ids)]
        rows.append(tuple(row))
    print_table(f"sample prompts: full model vs phase-aware (full prefill; decode {what})",
                ["task", "prompt", "full answer", "ok", "len", "phase-aware answer", "ok", "len"], rows)
    per_task = []
    for task, idx in by_task.items():
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
                ["configuration", "accuracy", "decode tok/s (median step)", "distinct experts / layer / step",
                 "expert MiB read / step"], summary)
    full_decode = results["full"][1]
    del llm
    _pool_speed_on_real_shapes(full_decode["mib_per_step"], full_decode["step_s"], args.speed_steps)
    print(f"done in {time.time() - t0:.0f} s")
    return 0


def _pool_speed_on_real_shapes(expert_mib_per_step: float, step_s: float, steps: int) -> None:
    """What the 50% decode pool saves where decode reads its experts from memory: on the bundled model the
    expert reads are a small part of a step, so a pool barely changes it; on a model with published layer
    shapes they dominate it. Both pools run side by side in one run (noise hits both alike)."""
    from ..bench.bandwidth import read_bandwidth
    from ..bench.decode import DecodeConfig, measure_model
    from ..bench.synthetic import EXPERT_WIDTH, EXPERTS, HIDDEN, TOP_K

    read_ms = expert_mib_per_step * 2**20 / read_bandwidth(256 << 20) * 1e3
    print(f"\nwhy a second model for speed: a decode step of the bundled model reads {expert_mib_per_step:.0f} MiB "
          f"of experts, {read_ms:.1f} ms at this machine's read bandwidth, of a {step_s * 1e3:.0f} ms step, so a "
          "smaller pool saves little time there: its step is bound by many small per-layer operations, not by "
          f"reading experts. Decode speed is measured on a real-shaped model instead: 2 layers of OLMoE-1B-7B's "
          f"shapes ({EXPERTS} experts of {HIDDEN}x{EXPERT_WIDTH}, top-{TOP_K}; seeded random fp32 weights, 3.2 GB "
          "of experts, built in memory), full pool vs a 50% decode pool, each batch side by side.")
    cfg = DecodeConfig(model="synthetic", batches=[1, 8, 32], keeps=[0.5], hf=False, pruned=False, steps=steps)
    measured, _ = measure_model("synthetic", cfg.resolved(), progress_desc="decode speed")
    rows = []
    for batch in cfg.batches:
        full, pool = (m.result for m in measured if m.result.batch == batch)
        ideal = full.expert_bytes / pool.expert_bytes   # the step time if it were all expert reads
        rows.append((batch, f"{full.step_s * 1e3:.1f}", f"{pool.step_s * 1e3:.1f}", f"{full.distinct:.1f}",
                     f"{pool.distinct:.1f}", f"{full.step_s / pool.step_s:.2f}x", f"{ideal:.2f}x"))
    print_table(f"decode on the real-shaped model: full pool vs 50% pool (median of {steps} steps)",
                ["batch", "full ms/step", "50% pool ms/step", "full experts read/layer", "pool experts read/layer",
                 "speedup", "expert bytes ratio"], rows)
    print("At batch 1 a token reads its top-k experts either way; the pool pays off as the batch's union of "
          "experts grows. Quality is measured on the trained model above; the random model's tokens mean nothing.")
