"""Decode throughput: the moetailor engine vs transformers `generate`, same prompts, one run.

    nice -n 15 .venv/bin/python scripts/engine_vs_hf.py --model reference --batch 1 8 32

For each batch size both sides get the same B prompts (held-out text, ``--prompt-len`` tokens) and
generate ``--new-tokens`` tokens greedily with EOS ignored. transformers: a fresh model object,
left-padded batch, stock experts implementation; decode throughput = B * (N - 1) / (t(N) - t(1)),
i.e. generate time minus a prefill-only generate. Engine: decode tokens / seconds of decode steps
from ``llm.step_log``; "e2e" counts all tokens over the whole generate call. Greedy outputs are
compared token for token (they agree up to floating-point ties between padded and packed batches).
"""
from __future__ import annotations

import argparse
import json
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


def hf_decode(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> tuple[float, float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])             # [B, L] left padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=pad_id)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        t2 = time.perf_counter()
    decode_s = (t2 - t1) - (t1 - t0)
    return len(prompts) * (new_tokens - 1) / decode_s, len(prompts) * new_tokens / (t2 - t1), out[:, width:].tolist()


def engine_decode(llm, prompts, new_tokens: int) -> tuple[float, float, list[list[int]], float]:
    from moetailor.engine import SamplingParams

    llm.step_log.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    total = time.perf_counter() - t0
    decode = [r for r in llm.step_log if r.phase == "decode"]
    tok_s = sum(r.num_seqs for r in decode) / sum(r.seconds for r in decode)
    distinct = sum(sum(r.distinct_experts.values()) / len(r.distinct_experts) for r in decode) / len(decode)
    return tok_s, len(prompts) * new_tokens / total, [o.token_ids for o in outs], distinct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="reference")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--decode-plan", default=None, help="also run the engine with this plan's decode policy")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    from moetailor.engine import LLM
    from moetailor.models.loading import load_model, load_tokenizer
    from moetailor.plans.plan import Plan

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    hf_model = load_model(args.model)
    llm = LLM(args.model, max_num_seqs=max(args.batch))
    planned = None
    if args.decode_plan:
        plan = Plan.load(args.decode_plan)
        planned = LLM(args.model, plan.with_phases(decode=plan.decode), max_num_seqs=max(args.batch))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts_all = heldout_prompts(tokenizer, max(args.batch), args.prompt_len)
    engine_decode(llm, prompts_all[:2], 4)                                               # warm-up
    hf_decode(hf_model, prompts_all[:2], 4, pad)

    rows = []
    for b in args.batch:
        prompts = prompts_all[:b]
        hf_tok_s, hf_e2e, hf_out = hf_decode(hf_model, prompts, args.new_tokens, pad)
        en_tok_s, en_e2e, en_out, distinct = engine_decode(llm, prompts, args.new_tokens)
        same = sum(a == h for a, h in zip(en_out, hf_out))
        row = {"batch": b, "hf_decode_tok_s": hf_tok_s, "engine_decode_tok_s": en_tok_s, "speedup": en_tok_s / hf_tok_s,
               "hf_e2e_tok_s": hf_e2e, "engine_e2e_tok_s": en_e2e, "identical_outputs": f"{same}/{b}",
               "distinct_experts": distinct}
        if planned is not None:
            p_tok_s, _, _, p_distinct = engine_decode(planned, prompts, args.new_tokens)
            row.update(plan_decode_tok_s=p_tok_s, plan_distinct_experts=p_distinct)
        rows.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)

    cols = ["batch", "transformers decode tok/s", "engine decode tok/s", "speedup", "transformers e2e tok/s",
            "engine e2e tok/s", "identical greedy outputs", "distinct experts/layer/step"]
    if planned is not None:
        cols += ["engine + decode plan tok/s", "plan distinct experts"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        vals = [r["batch"], f"{r['hf_decode_tok_s']:.0f}", f"{r['engine_decode_tok_s']:.0f}", f"{r['speedup']:.2f}x",
                f"{r['hf_e2e_tok_s']:.0f}", f"{r['engine_e2e_tok_s']:.0f}", r["identical_outputs"],
                f"{r['distinct_experts']:.1f}"]
        if planned is not None:
            vals += [f"{r['plan_decode_tok_s']:.0f}", f"{r['plan_distinct_experts']:.1f}"]
        print("| " + " | ".join(map(str, vals)) + " |")


if __name__ == "__main__":
    main()
