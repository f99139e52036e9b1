"""Helpers of the llama.cpp integration tests (real llama.cpp through llama-cpp-python, real bundled model).

These tests run in llama.cpp's environment (`make setup-llamacpp`, then `make test-llamacpp`); in
moetailor's main environment every module here skips, saying so.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ASSETS = ROOT / "src" / "moetailor" / "assets"
BUNDLED_PLAN = ASSETS / "plans" / "reference-reap-50.json"
SKIP_REASON = ("llama-cpp-python is not installed in this environment: run `make setup-llamacpp` then "
               "`make test-llamacpp` (uses .venv-llamacpp)")
MAX_TOKENS = 24
TOLERANCE = 1e-3     # f32 GGUF against the fp32 engine: last-token logits / log-probabilities


def task_prompts(per_task: int = 2) -> list[str]:
    from moetailor.data.tasks import TASKS, eval_examples

    return [ex.prompt for task in TASKS.values() for ex in eval_examples(task, per_task, seed=0)]


def heldout_texts(chars: int = 1500) -> list[str]:
    """The start of the first held-out text of every bundled domain (code, prose, dictionaries...)."""
    root = ASSETS.parent / "data" / "bundled" / "heldout"
    return [json.loads(p.read_text().splitlines()[0])["text"][:chars] for p in sorted(root.glob("*.jsonl"))]


def with_config(source: Path, dest: Path, **changes) -> Path:
    """A copy of checkpoint ``source`` (weights linked, not copied) whose config.json has ``changes``."""
    dest.mkdir(parents=True)
    for f in source.iterdir():
        if f.name == "config.json":
            config = json.loads(f.read_text())
            config.update(changes)
            (dest / f.name).write_text(json.dumps(config, indent=1))
        elif f.is_file():
            (dest / f.name).symlink_to(f.resolve())
    return dest


def copy_bundled_tokenizer(dest: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(ASSETS / "reference" / name, dest / name)


def engine_run(llm, prompts, max_tokens: int = MAX_TOKENS, expert_top_k: int | None = None):
    """Greedy ids and the first token's top-20 log-probabilities (from the prompt's last logits)."""
    from moetailor.serving import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=20, expert_top_k=expert_top_k)
    outs = llm.generate(prompts, params)
    return [list(o.token_ids) for o in outs], [o.logprobs[0] for o in outs], [list(o.prompt_token_ids) for o in outs]


def log_softmax(logits):
    import numpy as np

    x = logits.astype(np.float64)
    return x - (np.log(np.exp(x - x.max()).sum()) + x.max())


def top_logprob_gap(first, llama_logits) -> float:
    """Largest |engine logprob - llama.cpp logprob| over the engine's top-20 ids of one position."""
    lp = log_softmax(llama_logits)
    pairs = [(first.token_id, first.logprob)] + [(t, v) for t, v in first.top]
    return max(abs(float(lp[t]) - float(v)) for t, v in pairs)
