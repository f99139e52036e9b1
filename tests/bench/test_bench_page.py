"""docs/benchmarks.md's generated block from a run folder as scripts/benchmarks.sh writes it (a tiny real run)."""
import json

import pytest

from moetailor.bench import page
from moetailor.bench.measure import engine_prefill, make_llm
from moetailor.bench.report import Report
from moetailor.models.tiny import tiny_model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder: machine.json, a `moetailor bench`-style report, a script's tables JSON, a failed step and a
    step whose result has no tables, each measured for real on a tiny model."""
    out = tmp_path_factory.mktemp("run")
    assert page.main(["machine", str(out / "machine.json")]) == 0
    llm = make_llm(tiny_model("olmoe", num_experts=8, top_k=2), 2, 20)
    tok_s = engine_prefill(llm, 2, 16, repeats=1)
    rep = Report("Prefill: tokens/s per pool", out / "prefill", "moetailor bench prefill --model tiny")
    rep.table("tiny: prefill tokens/s", ["pool", "batch", "prefill tok/s"], [("full", 2, f"{tok_s:.0f}")])
    rep.data = {"models": {"tiny": {"full": [{"batch": 2, "tokens_per_s": tok_s}]}}}
    rep.write()
    page.write_tables(out / "kernels.json", [page.Table("prefill, µs per token", ["batch", "µs"],
                                                        [[2, round(1e6 / tok_s, 1)]])], tok_s=tok_s)
    (out / "plain.json").write_text(json.dumps({"tok_s": tok_s}))
    (out / "plain.txt").write_text(f"some log\n| batch | tok/s |\n| 2 | {tok_s:.0f} |\n")
    steps = [{"name": "bench_prefill", "result": "prefill", "command": "moetailor bench prefill --model tiny", "exit": 0},
             {"name": "native_kernels", "result": "kernels.json", "command": "python scripts/native_kernels.py", "exit": 0},
             {"name": "synth", "result": "", "command": "moetailor synth olmoe-1b-7b", "exit": 0},
             {"name": "broken", "result": "broken.json", "command": "python scripts/broken.py", "exit": 1},
             {"name": "plain", "result": "plain.json", "command": "python scripts/plain.py", "exit": 0}]
    (out / "index.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    return out, tok_s


def test_every_table_has_its_command_and_machine(run):
    out, tok_s = run
    block = page.render(out)
    machine = page.machine_line(json.loads((out / "machine.json").read_text()))
    assert block.startswith(page.BEGIN) and block.endswith(page.END)
    sections = block.split("\n### ")[1:]
    assert len(sections) == 4                                          # the set-up step (no result) is left out
    for section in sections:
        assert f"Machine: {machine}." in section and "```\n" in section
    prefill, kernels, broken, plain = sections
    assert prefill.startswith(page.TITLES["bench_prefill"])
    assert "moetailor bench prefill --model tiny" in prefill
    assert f"| full | 2 | {tok_s:.0f} |" in prefill and "#### tiny: prefill tokens/s" in prefill
    assert "![" not in prefill and prefill.count("```") == 2           # the report's own command block and plot go
    assert f"| 2 | {round(1e6 / tok_s, 1)} |" in kernels
    assert "exited with status 1" in broken and "broken.txt" in broken
    assert "As printed" in plain and f"| 2 | {tok_s:.0f} |" in plain


def test_the_page_keeps_its_hand_written_text(run, tmp_path):
    out, _ = run
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nintro\n\n{page.BEGIN}\nold numbers\n{page.END}\n\n## Measured with other tools\n\nkept\n")
    assert page.main(["render", str(out), "--page", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n\n") and text.endswith("## Measured with other tools\n\nkept\n")
    assert "old numbers" not in text and text.count(page.BEGIN) == 1 and text.count(page.END) == 1
    assert page.main(["render", str(out), "--page", str(doc)]) == 0    # rendering again changes nothing
    assert doc.read_text() == text


def test_bad_input_is_one_clear_error(run, tmp_path, capsys):
    out, _ = run
    doc = tmp_path / "nomarkers.md"
    doc.write_text("# Benchmarks\n")
    assert page.main(["render", str(out), "--page", str(doc)]) == 2
    assert "no generated block" in capsys.readouterr().err and doc.read_text() == "# Benchmarks\n"
    assert page.main(["render", str(tmp_path)]) == 2
    assert "index.jsonl" in capsys.readouterr().err
