"""The vLLM pair on NIXL with a decode KV cache small enough that vLLM preempts: does the pair finish,
how many decode requests were preempted, and how many outputs differ from moetailor's phase-aware
engine?

    flock /tmp/moetailor-heavy.lock env VLLM_CPU_CI_ENV=1 .venv-vllm/bin/python scripts/nixl_preemption.py \
        [--blocks 7] [--new-tokens 120]

Why: NixlConnector pulls a prompt's KV once; a request vLLM preempts afterwards is recomputed from
its tokens on the decode instance, i.e. its prompt on the pruned model, no longer the phase-aware
schedule (MoetailorConnector reloads the stored prompt KV instead: tests/integrations/vllm/
test_vllm_preemption.py). The decode model keeps a quarter of the experts (the bundled 50% plan
leaves these prompts' outputs unchanged, so a recompute could not show). Run it again with
``--blocks 40`` (nothing preempted) to see that the differences come from the preemption.
Needs ``make setup-vllm-nixl``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

BLOCK_SIZE = 32          # the CPU attention backend takes multiples of 32
MAX_MODEL_LEN = 192      # prompts of up to 53 tokens + 120 new; vLLM keeps one block aside, so 7 blocks hold it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=7, help="the decode instance's KV blocks of 32 tokens")
    ap.add_argument("--new-tokens", type=int, default=120)
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN, help="both instances' max_model_len")
    args = ap.parse_args()
    if args.blocks * BLOCK_SIZE < args.max_model_len + BLOCK_SIZE:
        ap.error(f"--blocks must be at least {args.max_model_len // BLOCK_SIZE + 1}: vLLM refuses a cache that cannot "
                 f"hold one request of {args.max_model_len} tokens")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations" / "vllm"))
    from vllm import SamplingParams
    from vllm_helpers import BUNDLED_PLAN, engine_token_ids, task_prompts, vllm_engine

    from moetailor.engine import LLM
    from moetailor.integrations.vllm import nixl
    from moetailor.plans import Plan
    from moetailor.transforms import prune_checkpoint

    nixl.require_nixl()
    tmp = Path(tempfile.mkdtemp(prefix="moetailor-nixl-preemption-"))
    plan = json.loads(BUNDLED_PLAN.read_text())
    for layer in plan["decode"].values():
        layer["keep"] = layer["keep"][:16]                  # a quarter of 64
    (tmp / "quarter.json").write_text(json.dumps(plan))
    pruned = prune_checkpoint("reference", tmp / "quarter.json", tmp / "pruned-25")
    ids = [LLM("reference").tokenizer.encode(p) for p in task_prompts()]
    expected = engine_token_ids(Plan.load(tmp / "quarter.json").phase_aware(), ids, max_tokens=args.new_tokens)

    prefill_kw, decode_kw = nixl.pair_kwargs("reference", pruned, kv_cache_mib=None, max_num_seqs=8,
                                             block_size=BLOCK_SIZE, max_model_len=args.max_model_len)
    prefill_kw.update(kv_cache_memory_bytes=64 << 20)
    decode_kw.update(kv_cache_memory_bytes=64 << 20, num_gpu_blocks_override=args.blocks, disable_log_stats=False)
    print(f"{len(ids)} prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, {args.new_tokens} new tokens, "
          f"decode instance: {args.blocks} blocks of {BLOCK_SIZE}", flush=True)
    with contextlib.ExitStack() as stack:
        engines = []
        for kw, port in ((prefill_kw, 5731), (decode_kw, 5741)):
            os.environ.update(nixl.side_channel_env(port))   # read by the engine-core process it starts
            engines.append(stack.enter_context(vllm_engine(**kw)))
        t0 = time.time()
        got = nixl.generate_pair(*engines, ids, SamplingParams(max_tokens=args.new_tokens, temperature=0.0))
        preempted = sum(m.value for m in engines[1].get_metrics() if m.name == "vllm:num_preemptions")
    differ = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    print(f"done in {time.time() - t0:.0f} s: {int(preempted)} preemptions on the decode instance; "
          f"{len(differ)} of {len(got)} outputs differ from the phase-aware engine (prompts {differ})", flush=True)


if __name__ == "__main__":
    main()
