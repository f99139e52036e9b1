"""`moetailor bench vllm`: decode throughput of stock vLLM and of every moetailor technique inside vLLM
(its default compiled mode), in one run; docs/vllm.md describes the rows and the method.

Timed interleaved, in one process: every engine the rows need is alive at once and each round times
every row once, in turn, so that drift of the machine hits every row alike (each configuration in its
own process, one after another, gave stock and the plugin at full k, the same expert work, 0.64x-1.14x
of each other). The plugin's rows share one engine, which switches plans between rows
(``rpc.use_plan``); every worker is bound to the same CPUs (``same_cores_for_every_instance``) and
every other process to the rest (``off_the_workers_cores``); before a row on another engine the run
waits ``IDLE_S``. Per batch B: decode tokens/s = B * (N - 1) / (tN - t1), the fastest of ``--repeats``
rounds after a warm-up round. A group of two rows (``observe``) also gets the median over rounds of the
second row's tokens/s over the first's in the same round, with a 95% interval of that median: the
machine's speed drifts by up to 20% within minutes, which moves both rows of a round alike but the
two rows' best-of rounds independently (their ratio scattered by ±10% from run to run).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

# group (--only) -> rows it measures
PROCESSES = {"stock": ("stock",), "budgets": ("full k", "k=4", "mixed k"), "masked-50": ("masked 50%",),
             "masked-50-eager": ("masked 50% eager",), "masked-25": ("masked 25%",), "fold-50": ("fold 50%",),
             "skip": ("skip",), "disaggregated": ("pair",),
             "experts-kernel": ("full k, mt kernel", "k=4, mt kernel", "mixed k, mt kernel", "masked 50%, mt kernel",
                                "masked 25%, mt kernel", "skip, mt kernel"),
             "disaggregated-kernel": ("pair, mt kernel",),
             "observe": ("full k", "observing"), "observe-kernel": ("full k, mt kernel", "observing, mt kernel")}
IDLE_S = 1.5                    # an idle vLLM worker busy-polls for 1 s after its last step
MIXED_K = (2, 4, 6, 8)          # the mixed batch's budgets, request i gets MIXED_K[i % 4] (capped at the model's k)
SKIP_BETA = 0.5
LEVEL = 0.95                    # coverage of the paired ratio's interval


def register_bench(bsub, common) -> None:
    q = bsub.add_parser("vllm", help="vLLM decode throughput: stock vs the phase-aware plugin vs a pruned decode instance")
    q.add_argument("--model", default="reference", help="'reference', 'synthetic' or a checkpoint directory")
    q.add_argument("--plan", default=None, help="decode plan (default: the bundled REAP 50%% plan for 'reference', "
                   "a uniform half-pool plan otherwise)")
    q.add_argument("--batches", default="1,8,32")
    q.add_argument("--prompt-tokens", type=int, default=48)
    q.add_argument("--new-tokens", type=int, default=64)
    q.add_argument("--only", default=None, help="comma-separated processes to run (default all: "
                   + ", ".join(PROCESSES) + ")")
    q.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    q.add_argument("--repeats", type=int, default=2, help="timed rounds per batch (the fastest is kept; a group of two rows "
                   "also gets its paired ratio's median, with a 95%% interval from 6 rounds on)")
    q.add_argument("--budget-gib", type=float, default=1.0, help="memory budget (weights + KV) for the KV-capacity table")
    q.add_argument("--slo", type=float, default=20.0, help="per-user decode tokens/s the SLO column asks for")
    common(q, "build/bench/vllm", quick=False)
    q.set_defaults(func=run)


def check_vllm_args(args, verb: str, why: str) -> None:
    """What a vLLM bench checks first: vLLM is here, and two new tokens at least (``why`` needs them)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError(f"`moetailor bench {verb}` needs vLLM in this environment: run `make setup-vllm` and use "
                         f".venv-vllm/bin/moetailor bench {verb}")
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be at least 2 ({why} tokens after the first)")


def model_dir(args) -> Path:
    """--model as a checkpoint folder; 'synthetic' (the bandwidth-bound model) is written once under --out."""
    from ..models.loading import resolve_model_path

    if args.model != "synthetic":
        return resolve_model_path(args.model)
    out = args.out / "synthetic"
    if not (out / "config.json").exists():
        import torch

        from ..models.tiny import char_tokenizer
        from .synthetic import synthetic_model

        synthetic_model(layers=2).to(getattr(torch, args.dtype)).save_pretrained(out)
        char_tokenizer(1024).save_pretrained(out)
    return out


def run_worker(module: str, spec: dict) -> tuple[int, dict | None]:
    """``module``'s worker on ``spec`` in its own process (its progress and vLLM's log on stderr, as it
    happens): the exit status and the last results it printed (a ``RESULT {...}`` line per batch), or None."""
    out = subprocess.run([sys.executable, "-m", module, json.dumps(spec)], stdout=subprocess.PIPE, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    return out.returncode, json.loads(lines[-1][len("RESULT "):]) if lines else None


def prepare(args) -> dict:
    """Model dir, the decode plans of every row and the pruned checkpoint, inside args.out."""
    from ..models import load_model, load_tokenizer
    from ..plans import Plan, uniform_plan
    from ..routing import LayerPolicy
    from ..transforms import prune_checkpoint

    args.out.mkdir(parents=True, exist_ok=True)
    path = model_dir(args)
    model = load_model(path)
    E = model.config.num_experts if hasattr(model.config, "num_experts") else model.config.num_local_experts
    if args.plan:
        half = Path(args.plan)
    elif args.model == "reference":
        half = Path(__file__).resolve().parents[1] / "assets" / "plans" / "reference-reap-50.json"
    else:
        half = uniform_plan(model, decode=LayerPolicy(keep=tuple(range(E // 2)))).save(args.out / "plan.json")
    base = Plan.load(half)
    keep = {i: p.keep for i, p in base.decode.layers.items()}
    plans = {"masked-50": half}
    quarter = base.with_phases(decode=type(base.decode)({i: LayerPolicy(keep=k[:len(k) // 2]) for i, k in keep.items()}))
    plans["masked-25"] = quarter.save(args.out / "plan-25.json")
    stats = args.out / "fold-stats.safetensors"
    if not stats.exists():
        from ..calibration import calibrate

        calibrate(model.float(), load_tokenizer(path), "tasks", 2048, batch_tokens=512, seq_len=128, fold=True,
                  progress=False).save(stats)
    fold = base.with_phases(decode=type(base.decode)({i: LayerPolicy(keep=k, pool_mode="fold") for i, k in keep.items()}))
    plans["fold-50"] = replace(fold, fold_stats=str(stats.resolve())).save(args.out / "plan-fold-50.json")
    skip = base.with_phases(decode=type(base.decode).uniform(base.model["moe_layers"], LayerPolicy(skip_beta=SKIP_BETA)))
    plans["skip"] = skip.save(args.out / "plan-skip.json")
    del model
    pruned = args.out / "pruned"
    if not (pruned / "config.json").exists():
        prune_checkpoint(path, base, pruned, overwrite=True)
    return {"model": Path(path), "plans": {k: str(v) for k, v in plans.items()}, "pruned": pruned}


def run(args) -> int:
    from ..outputs import check_output

    check_vllm_args(args, "vllm", "decode throughput needs")
    only = args.only.split(",") if args.only else list(PROCESSES)
    unknown = sorted(set(only) - set(PROCESSES))
    if unknown:
        raise ValueError(f"--only names unknown processes {unknown}; choose from {', '.join(PROCESSES)}")
    check_output(args.out, overwrite=True, directory=True, replaces=False)   # one run per --out at a time (it caches there)
    setup = prepare(args)
    spec = {"groups": only, "model": str(setup["model"]), "plans": setup["plans"], "pruned": str(setup["pruned"]),
            "batches": args.batches, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
            "dtype": args.dtype, "repeats": args.repeats, "out": str(args.out)}
    t0 = time.time()
    code, results = run_worker("moetailor.bench.vllm", spec)
    if results is None:
        raise RuntimeError(f"the benchmark process failed (exit {code}) before any batch size "
                           f"finished; its log is above")
    if code != 0:
        print(f"the benchmark process stopped (exit {code}) after batch sizes "
              f"{sorted({b for r in results.values() for b in r}, key=int)}: reporting those", flush=True)
    print(f"measured in {time.time() - t0:.0f} s", flush=True)
    capacity = kv_capacity(setup["model"], setup["pruned"], args.dtype, args.budget_gib)
    report = {"model": str(args.model), "plans": setup["plans"], "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "dtype": args.dtype, "results": results, "kv_capacity": capacity,
              "mixed_k": MIXED_K, "skip_beta": SKIP_BETA, "method": "interleaved, one process",
              "command": "moetailor " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M")}
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print_report(report, args.slo)
    return 0


def print_report(report: dict, slo: float) -> None:
    from ..tables import print_table

    res = report["results"]
    batches = sorted({int(b) for r in res.values() for b in r})
    rows = []
    for b in batches:
        for name, r in res.items():
            x = r.get(str(b))
            if x is None:
                continue
            # the stock routes, recorded through the hooks, on the row's own experts kernel
            ref = next((n for n in (("full k, mt kernel",) if name.endswith("mt kernel") else ()) + ("full k",)
                        if n in res), None)
            stock = res.get("stock", {}).get(str(b))
            distinct = x.get("distinct")
            base = res[ref][str(b)].get("distinct") if ref and str(b) in res[ref] else None
            full = res[ref][str(b)]["decode_tok_s"] if ref and str(b) in res[ref] else None
            rows.append((b, name, f"{x['decode_tok_s']:.0f}", f"{x['per_user_tok_s']:.1f}",
                         f"{x['decode_tok_s'] / stock['decode_tok_s']:.2f}x" if stock else "-",
                         f"{x['decode_tok_s'] / full:.2f}x" if full else "-",
                         f"{distinct:.1f}" if distinct is not None else "-",
                         f"{base / distinct:.2f}x" if distinct and base else "-",
                         f"{ratio_text(x['paired'])} vs {x['paired']['vs']}" if "paired" in x else "-"))
    print_table(f"vLLM decode, {report['model']}, {report['prompt_tokens']}-token prompts, {report['new_tokens']} new "
                f"tokens, {report['dtype']}", ["batch", "config", "tok/s", "per-user", "vs stock",
                                               "vs full k", "experts/step", "ideal",
                                               f"paired ratio [{LEVEL:.0%} interval]"], rows)
    at_slo = []
    for name, r in res.items():
        ok = [(x["decode_tok_s"], b) for b, x in r.items() if x["per_user_tok_s"] >= slo]
        at_slo.append((name, f"{max(ok)[0]:.0f} (B={max(ok)[1]})" if ok else "none meets it"))
    print_table(f"best decode tokens/s with every user at >= {slo:g} tokens/s", ["config", "tok/s"], at_slo)
    cap = report["kv_capacity"]
    print_table(f"KV blocks in a {cap['budget_gib']:g} GiB budget (weights + KV), block = {cap['block_tokens']} tokens",
                ["instance", "weights MiB", "KV blocks", "KV tokens"],
                [(name, f"{c['weights_mib']:.1f}", c["blocks"], c["blocks"] * cap["block_tokens"])
                 for name, c in cap["instances"].items()])


def kv_capacity(model_dir: Path, pruned: Path, dtype: str, budget_gib: float, block_tokens: int = 128) -> dict:
    """KV blocks that fit in the budget after each instance's weights (vLLM CPU block = 128 tokens)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    nbytes = 4 if dtype == "float32" else 2
    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    block_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * block_tokens * nbytes
    budget = int(budget_gib * 2**30)
    instances = {}
    for name, path in (("prefill / colocated (full)", model_dir), ("decode (pruned)", pruned)):
        numel = 0
        for f in Path(path).glob("*.safetensors"):
            with safe_open(f, "pt") as st:
                numel += sum(math.prod(st.get_slice(key).get_shape()) for key in st.keys())
        weights = numel * nbytes
        instances[name] = {"weights_mib": weights / 2**20, "blocks": max(0, (budget - weights) // block_bytes)}
    return {"budget_gib": budget_gib, "block_tokens": block_tokens, "block_bytes": block_bytes, "instances": instances}


def _time_generate(llm, prompts, params) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def _distinct(llm) -> float:
    """Mean distinct experts per decode step and MoE layer since the last reset (then reset)."""
    from ..integrations.vllm.rpc import call, route_totals

    totals = call(llm, route_totals, reset=True)[0]
    return sum(t["experts"] for t in totals.values()) / max(1, sum(t["steps"] for t in totals.values()))


@dataclass(frozen=True)
class Row:
    name: str
    engine: str                          # "stock" | "plugin" | "eager" | "kernel" | "pair" | "pair-kernel"
    plan: str | None = None              # decode plan the plugin engine switches to for this row
    budgets: tuple[int, ...] | None = None


def rows_of(groups: list[str], plans: dict[str, str], model_k: int) -> list[Row]:
    """The rows ``groups`` time; ``plans`` holds the plan files of the groups asked for (the stock row needs none)."""
    mixed = tuple(min(k, model_k) for k in MIXED_K)
    every = {"stock": [Row("stock", "stock")],
             "budgets": [Row("full k", "plugin"), Row("k=4", "plugin", budgets=(4,)),
                         Row("mixed k", "plugin", budgets=mixed)],
             "masked-50": [Row("masked 50%", "plugin", plans.get("masked-50"))],
             "masked-50-eager": [Row("masked 50% eager", "eager", plans.get("masked-50"))],
             "masked-25": [Row("masked 25%", "plugin", plans.get("masked-25"))],
             "fold-50": [Row("fold 50%", "plugin", plans.get("fold-50"))],
             "skip": [Row("skip", "plugin", plans.get("skip"))],
             "disaggregated": [Row("pair", "pair")],
             # the plugin on moetailor's experts kernel (additional_config moetailor_experts_kernel)
             "experts-kernel": [Row("full k, mt kernel", "kernel"), Row("k=4, mt kernel", "kernel", budgets=(4,)),
                                Row("mixed k, mt kernel", "kernel", budgets=mixed),
                                Row("masked 50%, mt kernel", "kernel", plans.get("masked-50")),
                                Row("masked 25%, mt kernel", "kernel", plans.get("masked-25")),
                                Row("skip, mt kernel", "kernel", plans.get("skip"))],
             # the pair with both instances on moetailor's experts kernel: against "masked 50%, mt kernel",
             # colocated and disaggregated on the same kernel
             "disaggregated-kernel": [Row("pair, mt kernel", "pair-kernel")],
             # the cost of observing the traffic (additional_config moetailor_observe): the same batch on an
             # engine that observes, beside the plugin at full k; on moetailor's kernel with EAN and REAP
             "observe": [Row("full k", "plugin"), Row("observing", "observe")],
             "observe-kernel": [Row("full k, mt kernel", "kernel"), Row("observing, mt kernel", "observe-kernel")]}
    rows = [row for group in groups for row in every[group]]
    return list(dict.fromkeys(rows))           # a row two groups name is timed once


def pairs_of(groups: list[str]) -> list[tuple[str, str]]:
    """The (first, second) rows of every group of two asked for: the rows whose per-round ratio is reported."""
    return [PROCESSES[g] for g in groups if len(PROCESSES[g]) == 2]


def median_interval(values: list[float], level: float = LEVEL) -> tuple[float, float | None, float | None]:
    """The median of ``values`` and an interval for it that assumes nothing about the noise's distribution:
    the sorted values j and n + 1 - j, j the largest whose coverage 1 - 2 P(Binomial(n, 1/2) < j) is at
    least ``level``. Too few values for any such pair (fewer than 6 at 95%): (median, None, None)."""
    xs, n = sorted(values), len(values)
    median = (xs[(n - 1) // 2] + xs[n // 2]) / 2
    j, tail = 0, 0.0                     # tail = P(Binomial(n, 1/2) < j)
    while j < n // 2 and 1 - 2 * (tail + math.comb(n, j) / 2**n) >= level:
        tail += math.comb(n, j) / 2**n
        j += 1
    return (median, xs[j - 1], xs[n - j]) if j else (median, None, None)


def paired_ratio(first_s: list[float], second_s: list[float]) -> dict:
    """The second row's tokens/s over the first's, round by round (both timed the same batch in the same
    round), as its median and 95% interval: what a row costs against the other, with the drift between
    rounds cancelled."""
    ratios = [a / b for a, b in zip(first_s, second_s, strict=True)]     # tok/s is B (N - 1) / seconds
    median, low, high = median_interval(ratios)
    return {"median": median, "low": low, "high": high, "rounds": len(ratios), "ratios": ratios}


def ratio_text(p: dict) -> str:
    """'0.98x [0.96-1.01]', or the median and why there is no interval."""
    if p["low"] is None:
        return f"{p['median']:.3f}x [{p['rounds']} rounds: too few to tell]"
    return f"{p['median']:.3f}x [{p['low']:.3f}-{p['high']:.3f}]"


def _descendants() -> set[int]:
    """Every process below this one (vLLM starts an engine core and its worker per instance)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def binding(pids: set[int]) -> list[dict]:
    """Threads and the CPUs each may run on, per process: which cores an engine's workers were bound
    to, for the log (instances that share or split cores time differently)."""
    out = []
    for pid in sorted(pids):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            cpus = dict(Counter(",".join(map(str, sorted(os.sched_getaffinity(int(tid)))))
                                for tid in os.listdir(f"/proc/{pid}/task")))
        except OSError:
            continue
        out.append({"pid": pid, "name": name, "threads_by_cpus": cpus})
    return out


def same_cores_for_every_instance() -> str:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` every engine of the run gets: the CPUs vLLM's automatic
    binding gives a colocated instance (all but the last, which it reserves for the scheduler
    process), unless the caller set one. Why: the automatic binding reserves one more core for an
    instance with a KV connector, and when the machine has no core left to reserve it reserves
    none, so on 2 cores the pair's workers bound both cores and every other instance one
    (read from the workers' thread affinities: 1.8-1.9x of the pair's 'speed-up' was that)."""
    given = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if given and given != "auto":
        return given
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, cpus[:-1] if len(cpus) > 1 else cpus))


def cpu_list(bind: str) -> set[int]:
    """The CPUs a ``VLLM_CPU_OMP_THREADS_BIND`` value names ("0,2-3", ranks split by "|")."""
    cpus = set()
    for part in bind.replace("|", ",").split(","):
        first, _, last = part.strip().partition("-")
        if first.isdigit():
            cpus.update(range(int(first), int(last if last.isdigit() else first) + 1))
    return cpus


def off_the_workers_cores(pids: set[int], workers: set[int]) -> None:
    """Bind every thread of ``pids`` but vLLM's workers to the CPUs the workers are not bound to (on 2
    cores: the engine cores and this process on the second, the workers alone on the first). Why: vLLM
    binds only its workers, so an engine core process (which waits on its worker's replies) and this
    process could be scheduled on the core the worker computes on, for stretches that favour one
    engine over another."""
    rest = set(os.sched_getaffinity(0)) - workers
    if not rest:
        return
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "VLLM::Worker":
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), rest)
        except OSError:      # a thread that ended meanwhile
            continue


def start_engines(spec: dict, rows: list[Row]) -> dict:
    """Every engine the rows need, alive together: name -> (LLM that decodes, instances to shut down)."""
    import tempfile

    from vllm import LLM

    from ..integrations.vllm.disagg import pair_kwargs
    from ..integrations.vllm.launch import engine_kwargs
    from ..integrations.vllm.patches import RECORD_KEY
    from ..integrations.vllm.rpc import SERIALIZATION_ENV

    batches = [int(b) for b in spec["batches"].split(",")]
    common = dict(dtype=spec["dtype"], kv_cache_mib=256, max_num_seqs=max(batches),
                  max_model_len=spec["prompt_tokens"] + spec["new_tokens"] + 8,
                  max_num_batched_tokens=max(2048, max(batches) * spec["prompt_tokens"]), disable_log_stats=True,
                  enable_prefix_caching=False)  # every configuration recomputes its prompts
    needed = {row.engine for row in rows}
    engines = {}
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = same_cores_for_every_instance()   # read by each engine process
    os.environ[SERIALIZATION_ENV] = "1"   # the plan swaps and route counts reach the workers as functions (rpc.py)
    print(f"[binding] every instance's worker on CPUs {os.environ['VLLM_CPU_OMP_THREADS_BIND']}", file=sys.stderr,
          flush=True)
    seen = _descendants()

    workers = cpu_list(os.environ["VLLM_CPU_OMP_THREADS_BIND"])

    def log_binding(name: str) -> None:
        nonlocal seen
        now = _descendants()
        off_the_workers_cores(now - seen, workers)
        print(f"[binding] {name}: " + json.dumps(binding(now - seen)), file=sys.stderr, flush=True)
        seen = now
    # the plugin's engines first: vLLM loads plugins once per process, and the stock engine's
    # worker process is started without them (VLLM_PLUGINS="")
    for name in ("plugin", "eager", "kernel", "observe", "observe-kernel"):
        if name in needed:
            observe = None
            if name.startswith("observe"):   # a new file per engine and run (observed statistics are never appended)
                observe = Path(spec["out"]) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.safetensors"
            kwargs = engine_kwargs(spec["model"], enforce_eager=name == "eager", experts_kernel=name.endswith("kernel"),
                                   observe=observe, **common)
            kwargs.setdefault("additional_config", {})[RECORD_KEY] = True
            llm = LLM(**kwargs)
            engines[name] = (llm, (llm,))
            log_binding(name)
    for name in ("pair", "pair-kernel"):
        if name in needed:
            storage = tempfile.mkdtemp(prefix="moetailor-kv-", dir=spec["out"])
            pk, dk = pair_kwargs(spec["model"], spec["pruned"], storage, experts_kernel=name == "pair-kernel", **common)
            dk.setdefault("additional_config", {})[RECORD_KEY] = True
            prefill = LLM(**pk)
            log_binding(f"{name} prefill")
            decode = LLM(**dk)
            log_binding(f"{name} decode")
            engines[name] = (decode, (prefill, decode))
            engines[f"{name}-prefill"] = (prefill, ())
    if "stock" in needed:
        before = os.environ.get("VLLM_PLUGINS")
        os.environ["VLLM_PLUGINS"] = ""   # the unmodified engine: its worker process loads no plugin
        try:
            llm = LLM(**engine_kwargs(spec["model"], **common))
        finally:
            if before is None:
                del os.environ["VLLM_PLUGINS"]
            else:
                os.environ["VLLM_PLUGINS"] = before
        engines["stock"] = (llm, (llm,))
        log_binding("stock")
    off_the_workers_cores({os.getpid()}, workers)   # last: the engines' processes inherited every CPU from it
    return engines


def worker(spec: dict) -> dict:
    import random

    from transformers import AutoConfig
    from vllm import SamplingParams

    from ..integrations.vllm.rpc import call, use_plan

    new_tokens, prompt_tokens = spec["new_tokens"], spec["prompt_tokens"]
    batches = [int(b) for b in spec["batches"].split(",")]
    config = AutoConfig.from_pretrained(spec["model"], local_files_only=True)
    rows = rows_of(spec["groups"], spec["plans"], config.num_experts_per_tok)
    engines = start_engines(spec, rows)
    current_plan = {"plugin": None, "eager": None, "kernel": None, "observe": None, "observe-kernel": None}
    rng = random.Random(0)
    results = {row.name: {} for row in rows}
    last_engine = None

    def timed_row(row: Row, b: int, prompts: list[list[int]]) -> float:
        nonlocal last_engine
        llm = engines[row.engine][0]
        if row.engine in current_plan and current_plan[row.engine] != row.plan:
            call(llm, use_plan, row.plan, "decode")
            current_plan[row.engine] = row.plan
        if last_engine is not None and last_engine != row.engine:
            time.sleep(IDLE_S)
        last_engine = row.engine
        extra = [None if row.budgets is None else {"expert_top_k": row.budgets[i % len(row.budgets)]} for i in range(b)]
        reqs = [{"prompt_token_ids": p} for p in prompts]

        def params(n):
            return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, extra_args=e) for e in extra]
        if row.engine in ("pair", "pair-kernel"):
            prefill = engines[f"{row.engine}-prefill"][0]

            # the decode instance frees a prompt's stored KV when its request ends: prefill twice
            def handoff(max_tokens):
                firsts = prefill.generate(reqs, params(1), use_tqdm=False)
                cont = [{"prompt_token_ids": p + list(f.outputs[0].token_ids)} for p, f in zip(prompts, firsts)]
                return _time_generate(llm, cont, params(max_tokens))
            first = handoff(1)
            return (handoff(new_tokens - 1) - first) * (new_tokens - 1) / (new_tokens - 2)
        first = _time_generate(llm, reqs, params(1))
        return _time_generate(llm, reqs, params(new_tokens)) - first

    for b in batches:
        rounds: dict[str, list[float]] = {row.name: [] for row in rows}   # every timed round's seconds
        experts: dict[str, list[float]] = {row.name: [] for row in rows}
        for rnd in range(spec["repeats"] + 1):   # round 0 warms up
            prompts = [[rng.randrange(3, config.vocab_size) for _ in range(prompt_tokens)] for _ in range(b)]
            order = rows[rnd % len(rows):] + rows[:rnd % len(rows)]    # each round starts one row later, and
            if (rnd // len(rows)) % 2:    # every other cycle runs backwards: each row of a pair goes first in half
                order = order[::-1]       # the rounds (a pair's paired ratio is not biased by who runs first)
            for row in order:
                recorded = row.engine != "stock"
                if recorded:
                    _distinct(engines[row.engine][0])
                seconds = timed_row(row, b, prompts)
                if recorded:
                    experts[row.name].append(_distinct(engines[row.engine][0]))
                if rnd:
                    rounds[row.name].append(seconds)
            print(f"[B={b}] round {rnd}, best so far: " + ", ".join(
                f"{n} {b * (new_tokens - 1) / min(s):.0f}" for n, s in rounds.items() if s), file=sys.stderr, flush=True)
        for row in rows:
            seconds = min(rounds[row.name])
            results[row.name][str(b)] = {"decode_seconds": seconds, "decode_tok_s": b * (new_tokens - 1) / seconds,
                                         "per_user_tok_s": (new_tokens - 1) / seconds,
                                         "round_seconds": rounds[row.name],
                                         "distinct": (sum(experts[row.name][1:]) / len(experts[row.name][1:])
                                                      if experts[row.name][1:] else None)}
        for first, second in pairs_of(spec["groups"]):
            results[second][str(b)]["paired"] = {"vs": first, **paired_ratio(rounds[first], rounds[second])}
            print(f"[B={b}] {second} / {first}, paired by round: "
                  f"{ratio_text(results[second][str(b)]['paired'])}", file=sys.stderr, flush=True)
        print("RESULT " + json.dumps(results), flush=True)   # what is measured so far survives a stop
    for _, instances in engines.values():
        for engine in instances:
            engine.llm_engine.engine_core.shutdown()
    return results


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
