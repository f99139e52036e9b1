"""Decode throughput: llama.cpp beside moetailor's engine on the same weights, one run (.venv-llamacpp).

    flock /tmp/moetailor-heavy.lock .venv-llamacpp/bin/python scripts/llamacpp_vs_engine.py --batch 1 8 32
    ... --model build/olmoe4 --dtype bf16 --prompt-len 32 --new-tokens 16   # a real-size bf16 checkpoint

Both sides run the same function: the bundled model's weights with norm_topk_prob=false (llama.cpp's
qwen2moe graph never renormalises the top-k weights, so the engine loads a copy of the checkpoint whose
config says so), f32 on both sides, the GGUF written by `moetailor export gguf`. With ``--plan`` the
same again for the checkpoint pruned to the plan's decode experts (`moetailor prune`, then exported).
With ``--model`` another checkpoint (e.g. `moetailor synth olmoe-1b-7b --layers 4`), and with ``--dtype bf16``
both sides read bf16 weights: the engine loads them as stored (bf16 activations, fp32 sums), llama.cpp a bf16
GGUF (fp32 activations): the functions differ in rounding only, so greedy outputs may part after a few tokens.
Decode throughput is measured as scripts/engine_vs_hf.py does: B * (N - 1) / (t(N) - t(1)), the time of
an N-token greedy generation minus a 1-token one (prefill only), best of ``--repeats`` rounds, EOS ignored;
the rounds alternate engine and llama.cpp (this machine's speed drifts by 2x within minutes), and the
median of the per-round llama.cpp / engine ratios is printed beside the ratio of the bests, with each
side's median tok/s and every round's pair in the JSON lines. Read the medians: t(N) - t(1) of two
generations that a spell falls between can come out far too small, and a best-of keeps exactly that.
llama.cpp runs the B sequences together in one context (``BatchedDecoder``: one ``llama_decode`` per
step, one seq_id per sequence; llama-cpp-python's ``Llama`` itself decodes one sequence at a time).
Greedy outputs of the two sides are compared token for token.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_vs_hf import engine_decode, heldout_prompts   # noqa: E402


def llamacpp_decode(decoder, prompts, new_tokens: int, repeats: int) -> tuple[float, list[list[int]]]:
    best, outs = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        decoder.generate(prompts, 1)
        t1 = time.perf_counter()
        outs = decoder.generate(prompts, new_tokens)
        best = min(best, (time.perf_counter() - t1) - (t1 - t0))
    return len(prompts) * (new_tokens - 1) / best, outs


def unnormalised_copy(source: Path, dest: Path) -> Path:
    """``source`` with norm_topk_prob=false (weights linked): the function llama.cpp computes from them."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        target = dest / f.name
        if target.exists() or target.is_symlink():
            target.unlink()
        if f.name == "config.json":
            target.write_text(json.dumps({**json.loads(f.read_text()), "norm_topk_prob": False}, indent=1))
        elif f.is_file():
            target.symlink_to(f.resolve())
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--plan", default=None, help="also compare the checkpoint pruned to this plan's decode experts")
    ap.add_argument("--model", default="reference", help="checkpoint (default: the bundled model)")
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32", help="weights on both sides")
    ap.add_argument("--compile-decode", action="store_true", help="the engine's decode steps through torch.compile")
    ap.add_argument("--out", default="build/llamacpp_vs_engine")
    args = ap.parse_args()

    from moetailor.cli.main import main as cli
    from moetailor.serving import LLM
    from moetailor.integrations.llamacpp import BatchedDecoder, load
    from moetailor.models.loading import load_tokenizer, resolve_model_path
    from moetailor.bench.page import Table, write_tables
    from moetailor.tables import print_table

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = Path(args.model).name
    models = {"full": unnormalised_copy(resolve_model_path(args.model), out / f"{name}-unnormalised")}
    if args.plan:
        pruned = out / f"{name}-pruned"
        assert cli(["prune", args.model, args.plan, "--out", str(pruned), "--overwrite"]) == 0
        models["pruned"] = unnormalised_copy(pruned, out / f"{name}-pruned-unnormalised")
    n = max(args.batch)
    tokenizer = load_tokenizer(str(models["full"]))
    prompts_all = heldout_prompts(tokenizer, n, args.prompt_len)
    n_ctx = n * (args.prompt_len + args.new_tokens) + 16
    rows = []
    for name, path in models.items():
        gguf = out / f"{path.name}-{args.dtype}.gguf"
        if not gguf.exists() or gguf.stat().st_mtime < max(f.stat().st_mtime for f in path.iterdir()):
            assert cli(["export", "gguf", str(path), "--out", str(gguf), "--outtype", args.dtype, "--overwrite"]) == 0
        engine = LLM(str(path), max_num_seqs=n, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32,
                     max_model_len=args.prompt_len + args.new_tokens + 8, compile_decode=args.compile_decode)
        llm = load(gguf, n_threads=args.threads)
        with BatchedDecoder(llm, max_seqs=n, n_ctx=n_ctx, n_threads=args.threads) as decoder:
            engine_decode(engine, prompts_all[:1], 4, 1)                    # warm-up (compiled: batch 1
            engine_decode(engine, prompts_all[:2], 4, 1)                    # and the dynamic-shape graph)
            llamacpp_decode(decoder, prompts_all[:2], 4, 1)
            for b in args.batch:
                prompts = prompts_all[:b]
                load_avg = os.getloadavg()[0]
                rounds = []                                                 # (engine, llama.cpp) tok/s, side by side
                for _ in range(args.repeats):                               # interleaved: a slow spell hits both
                    e_tok_s, e_out, _ = engine_decode(engine, prompts, args.new_tokens, 1)
                    l_tok_s, l_out = llamacpp_decode(decoder, prompts, args.new_tokens, 1)
                    rounds.append((e_tok_s, l_tok_s))
                same = sum(list(a) == list(b_) for a, b_ in zip(e_out, l_out))
                ratios = sorted(l / e for e, l in rounds)
                ours = sorted(e / l for e, l in rounds)
                row = {"model": name, "batch": b, "engine": max(e for e, _ in rounds),
                       "llama.cpp": max(l for _, l in rounds), "median round ratio": ratios[len(ratios) // 2],
                       "median round engine / llama.cpp": ours[len(ours) // 2],
                       "engine median": statistics.median(e for e, _ in rounds),
                       "llama.cpp median": statistics.median(l for _, l in rounds),
                       "identical": f"{same}/{b}", "load": load_avg,
                       "rounds": [[round(e, 1), round(l, 1)] for e, l in rounds]}   # a spell shows here
                print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
                rows.append(row)
        del llm, engine
    title = (f"decode tok/s, {args.model} (norm_topk_prob=false), {args.dtype}, {args.prompt_len}-token prompts, "
             f"{args.new_tokens} new tokens, {args.threads} threads, {args.repeats} rounds")
    heads = ["model", "batch", "engine tok/s", "llama.cpp tok/s", "engine / llama.cpp", "median tok/s (engine / llama.cpp)",
             "median round (engine / llama.cpp)", "identical greedy", "load"]
    table = [(r["model"], r["batch"], f"{r['engine']:.0f}", f"{r['llama.cpp']:.0f}",
              f"{r['engine'] / r['llama.cpp']:.2f}x", f"{r['engine median']:.0f} / {r['llama.cpp median']:.0f}",
              f"{r['median round engine / llama.cpp']:.2f}x", r["identical"], f"{r['load']:.2f}") for r in rows]
    print_table(title, heads, table)
    write_tables(out / "results.json", [Table(title, heads, table)], command=" ".join(sys.argv), rows=rows)


if __name__ == "__main__":
    main()
