"""The user's own JSONL tasks: match rules, one-line errors naming the line, and `moetailor eval
--tasks FILE.jsonl` end to end on the bundled model, scored like the built-in tasks."""
from __future__ import annotations

import json
import os

import pytest

from moetailor.cli.main import main
from moetailor.eval import lm_eval_tasks
from moetailor.eval.user_tasks import MatchRule, load_user_tasks, select_tasks


def write(path, lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize("kind, pattern, output, answer, expected", [
    ("exact", None, "  46\n", "46", True),
    ("exact", None, "46 apples", "46", False),
    ("number", None, "so the total is 1,046.0 in all", "1046", True),
    ("number", None, "46 then 47", "46", False),            # the last number counts
    ("number", None, "no digits", "46", False),
    ("regex", r"#### (\S+)", "1+2=3\n#### 46\n#### 47", "46", True),   # first match's capture
    ("regex", r"#### (\S+)", "46", "46", False),
    ("contains", None, "The capital is Paris.", "Paris", True),
    ("contains", None, "The capital is Lyon.", "Paris", False),
])
def test_match_rules(kind, pattern, output, answer, expected):
    import re
    assert MatchRule(kind, re.compile(pattern) if pattern else None).matches(output, answer) is expected


def test_lines_group_into_tasks_and_chat_lines_render(tmp_path, char_tok):
    path = write(tmp_path / "mine.jsonl", [
        {"prompt": "add 1 + 2\n", "answer": 3, "match": "number"},
        "",
        {"messages": [{"role": "user", "content": "capital of France?"}], "answer": "Paris", "match": "contains",
         "task": "geo"},
        {"prompt": "x", "answer": "y"},
    ])
    mine, geo = load_user_tasks(path)
    assert (mine.name, len(mine.items), geo.name, len(geo.items)) == ("mine", 2, "geo", 1)
    assert [t.name for t in select_tasks(f"addition,{path}")] == ["addition", "mine", "geo"]
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        geo.examples()
    (ex,) = geo.examples(tokenizer=char_tok)
    assert "capital of France?" in ex.prompt and ex.is_correct("It is Paris") and not ex.is_correct("Lyon")
    assert mine.examples(1)[0].is_correct("3") and not mine.examples(1)[0].is_correct("4")


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a", "answer": "b"', ":1: not valid JSON"),
    ('["prompt"]', ":1: each line must be a JSON object"),
    ({"answer": "b"}, ":1: give exactly one of 'prompt'"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "a"}], "answer": "b"}, ":1: give exactly one"),
    ({"prompt": "", "answer": "b"}, ":1: 'prompt' must be a non-empty string"),
    ({"messages": [{"content": "a"}], "answer": "b"}, ":1: 'messages' must be"),
    ({"prompt": "a"}, ":1: 'answer' must be"),
    ({"prompt": "a", "answer": "b", "match": "fuzzy"}, ":1: unknown match rule 'fuzzy'; choose from: exact, number"),
    ({"prompt": "a", "answer": "b", "match": "regex"}, ":1: match 'regex' needs 'pattern'"),
    ({"prompt": "a", "answer": "b", "match": "regex", "pattern": "(a"}, ":1: 'pattern' '(a' is not a valid"),
    ({"prompt": "a", "answer": "b", "match": "regex", "pattern": "a"}, ":1: 'pattern' 'a' has 0 capture groups"),
    ({"prompt": "a", "answer": "b", "pattern": "(a)"}, ":1: 'pattern' is only read with"),
    ({"prompt": "a", "answer": "many", "match": "number"}, ":1: match 'number' needs a numeric 'answer'"),
    ({"prompt": "a", "answer": "b", "weight": 2}, ":1: unknown field 'weight'"),
    ({"prompt": "a", "answer": "b", "task": "all"}, ":1: 'task' must be"),
])
def test_malformed_lines_name_the_line(tmp_path, line, message):
    path = write(tmp_path / "bad.jsonl", [line])
    with pytest.raises(ValueError) as e:
        load_user_tasks(path)
    assert message in str(e.value) and str(e.value).startswith(path) and "\n" not in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        select_tasks(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="has no tasks"):
        load_user_tasks(write(tmp_path / "empty.jsonl", [""]))
    path = write(tmp_path / "addition.jsonl", [{"prompt": "a", "answer": "b"}])
    with pytest.raises(ValueError, match="selected twice"):
        select_tasks(f"addition,{path}")
    good = write(tmp_path / "ok.jsonl", [{"prompt": "a", "answer": "b"}, {"prompt": "a", "answer": "b"}])
    lines = open(good).read().splitlines()
    write(tmp_path / "third.jsonl", [*lines, '{"prompt": 3, "answer": "b"}'])
    with pytest.raises(ValueError, match=r"third.jsonl:3: 'prompt' must be"):
        load_user_tasks(tmp_path / "third.jsonl")


def test_cli_rejects_a_bad_task_file_before_loading_a_model(tmp_path, capsys):
    path = write(tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "b"}, {"prompt": "a", "answer": "b", "match": "x"}])
    assert main(["eval", "no-such-model-dir", "--tasks", path, "--out", str(tmp_path / "out")]) == 2
    assert "bad.jsonl:2: unknown match rule 'x'" in capsys.readouterr().err


def test_eval_on_a_user_file_reports_like_the_built_in_tasks(tmp_path, capsys):
    """The shipped addition.jsonl (regex rule) and a chat/number file, on the bundled model."""
    shipped = os.path.join(os.path.dirname(lm_eval_tasks.__file__), "addition.jsonl")
    chat = write(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "add 12 + 34\n"}], "answer": "46", "match": "number"},
        {"messages": [{"role": "user", "content": "add 50 + 25\n"}], "answer": "75", "match": "number"}])
    out = tmp_path / "out"
    code = main(["eval", "reference", "--tasks", f"{shipped},{chat}", "--configs", "baseline", "--n", "6",
                 "--seeds", "1", "--kl-docs", "1", "--kl-window", "32", "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    rows = {r["task"]: r for r in results["rows"]}
    assert set(rows) == {"addition", "chat", "all"}
    assert rows["addition"]["n"] == 6 and rows["chat"]["n"] == 2 and rows["all"]["n"] == 8
    assert results["settings"]["max_tokens"] == {"addition": 256, "chat": 256}
    for r in rows.values():
        assert 0 <= r["accuracy"] <= 1 and r["p50"] <= r["p90"] <= 256 and 0 <= r["budget_hit"] <= 1
    assert rows["addition"]["accuracy"] >= 0.5 and rows["chat"]["accuracy"] == 1.0   # the model can add
    assert "addition" in (out / "results.md").read_text()
    assert "baseline" in capsys.readouterr().out


def test_a_prompt_past_the_context_names_its_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """The reference model has 1,024 positions: an 800-token prompt fits alone, not with the default
    budget of 256 new tokens. The error names the file's line and the budget's source, and comes
    before the model's weights load."""
    import moetailor.models

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the prompts were checked")

    monkeypatch.setattr(moetailor.models, "load_model", no_load)
    long = " ".join(["add 12 + 34"] * 100)
    path = write(tmp_path / "long.jsonl", [{"prompt": "add 1 + 2\n", "answer": "3"}, {"prompt": long, "answer": "46"}])
    assert main(["eval", "reference", "--tasks", path, "--configs", "baseline", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: the prompt has" in err and "the default budget of 256 new tokens" in err
    assert "past the model's context of 1024 tokens" in err and "--max-tokens" in err
    assert main(["eval", "reference", "--tasks", path, "--configs", "baseline", "--max-tokens", "300",
                 "--out", str(tmp_path / "out")]) == 2
    assert "and --max-tokens 300 would take it" in capsys.readouterr().err
