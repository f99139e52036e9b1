"""`moetailor bench {decode,slo,prefill,project}`: decode speed against the bandwidth floor,
expert traffic, throughput at a per-user SLO, and a GPU roofline projection."""
from __future__ import annotations

from pathlib import Path

from .options import add_dtype_option, add_overwrite_option, invocation, torch_name


def _numbers(text: str, kind=float) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        example = "numbers like 0.75,0.5,0.25" if kind is float else "integers like 1,8,64"
        raise ValueError(f"expected comma-separated {example}, got {text!r}") from None


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: decode vs bandwidth floor, SLO throughput, prefill, k scheduling, GPU projection")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCH")

    def common(q, out: str, quick: bool = True):
        q.add_argument("--out", type=Path, default=Path(out), help=f"output folder (default {out})")
        add_overwrite_option(q, help="replace the report in --out if there is one")
        if quick:
            q.add_argument("--quick", action="store_true", help="small sweep that finishes in under two minutes")

    from ..bench.roofline import GPUS, SHAPES

    q = bsub.add_parser("project", help="roofline projection of pool speedups at a per-user SLO on a GPU")
    q.add_argument("--gpu", choices=sorted(GPUS), default="a100")
    q.add_argument("--model-shape", choices=sorted(SHAPES), default="qwen3.6-35b-a3b")
    q.add_argument("--num-gpus", type=int, default=2, help="GPUs per decode instance (SlimWise: 2)")
    q.add_argument("--batch", type=int, default=64, help="batch for the per-step breakdown")
    q.add_argument("--context", type=int, default=5120,
                   help="mean context length read per step (1k in / 8k out averages 5k)")
    q.add_argument("--max-context", type=int, default=9216, help="context each sequence reserves KV for")
    q.add_argument("--keep", default="0.5,0.25",
                   help="fractions of routed experts kept (SlimWise's 50%%/75%% pruning keep 0.5/0.25)")
    q.add_argument("--slo", type=float, default=50.0, help="per-user decode tokens/s")
    common(q, "build/bench/project", quick=False)
    q.set_defaults(func=run_project)

    from ..bench.vllm import register_bench as register_vllm_bench
    register_vllm_bench(bsub, common)   # `bench vllm` (runs in the vLLM environment: make setup-vllm)
    from ..bench.vllm_k import register_bench as register_vllm_k_bench
    register_vllm_k_bench(bsub, common)   # `bench vllm-k`: split checkpoint, FIFO vs the k-aware scheduler

    d = bsub.add_parser("decode", help="decode step time, tokens/s, expert traffic and bandwidth per pool and batch")
    d.add_argument("--model", default="both", help="'synthetic', 'reference', 'both', or a local checkpoint path")
    d.add_argument("--batches", default="1,2,4,8,16,32,64")
    d.add_argument("--keep", default="0.75,0.5,0.25", help="decode pools as kept fractions of each layer's experts")
    d.add_argument("--top-k", default=None, help="also run reduced per-token k' (e.g. 2,4,6) on the full pool")
    d.add_argument("--steps", type=int, default=None, help="decode steps timed per configuration")
    d.add_argument("--synthetic-layers", type=int, default=2, help="MoE layers of the synthetic model (1.6 GB each)")
    d.add_argument("--no-hf", action="store_true", help="skip the transformers generate comparison")
    d.add_argument("--no-pruned", action="store_true", help="skip pruned-checkpoint pools (masking only)")
    add_dtype_option(d, "the weights as measured (bf16: as real checkpoints ship them; the synthetic model is "
                     "converted, a checkpoint loaded so)", "fp32", allowed=("fp32", "bf16"))
    d.add_argument("--plan", action="append", default=[], metavar="PLAN",
                   help="also time the decode pool of this plan file (repeatable; e.g. fold vs mask plans)")
    common(d, "build/bench/decode")
    d.set_defaults(func=run_decode)

    s = bsub.add_parser("slo", help="throughput vs per-user tokens/s as the batch grows, per pool")
    s.add_argument("--model", default="synthetic")
    s.add_argument("--batches", default="1,2,4,8,16,32,64")
    s.add_argument("--keep", default="0.5,0.25")
    s.add_argument("--slo", type=float, default=None, help="per-user tokens/s target (default: the full pool's "
                   "speed at batch 8, so the target is reachable on this machine)")
    s.add_argument("--steps", type=int, default=None)
    s.add_argument("--synthetic-layers", type=int, default=2)
    s.add_argument("--no-pruned", action="store_true")
    common(s, "build/bench/slo")
    s.set_defaults(func=run_slo)

    f = bsub.add_parser("prefill", help="prefill tokens/s per pool (expected nearly flat)")
    f.add_argument("--model", default="synthetic")
    f.add_argument("--keep", default="0.75,0.5,0.25")
    f.add_argument("--prompt-len", type=int, default=128)
    f.add_argument("--batches", default="1,4")
    f.add_argument("--synthetic-layers", type=int, default=2)
    common(f, "build/bench/prefill")
    f.set_defaults(func=run_prefill)

    t = bsub.add_parser("ktiers", help="per-request expert budgets: max-k vs mixed vs lanes vs tiers scheduling")
    t.add_argument("--model", default="reference", help="'reference', 'synthetic' or a local checkpoint path")
    t.add_argument("--mix", default="2:0.5,8:0.5", help="budgets and their shares, K:SHARE,... (default 2:0.5,8:0.5)")
    t.add_argument("--requests", type=int, default=64)
    t.add_argument("--prompt-len", type=int, default=32)
    t.add_argument("--max-tokens", type=int, default=32)
    t.add_argument("--max-num-seqs", type=int, default=16, help="sequences per step")
    t.add_argument("--repeats", type=int, default=2, help="runs per schedule (best is reported)")
    t.add_argument("--synthetic-layers", type=int, default=2)
    common(t, "build/bench/ktiers")
    t.set_defaults(func=run_ktiers)


def check_bench_outputs(args, inputs=()) -> None:
    """Before any work: --out is a folder (not an input) without an earlier report, unless --overwrite."""
    from ..outputs import check_output

    check_output(args.out, overwrite=True, inputs=inputs, directory=True, replaces=False)
    for name in ("report.md", "results.json"):
        if (args.out / name).exists() and not args.overwrite:
            raise FileExistsError(f"--out {args.out} already holds a benchmark report ({name}); pass --overwrite to "
                                  "replace it or choose another --out")


def _local(model: str) -> list[str]:
    """The checkpoint folder a --model names, when it is one (an input no output may replace)."""
    return [model] if model not in ("synthetic", "reference", "both") else []


def run_project(args) -> int:
    from ..bench.project import run_project as project

    if args.num_gpus < 1 or args.batch < 1 or args.context < 0 or args.slo <= 0:
        raise ValueError("--num-gpus and --batch must be >= 1, --context >= 0 and --slo > 0")
    check_bench_outputs(args)
    project(args.model_shape, args.gpu, _numbers(args.keep), args.slo, args.context, args.max_context, args.num_gpus,
            args.batch, args.out, invocation()).write()
    return 0


def run_decode(args) -> int:
    from ..bench.decode import DecodeConfig
    from ..bench.decode import run_decode as decode

    check_bench_outputs(args, _local(args.model) + list(args.plan))
    cfg = DecodeConfig(model=args.model, batches=_numbers(args.batches, int), keeps=_numbers(args.keep),
                       top_ks=_numbers(args.top_k, int) if args.top_k else [], steps=args.steps, quick=args.quick,
                       synthetic_layers=args.synthetic_layers, hf=not args.no_hf, pruned=not args.no_pruned,
                       plans=args.plan, dtype=torch_name(args.dtype))
    decode(cfg, args.out, invocation()).write()
    return 0


def run_slo(args) -> int:
    from ..bench.slo import run_slo as slo

    check_bench_outputs(args, _local(args.model))
    slo(args.model, _numbers(args.batches, int), _numbers(args.keep), args.slo, args.steps, args.quick,
        args.synthetic_layers, not args.no_pruned, args.out, invocation()).write()
    return 0


def run_prefill(args) -> int:
    from ..bench.prefill import run_prefill as prefill

    check_bench_outputs(args, _local(args.model))
    prefill(args.model, _numbers(args.keep), args.prompt_len, _numbers(args.batches, int), args.quick,
            args.synthetic_layers, args.out, invocation()).write()
    return 0


def run_ktiers(args) -> int:
    from ..bench.ktiers import run_ktiers as ktiers

    if min(args.requests, args.prompt_len, args.max_tokens, args.max_num_seqs, args.repeats) < 1:
        raise ValueError("--requests, --prompt-len, --max-tokens, --max-num-seqs and --repeats must be >= 1")
    check_bench_outputs(args, _local(args.model))
    ktiers(args.model, args.mix, args.requests, args.prompt_len, args.max_tokens, args.max_num_seqs, args.repeats,
           args.quick, args.synthetic_layers, args.out, invocation()).write()
    return 0
