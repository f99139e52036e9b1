"""`moetailor bench vllm`: decode throughput of stock vLLM, vLLM + the phase-aware plugin (masked
decode pool) and the disaggregated pair (pruned decode instance), in one run.

Each configuration runs in its own process, one after another (stock runs with the plugin switched
off: ``VLLM_PLUGINS=""``). Per batch size B: ``t1`` = time to generate 1 token for B prompts,
``tN`` = time to generate N; decode tokens/s = B * (N - 1) / (tN - t1), per-user tokens/s =
(N - 1) / (tN - t1). The pair's decode instance is timed the same way on its own requests (prompt +
first token, the prompt's KV loaded through the connector): (N - 1 tokens) minus (1 token), so the
KV load and the first step cancel and the number is its steady decode rate. KV capacity: blocks a fixed memory budget holds after the weights, from the checkpoint sizes
and vLLM's block shape.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = ("stock", "phase-aware", "disaggregated")


def register_bench(bsub, common) -> None:
    q = bsub.add_parser("vllm", help="vLLM decode throughput: stock vs the phase-aware plugin vs a pruned decode instance")
    q.add_argument("--model", default="reference", help="'reference', 'synthetic' or a checkpoint directory")
    q.add_argument("--plan", default=None, help="decode plan (default: the bundled REAP 50%% plan for 'reference', "
                   "a uniform half-pool plan otherwise)")
    q.add_argument("--batches", default="1,8,32")
    q.add_argument("--prompt-tokens", type=int, default=48)
    q.add_argument("--new-tokens", type=int, default=64)
    q.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    q.add_argument("--repeats", type=int, default=2, help="timed runs per batch (the fastest is kept)")
    q.add_argument("--budget-gib", type=float, default=1.0, help="memory budget (weights + KV) for the KV-capacity table")
    q.add_argument("--slo", type=float, default=20.0, help="per-user decode tokens/s the SLO column asks for")
    common(q, "build/bench/vllm", quick=False)
    q.set_defaults(func=run)


def prepare(args) -> tuple[Path, Path, Path]:
    """(model dir, decode plan, pruned checkpoint) inside args.out."""
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
    if args.plan:
        plan_path = Path(args.plan)
    elif args.model == "reference":
        plan_path = Path(__file__).resolve().parents[2] / "assets" / "plans" / "reference-reap-50.json"
    else:
        from ...models import load_model

        model = load_model(model_dir)
        E = model.config.num_experts if hasattr(model.config, "num_experts") else model.config.num_local_experts
        plan_path = uniform_plan(model, decode=LayerPolicy(keep=tuple(range(E // 2)))).save(args.out / "plan.json")
        del model
    pruned = args.out / "pruned"
    if not (pruned / "config.json").exists():
        prune_checkpoint(model_dir, Plan.load(plan_path), pruned, overwrite=True)
    return Path(model_dir), plan_path, pruned


def run(args) -> int:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("`moetailor bench vllm` needs vLLM in this environment: run `make setup-vllm` and use "
                         ".venv-vllm/bin/moetailor bench vllm")
    if args.new_tokens < 2:
        raise ValueError("--new-tokens must be at least 2 (decode throughput needs tokens after the first)")
    model_dir, plan_path, pruned = prepare(args)
    results = {}
    for config in CONFIGS:
        env = dict(os.environ)
        if config == "stock":
            env["VLLM_PLUGINS"] = ""   # vLLM loads no plugin: the unmodified engine
        cmd = [sys.executable, "-m", "moetailor.integrations.vllm.bench", config, str(model_dir), str(plan_path),
               str(pruned), args.batches, str(args.prompt_tokens), str(args.new_tokens), args.dtype,
               str(args.repeats), str(args.out)]
        print(f"[{config}] starting", flush=True)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode != 0 or not line:
            raise RuntimeError(f"{config} run failed (exit {out.returncode}): {out.stderr[-2000:]}")
        results[config] = json.loads(line[-1][len("RESULT "):])
    capacity = kv_capacity(model_dir, pruned, args.dtype, args.budget_gib)
    report = {"model": str(args.model), "plan": str(plan_path), "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "dtype": args.dtype, "results": results, "kv_capacity": capacity,
              "command": "moetailor " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d %H:%M")}
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    print_report(report, args.slo)
    return 0


def print_report(report: dict, slo: float) -> None:
    from ...tables import print_table

    batches = sorted({int(b) for r in report["results"].values() for b in r})
    rows = []
    for b in batches:
        row = [b]
        stock = report["results"]["stock"][str(b)]["decode_tok_s"]
        for config in CONFIGS:
            r = report["results"][config][str(b)]
            row += [f"{r['decode_tok_s']:.0f}", f"{r['per_user_tok_s']:.1f}", f"{r['decode_tok_s'] / stock:.2f}x"]
        rows.append(tuple(row))
    heads = ["batch"] + [f"{c} {h}" for c in CONFIGS for h in ("tok/s", "per-user", "vs stock")]
    print_table(f"vLLM decode, {report['model']}, {report['prompt_tokens']}-token prompts, "
                f"{report['new_tokens']} new tokens, {report['dtype']}", heads, rows)
    at_slo = []
    for config in CONFIGS:
        ok = [r["decode_tok_s"] for r in report["results"][config].values() if r["per_user_tok_s"] >= slo]
        at_slo.append((config, f"{max(ok):.0f}" if ok else "none meets it"))
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


def worker(config, model_dir, plan_path, pruned, batches, prompt_tokens, new_tokens, dtype, repeats, out) -> dict:
    import random
    import tempfile

    from vllm import LLM, SamplingParams

    from .disagg import pair_kwargs
    from .launch import engine_kwargs

    batches = [int(b) for b in batches.split(",")]
    common = dict(dtype=dtype, kv_cache_mib=1024, max_num_seqs=max(batches), max_model_len=prompt_tokens + new_tokens + 8,
                  max_num_batched_tokens=max(2048, max(batches) * prompt_tokens), disable_log_stats=True,
                  enable_prefix_caching=False)  # every configuration recomputes its prompts
    rng = random.Random(0)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir, local_files_only=True).vocab_size
    results = {}
    if config == "disaggregated":
        storage = tempfile.mkdtemp(prefix="moetailor-kv-", dir=out)
        pk, dk = pair_kwargs(model_dir, pruned, storage, **common)
        prefill, decode = LLM(**pk), LLM(**dk)
    else:
        llm = LLM(**engine_kwargs(model_dir, decode_plan=plan_path if config == "phase-aware" else None, **common))
    for b in batches:
        best = None
        for rep in range(repeats + 1):   # the first run warms up
            prompts = [[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(b)]
            reqs = [{"prompt_token_ids": p} for p in prompts]
            one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            many = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            if config == "disaggregated":
                # the decode instance frees a prompt's stored KV when its request ends: prefill twice
                def handoff(max_tokens):
                    firsts = prefill.generate(reqs, one, use_tqdm=False)
                    cont = [{"prompt_token_ids": p + list(f.outputs[0].token_ids)} for p, f in zip(prompts, firsts)]
                    return _time_generate(decode, cont, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                       ignore_eos=True))
                first = handoff(1)
                seconds = (handoff(new_tokens - 1) - first) * (new_tokens - 1) / (new_tokens - 2)
            else:
                first = _time_generate(llm, reqs, one)
                seconds = _time_generate(llm, reqs, many) - first
            if rep and (best is None or seconds < best):
                best = seconds
        results[str(b)] = {"decode_seconds": best, "decode_tok_s": b * (new_tokens - 1) / best,
                           "per_user_tok_s": (new_tokens - 1) / best}
    for engine in ((prefill, decode) if config == "disaggregated" else (llm,)):
        engine.llm_engine.engine_core.shutdown()
    return results


if __name__ == "__main__":
    a = sys.argv[1:]
    res = worker(a[0], a[1], a[2], a[3], a[4], int(a[5]), int(a[6]), a[7], int(a[8]), a[9])
    print("RESULT " + json.dumps(res), flush=True)
