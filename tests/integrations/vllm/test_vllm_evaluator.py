"""vLLM as the evaluator: `moetailor eval --backend vllm` runs every configuration on one vLLM engine
(in this process, vLLM's default compiled mode), switching plans between cells, and its accuracy
table equals the embedded engine's prompt for prompt (greedy, fp32, bundled reference model); the
held-out KL comes from vLLM's prompt logprobs."""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys

import pytest
from vllm_helpers import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)

from moetailor.cli.main import main  # noqa: E402

ARGS = ["--configs", "baseline,pruned,phase-aware", "--n", "3", "--seeds", "1", "--kl-docs", "1", "--kl-window", "64",
        "--max-num-seqs", "8"]


def run_eval(out, plan, *extra) -> dict:
    assert main(["eval", "reference", "--plan", str(plan), *ARGS, *extra, "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


def generations(out) -> dict[str, list]:
    """Per generation cell: each prompt's [task, difficulty, correct, length, finish reason, budget], in
    prompt order."""
    cells = {}
    for path in sorted((out / "cells").glob("*.json")):
        data = json.loads(path.read_text())
        if "generations" in data:
            cells[path.stem] = data["generations"]
    return cells


@pytest.fixture(scope="module")
def both(tmp_path_factory, quarter_plan):
    root = tmp_path_factory.mktemp("evaluator")
    engine = run_eval(root / "engine", quarter_plan)
    vllm = run_eval(root / "vllm", quarter_plan, "--backend", "vllm")
    return root, engine, vllm


def table(results) -> list[tuple]:
    return [(r["variant"], r["task"], r["accuracy"], r["p50"], r["p90"], r["budget_hit"], r["eos"])
            for r in results["rows"]]


def test_accuracy_table_equals_the_engine_prompt_for_prompt(both):
    root, engine, vllm = both
    assert vllm["backend"] == "vllm" and "vllm" in vllm["versions"]
    assert generations(root / "vllm") == generations(root / "engine")
    assert table(vllm) == table(engine)


def test_the_plan_changes_outputs(both):
    """A backend that ignored the plan would give the baseline's outputs in every configuration."""
    root, _, _ = both
    cells = generations(root / "vllm")
    base = next(v for k, v in cells.items() if k.startswith("baseline"))
    changed = [k for k, v in cells.items() if not k.startswith("baseline") and v != base]
    assert len(changed) == 2, cells.keys()


def test_heldout_kl_from_prompt_logprobs(both):
    _, engine, vllm = both
    kl = {r["variant"]: (r["kl"], r["perplexity"]) for r in engine["rows"] if r["task"] == "all"}
    got = {r["variant"]: (r["kl"], r["perplexity"]) for r in vllm["rows"] if r["task"] == "all"}
    assert got.keys() == kl.keys()
    for variant, (k, ppl) in kl.items():
        g, gppl = got[variant]
        assert math.isclose(g, k, rel_tol=1e-3, abs_tol=1e-5), (variant, g, k)
        assert math.isclose(gppl, ppl, rel_tol=1e-4), (variant, gppl, ppl)
    assert got["baseline"][0] == 0.0
    assert min(v[0] for k, v in got.items() if k != "baseline") > 0.01


@pytest.fixture(scope="module")
def server(both):
    """`moetailor serve reference --backend vllm` (vLLM's OpenAI server with the plugin and middleware)."""
    yield from serving("--vllm-no-prefix-caching")


def serving(*extra):
    from moetailor.integrations.vllm.serve import wait_healthy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moetailor.cli.main", "serve", "reference", "--backend", "vllm",
                             "--port", str(port), "--vllm-kv-cache-mib", "128", "--max-num-seqs", "8",
                             *extra],
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy([url], [proc], timeout=600)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_running_server_scores_the_same(both, server, tmp_path, quarter_plan):
    """--vllm-url: plans switched on the server between cells; the same table as the engine."""
    root, engine, _ = both
    out = tmp_path / "url"
    assert main(["eval", "reference", "--plan", str(quarter_plan), *ARGS, "--backend", "vllm", "--vllm-url", server,
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["backend"] == f"vllm at {server}"
    assert generations(out) == generations(root / "engine")
    assert table(results) == table(engine)



def test_tune_novice_needs_a_server_started_with_vllm_novice(server, tmp_path, capsys):
    """The server above was started without --vllm-novice: its fingerprint says so, and `tune --novice`
    is refused in one line naming the flag (without --novice, tune leaves novice pools out with a note:
    tests/tuning/test_search.py)."""
    from moetailor.eval.backends import server_info

    assert server_info(server, "reference")["novice"] is False
    out = tmp_path / "tune"
    assert main(["tune", "reference", "--max-kl", "1", "--budget", "0.5", "--servable", "vllm", "--backend", "vllm",
                 "--vllm-url", server, "--novice", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "adds no novice constants" in err and "--vllm-novice" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_eval_of_a_novice_plan_needs_a_server_started_with_vllm_novice(server, tmp_path, capsys, monkeypatch):
    """A plan that replaces dropped experts by their constants, evaluated on the server above (started
    without --vllm-novice): refused in one line naming the flag, before any model loads or prompt runs,
    with nothing written (the plan switch would otherwise be answered 400 after the baseline's cells)."""
    import moetailor.models as models
    from moetailor.calibration import calibrate
    from moetailor.models import load_model, load_tokenizer
    from moetailor.plans.criteria import make_plan

    model = load_model("reference")
    stats = calibrate(model, load_tokenizer("reference"), "tasks", 512, batch_tokens=512, seq_len=128, progress=False)
    stats_path = str(stats.save(tmp_path / "stats.safetensors"))
    plan = make_plan(stats, model, "mone", keep=0.5, novice=True, stats_path=stats_path).save(tmp_path / "novice.json")

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the plan was refused")

    monkeypatch.setattr(models, "load_model", no_load)
    out = tmp_path / "eval"
    assert main(["eval", "reference", "--plan", str(plan), *ARGS, "--backend", "vllm", "--vllm-url", server,
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "novice experts" in err and server in err and "--vllm-novice" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_a_server_started_with_vllm_novice_says_so():
    from moetailor.eval.backends import server_info

    for url in serving("--vllm-no-prefix-caching", "--vllm-novice"):
        assert server_info(url, "reference")["novice"] is True


def test_a_server_of_another_model_is_refused(server, tmp_path, capsys):
    out = tmp_path / "other"
    assert main(["eval", "reference-qwen3", "--configs", "baseline", "--backend", "vllm", "--vllm-url", server,
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "serves another model" in err and len(err.splitlines()) == 1, err
    assert not out.exists()


def test_a_server_with_prefix_caching_is_refused(tmp_path, capsys):
    """Prefix caching would hand blocks one plan computed to the next cell: refused before any model loads."""
    for url in serving():
        out = tmp_path / "cached"
        assert main(["eval", "reference", "--configs", "baseline", "--backend", "vllm", "--vllm-url", url,
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "prefix caching on" in err and "--vllm-no-prefix-caching" in err and len(err.splitlines()) == 1, err
        assert not out.exists()


def test_tune_scores_candidates_on_vllm(tmp_path):
    """`tune --backend vllm`: the same candidates, the same held-out KL (prompt logprobs, the traffic
    windows' second half as decode tokens) and the same greedy task answers as on the engine. In fp32:
    the bundled checkpoint is stored in bf16, which `--dtype auto` would score in, and two engines'
    bf16 kernels round differently (vLLM runs in the dtype of the model tune holds)."""
    args = ["--data", "tasks", "--min-quality", "0.5", "--budget", "0.5", "--servable", "vllm", "--criteria", "reap",
            "--no-fold", "--no-allocation", "--no-top-k", "--no-novice", "--no-merge", "--protect-super", "0",
            "--calib-tokens", "4096", "--kl-tokens", "256",
            "--kl-window", "64", "--n", "2", "--evaluate", "2", "--dtype", "fp32"]
    runs = {}
    for backend in ("engine", "vllm"):
        out = tmp_path / backend
        assert main(["tune", "reference", *args, "--backend", backend, "--out", str(out)]) in (0, 1)
        runs[backend] = {p.stem: json.loads(p.read_text()) for p in (out / "candidates").glob("*.json")}
    assert runs["vllm"].keys() == runs["engine"].keys() and len(runs["vllm"]) > 2
    for key, r in runs["engine"].items():
        assert math.isclose(runs["vllm"][key]["kl"], r["kl"], rel_tol=1e-3, abs_tol=1e-5), key
        assert runs["vllm"][key]["identity"]["backend"] == "vllm"
        for prompts in ("tasks", "fresh_tasks"):   # the prompts that pick, and the fresh ones that confirm
            if prompts in r:
                assert runs["vllm"][key][prompts]["correct"] == r[prompts]["correct"], (key, prompts)
    assert sum("tasks" in r for r in runs["vllm"].values()) >= 2
    assert max(r["kl"] for r in runs["vllm"].values()) > 0.01


def tune_on_both(tmp_path, args: list[str]) -> tuple[dict, dict]:
    """`tune reference ARGS` on the embedded engine and on vLLM: per backend, the candidates' records by
    key and front.json."""
    runs, fronts = {}, {}
    for backend in ("engine", "vllm"):
        out = tmp_path / backend
        assert main(["tune", "reference", *args, "--backend", backend, "--out", str(out)]) in (0, 1)
        runs[backend] = {p.stem: json.loads(p.read_text()) for p in (out / "candidates").glob("*.json")}
        fronts[backend] = json.loads((out / "front.json").read_text())
    return runs, fronts


def test_tune_scores_novice_and_protected_super_candidates_on_vllm(tmp_path):
    """`tune --backend vllm` searches the candidates that replace dropped experts: novice pools (the
    in-process engine starts with novice constants) and the masked and novice pools with the model's
    super experts protected are scored on vLLM, each one's held-out KL and greedy task answers equal to
    the embedded engine's on the same candidate (fp32). Merged experts stay out here: a merged decoder
    is scored on the embedded engine under either backend (tests/tuning/test_search.py)."""
    # 16 super experts at pools of 16-32 of 64: the bundled model's first 8 are in REAP's pools anyway
    args = ["--data", "tasks", "--min-quality", "0.5", "--budget", "0.375", "--servable", "vllm", "--criteria", "reap",
            "--no-fold", "--no-allocation", "--no-top-k", "--novice", "--no-merge", "--protect-super", "16",
            "--calib-tokens", "4096", "--kl-tokens", "256", "--kl-window", "64", "--n", "2", "--evaluate", "6",
            "--dtype", "fp32"]
    runs, fronts = tune_on_both(tmp_path, args)
    assert runs["vllm"].keys() == runs["engine"].keys()

    def kind(r):
        return r["candidate"]["pool_mode"], bool(r["candidate"].get("protect_super"))

    replacing = {k: r for k, r in runs["vllm"].items() if kind(r) != ("mask", False)}
    assert {kind(r) for r in replacing.values()} == {("novice", False), ("novice", True), ("mask", True)}
    for key, r in runs["engine"].items():
        assert math.isclose(runs["vllm"][key]["kl"], r["kl"], rel_tol=1e-3, abs_tol=1e-5), key
        if "tasks" in r:
            assert runs["vllm"][key]["tasks"]["correct"] == r["tasks"]["correct"], key
    evaluated = {kind(r) for r in replacing.values() if "tasks" in r}
    assert evaluated & {("novice", False), ("novice", True)} and ("mask", True) in evaluated, evaluated
    assert {p["scored_by"] for p in fronts["vllm"]["proxy"]} == {"vllm"}
    assert not fronts["vllm"]["summary"]["notes"]
    # the replacements change the scores, so a vLLM engine that ignored them could not pass: every novice
    # pool scores another KL than the plain masked pool of its size, and so does some protected pool
    kl = {(r["candidate"]["criterion"], *kind(r), r["candidate"]["sizes"][0]): r["kl"] for r in runs["engine"].values()
          if len(set(r["candidate"]["sizes"])) == 1}
    for mode, protected, some in (("novice", False, all), ("mask", True, any)):
        sizes = [m for (c, p, s, m) in kl if (c, p, s) == ("reap", mode, protected)]
        assert sizes and some(abs(kl[("reap", mode, protected, m)] - kl[("reap", "mask", False, m)]) > 1e-3
                              for m in sizes), (mode, protected, kl)


def test_tune_on_vllm_scores_merged_experts_on_the_engine_and_says_so(tmp_path, capsys):
    """Merged experts are other checkpoints, which a plan switch on the vLLM engine cannot give: `tune
    --backend vllm` scores them on the embedded engine (held-out KL with the merged decoder, task answers
    in the engine's disaggregated pair, beside the running vLLM engine), as `--backend engine` does, and
    says so: a printed note, "scored on" engine in the table, "scored_by" in front.json."""
    args = ["--data", "tasks", "--min-quality", "0.5", "--budget", "0.375", "--servable", "vllm", "--criteria", "reap",
            "--no-fold", "--no-allocation", "--no-top-k", "--no-novice", "--protect-super", "0",
            "--calib-tokens", "4096", "--kl-tokens", "256", "--kl-window", "64", "--n", "2", "--evaluate", "4",
            "--dtype", "fp32"]
    runs, fronts = tune_on_both(tmp_path, args)
    printed = capsys.readouterr().out
    assert runs["vllm"].keys() == runs["engine"].keys()
    merged = {k for k, r in runs["vllm"].items() if r["candidate"]["pool_mode"] == "merge"}
    assert {runs["vllm"][k]["candidate"]["merge"] for k in merged} == {"hcsmoe", "msmoe"}
    assert {p["key"] for p in fronts["vllm"]["proxy"] if p["scored_by"] == "engine"} == merged
    assert {p["scored_by"] for p in fronts["vllm"]["proxy"] if p["key"] not in merged} == {"vllm"}
    for key, r in runs["engine"].items():
        assert math.isclose(runs["vllm"][key]["kl"], r["kl"], rel_tol=1e-3, abs_tol=1e-5), key
        if "tasks" in r:
            assert runs["vllm"][key]["tasks"]["correct"] == r["tasks"]["correct"], key
    assert any("tasks" in runs["vllm"][k] for k in merged), "a merged point must be evaluated to test its answers"
    notes = fronts["vllm"]["summary"]["notes"]
    assert len(notes) == 1 and "merged experts are scored on moetailor's engine" in notes[0]
    assert f"note: {notes[0]}" in printed
    table = (tmp_path / "vllm" / "front.md").read_text()
    assert "| scored on |" in table and "| engine |" not in (tmp_path / "engine" / "front.md").read_text()
    assert not fronts["engine"]["summary"]["notes"]
