"""Writes the lm-evaluation-harness tasks' data from the bundled task suite (held-out seed stream):

* ``addition.jsonl``: generation; each line is also a ``moetailor eval --tasks`` line (prompt,
  answer, match rule), so the same file scores through the engine and through lm-eval;
* ``reverse_mc.jsonl``: multiple choice; the context is the prompt and the answer marker, the
  choices the right answer (reversed, or copied for ``copy`` prompts) and three near misses (that
  answer reversed, or two neighbouring letters swapped).

Run ``python -m moetailor.eval.lm_eval_tasks.build`` to regenerate (the output is deterministic).
"""
from __future__ import annotations

import json
from pathlib import Path

from ...data.tasks import ANSWER_MARKER, TASKS, eval_examples

HERE = Path(__file__).resolve().parent
N = 40          # prompts per task: enough for a quick check through a server, small enough for a test
SEED = 0


def addition_lines(n: int = N) -> list[dict]:
    return [{"prompt": ex.prompt, "answer": ex.answer, "match": "regex", "pattern": f"{ANSWER_MARKER} (\\S+)"}
            for ex in eval_examples(TASKS["addition"], n, SEED)]


def _near_misses(answer: list[str]) -> list[list[str]]:
    """Three wrong orders close to ``answer``: unreversed, first two swapped, last two swapped (then rotations)."""
    candidates = [answer[::-1], [answer[1], answer[0], *answer[2:]], [*answer[:-2], answer[-1], answer[-2]]]
    candidates += [answer[i:] + answer[:i] for i in range(1, len(answer))]
    out: list[list[str]] = []
    for c in candidates:
        if c != answer and c not in out:
            out.append(c)
    return out[:3]


def reverse_mc_lines(n: int = N) -> list[dict]:
    lines = []
    for i, ex in enumerate(e for e in eval_examples(TASKS["reverse"], 4 * n, SEED) if len(e.answer.split()) >= 3):
        if len(lines) == n:
            break
        answer = ex.answer.split()
        wrong = _near_misses(answer)
        if len(wrong) < 3:
            continue
        label = i % 4                                        # the right choice at every position in turn
        choices = [" ".join(c) for c in wrong]
        choices.insert(label, ex.answer)
        lines.append({"prompt": ex.prompt, "choices": choices, "label": label})
    return lines


def write(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    write(HERE / "addition.jsonl", addition_lines())
    write(HERE / "reverse_mc.jsonl", reverse_mc_lines())
    print(f"wrote {HERE / 'addition.jsonl'} and {HERE / 'reverse_mc.jsonl'}")
