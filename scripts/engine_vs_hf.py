"""Decode throughput: the moetailor engine vs transformers `generate` vs vLLM's CPU build, one run.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/engine_vs_hf.py --model reference --batch 1 8 32

Every side generates ``--new-tokens`` tokens greedily (EOS ignored) for B prompts of ``--prompt-len``
tokens, and decode throughput is measured the same way for all: B * (N - 1) / (t(N) - t(1)), i.e. the
time of an N-token generate minus a 1-token (prefill-only) generate, best of ``--repeats``.
- transformers: a fresh model object, left-padded batch, its stock experts implementation;
- engine: `LLM` with the compiled CPU kernels (default), with torch's ops only (`native_kernels=False`),
  with `torch.compile`d decode steps (`compile_decode=True`, with `--compile`; its warm-up compiles),
  with bf16 decode experts (`decode_expert_dtype=torch.bfloat16`) and with the whole model and KV
  cache in bf16 (`dtype=torch.bfloat16`, what vLLM bf16 runs); the bf16 rows change numerics;
- vLLM: when `.venv-vllm` exists (`make setup-vllm`), its unmodified engine (no plugin) in a
  subprocess, fp32 and bf16, on random prompts of the same length (`--no-vllm` skips it).
Greedy outputs of the engine are compared with transformers' token for token (they agree up to
floating-point ties between padded and packed batches).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch


def heldout_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    root = Path(__file__).resolve().parent.parent / "src" / "moetailor" / "data" / "bundled" / "heldout"
    prompts = []
    for path in sorted(root.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            ids = tokenizer.encode(json.loads(line)["text"], add_special_tokens=False)
            if len(ids) >= length:
                prompts.append(ids[:length])
            if len(prompts) >= count:
                return prompts
    raise SystemExit(f"only {len(prompts)} held-out texts have {length} tokens; lower --prompt-len")


def hf_decode(model, prompts: list[list[int]], new_tokens: int, pad_id: int, repeats: int
              ) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])             # [B, L] left padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=pad_id)
    best, out = float("inf"), None
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            t1 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
            best = min(best, (time.perf_counter() - t1) - (t1 - t0))
    return len(prompts) * (new_tokens - 1) / best, out[:, width:].tolist()


def engine_decode(llm, prompts, new_tokens: int, repeats: int) -> tuple[float, list[list[int]], float]:
    from moetailor.serving import SamplingParams

    best, outs = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
        t1 = time.perf_counter()
        llm.step_log.clear()
        outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        best = min(best, (time.perf_counter() - t1) - (t1 - t0))
    decode = [r for r in llm.step_log if r.phase == "decode"]
    distinct = sum(sum(r.distinct_experts.values()) / len(r.distinct_experts) for r in decode) / len(decode)
    return len(prompts) * (new_tokens - 1) / best, [o.token_ids for o in outs], distinct


def vllm_decode(python: Path, model: str, batches: list[int], prompt_len: int, new_tokens: int, dtype: str,
                repeats: int, out: Path) -> dict[int, float]:
    """Stock vLLM (no plugin) decode tok/s per batch, from its own environment in a subprocess."""
    from moetailor.models.loading import resolve_model_path

    model_dir = str(resolve_model_path(model))
    out.mkdir(parents=True, exist_ok=True)
    spec = {"groups": ["stock"], "model": model_dir, "plans": {}, "pruned": "", "batches": ",".join(map(str, batches)),
            "prompt_tokens": prompt_len, "new_tokens": new_tokens, "dtype": dtype, "repeats": repeats, "out": str(out)}
    cmd = [str(python), "-m", "moetailor.bench.vllm", json.dumps(spec)]   # `moetailor bench vllm`'s worker, stock row
    run = subprocess.run(cmd, env={**os.environ, "VLLM_PLUGINS": ""}, capture_output=True, text=True)
    line = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
    if run.returncode != 0 or not line:
        raise SystemExit(f"vLLM run failed (exit {run.returncode}): {run.stderr[-2000:]}")
    return {int(b): r["decode_tok_s"] for b, r in json.loads(line[-1][len("RESULT "):])["stock"].items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="reference")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--decode-plan", default=None, help="also run the engine with this plan's decode policy")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per side and batch (the fastest is kept)")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM even when .venv-vllm exists")
    ap.add_argument("--compile", action="store_true", help="also run the engine with torch.compile'd decode steps")
    ap.add_argument("--out", default="build/engine_vs_hf")
    args = ap.parse_args()

    from moetailor.serving import LLM
    from moetailor.models.loading import load_model, load_tokenizer
    from moetailor.plans.plan import Plan
    from moetailor.bench.page import Table, write_tables
    from moetailor.tables import print_table

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    hf_model = load_model(args.model)
    n = max(args.batch)
    engines = {"engine": LLM(args.model, max_num_seqs=n),
               "engine, torch ops": LLM(args.model, max_num_seqs=n, native_kernels=False),
               "engine, bf16 decode experts": LLM(args.model, max_num_seqs=n, decode_expert_dtype=torch.bfloat16),
               "engine, bf16 model": LLM(args.model, max_num_seqs=n, dtype=torch.bfloat16)}
    if args.compile:
        engines["engine, compiled decode"] = LLM(args.model, max_num_seqs=n, compile_decode=True)
    if args.decode_plan:
        plan = Plan.load(args.decode_plan)
        engines["engine + decode plan"] = LLM(args.model, plan.with_phases(decode=plan.decode), max_num_seqs=n)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts_all = heldout_prompts(tokenizer, n, args.prompt_len)
    for llm in engines.values():                                                     # warm-up
        engine_decode(llm, prompts_all[:2], 4, 1)
    hf_decode(hf_model, prompts_all[:2], 4, pad, 1)

    rows = {b: {} for b in args.batch}
    for b in args.batch:
        prompts = prompts_all[:b]
        rows[b]["transformers"], hf_out = hf_decode(hf_model, prompts, args.new_tokens, pad, args.repeats)
        for name, llm in engines.items():
            tok_s, out, distinct = engine_decode(llm, prompts, args.new_tokens, args.repeats)
            rows[b][name] = tok_s
            if name == "engine":
                rows[b]["identical"] = f"{sum(a == h for a, h in zip(out, hf_out))}/{b}"
                rows[b]["distinct"] = distinct
        print(json.dumps({"batch": b, **{k: round(v, 1) if isinstance(v, float) else v for k, v in rows[b].items()}}),
              flush=True)
    vllm_python = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
    sides = ["transformers", *engines]
    if vllm_python.exists() and not args.no_vllm:
        for dtype in ("float32", "bfloat16"):
            for b, tok_s in vllm_decode(vllm_python, args.model, args.batch, args.prompt_len, args.new_tokens, dtype,
                                        args.repeats, Path(args.out) / f"vllm-{dtype}").items():
                rows[b][f"vLLM {dtype}"] = tok_s
            sides.append(f"vLLM {dtype}")
    table = [(b, *(f"{rows[b][s]:.0f}" for s in sides), f"{rows[b]['engine'] / rows[b]['transformers']:.2f}x",
              *([f"{rows[b]['engine'] / rows[b]['vLLM float32']:.2f}x"] if "vLLM float32" in rows[b] else []),
              rows[b]["identical"], f"{rows[b]['distinct']:.1f}") for b in args.batch]
    heads = ["batch", *(f"{s} tok/s" for s in sides), "engine / transformers",
             *(["engine / vLLM fp32"] if "vLLM float32" in sides else []), "identical greedy (engine vs HF)",
             "distinct experts/layer/step"]
    title = (f"decode tok/s, {args.model}, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
             f"{torch.get_num_threads()} threads")
    print_table(title, heads, table)
    write_tables(Path(args.out) / "results.json", [Table(title, heads, table)], command=" ".join(sys.argv),
                 load=os.getloadavg(), threads=torch.get_num_threads(), rows=rows)


if __name__ == "__main__":
    main()
