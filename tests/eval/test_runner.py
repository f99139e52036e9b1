"""End-to-end sweeps on a tiny random model through the real engine (small n, short budgets)."""
import json

import pytest

from moetailor.cli.main import main
from moetailor.data.tasks import TASKS, eval_examples
from moetailor.eval.configurations import parse_configs
from moetailor.eval.runner import CellMismatch, EvalSettings, Sweep, parse_sweep, task_budget
from moetailor.models.tiny import tiny_model
from moetailor.plans import PlanMismatch, uniform_plan
from moetailor.routing import LayerPolicy


def small_settings(**overrides) -> EvalSettings:
    base = dict(model="tiny", tasks=["reverse", "sorting"], n=2, seeds=2,
                configs=parse_configs("baseline,pruned,reverse,phase-aware"), sweep="criteria=frequency;keep=0.5",
                max_tokens=6, kl_docs=1, kl_window=16, calib_tokens=512, calib_data="tasks")
    base.update(overrides)
    return EvalSettings(**base)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2_moe", num_experts=8, top_k=2, vocab=98, max_position_embeddings=512)


@pytest.fixture(scope="module")
def swept(model, char_tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    results = Sweep(small_settings(), out, model=model, tokenizer=char_tok, command="moetailor eval tiny").run()
    return out, results


def test_sweep_writes_results_tables_and_plots(swept):
    out, results = swept
    for name in ("results.json", "results.md", "accuracy_vs_keep.png", "length_by_configuration.png",
                 "length_distribution.png", "stats.safetensors", "plans/frequency-0.5.json"):
        assert (out / name).is_file(), name
    saved = json.loads((out / "results.json").read_text())
    assert saved["command"] == "moetailor eval tiny"
    assert saved["settings"]["seeds"] == [0, 1]
    assert set(saved["versions"]) >= {"torch", "transformers", "moetailor"}
    assert saved["model"]["router_hash"]
    plan = saved["plans"]["frequency-0.5"]
    assert all(len(p["keep"]) == 4 for p in plan["decode"].values())  # 50% of 8 experts
    variants = {r["variant"] for r in saved["rows"]}
    assert variants == {"baseline", "frequency-0.5/pruned", "frequency-0.5/reverse", "frequency-0.5/phase-aware"}
    assert "| frequency | 50% | phase-aware |" in (out / "results.md").read_text()


def test_rows_are_consistent_with_the_budget(swept):
    _, results = swept
    for r in results["rows"]:
        n = 2 * 2 * (2 if r["task"] == "all" else 1)  # n x seeds (x tasks for "all")
        assert r["n"] == n
        assert len(r["accuracy_per_seed"]) == 2
        assert 0 <= r["p50"] <= r["p90"] <= 6
        assert r["budget_hit"] + r["eos"] == pytest.approx(1.0)  # every generation stopped one of the two ways
    by = {(r["variant"], r["task"]): r for r in results["rows"]}
    assert by["baseline", "all"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert by["frequency-0.5/phase-aware", "all"]["kl"] > 0
    assert by["frequency-0.5/reverse", "all"]["kl"] > 0
    assert sum(results["histograms"]["baseline"]["greedy"]) == 8


def test_interrupted_sweep_resumes_from_completed_cells(swept, model, char_tok):
    out, first = swept
    cells = sorted((out / "cells").glob("*.json"))
    assert len(cells) == 4 * 3  # 4 variants x (held-out + 2 seeds)
    lost = out / "cells" / "frequency-0.5__reverse__greedy__seed1.json"
    lost.unlink()  # as if the sweep was killed before this cell finished
    stamps = {p: p.stat().st_mtime_ns for p in cells if p != lost}
    again = Sweep(small_settings(), out, model=model, tokenizer=char_tok, command="moetailor eval tiny").run()
    assert again["timing"]["computed_cells"] == 1 and again["timing"]["cached_cells"] == 11
    assert lost.exists()
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())
    assert again["rows"] == first["rows"]  # greedy generation is deterministic


def test_changed_settings_do_not_reuse_cells(swept, model, char_tok):
    out, _ = swept
    settings = small_settings(max_tokens=5, configs=parse_configs("baseline"))
    with pytest.raises(CellMismatch, match="another max tokens.*--overwrite"):
        Sweep(settings, out, model=model, tokenizer=char_tok, command="x").run()
    results = Sweep(settings, out, model=model, tokenizer=char_tok, command="x", overwrite=True).run()
    assert results["timing"]["computed_cells"] == 3
    assert all(r["p90"] <= 5 for r in results["rows"])


def test_another_plan_into_the_same_folder_never_reports_the_first_plans_results(model, char_tok, tmp_path):
    """Plan A evaluated into DIR, then plan B into DIR: B's run must not reuse A's cells."""
    meta = {"criterion": "reap", "keep_ratio": 0.5}   # same criterion and ratio: the same cell keys
    a = uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3)), **meta).save(tmp_path / "a.json")
    b = uniform_plan(model, decode=LayerPolicy(keep=(4, 5, 6, 7)), **meta).save(tmp_path / "b.json")
    settings = lambda plan: small_settings(sweep=None, plan=str(plan), configs=parse_configs("phase-aware"),  # noqa: E731
                                           seeds=1, max_tokens=8)
    run = lambda plan, out, **kw: Sweep(settings(plan), out, model=model, tokenizer=char_tok, **kw).run()  # noqa: E731
    first = run(a, tmp_path / "dir")
    with pytest.raises(CellMismatch, match=r"another plan \(content hash\).*--overwrite.*fresh --out"):
        run(b, tmp_path / "dir")
    fresh = run(b, tmp_path / "fresh")
    again = run(b, tmp_path / "dir", overwrite=True)
    assert again["timing"]["cached_cells"] == 0 and again["timing"]["computed_cells"] == 2
    assert again["rows"] == fresh["rows"]
    assert [r["kl"] for r in again["rows"]] != [r["kl"] for r in first["rows"]]   # the two plans differ
    # the same plan regenerated (new creation time and command) still resumes
    regenerated = uniform_plan(model, decode=LayerPolicy(keep=(4, 5, 6, 7)), command="again", **meta)
    regenerated.save(tmp_path / "b2.json")
    resumed = run(tmp_path / "b2.json", tmp_path / "dir")
    assert resumed["timing"]["cached_cells"] == 2 and resumed["rows"] == fresh["rows"]


def test_cells_of_another_model_are_refused(model, char_tok, tmp_path):
    settings = small_settings(sweep=None, configs=parse_configs("baseline"), seeds=1, max_tokens=4)
    Sweep(settings, tmp_path, model=model, tokenizer=char_tok).run()
    other = tiny_model("qwen2_moe", seed=5, num_experts=8, top_k=2, vocab=98, max_position_embeddings=512)
    with pytest.raises(CellMismatch, match=r"another model \(weights hash\)"):
        Sweep(settings, tmp_path, model=other, tokenizer=char_tok).run()


def test_cached_statistics_of_other_calibration_settings_are_refused(swept, model, char_tok):
    out, _ = swept
    with pytest.raises(CellMismatch, match="stats.safetensors holds statistics.*1024 of 'tasks'.*--overwrite"):
        Sweep(small_settings(calib_tokens=1024), out, model=model, tokenizer=char_tok).run()


def test_budget_is_twice_the_longest_reference_answer(char_tok):
    for name in ("addition", "sorting"):
        budget = task_budget(TASKS[name], char_tok)
        longest = max(len(char_tok(ex.completion)["input_ids"]) + 1 for ex in eval_examples(TASKS[name], 60, 0))
        assert 2 * longest <= budget <= 4 * longest


def test_plan_for_another_model_is_an_error(model, char_tok, tmp_path):
    other = tiny_model("qwen2_moe", seed=3, num_experts=8, top_k=2)
    path = uniform_plan(other, decode=LayerPolicy(keep=(0, 1, 2, 3))).save(tmp_path / "other.json")
    with pytest.raises(PlanMismatch, match="does not match the model"):
        Sweep(small_settings(sweep=None, plan=str(path)), tmp_path / "out", model=model, tokenizer=char_tok).run()


def test_bad_settings_are_errors():
    with pytest.raises(ValueError, match="--n must be a positive"):
        small_settings(n=0).validate()
    with pytest.raises(ValueError, match="--n must be a positive"):
        small_settings(n=-3).validate()
    with pytest.raises(ValueError, match="unknown task 'poetry'; choose from: addition"):
        small_settings(tasks=["addition", "poetry"]).validate()
    with pytest.raises(ValueError, match="need a plan"):
        small_settings(sweep=None).validate()
    with pytest.raises(ValueError, match="unknown sampling mode"):
        small_settings(sampling=["beam"]).validate()
    with pytest.raises(ValueError, match="unknown criterion 'vibes'; choose from: frequency"):
        parse_sweep("criteria=frequency,vibes;keep=0.5")
    with pytest.raises(ValueError, match="between 0 and 1"):
        parse_sweep("criteria=reap;keep=50")
    assert parse_sweep("paper") == (("frequency", "reap", "ean", "mass"), (0.5, 0.25))


@pytest.mark.parametrize("argv, message", [
    (["--n", "0"], "--n must be a positive"),
    (["--tasks", "addition,poetry"], "unknown task 'poetry'; choose from: addition"),
    (["--sweep", "criteria=vibes"], "unknown criterion 'vibes'; choose from: "),
    (["--sweep", "paper", "--configs", "baseline,halfway"], "unknown configuration 'halfway'; choose from: "),
    (["--sweep", "paper", "--configs", "phase-aware", "--floor", "0.97"], "add baseline to --configs"),
    (["--sweep", "paper", "--configs", "baseline,phase-aware", "--floor", "97"], "--floor is a share"),
    (["--first-seed", "-1"], "--first-seed must be 0 or more"),
])
def test_cli_rejects_bad_input_before_loading_a_model(argv, message, tmp_path, capsys):
    assert main(["eval", "no-such-model-dir", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_sampled_generation_is_reproducible_per_seed(model, char_tok, tmp_path):
    settings = small_settings(sweep=None, configs=parse_configs("baseline"), sampling=["sample"], seeds=1, n=3,
                              max_tokens=5)
    a = Sweep(settings, tmp_path / "a", model=model, tokenizer=char_tok).run()
    b = Sweep(settings, tmp_path / "b", model=model, tokenizer=char_tok).run()
    assert a["rows"] == b["rows"]
    assert all(r["sampling"] == "sample" for r in a["rows"])


def test_calibration_data_axis_gives_the_cross_domain_matrix(model, char_tok, tmp_path):
    """data=... calibrates once per domain, makes each domain's plan, evaluates it on every task,
    records what each plan was calibrated on, and writes the cross-domain table."""
    from moetailor.eval.runner import sweep_data

    assert sweep_data("criteria=reap;keep=0.5") is None
    assert sweep_data("keep=0.5;data=domains")[:2] == ("tasks", "tasks:addition")
    with pytest.raises(ValueError, match="unknown task 'juggling'"):
        parse_sweep("keep=0.5;data=tasks:juggling")
    settings = small_settings(sweep="criteria=frequency;keep=0.5;data=tasks:reverse|tasks:sorting|text:fortunes",
                              configs=parse_configs("baseline,phase-aware"), seeds=1)
    out = tmp_path / "cross"
    results = Sweep(settings, out, model=model, tokenizer=char_tok, command="x").run()
    labels = {"frequency-0.5@tasks:reverse", "frequency-0.5@tasks:sorting", "frequency-0.5@text:fortunes"}
    assert set(results["plans"]) == labels
    assert {r["variant"] for r in results["rows"]} == {"baseline", *(f"{l}/phase-aware" for l in labels)}
    records = {c["data"]: c for c in results["settings"]["calibration"]}
    assert set(records) == {"tasks:reverse", "tasks:sorting", "text:fortunes"}
    assert len({c["sha256"] for c in records.values()}) == 3 and all(c["tokens"] == 512 for c in records.values())
    keeps = {l: results["plans"][l]["decode"]["0"]["keep"] for l in labels}
    assert len({tuple(k) for k in keeps.values()}) > 1   # different domains choose different experts
    md = (out / "results.md").read_text()
    assert "Cross-domain" in md and "| frequency 50% phase-aware | tasks:sorting |" in md
    # the summary table tells the per-domain plans' rows apart too
    assert "| frequency | 50% | phase-aware | tasks:reverse |" in md and "| frequency | 50% | phase-aware | text:fortunes |" in md
    assert "Plans calibrated on: tasks:reverse (512 tokens, sha256" in md
    # a rerun reuses every cell; a plan from other data does not reuse the cells of the old one
    again = Sweep(settings, out, model=model, tokenizer=char_tok, command="x").run()
    assert again["timing"]["computed_cells"] == 0
    other = small_settings(sweep="criteria=frequency;keep=0.5;data=tasks:reverse|tasks:sorting|text:fortunes",
                           configs=parse_configs("baseline,phase-aware"), seeds=1, calib_tokens=256)
    with pytest.raises(ValueError, match="--overwrite"):
        Sweep(other, out, model=model, tokenizer=char_tok, command="x").run()
    third = Sweep(other, out, model=model, tokenizer=char_tok, command="x", overwrite=True).run()
    assert third["timing"]["computed_cells"] > 0


def test_cross_domain_matrix_from_user_files(model, char_tok, tmp_path):
    """The per-domain plan x per-domain evaluation matrix from the user's own files in one run:
    each traffic file of the data= axis calibrates a plan, each --tasks file is a column."""
    def write(path, records):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return str(path)

    chat = write(tmp_path / "chat.jsonl", [{"prompt": f"say {w}\n", "completion": f"{w} {w}\n"}
                                          for w in ("hi", "yes", "ok", "no", "fine", "sure")] * 6)
    code = write(tmp_path / "code.jsonl", [{"text": f"def f{i}(x):\n    return x * {i} + {i % 3}\n"}
                                          for i in range(40)])
    chat_eval = write(tmp_path / "chat-eval.jsonl", [{"prompt": "say hi\n", "answer": "hi", "match": "contains"},
                                                     {"prompt": "say ok\n", "answer": "ok", "match": "contains"}])
    code_eval = write(tmp_path / "code-eval.jsonl", [{"prompt": "def f2(x):\n", "answer": "2", "match": "number"},
                                                     {"prompt": "def f5(x):\n", "answer": "5", "match": "number"}])
    settings = small_settings(sweep=f"criteria=frequency;keep=0.5;data={chat}|{code}", tasks=[chat_eval, code_eval],
                              configs=parse_configs("baseline,phase-aware"), seeds=1)
    out = tmp_path / "cross"
    results = Sweep(settings, out, model=model, tokenizer=char_tok, command="x").run()
    labels = {f"frequency-0.5@{chat}", f"frequency-0.5@{code}"}
    assert set(results["plans"]) == labels
    records = results["settings"]["calibration"]
    assert {c["data"] for c in records} == {"chat.jsonl", "code.jsonl"} and len({c["sha256"] for c in records}) == 2
    keeps = {tuple(results["plans"][l]["decode"]["0"]["keep"]) for l in labels}
    assert len(keeps) == 2   # the two traffic files choose different experts
    tasks = {r["task"] for r in results["rows"]}
    assert {"chat-eval", "code-eval"} <= tasks
    md = (out / "results.md").read_text()
    assert "| plan | calibrated on | chat-eval | code-eval | all tasks |" in md
    assert "| frequency 50% phase-aware | code.jsonl |" in md


def test_each_plan_row_is_paired_with_the_full_model_on_each_distinct_prompt_once(tmp_path, capsys):
    """`eval --configs baseline,plan --floor F` on the bundled model: every plan row carries its share of
    the baseline's accuracy, changed prompts and verdict, recomputed here from the cells the run wrote;
    seeds 1-2 of `brackets` hold one prompt twice, which counts once."""
    from moetailor.cli.demo import BUNDLED_PLAN
    from moetailor.eval.metrics import PairedCounts, floor_verdict

    out = tmp_path / "eval"
    assert main(["eval", "reference", "--plan", str(BUNDLED_PLAN), "--configs", "baseline,plan", "--tasks",
                 "brackets,reverse", "--n", "8", "--seeds", "2", "--first-seed", "1", "--floor", "0.9",
                 "--kl-docs", "1", "--out", str(out)]) == 0
    assert "of full (95% CI)" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["seeds"] == [1, 2]
    rows = {(r["configuration"], r["task"]): r for r in results["rows"]}
    assert rows[("baseline", "all")]["vs_full"] is None
    cells = {c: [json.loads(next((out / "cells").glob(f"*{c}__greedy__seed{s}.json")).read_text())["generations"]
                 for s in (1, 2)] for c in ("baseline", "plan")}
    prompts = [(t, ex.prompt) for s in (1, 2) for t in ("brackets", "reverse")
               for ex in eval_examples(TASKS[t], 8, seed=s)]
    seen, plan, full = set(), [], []
    for key, p, f in zip(prompts, (g for gens in cells["plan"] for g in gens), (g for gens in cells["baseline"]
                                                                               for g in gens)):
        assert p[0] == f[0] == key[0]
        if key not in seen:
            seen.add(key)
            plan.append(bool(p[2]))
            full.append(bool(f[2]))
    assert len(plan) == len(prompts) - 1 == 31
    want = floor_verdict(PairedCounts.of(plan, full), 0.9)
    got = rows[("plan", "all")]["vs_full"]
    assert (got["prompts"], got["gained"], got["lost"], got["verdict"]) == (31, want.gained, want.lost, want.verdict)
    assert got["gained"] + got["lost"] > 0          # the plan changes answers: the pairing is tested, not only counts
    assert got["ratio"] == pytest.approx(want.ratio) and got["low"] == pytest.approx(want.low)
    assert rows[("plan", "reverse")]["vs_full"]["prompts"] == 16
    assert "of full (95% CI)" in (out / "results.md").read_text()
