"""Helpers of the vLLM integration tests (real vLLM CPU build, real bundled model).

These tests run in the separate vLLM environment (`make setup-vllm`, then `make test-vllm`); in
moetailor's main environment every module that starts vLLM skips, saying so (test_vllm_fingerprint.py
imports no vLLM and runs in both).
"""
from __future__ import annotations

import contextlib
import gc
import time
from pathlib import Path

BUNDLED_PLAN = Path(__file__).resolve().parents[3] / "src" / "moetailor" / "assets" / "plans" / "reference-reap-50.json"
SKIP_REASON = "vLLM is not installed in this environment: run `make setup-vllm` then `make test-vllm` (uses .venv-vllm)"
MAX_TOKENS = 40


def task_prompts(per_task: int = 2) -> list[str]:
    from moetailor.data.tasks import TASKS, eval_examples

    return [ex.prompt for task in TASKS.values() for ex in eval_examples(task, per_task, seed=0)]


@contextlib.contextmanager
def vllm_engine(**kwargs):
    """A vLLM offline engine, shut down on exit (one start-up at a time keeps memory small)."""
    from vllm import LLM

    llm = LLM(**{"max_model_len": 512, "disable_log_stats": True, "seed": 0, **kwargs})
    try:
        yield llm
    finally:
        # vLLM 0.32's engine core can miss a SIGTERM that lands while its main thread goes from its last
        # request to blocking on its input queue (CPython runs the handler at the next bytecode, and a
        # blocked thread runs none): it then sits out the whole timeout and is killed with its workers,
        # so an observing engine writes nothing at shutdown. An idle engine core takes the signal.
        time.sleep(1)
        # vLLM force-kills an engine core that has not stopped 5 s after SIGTERM unless given longer; an
        # observing engine writes its statistics while it stops, which a busy 2-core machine can take past 5 s
        llm.llm_engine.engine_core.shutdown(timeout=60)
        del llm
        gc.collect()


def vllm_token_ids(llm, prompts, extra_args: list[dict | None] | None = None, max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    extra_args = extra_args or [None] * len(prompts)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=e) for e in extra_args]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def engine_token_ids(plan, prompts, expert_top_k: list[int | None] | None = None, max_tokens: int = MAX_TOKENS):
    """moetailor's own engine, fp32 greedy: the reference every vLLM output must equal."""
    from moetailor.serving import LLM, SamplingParams

    llm = LLM("reference", plan)
    ks = expert_top_k or [None] * len(prompts)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, expert_top_k=k) for k in ks]
    return [list(o.token_ids) for o in llm.generate(prompts, params)]
