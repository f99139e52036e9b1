"""The contract every task obeys: a seeded generator and an exact-match scorer.

A task turns (rng, difficulty) into a prompt and the completion the reference model was trained
to write: a step-by-step trace whose length grows with difficulty, then ``#### answer``. Scoring
reads only the text after the last answer marker, so a model that reasons differently but lands
on the right answer still scores.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

ANSWER_MARKER = "####"


@dataclass(frozen=True)
class Example:
    task: str
    difficulty: int
    prompt: str
    completion: str  # trace + "#### answer" (the end-of-sequence token is added by the tokenizer side)
    answer: str

    def is_correct(self, output: str) -> bool:
        """Exact match of the extracted answer against the generator's answer."""
        return extract_answer(output) == self.answer


@dataclass(frozen=True)
class Task:
    name: str
    generate: Callable[[random.Random, int], Example]
    difficulties: tuple[int, ...]  # the difficulties the reference model was trained on
    description: str


def extract_answer(text: str) -> str | None:
    """Text after the last answer marker, stripped; None when the marker is missing."""
    if ANSWER_MARKER not in text:
        return None
    return text.rsplit(ANSWER_MARKER, 1)[1].strip()


def score(example: Example, output: str) -> bool:
    """Whether ``output`` answers ``example`` (built-in tasks: exact match after the answer marker;
    user tasks: their own match rule)."""
    return example.is_correct(output)


def make_example(task: str, difficulty: int, prompt: str, trace: list[str], answer: str) -> Example:
    lines = [*trace, f"{ANSWER_MARKER} {answer}"]
    return Example(task, difficulty, prompt, "\n".join(lines), answer)
