"""Tasks from the user's own JSONL: a prompt (or chat ``messages``), a reference answer and a match
rule (``exact``, ``number``, ``regex`` with ``pattern``, ``contains``; docs/evaluation.md shows the
format). ``task`` (optional) groups lines into report rows (default: the file's name). A bad line is
a ValueError naming the file, the line number and what is wrong.
"""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..calibration.data import read_jsonl
from ..data.tasks import TASKS, Task, eval_examples, get_task
from ..data.tasks.base import Example
from ..tables import unknown_choice

MATCH_RULES = ("exact", "number", "regex", "contains")
DEFAULT_BUDGET = 256      # max new tokens for a user task unless --max-tokens says otherwise
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def parse_number(text: str) -> float | None:
    """``"1,234.5"`` -> 1234.5; None when the text is not a number."""
    try:
        value = float(text.strip().replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class MatchRule:
    kind: str                        # one of MATCH_RULES
    pattern: re.Pattern | None = None  # regex: one capture group

    def matches(self, output: str, answer: str) -> bool:
        if self.kind == "exact":
            return output.strip() == answer.strip()
        if self.kind == "contains":
            return answer.strip() in output
        if self.kind == "number":
            found = _NUMBER.findall(output)
            value = parse_number(found[-1]) if found else None
            return value is not None and math.isclose(value, parse_number(answer), rel_tol=1e-9, abs_tol=1e-9)
        m = self.pattern.search(output)
        return m is not None and m.group(1) is not None and m.group(1).strip() == answer.strip()


@dataclass(frozen=True)
class UserExample(Example):
    """An example from a user file: scored by its own match rule (``Example.is_correct``)."""
    rule: MatchRule = MatchRule("exact")
    messages: tuple | None = None    # chat turns, rendered into ``prompt`` by ``UserTask.examples``
    line: int = 0                    # the line of the task file it came from, for error messages

    def is_correct(self, output: str) -> bool:
        return self.rule.matches(output, self.answer)


@dataclass(frozen=True)
class UserTask:
    """The lines of one user file that share a ``task`` name."""
    name: str
    path: str
    items: tuple[UserExample, ...]
    digest: str                      # hash of the file's bytes: resumed results must come from the same file
    description: str = "user task"

    def examples(self, n: int | None = None, tokenizer=None) -> list[UserExample]:
        """The first ``n`` examples (all when None), chat ``messages`` rendered for ``tokenizer``."""
        from dataclasses import replace

        from ..models.chat import chat_prompt

        chosen = self.items if n is None else self.items[:n]
        if any(ex.messages is not None for ex in chosen) and tokenizer is None:
            raise ValueError(f"{self.path} has chat 'messages' lines; rendering them needs the model's tokenizer")
        return [replace(ex, prompt=chat_prompt(tokenizer, list(ex.messages))) if ex.messages is not None else ex
                for ex in chosen]


def select_tasks(spec: str | list[str]) -> list:
    """'all', a comma-separated string, or a list of entries -> tasks, validated. An entry is a
    built-in task's name (``data.tasks``), 'all' (every built-in task) or a JSONL file of the
    user's own tasks (one ``UserTask`` per ``task`` name in it)."""
    entries = [e.strip() for e in (spec.split(",") if isinstance(spec, str) else spec) if e.strip()]
    if not entries:
        raise ValueError("no tasks given; name built-in tasks, 'all', or a JSONL task file")
    tasks: list = []
    for entry in entries:
        if entry == "all":
            tasks += TASKS.values()
        elif entry in TASKS:
            tasks.append(TASKS[entry])
        elif is_task_file(entry):
            tasks += load_user_tasks(entry)
        else:
            get_task(entry)   # raises, listing the valid names
    names = [task.name for task in tasks]
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise ValueError(f"task {twice!r} is selected twice (a user file's 'task' names must differ from "
                         "each other's and from the built-in tasks')")
    return tasks


def task_examples(task, n: int, seed: int = 0, tokenizer=None) -> list[Example]:
    """A built-in task's n held-out examples for ``seed``, or a user task's first n lines whatever
    the seed (chat lines rendered for ``tokenizer``)."""
    if isinstance(task, Task):
        return eval_examples(task, n, seed)
    return task.examples(n, tokenizer)


def is_task_file(spec: str) -> bool:
    """Whether a --tasks entry names a file rather than a built-in task."""
    return spec.endswith((".jsonl", ".json")) or "/" in spec or Path(spec).is_file()


def _example(path: Path, number: int, record: dict, default_task: str) -> UserExample:
    where = f"{path}:{number}"
    known = {"prompt", "messages", "answer", "match", "pattern", "task"}
    unknown = sorted(set(record) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; a line has: {', '.join(sorted(known))}")
    prompt, messages = record.get("prompt"), record.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError(f"{where}: give exactly one of 'prompt' (a string) or 'messages' "
                         "(a list of {role, content})")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
    if messages is not None and (not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\": str, \"content\": str}} objects")
    answer = record.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
        raise ValueError(f"{where}: 'answer' must be a non-empty string or a number, got {answer!r}")
    answer = str(answer)
    kind = record.get("match", "exact")
    if kind not in MATCH_RULES:
        raise ValueError(f"{where}: " + unknown_choice("match rule", kind, MATCH_RULES))
    pattern, compiled = record.get("pattern"), None
    if kind == "regex":
        if not isinstance(pattern, str):
            raise ValueError(f"{where}: match 'regex' needs 'pattern', a regular expression with one capture group "
                             "(e.g. \"#### (\\\\S+)\")")
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{where}: 'pattern' {pattern!r} is not a valid regular expression ({e})") from None
        if compiled.groups != 1:
            raise ValueError(f"{where}: 'pattern' {pattern!r} has {compiled.groups} capture groups; it needs "
                             "exactly one, around the answer")
    elif pattern is not None:
        raise ValueError(f"{where}: 'pattern' is only read with \"match\": \"regex\" (this line matches {kind!r})")
    if kind == "number" and parse_number(answer) is None:
        raise ValueError(f"{where}: match 'number' needs a numeric 'answer', got {answer!r}")
    task = record.get("task", default_task)
    if not isinstance(task, str) or not task.strip() or task == "all":
        raise ValueError(f"{where}: 'task' must be a non-empty name other than 'all', got {task!r}")
    return UserExample(task, 0, prompt or "", "", answer, MatchRule(kind, compiled),
                       tuple(messages) if messages is not None else None, number)


def load_user_tasks(path: str | Path) -> list[UserTask]:
    """Every line of a JSONL task file, validated, grouped by ``task`` (first appearance first)."""
    path = Path(path)
    records = read_jsonl(path)
    if not records:
        raise ValueError(f"{path} has no tasks; write one JSON object per line with 'prompt', 'answer', 'match'")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    groups: dict[str, list[UserExample]] = {}
    for number, record in records:
        ex = _example(path, number, record, path.stem)
        groups.setdefault(ex.task, []).append(ex)
    return [UserTask(name, str(path), tuple(items), digest, f"user task from {path.name} ({len(items)} prompts)")
            for name, items in groups.items()]


def check_prompts_fit(tasks: list, tokenizer, budgets: dict[str, int], context: int, n: int,
                      budget_given: bool) -> None:
    """ValueError naming the file and line of the first user prompt that, with its task's budget of new
    tokens, does not fit the model's context: said before the model loads, in the user's terms."""
    for task in tasks:
        if isinstance(task, Task):
            continue
        for ex in task.examples(n, tokenizer):
            used = len(tokenizer.encode(ex.prompt, add_special_tokens=False))
            budget = budgets[task.name]
            if used + budget > context:
                source = f"--max-tokens {budget}" if budget_given else f"the default budget of {budget} new tokens for a user task"
                fix = (f"pass --max-tokens {context - used} or less" if used < context
                       else "shorten the prompt")
                raise ValueError(f"{task.path}:{ex.line}: the prompt has {used} tokens and {source} would take it "
                                 f"past the model's context of {context} tokens; {fix}")
