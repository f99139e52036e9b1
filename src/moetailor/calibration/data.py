"""Calibration text: a ``--data`` spec (docs/plans.md lists them) -> a deterministic stream of token
windows. Documents are tokenized without special tokens, joined with EOS and packed into windows
that cross document boundaries, as in training. Reused by distillation and evaluation.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Iterator

from ..models.paths import is_bundled
from ..tables import unknown_choice

TASK_SEED_OFFSET = 7_000_003  # training stream, but far from the seeds training and the tokenizer used
REFERENCE_DEFAULT_DATA = "tasks"  # the bundled models' workload: their default calibration data


@dataclass(frozen=True)
class DataSpec:
    kind: str                       # "tasks" | "text" | "mix" | "mixture" | "file"
    domains: tuple[str, ...] = ()   # "tasks": task names; "text"/"mix": text domains; empty = all
    path: Path | None = None        # for "file"
    shares: tuple[tuple[str, float], ...] = ()   # for "mixture": (component, token share), shares sum to 1

    def __str__(self) -> str:
        if self.kind == "file":
            return str(self.path)
        if self.kind == "mixture":
            return "mixture:" + ",".join(f"{c}={s:g}" for c, s in self.shares)
        if self.domains:
            return f"{self.kind}:{','.join(self.domains)}"
        return self.kind

    @property
    def name(self) -> str:
        """A short name for reports and plans: the spec, or the file's name (never a machine path)."""
        return self.path.name if self.kind == "file" else str(self)


def default_data_spec(model: str, data: str | None, flag: str = "--data") -> str:
    """``data`` if given; for a bundled model (``reference``, ``reference-qwen3``) its task domain; otherwise an error:
    any other model must be calibrated on data the user names (its own traffic)."""
    if data:
        return data
    if is_bundled(model):
        return REFERENCE_DEFAULT_DATA
    raise ValueError(f"{flag} is required for {model!r}: calibrate on the traffic the model will serve, e.g. "
                     f"{flag} my-traffic.jsonl (lines with \"text\", \"prompt\"+\"completion\" or chat "
                     f"\"messages\"), {flag} notes.txt, or a bundled domain (tasks, text, text:DOMAIN, mix)")


def _component_names() -> tuple[list[str], list[str]]:
    from ..data.corpus import DOMAIN_NAMES
    from ..data.tasks import TASKS
    return list(TASKS), list(DOMAIN_NAMES)


def _parse_shares(tail: str, spec: str) -> tuple[tuple[str, float], ...]:
    tasks, domains = _component_names()
    valid = ["tasks", "text", *tasks, *domains]
    shares = []
    for part in [p.strip() for p in tail.split(",") if p.strip()]:
        name, eq, value = part.partition("=")
        try:
            share = float(value) if eq else float("nan")
        except ValueError:
            share = float("nan")
        if name not in valid or not share > 0:
            raise ValueError(f"--data {spec!r}: {part!r} is not COMPONENT=SHARE with a positive share; components: "
                             f"{', '.join(valid)}")
        shares.append((name, share))
    if len(shares) < 2:
        raise ValueError(f"--data {spec!r}: a mixture needs at least two components, e.g. mixture:tasks=0.7,text=0.3")
    total = sum(s for _, s in shares)
    return tuple((n, s / total) for n, s in shares)


def parse_data_spec(spec: str | DataSpec) -> DataSpec:
    """Validate a ``--data`` spec (docs/plans.md lists the forms) and return it parsed."""
    if isinstance(spec, DataSpec):
        return spec
    tasks, domain_names = _component_names()
    head, _, tail = str(spec).partition(":")
    if head == "mixture":
        return DataSpec("mixture", shares=_parse_shares(tail, str(spec)))
    if head in ("tasks", "text", "mix"):
        names = tuple(d.strip() for d in tail.split(",") if d.strip()) if tail else ()
        valid = tasks if head == "tasks" else domain_names
        unknown = [d for d in names if d not in valid]
        if unknown:
            what = "task" if head == "tasks" else "text domain"
            raise ValueError(f"--data {spec!r}: " + unknown_choice(what, ",".join(unknown), valid))
        return DataSpec(head, names)
    path = Path(spec)
    if path.suffix in (".jsonl", ".txt"):
        if not path.is_file():
            raise FileNotFoundError(f"calibration data file {path} does not exist")
        return DataSpec("file", (), path)
    raise ValueError(f"--data {spec!r} is not understood; use 'tasks', 'tasks:TASK[,TASK]', 'text', "
                     "'text:DOMAIN[,DOMAIN]', 'mix', 'mixture:tasks=0.7,text=0.3', or a path to a .jsonl "
                     "(\"text\", \"prompt\"+\"completion\" or chat \"messages\" per line) or .txt file")


def data_file(spec: str | DataSpec) -> Path | None:
    """The file a ``--data`` spec reads, or None for the bundled data (an input no output may replace)."""
    spec = parse_data_spec(spec)
    return spec.path if spec.kind == "file" else None


def _task_documents(seed: int, names: tuple[str, ...] = ()) -> Iterator[str]:
    from ..data.tasks import TASKS, training_rng

    rng = training_rng(TASK_SEED_OFFSET + seed)
    tasks = [TASKS[n] for n in names] if names else list(TASKS.values())
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
    lists = []
    for name in sorted(per_domain):
        d = list(per_domain[name])
        rng.shuffle(d)
        lists.append(d)
    docs = [d for row in zip_longest(*lists) for d in row if d is not None]
    return _cycle(docs, "the bundled calibration text")


def render_chat(messages, tokenizer, where: str) -> str:
    """Chat ``messages`` as the model sees them: the tokenizer's chat template, rendered to text."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                  and isinstance(m.get("role"), str) for m in messages):
        raise ValueError(f"{where}: \"messages\" must be a list of {{\"role\": ..., \"content\": \"...\"}} objects")
    if tokenizer is None:
        raise ValueError(f"{where}: chat \"messages\" need the model's tokenizer to render them")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: chat \"messages\" need a chat template, and this model's tokenizer has none; "
                         "render the conversations yourself and pass them as {\"text\": \"...\"} lines")
    return tokenizer.apply_chat_template(messages, tokenize=False)


def jsonl_document(row, tokenizer, where: str) -> str:
    """One line of a user JSONL file as calibration text: "text", "prompt"+"completion" or "messages"."""
    if isinstance(row, dict):
        if isinstance(row.get("text"), str):
            return row["text"]
        if isinstance(row.get("prompt"), str):
            completion = row.get("completion", "")
            if not isinstance(completion, str):
                raise ValueError(f"{where}: \"completion\" must be a string")
            return row["prompt"] + completion
        if "messages" in row:
            return render_chat(row["messages"], tokenizer, where)
    raise ValueError(f"{where} has none of the fields \"text\", \"prompt\" (+ \"completion\") or \"messages\"; "
                     "each line must be one JSON object with one of them")


def read_jsonl(path: str | Path, what: str = "task file",
               shape: str = '{"prompt": ..., "answer": ..., "match": ...}') -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSONL ``what``; ValueError naming the line
    that is not a JSON object (one like ``shape``). Task files and calibration files read alike."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist; give a JSONL file with one object per line")
    records = []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: each line must be a JSON object like {shape}, got "
                             + type(record).__name__)
        records.append((number, record))
    return records


def _file_documents(path: Path, tokenizer=None, repeat: bool = True) -> Iterator[str]:
    if path.suffix == ".jsonl":
        docs = [jsonl_document(row, tokenizer, f"{path}:{n}")
                for n, row in read_jsonl(path, "calibration file", '{"text": ...}')]
    else:
        from ..data.corpus import _chunks
        docs = list(_chunks(path.read_text("utf-8", "replace")))
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"calibration file {path} holds no text")
    return _cycle(docs, f"calibration file {path}") if repeat else iter(docs)


def iter_documents(spec: str | DataSpec, seed: int = 0, tokenizer=None, repeat: bool = True) -> Iterator[str]:
    """An endless, deterministic stream of documents for ``spec`` (``tokenizer`` renders chat files).
    A ``mixture`` is balanced by tokens, so it is streamed by ``iter_token_windows`` only.
    ``repeat=False``: a file ends at its end (statistics never count a file's repeats as data)."""
    spec = parse_data_spec(spec)
    if spec.kind == "tasks":
        return _task_documents(seed, spec.domains)
    if spec.kind == "text":
        return _text_documents(spec.domains, seed)
    if spec.kind == "file":
        return _file_documents(spec.path, tokenizer, repeat)
    if spec.kind == "mixture":
        raise ValueError("a mixture is balanced by tokens: stream it with iter_token_windows")
    return _mix(_task_documents(seed), _text_documents(spec.domains, seed), random.Random(f"mix:{seed}"))


def _mix(tasks: Iterator[str], text: Iterator[str], rng: random.Random) -> Iterator[str]:
    while True:
        yield next(tasks) if rng.random() < 0.5 else next(text)


def _component_documents(name: str, seed: int) -> Iterator[str]:
    tasks, _ = _component_names()
    if name == "tasks":
        return _task_documents(seed)
    if name == "text":
        return _text_documents((), seed)
    return _task_documents(seed, (name,)) if name in tasks else _text_documents((name,), seed)


def iter_document_tokens(tokenizer, spec: str | DataSpec, seed: int = 0, repeat: bool = True) -> Iterator[list[int]]:
    """Each document's token ids followed by EOS. A ``mixture`` takes its next document from the
    component furthest below its token share, so every component gets at least its share."""
    spec = parse_data_spec(spec)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def encode(doc: str) -> list[int]:
        return tokenizer(doc, add_special_tokens=False)["input_ids"] + eos

    if spec.kind != "mixture":
        for doc in iter_documents(spec, seed, tokenizer, repeat):
            yield encode(doc)
        return
    streams = [(name, share, _component_documents(name, seed)) for name, share in spec.shares]
    got = [0] * len(streams)
    while True:
        total = sum(got) + 1
        i = max(range(len(streams)), key=lambda j: streams[j][1] * total - got[j])
        ids = encode(next(streams[i][2]))
        got[i] += len(ids)
        yield ids


def iter_token_windows(tokenizer, spec: str | DataSpec, tokens: int, seq_len: int = 512,
                       seed: int = 0, repeat: bool = True) -> Iterator[list[int]]:
    """Windows of ``seq_len`` token ids (the last one shorter) totalling exactly ``tokens``; with
    ``repeat=False`` fewer when a data file ends first (its last window then shorter)."""
    if tokens < 1:
        raise ValueError(f"--tokens must be at least 1 (got {tokens})")
    if seq_len < 1:
        raise ValueError(f"sequence length must be at least 1 (got {seq_len})")
    buf: list[int] = []
    left = tokens
    for ids in iter_document_tokens(tokenizer, spec, seed, repeat):
        buf += ids
        while len(buf) >= min(seq_len, left):
            n = min(seq_len, left)
            yield buf[:n]
            buf = buf[n:]
            left -= n
            if left == 0:
                return
    while buf:   # the file ended (repeat=False) before ``tokens``: what it held, once
        yield buf[:seq_len]
        buf = buf[seq_len:]


def iter_token_batches(tokenizer, spec: str | DataSpec, tokens: int, batch_tokens: int = 4096,
                       seq_len: int = 512, seed: int = 0, repeat: bool = True):
    """Batches ``LongTensor [B, S]`` of equal-length windows, about ``batch_tokens`` tokens each."""
    import torch

    if batch_tokens < 1:
        raise ValueError(f"--batch-tokens must be at least 1 (got {batch_tokens})")
    seq_len = min(seq_len, batch_tokens)
    rows: list[list[int]] = []
    for window in iter_token_windows(tokenizer, spec, tokens, seq_len, seed, repeat):
        if rows and (len(window) != len(rows[0]) or (len(rows) + 1) * len(window) > batch_tokens):
            yield torch.tensor(rows, dtype=torch.long)
            rows = []
        rows.append(window)
    if rows:
        yield torch.tensor(rows, dtype=torch.long)
