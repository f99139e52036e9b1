"""Calibration text: a data spec -> a deterministic stream of token windows.

Specs (``--data``):
  ``tasks``                 the task-suite mixture, drawn from the TRAINING rng stream with a seed offset
                            (``training_rng(TASK_SEED_OFFSET + seed)``), so it is neither the evaluation
                            stream nor the exact sequences the reference model was trained on;
  ``text``                  the bundled calibration documents of every text domain;
  ``text:dom1,dom2``        the bundled calibration documents of the named domains;
  ``mix``                   tasks and text, alternating by a seeded coin (half each);
  ``path/to/file.jsonl``    one JSON object per line with a "text" field;
  ``path/to/file.txt``      plain text, cut into ~3 KB documents at line boundaries.

Documents are tokenized without special tokens, joined with EOS and packed into windows of
``seq_len`` tokens (windows cross document boundaries, as in training). When a finite source is
exhausted it starts again from its first document, so any token count can be reached.
Reused by distillation and evaluation (next-token KL on calibration text).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

TASK_SEED_OFFSET = 7_000_003  # training stream, but far from the seeds training and the tokenizer used


@dataclass(frozen=True)
class DataSpec:
    kind: str                       # "tasks" | "text" | "mix" | "file"
    domains: tuple[str, ...] = ()   # for "text"/"mix": empty = all domains
    path: Path | None = None        # for "file"

    def __str__(self) -> str:
        if self.kind == "file":
            return str(self.path)
        if self.domains:
            return f"{self.kind}:{','.join(self.domains)}"
        return self.kind


def parse_data_spec(spec: str | DataSpec) -> DataSpec:
    """Validate a ``--data`` spec (see the module docstring) and return it parsed."""
    from ..data.corpus import DOMAIN_NAMES

    if isinstance(spec, DataSpec):
        return spec
    head, _, tail = str(spec).partition(":")
    if head in ("tasks", "text", "mix") and not (head == "tasks" and tail):
        domains = tuple(d.strip() for d in tail.split(",") if d.strip()) if tail else ()
        unknown = [d for d in domains if d not in DOMAIN_NAMES]
        if unknown:
            raise ValueError(f"unknown text domain(s) {unknown} in --data {spec!r}; valid domains: "
                             f"{', '.join(DOMAIN_NAMES)}")
        return DataSpec(head, domains)
    path = Path(spec)
    if path.suffix in (".jsonl", ".txt"):
        if not path.is_file():
            raise FileNotFoundError(f"calibration data file {path} does not exist")
        return DataSpec("file", (), path)
    raise ValueError(f"--data {spec!r} is not understood; use 'tasks', 'text', 'text:DOMAIN[,DOMAIN]', 'mix', "
                     "or a path to a .jsonl (one {\"text\": ...} per line) or .txt file")


def data_file(spec: str | DataSpec) -> Path | None:
    """The file a ``--data`` spec reads, or None for the bundled data (an input no output may replace)."""
    spec = parse_data_spec(spec)
    return spec.path if spec.kind == "file" else None


def _task_documents(seed: int) -> Iterator[str]:
    from ..data.tasks import TASKS, training_rng

    rng = training_rng(TASK_SEED_OFFSET + seed)
    tasks = list(TASKS.values())
    while True:
        task = rng.choice(tasks)
        ex = task.generate(rng, rng.choice(task.difficulties))
        yield ex.prompt + ex.completion


def _cycle(docs: list[str], what: str) -> Iterator[str]:
    if not docs:
        raise ValueError(f"{what} holds no text")
    while True:
        yield from docs


def _text_documents(domains: tuple[str, ...], seed: int) -> Iterator[str]:
    """Bundled calibration documents, domains interleaved round-robin, each shuffled by the seed."""
    from ..data.corpus import bundled_documents

    per_domain = bundled_documents("calibration", list(domains) or None)
    rng = random.Random(f"calibration-text:{seed}")
    docs: list[str] = []
    lists = []
    for name in sorted(per_domain):
        d = list(per_domain[name])
        rng.shuffle(d)
        lists.append(d)
    for i in range(max(len(d) for d in lists)):
        docs += [d[i] for d in lists if i < len(d)]
    return _cycle(docs, "the bundled calibration text")


def _file_documents(path: Path) -> Iterator[str]:
    if path.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(path.read_text("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {n} is not valid JSON ({e}); a .jsonl file needs one "
                                 "{\"text\": ...} object per line") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"{path} line {n} has no string field \"text\"; each line must be "
                                 "{\"text\": \"...\"}")
            docs.append(row["text"])
    else:
        from ..data.corpus import _chunks
        docs = list(_chunks(path.read_text("utf-8", "replace")))
    return _cycle([d for d in docs if d.strip()], f"calibration file {path}")


def iter_documents(spec: str | DataSpec, seed: int = 0) -> Iterator[str]:
    """An endless, deterministic stream of documents for ``spec``."""
    spec = parse_data_spec(spec)
    if spec.kind == "tasks":
        return _task_documents(seed)
    if spec.kind == "text":
        return _text_documents(spec.domains, seed)
    if spec.kind == "file":
        return _file_documents(spec.path)
    return _mix(_task_documents(seed), _text_documents(spec.domains, seed), random.Random(f"mix:{seed}"))


def _mix(tasks: Iterator[str], text: Iterator[str], rng: random.Random) -> Iterator[str]:
    while True:
        yield next(tasks) if rng.random() < 0.5 else next(text)


def iter_token_windows(tokenizer, spec: str | DataSpec, tokens: int, seq_len: int = 512,
                       seed: int = 0) -> Iterator[list[int]]:
    """Windows of ``seq_len`` token ids (the last one shorter) totalling exactly ``tokens``."""
    if tokens < 1:
        raise ValueError(f"--tokens must be at least 1 (got {tokens})")
    if seq_len < 1:
        raise ValueError(f"sequence length must be at least 1 (got {seq_len})")
    eos = tokenizer.eos_token_id
    buf: list[int] = []
    left = tokens
    for doc in iter_documents(spec, seed):
        buf += tokenizer(doc, add_special_tokens=False)["input_ids"]
        if eos is not None:
            buf.append(eos)
        while len(buf) >= min(seq_len, left):
            n = min(seq_len, left)
            yield buf[:n]
            buf = buf[n:]
            left -= n
            if left == 0:
                return


def iter_token_batches(tokenizer, spec: str | DataSpec, tokens: int, batch_tokens: int = 4096,
                       seq_len: int = 512, seed: int = 0):
    """Batches ``LongTensor [B, S]`` of equal-length windows, about ``batch_tokens`` tokens each."""
    import torch

    if batch_tokens < 1:
        raise ValueError(f"--batch-tokens must be at least 1 (got {batch_tokens})")
    seq_len = min(seq_len, batch_tokens)
    rows: list[list[int]] = []
    for window in iter_token_windows(tokenizer, spec, tokens, seq_len, seed):
        if rows and (len(window) != len(rows[0]) or (len(rows) + 1) * len(window) > batch_tokens):
            yield torch.tensor(rows, dtype=torch.long)
            rows = []
        rows.append(window)
    if rows:
        yield torch.tensor(rows, dtype=torch.long)
