"""Start the disaggregated vLLM pair N times and run generate_pair on it, to count decode-instance
crashes (.venv-vllm). The evidence behind ``disagg.DECODE_EAGER``.

    VLLM_CPU_CI_ENV=1 .venv-vllm/bin/python scripts/vllm_pair_crash.py --runs 4 --traced
    VLLM_CPU_CI_ENV=1 .venv-vllm/bin/python scripts/vllm_pair_crash.py --runs 4 --traced --no-plugin
    VLLM_CPU_CI_ENV=1 .venv-vllm/bin/python scripts/vllm_pair_crash.py --runs 4        # decode eager (default)

Measured 2026-12-02 on 2 cores (the bundled model, its 50% plan pruned, 12 task prompts x 3
rounds per start, CI's trace-once mode): traced with the plugin 5 of 9 starts crashed (4 of 5
with the routing traced inline, 1 of 4 with it as one opaque op; a segfault inside oneDNN's
matmul, glibc "corrupted double-linked list", or a tensor size mismatch), traced without the
plugin 0 of 4, decode eager 0 of 7.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations" / "vllm"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--traced", action="store_true", help="decode instance in vLLM's default traced mode")
    ap.add_argument("--no-plugin", action="store_true", help="decode instance without moetailor's plugin")
    ap.add_argument("--out", default="build/vllm-pair-crash")
    args = ap.parse_args()

    from vllm import SamplingParams
    from vllm_helpers import BUNDLED_PLAN, MAX_TOKENS, task_prompts, vllm_engine

    from moetailor.integrations.vllm.disagg import generate_pair, pair_kwargs
    from moetailor.models import load_tokenizer
    from moetailor.transforms import prune_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pruned = out / "pruned"
    if not (pruned / "config.json").exists():
        prune_checkpoint("reference", BUNDLED_PLAN, pruned, overwrite=True)
    tok = load_tokenizer("reference")
    ids = [tok.encode(p) for p in task_prompts()]
    failed = 0
    for i in range(args.runs):
        prefill, decode = pair_kwargs("reference", pruned, out / f"kv{i}-{os.getpid()}", kv_cache_mib=128,
                                      max_num_seqs=8, decode_eager=not args.traced)
        t0 = time.time()
        try:
            with contextlib.ExitStack() as stack:
                p = stack.enter_context(vllm_engine(**prefill))
                saved = os.environ.get("VLLM_PLUGINS")
                if args.no_plugin:
                    os.environ["VLLM_PLUGINS"] = ""   # the decode engine's processes start without the plugin
                d = stack.enter_context(vllm_engine(**decode))
                if saved is None:
                    os.environ.pop("VLLM_PLUGINS", None)
                else:
                    os.environ["VLLM_PLUGINS"] = saved
                for _ in range(3):
                    generate_pair(p, d, ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
            print(f"start {i}: ok ({time.time() - t0:.0f} s)", flush=True)
        except Exception as e:   # the decode engine died: report and start the next pair
            failed += 1
            print(f"start {i}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    print(f"{failed} of {args.runs} starts failed")


if __name__ == "__main__":
    main()
