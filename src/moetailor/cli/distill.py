"""`moetailor distill MODEL PLAN --data SPEC --steps N --out DIR`: repair the pruned decoder by
distillation from the full model's KV cache (SlimWise). Writes a stock checkpoint (shared expert
twice as wide) plus the plan to decode it with."""
from __future__ import annotations

from ..tables import print_table
from .options import add_device_option, add_overwrite_option, invocation


def register(sub) -> None:
    p = sub.add_parser("distill", help="train the pruned decoder (router, norms, a residual shared expert) to continue "
                       "from the full model's KV cache; export a stock checkpoint")
    p.add_argument("model", help="local checkpoint directory or a bundled model: 'reference', 'reference-qwen3'")
    p.add_argument("plan", help="plan file from `moetailor plan` (its decode policy is the student)")
    p.add_argument("--data", default=None, help="training text, the traffic to serve: FILE.jsonl | FILE.txt | tasks | "
                   "tasks:TASK | text | text:DOMAIN[,DOMAIN] | mix | mixture:... (default for the bundled models: tasks, its "
                   "workload, from the training stream, never evaluation seeds; required otherwise)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--out", required=True, help="output checkpoint directory (state for --resume: OUT.partial)")
    p.add_argument("--split-point", default="uniform",
                   help="uniform (s ~ U[0, L), default) | zero (ordinary distillation, the ablation) | a fraction in [0, 1)")
    p.add_argument("--alpha", type=float, default=0.1, help="loss = alpha * CE + (1 - alpha) * KD (default 0.1)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (router: 1/10 of it; default 1e-4)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps (then cosine to 10%%)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="write a resumable checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-se2", action="store_true", help="no SE2 residual: train router and norms only (required "
                   "for architectures without a shared expert)")
    p.add_argument("--train-experts", action="store_true", help="also train the decode pool's routed experts (the "
                   "decode checkpoint gets its own copies; prefill keeps the original's)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the matmuls (faster on AMX CPUs)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    add_device_option(p, what="where the teacher and the student train")
    p.add_argument("--resume", action="store_true", help="continue the interrupted run in OUT.partial")
    add_overwrite_option(p, help="replace --out (and any interrupted run) if it exists")
    p.set_defaults(func=run, report_peak_rss=True)


def run(args) -> int:
    from ..training.distill import DistillConfig, distill_checkpoint
    from .generate import set_threads

    set_threads(args.threads)
    cfg = DistillConfig(steps=args.steps, alpha=args.alpha, lr=args.lr, batch_size=args.batch_size,
                        seq_len=args.seq_len, split_point=args.split_point, warmup=args.warmup,
                        checkpoint_every=args.checkpoint_every, seed=args.seed, se2=not args.no_se2,
                        experts=args.train_experts,
                        bf16=args.bf16)
    cfg.validate()
    command = invocation()
    from ..calibration.data import default_data_spec
    out, result = distill_checkpoint(args.model, args.plan, default_data_spec(args.model, args.data), cfg, args.out, overwrite=args.overwrite,
                                     resume=args.resume, command=command, device=args.device)
    counts = result.student.counts()
    first, last = result.log[0], result.log[-1]
    print_table(f"distilled decoder -> {out}", ["property", "value"], [
        ("steps", f"{len(result.log)} (resumed from {result.resumed_from})" if result.resumed_from else len(result.log)),
        ("tokens (teacher / student)", f"{last['tokens']:,} / {sum(r['student_tokens'] for r in result.log):,}"),
        ("time", f"{result.seconds:.0f} s ({last['tokens'] / max(result.seconds, 1e-9):.0f} tok/s)"),
        ("loss first -> last", f"{first['loss']:.4f} -> {last['loss']:.4f} (KD {first['kd']:.4f} -> {last['kd']:.4f}, "
                               f"CE {first['ce']:.4f} -> {last['ce']:.4f})"),
        ("trainable", f"{counts['trainable']:,} of {counts['model'] + counts['se2']:,} ({counts['trainable_share']:.2%}): "
                      f"router {counts['router']:,}, norms {counts['norms']:,}, SE2 {counts['se2']:,}"),
        ("serve", f"prefill on {args.model}, decode on {out} with {out}/plan.json"),
    ])
    return 0
