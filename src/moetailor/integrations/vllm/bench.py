"""`moetailor bench vllm`: decode throughput of stock vLLM and of every moetailor technique inside vLLM
(its default compiled mode), in one run.

Rows: stock (plugin off: ``VLLM_PLUGINS=""``); the plugin at full k (the same batch with the hooks);
per-request ``expert_top_k=4`` and a mixed-budget batch; masked decode pools of 50% and 25%; a
folding decode pool (ExFold, 50%, tables calibrated once on the model); dynamic skipping (NAEE
threshold); the disaggregated pair (pruned 50% decode instance). Each process runs one engine
(the three budget rows share one), one after another.

Per batch size B: ``t1`` = time to generate 1 token for B prompts, ``tN`` = time to generate N;
decode tokens/s = B * (N - 1) / (tN - t1), per-user tokens/s = (N - 1) / (tN - t1). The pair's
decode instance is timed the same way on its own requests (prompt + first token, the prompt's KV
loaded through the connector). Distinct experts per decode step are counted from the routes vLLM's
kernel receives (the plugin's route recorder, mean over MoE layers); the ideal speed-up is stock's
distinct experts over the row's, what a purely weight-bandwidth-bound decode would gain. KV
capacity: blocks a fixed memory budget holds after the weights, from the checkpoint sizes and
vLLM's block shape.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

# process -> rows it measures
PROCESSES = {"stock": ("stock",), "budgets": ("full k", "k=4", "mixed k"), "masked-50": ("masked 50%",),
             "masked-25": ("masked 25%",), "fold-50": ("fold 50%",), "skip": ("skip",),
             "disaggregated": ("pair",)}
MIXED_K = (2, 4, 6, 8)          # the mixed batch's budgets, request i gets MIXED_K[i % 4] (capped at the model's k)
SKIP_BETA = 0.5


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
    q.add_argument("--repeats", type=int, default=2, help="timed runs per batch (the fastest is kept)")
    q.add_argument("--budget-gib", type=float, default=1.0, help="memory budget (weights + KV) for the KV-capacity table")
    q.add_argument("--slo", type=float, default=20.0, help="per-user decode tokens/s the SLO column asks for")
    common(q, "build/bench/vllm", quick=False)
    q.set_defaults(func=run)


def prepare(args) -> dict:
    """Model dir, the decode plans of every row and the pruned checkpoint, inside args.out."""
    from ...models.loading import resolve_model_path
    from ...plans import Plan, uniform_plan
    from ...routing import LayerPolicy
    from ...transforms import prune_checkpoint

    args.out.mkdir(parents=True, exist_ok=True)
    if args.model == "synthetic":
        model_dir = args.out / "synthetic"
        if not (model_dir / "config.json").exists():
            from ...bench.synthetic import synthetic_model
            from ...models.tiny import char_tokenizer

            import torch

            model = synthetic_model(layers=2).to(getattr(torch, args.dtype))
            model.save_pretrained(model_dir)
            char_tokenizer(1024).save_pretrained(model_dir)
    else:
        model_dir = resolve_model_path(args.model)
    from ...models import load_model, load_tokenizer

    model = load_model(model_dir)
    E = model.config.num_experts if hasattr(model.config, "num_experts") else model.config.num_local_experts
    if args.plan:
        half = Path(args.plan)
    elif args.model == "reference":
        half = Path(__file__).resolve().parents[2] / "assets" / "plans" / "reference-reap-50.json"
    else:
        half = uniform_plan(model, decode=LayerPolicy(keep=tuple(range(E // 2)))).save(args.out / "plan.json")
    base = Plan.load(half)
    keep = {i: p.keep for i, p in base.decode.layers.items()}
    plans = {"masked-50": half}
    quarter = base.with_phases(decode=type(base.decode)({i: LayerPolicy(keep=k[:len(k) // 2]) for i, k in keep.items()}))
    plans["masked-25"] = quarter.save(args.out / "plan-25.json")
    stats = args.out / "fold-stats.safetensors"
    if not stats.exists():
        from ...calibration import calibrate

        calibrate(model.float(), load_tokenizer(model_dir), "tasks", 2048, batch_tokens=512, seq_len=128, fold=True,
                  progress=False).save(stats)
    fold = base.with_phases(decode=type(base.decode)({i: LayerPolicy(keep=k, pool_mode="fold") for i, k in keep.items()}))
    plans["fold-50"] = replace(fold, fold_stats=str(stats.resolve())).save(args.out / "plan-fold-50.json")
    skip = base.with_phases(decode=type(base.decode).uniform(base.model["moe_layers"], LayerPolicy(skip_beta=SKIP_BETA)))
    plans["skip"] = skip.save(args.out / "plan-skip.json")
    del model
    pruned = args.out / "pruned"
    if not (pruned / "config.json").exists():
        prune_checkpoint(model_dir, base, pruned, overwrite=True)
    return {"model": Path(model_dir), "plans": {k: str(v) for k, v in plans.items()}, "pruned": pruned}


def run(args) -> int:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("`moetailor bench vllm` needs vLLM in this environment: run `make setup-vllm` and use "
                         ".venv-vllm/bin/moetailor bench vllm")
    if args.new_tokens < 2:
        raise ValueError("--new-tokens must be at least 2 (decode throughput needs tokens after the first)")
    only = args.only.split(",") if args.only else list(PROCESSES)
    unknown = sorted(set(only) - set(PROCESSES))
    if unknown:
        raise ValueError(f"--only names unknown processes {unknown}; choose from {', '.join(PROCESSES)}")
    setup = prepare(args)
    results = {}
    for proc in only:
        env = dict(os.environ)
        if proc == "stock":
            env["VLLM_PLUGINS"] = ""   # vLLM loads no plugin: the unmodified engine
        spec = {"process": proc, "model": str(setup["model"]), "plan": setup["plans"].get(proc),
                "pruned": str(setup["pruned"]), "batches": args.batches, "prompt_tokens": args.prompt_tokens,
                "new_tokens": args.new_tokens, "dtype": args.dtype, "repeats": args.repeats, "out": str(args.out)}
        print(f"[{proc}] starting", flush=True)
        t0 = time.time()
        out = subprocess.run([sys.executable, "-m", "moetailor.integrations.vllm.bench", json.dumps(spec)], env=env,
                             capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode != 0 or not line:
            raise RuntimeError(f"{proc} run failed (exit {out.returncode}): {out.stderr[-3000:]}")
        results.update(json.loads(line[-1][len("RESULT "):]))
        print(f"[{proc}] done in {time.time() - t0:.0f} s", flush=True)
    capacity = kv_capacity(setup["model"], setup["pruned"], args.dtype, args.budget_gib)
    report = {"model": str(args.model), "plans": setup["plans"], "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "dtype": args.dtype, "results": results, "kv_capacity": capacity,
              "mixed_k": MIXED_K, "skip_beta": SKIP_BETA,
              "command": "moetailor " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M")}
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print_report(report, args.slo)
    return 0


def print_report(report: dict, slo: float) -> None:
    from ...tables import print_table

    res = report["results"]
    batches = sorted({int(b) for r in res.values() for b in r})
    ref = "full k" if "full k" in res else None     # the stock routes, recorded through the hooks
    rows = []
    for b in batches:
        for name, r in res.items():
            x = r.get(str(b))
            if x is None:
                continue
            stock = res.get("stock", {}).get(str(b))
            distinct = x.get("distinct")
            base = res[ref][str(b)].get("distinct") if ref and str(b) in res[ref] else None
            full = res[ref][str(b)]["decode_tok_s"] if ref and str(b) in res[ref] else None
            rows.append((b, name, f"{x['decode_tok_s']:.0f}", f"{x['per_user_tok_s']:.1f}",
                         f"{x['decode_tok_s'] / stock['decode_tok_s']:.2f}x" if stock else "-",
                         f"{x['decode_tok_s'] / full:.2f}x" if full else "-",
                         f"{distinct:.1f}" if distinct is not None else "-",
                         f"{base / distinct:.2f}x" if distinct and base else "-"))
    print_table(f"vLLM decode, {report['model']}, {report['prompt_tokens']}-token prompts, {report['new_tokens']} new "
                f"tokens, {report['dtype']}", ["batch", "config", "tok/s", "per-user", "vs stock",
                                               "vs full k", "experts/step", "ideal"], rows)
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
                for key in st.keys():
                    shape = st.get_slice(key).get_shape()
                    n = 1
                    for s in shape:
                        n *= s
                    numel += n
        weights = numel * nbytes
        instances[name] = {"weights_mib": weights / 2**20, "blocks": max(0, (budget - weights) // block_bytes)}
    return {"budget_gib": budget_gib, "block_tokens": block_tokens, "block_bytes": block_bytes, "instances": instances}


def _time_generate(llm, prompts, params) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def _distinct(llm) -> float:
    """Mean distinct experts per decode step and MoE layer since the last reset (then reset)."""
    totals = llm.collective_rpc("moetailor_route_totals", kwargs={"reset": True})[0]
    return sum(t["experts"] for t in totals.values()) / max(1, sum(t["steps"] for t in totals.values()))


def worker(spec: dict) -> dict:
    import random
    import tempfile

    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    from .disagg import pair_kwargs
    from .launch import engine_kwargs
    from .patches import RECORD_KEY

    proc, new_tokens, prompt_tokens = spec["process"], spec["new_tokens"], spec["prompt_tokens"]
    batches = [int(b) for b in spec["batches"].split(",")]
    common = dict(dtype=spec["dtype"], kv_cache_mib=1024, max_num_seqs=max(batches),
                  max_model_len=prompt_tokens + new_tokens + 8,
                  max_num_batched_tokens=max(2048, max(batches) * prompt_tokens), disable_log_stats=True,
                  enable_prefix_caching=False)  # every configuration recomputes its prompts
    recording = proc != "stock"
    rng = random.Random(0)
    model_k = AutoConfig.from_pretrained(spec["model"], local_files_only=True).num_experts_per_tok
    vocab = AutoConfig.from_pretrained(spec["model"], local_files_only=True).vocab_size
    rows = {name: {} for name in PROCESSES[proc]}
    budgets = {"stock": None, "full k": None, "k=4": [4], "mixed k": [min(k, model_k) for k in MIXED_K]}
    if proc == "disaggregated":
        storage = tempfile.mkdtemp(prefix="moetailor-kv-", dir=spec["out"])
        pk, dk = pair_kwargs(spec["model"], spec["pruned"], storage, **common)
        dk.setdefault("additional_config", {})[RECORD_KEY] = True
        prefill, decode = LLM(**pk), LLM(**dk)
        engines, recorded = (prefill, decode), decode
    else:
        kwargs = engine_kwargs(spec["model"], decode_plan=spec["plan"], **common)
        if recording:
            kwargs.setdefault("additional_config", {})[RECORD_KEY] = True
        llm = LLM(**kwargs)
        engines, recorded = (llm,), llm
    for b in batches:
        for name in rows:
            ks = budgets.get(name)
            extra = [None if ks is None else {"expert_top_k": ks[i % len(ks)]} for i in range(b)]
            best = None
            if recording:
                _distinct(recorded)
            for rep in range(spec["repeats"] + 1):   # the first run warms up
                prompts = [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(b)]
                reqs = [{"prompt_token_ids": p} for p in prompts]

                def params(n):
                    return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, extra_args=e) for e in extra]
                if proc == "disaggregated":
                    # the decode instance frees a prompt's stored KV when its request ends: prefill twice
                    def handoff(max_tokens):
                        firsts = prefill.generate(reqs, params(1), use_tqdm=False)
                        cont = [{"prompt_token_ids": p + list(f.outputs[0].token_ids)} for p, f in zip(prompts, firsts)]
                        return _time_generate(decode, cont, params(max_tokens))
                    first = handoff(1)
                    seconds = (handoff(new_tokens - 1) - first) * (new_tokens - 1) / (new_tokens - 2)
                else:
                    first = _time_generate(llm, reqs, params(1))
                    seconds = _time_generate(llm, reqs, params(new_tokens)) - first
                if rep and (best is None or seconds < best):
                    best = seconds
            rows[name][str(b)] = {"decode_seconds": best, "decode_tok_s": b * (new_tokens - 1) / best,
                                  "per_user_tok_s": (new_tokens - 1) / best,
                                  "distinct": _distinct(recorded) if recording else None}
    for engine in engines:
        engine.llm_engine.engine_core.shutdown()
    return rows


if __name__ == "__main__":
    res = worker(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(res), flush=True)
