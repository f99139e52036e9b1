"""Fourth reliability round, command line (docs/reliability.md, "Command line, fourth round"): two runs
into one --out, --overwrite of a folder moetailor did not write, a full disk under safetensors' writer,
and the smaller one-line errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moetailor.cli.main import main
from moetailor.models.tiny import char_tokenizer, tiny_model
from moetailor.plans.plan import uniform_plan
from moetailor.routing.policy import LayerPolicy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny checkpoint on disk and two plans for it that keep different experts."""
    folder = tmp_path_factory.mktemp("tiny")
    model = tiny_model("qwen2_moe", num_experts=8, top_k=2)
    model.save_pretrained(folder / "model")
    char_tokenizer().save_pretrained(folder / "model")
    plans = []
    for name, keep in (("low", (0, 1, 2, 3)), ("high", (4, 5, 6, 7))):
        path = folder / f"{name}.json"
        uniform_plan(model, decode=LayerPolicy(keep=keep), criterion=name).save(path)
        plans.append(path)
    return folder / "model", plans


def cli(*argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen([sys.executable, "-m", "moetailor.cli.main", *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def one_line_error(capsys, argv, *needles) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if "moetailor" in line]   # a progress bar may precede it
    assert len(lines) == 1 and err.endswith(lines[0]), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def kept(out: Path) -> list[int]:
    side = json.loads((out / "moetailor_pruning.json").read_text())
    return sorted(next(iter(side["kept"].values())))


def test_two_prune_runs_into_one_out_one_fails(tiny, tmp_path):
    """Two real processes started together, different plans, one --out: exactly one succeeds and the
    output is that one's checkpoint; the other fails with one line (it is being written / exists)."""
    model, (low, high) = tiny
    out = tmp_path / "X"
    runs = [cli("prune", str(model), str(plan), "--out", str(out)) for plan in (low, high)]
    results = [(r.wait(timeout=600), *r.communicate()) for r in runs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [(c, e[-800:]) for c, _, e in results]
    winner = next(i for i, (code, _, _) in enumerate(results) if code == 0)
    loser_err = results[1 - winner][2].strip().splitlines()[-1]
    assert "being written" in loser_err or "already exists" in loser_err, loser_err
    assert kept(out) == ([0, 1, 2, 3] if winner == 0 else [4, 5, 6, 7])


def test_a_claimed_out_refuses_a_second_process(tiny, tmp_path):
    """Deterministic form of the race: this process holds the claim while a real `moetailor prune` starts."""
    from moetailor.outputs import claim_output, release_outputs

    model, (low, _) = tiny
    out = tmp_path / "X"
    claim_output(out)
    try:
        run = cli("prune", str(model), str(low), "--out", str(out))
        code, (_, err) = run.wait(timeout=600), run.communicate()
    finally:
        release_outputs()
    assert code == 2, err[-1500:]
    assert "being written by another moetailor run" in err and "Traceback" not in err
    assert not out.exists()
    run = cli("prune", str(model), str(low), "--out", str(out))   # released: it runs
    assert run.wait(timeout=600) == 0, run.communicate()[1][-1500:]


def test_a_dead_runs_claim_is_taken_over(tiny, tmp_path):
    from moetailor.outputs import LOCK_DIR, _lock_file

    model, (low, _) = tiny
    out = tmp_path / "X"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    _lock_file(out).write_text(f"{dead.pid} {out}\n")   # what a SIGKILLed run leaves
    assert main(["prune", str(model), str(low), "--out", str(out)]) == 0
    assert not _lock_file(out).exists()


def test_overwrite_refuses_a_folder_moetailor_did_not_write(tiny, tmp_path, capsys):
    model, (low, high) = tiny
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    one_line_error(capsys, ["prune", str(model), str(low), "--out", str(user), "--overwrite"],
                   "moetailor did not write", "thesis.tex")
    assert (user / "thesis.tex").read_text() == "years of work"
    # its own output is replaced, as before; so is an empty folder
    own = tmp_path / "own"
    assert main(["prune", str(model), str(low), "--out", str(own)]) == 0
    assert (own / ".moetailor-output").is_file()
    assert main(["prune", str(model), str(high), "--out", str(own), "--overwrite"]) == 0
    assert kept(own) == [4, 5, 6, 7]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["prune", str(model), str(low), "--out", str(empty), "--overwrite"]) == 0


def test_overwrite_still_replaces_a_checkpoint_from_before_the_marker(tiny, tmp_path):
    model, (low, high) = tiny
    out = tmp_path / "old"
    assert main(["prune", str(model), str(low), "--out", str(out)]) == 0
    (out / ".moetailor-output").unlink()   # what an older moetailor wrote: the sidecar only
    assert main(["prune", str(model), str(high), "--out", str(out), "--overwrite"]) == 0
    assert kept(out) == [4, 5, 6, 7]


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB file system (tmpfs), where the machine lets this process mount one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_prune_onto_a_full_disk_is_one_line_and_leaves_nothing(small_disk, capsys):
    """The real writer (safetensors) fails with its own SafetensorError, not OSError."""
    from moetailor.cli.demo import BUNDLED_PLAN

    one_line_error(capsys, ["prune", "reference", str(BUNDLED_PLAN), "--out", str(small_disk / "pruned")],
                   "No space left on device", "free disk space")
    assert list(small_disk.iterdir()) == []


def test_calibrate_onto_a_full_disk_is_one_line_and_leaves_nothing(small_disk, capsys):
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (2 * 2**20 - 200 * 2**10))   # leave 200 KiB: less than the statistics
    one_line_error(capsys, ["calibrate", "reference", "--tokens", "600", "--out", str(small_disk / "s.safetensors")],
                   "No space left on device")
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]


@pytest.fixture(scope="module")
def folded(tiny, tmp_path_factory):
    """A folded plan (the kind `tune` picks) in a plan folder beside its statistics."""
    from dataclasses import replace

    from moetailor.plans import Plan
    from moetailor.plans.techniques import pool_with_fold

    model, _ = tiny
    folder = tmp_path_factory.mktemp("tuned") / "T"
    folder.mkdir()
    assert main(["calibrate", str(model), "--data", "mix", "--tokens", "600", "--batch-tokens", "256", "--seq-len",
                 "64", "--fold", "--out", str(folder / "stats.safetensors")]) == 0
    assert main(["plan", str(folder / "stats.safetensors"), "--criterion", "reap", "--keep", "0.5",
                 "--out", str(folder / "masked.json")]) == 0
    plan = Plan.load(folder / "masked.json")
    replace(plan, decode=pool_with_fold(plan.decode, fold=True)).save(folder / "plan.json")
    return folder


def test_a_folded_plan_stores_its_statistics_relative_and_moves_with_its_folder(folded, tmp_path):
    import shutil

    from moetailor.plans import Plan

    assert json.loads((folded / "plan.json").read_text())["fold_stats"] == "stats.safetensors"
    moved = tmp_path / "elsewhere"
    shutil.copytree(folded, moved)
    plan = Plan.load(moved / "plan.json")
    assert plan.fold_tables_path() == moved / "stats.safetensors"
    # a plan written before, with an absolute path, is still read as written
    data = json.loads((folded / "plan.json").read_text())
    data["fold_stats"] = str(folded / "stats.safetensors")
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Plan.load(tmp_path / "old.json").fold_tables_path() == folded / "stats.safetensors"


def test_eval_runs_a_folded_plan_with_its_own_statistics(tiny, folded, tmp_path, capsys):
    """`eval --plan T/plan.json` of a folded plan: the held-out KL cell used to fail ("no fold statistics
    were given; ... pass the stats file", an option eval does not have)."""
    model, _ = tiny
    assert main(["eval", str(model), "--plan", str(folded / "plan.json"), "--configs", "baseline,phase-aware",
                 "--tasks", "addition", "--n", "1", "--seeds", "1", "--max-tokens", "4", "--kl-docs", "1",
                 "--kl-window", "32", "--out", str(tmp_path / "ev")]) == 0, capsys.readouterr().err[-800:]


def test_a_folded_plan_without_its_statistics_names_the_file(tiny, folded, tmp_path, capsys):
    import shutil

    model_plan = tmp_path / "T"
    shutil.copytree(folded, model_plan)
    (model_plan / "stats.safetensors").unlink()
    one_line_error(capsys, ["generate", str(tiny[0]), "--prompt", "1+1=", "--max-tokens", "2", "--plan",
                            str(model_plan / "plan.json")], "stats.safetensors", "do not exist")


def test_the_vllm_plugin_reads_a_folded_plans_statistics_through_the_same_reader(tiny, folded, tmp_path):
    """The plugin's router tables (no vLLM import) find a moved plan folder's statistics, and name them
    when they are gone, as every verb does (``Plan.fold_tables_path``)."""
    import shutil

    from moetailor.integrations.vllm.plan import fold_tables_for
    from moetailor.plans import Plan

    model, (low, _) = tiny
    moved = tmp_path / "moved"
    shutil.copytree(folded, moved)
    assert sorted(fold_tables_for(Plan.load(moved / "plan.json"), model)) == [0, 1]
    assert fold_tables_for(Plan.load(low), model) == {}            # a plan that folds nothing needs none
    (moved / "stats.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="stats.safetensors, which do not exist"):
        fold_tables_for(Plan.load(moved / "plan.json"), model)


def test_calibrate_reads_a_small_traffic_file_once(tiny, tmp_path, capsys):
    """A file smaller than --tokens used to be read over and over, its repeats recorded as data."""
    from moetailor.calibration import ExpertStats
    from moetailor.calibration.data import iter_document_tokens
    from moetailor.models import load_tokenizer

    model, _ = tiny
    traffic = tmp_path / "my-traffic.jsonl"
    traffic.write_text("".join(json.dumps({"text": f"request {i}: add {i} and {2 * i}"}) + "\n" for i in range(40)))
    held = sum(len(ids) for ids in iter_document_tokens(load_tokenizer(str(model)), str(traffic), repeat=False))
    out = tmp_path / "s.safetensors"
    assert main(["calibrate", str(model), "--data", str(traffic), "--tokens", "200000", "--seq-len", "64",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ExpertStats.load(out).meta["tokens"] == held < 200000
    assert f"held {held:,} tokens, fewer than --tokens 200,000" in printed
    assert "200,000 tokens" not in printed


def _uneven_folded(model_dir, folded) -> Path:
    """A folded plan with a different pool per layer (what `tune` picks), for the tiny model."""
    from dataclasses import replace

    from moetailor.plans import Plan
    from moetailor.routing.policy import PhasePolicy

    plan = Plan.load(folded / "plan.json")
    sizes = iter((4, 6))
    decode = PhasePolicy({i: replace(p, keep=tuple(range(next(sizes)))) for i, p in sorted(plan.decode.layers.items())})
    path = folded / "uneven.json"
    replace(plan, decode=decode).save(path)
    return path


def _top_k_plan(tiny) -> Path:
    from moetailor.models import load_model

    model_dir, (low, _) = tiny
    path = low.parent / "topk.json"
    uniform_plan(load_model(str(model_dir)), decode=LayerPolicy(top_k=1), prefill=LayerPolicy(top_k=1)).save(path)
    return path


def test_plans_are_described_as_they_are(tiny, folded, capsys):
    """One description (kept per layer, folding, top-k) in info, prune and export."""
    from moetailor.plans import Plan
    from moetailor.plans.plan import describe_phase
    from moetailor.transforms.gguf import gguf_plan

    model_dir, _ = tiny
    uneven = _uneven_folded(model_dir, folded)
    plan = Plan.load(uneven)
    assert describe_phase(plan, "decode") == "keeps 4/6 of 8 experts per layer, folds the excluded experts' routes onto kept ones"
    assert main(["info", str(uneven)]) == 0
    assert "folds the excluded experts" in capsys.readouterr().out
    err = one_line_error(capsys, ["prune", str(model_dir), str(uneven), "--out", str(folded / "p")],
                         "folds the excluded", "--decode-plan PLAN", "without folding")
    assert "masked mode" not in err
    with pytest.raises(ValueError, match="folds the excluded.*without folding"):
        gguf_plan(Plan.load(folded / "plan.json"))
    topk = _top_k_plan(tiny)
    assert describe_phase(Plan.load(topk), "decode") == "keeps all 8 experts, routes 1 of them per token (model top-2)"
    err = one_line_error(capsys, ["prune", str(model_dir), str(topk), "--out", str(folded / "p")],
                         "keeps all 8 experts, routes 1", "--plan PLAN` (both phases as written)")
    assert "masked mode" not in err


def test_eval_does_not_call_a_top_k_plan_pruned(tiny, tmp_path, capsys):
    from moetailor.cli.eval import plan_configs

    topk = str(_top_k_plan(tiny))
    assert plan_configs(topk, None) == "baseline,plan,phase-aware"
    one_line_error(capsys, ["eval", str(tiny[0]), "--plan", topk, "--configs", "baseline,pruned,reverse",
                            "--out", str(tmp_path / "e")], "keeps every expert", "--configs baseline,plan,phase-aware")
    assert plan_configs(str(tiny[1][0]), None) == "baseline,pruned,reverse,phase-aware"


def test_demo_says_a_plan_folds(tiny, folded, capsys):
    model_dir, _ = tiny
    assert main(["demo", "--model", str(model_dir), "--plan", str(_uneven_folded(model_dir, folded)),
                 "--per-task", "1"]) == 0
    out = capsys.readouterr().out
    assert "decode keeps 4/6 of 8 experts per layer, folds the excluded experts' routes onto kept ones" in out


@pytest.mark.parametrize("verb", [["calibrate", "reference", "--out", "s.safetensors"], ["tune", "reference", "--out", "T"],
                                  ["eval", "reference", "--out", "E"], ["generate", "reference", "--prompt", "x"],
                                  ["serve", "reference"], ["bench", "decode"]])
def test_dtype_is_spelled_one_way_everywhere(verb):
    """--dtype was {bf16,fp16,fp32} in generate/serve, {auto,bfloat16,float16,float32} in calibrate/tune/
    eval and {float32,bfloat16} in bench decode: now fp32/bf16 (and fp16, auto where they apply) in all,
    the long names accepted as the same values."""
    from moetailor.cli.main import build_parser

    parser = build_parser()
    for given, want in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp32", "fp32"), ("float32", "fp32")):
        assert parser.parse_args(verb + ["--dtype", given]).dtype == want
    with pytest.raises(SystemExit):
        parser.parse_args(verb + ["--dtype", "int8"])


@pytest.mark.parametrize("verb", [["calibrate", "reference", "--out", "o"], ["prune", "m", "p", "--out", "o"],
                                  ["plan", "s", "--criterion", "reap", "--out", "o"], ["split", "m", "--parts", "2",
                                  "--out", "o"], ["distill", "m", "p", "--steps", "1", "--out", "o"],
                                  ["search-k", "m", "--budget", "4", "--out", "o"], ["eval", "m", "--out", "o"],
                                  ["tune", "m", "--out", "o"], ["export", "gguf", "m", "--out", "o"],
                                  ["synth", "olmoe-1b-7b", "--out", "o"], ["bench", "decode"]])
def test_overwrite_and_force_are_one_flag_in_every_writing_verb(verb):
    from moetailor.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(verb + ["--overwrite"]).overwrite and parser.parse_args(verb + ["--force"]).overwrite
    assert not parser.parse_args(verb).overwrite


def test_split_data_defaults_like_the_other_verbs():
    from moetailor.cli.main import build_parser

    assert build_parser().parse_args(["split", "reference", "--parts", "2", "--out", "o"]).data is None


def test_prune_names_a_malformed_config(tiny, tmp_path, capsys):
    import shutil

    model, (low, _) = tiny
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    (broken / "config.json").write_text('{"model_type": "qwen2_moe", ')
    one_line_error(capsys, ["prune", str(broken), str(low), "--out", str(tmp_path / "o")], str(broken / "config.json"))


def test_calibrate_spill_dir_that_is_a_file(tiny, tmp_path, capsys):
    spill = tmp_path / "spill"
    spill.write_text("x")
    one_line_error(capsys, ["calibrate", str(tiny[0]), "--data", "text", "--tokens", "64", "--stream", "on",
                            "--spill-dir", str(spill), "--out", str(tmp_path / "s.safetensors")],
                   "is a file; it needs a directory")


def test_eval_table_names_the_tasks_it_ran(tiny, tmp_path, capsys):
    """The summary table said "(all tasks)" whatever --tasks held."""
    model_dir, plans = tiny
    assert main(["eval", str(model_dir), "--plan", str(plans[0]), "--configs", "baseline", "--tasks", "reverse",
                 "--n", "1", "--seeds", "1", "--max-tokens", "4", "--kl-docs", "1", "--kl-window", "16",
                 "--out", str(tmp_path / "e")]) == 0
    out = capsys.readouterr().out
    assert "(tasks: reverse)" in out and "(all tasks)" not in out
    assert "± n/a" in out and "± 0.0" not in out      # one seed measures no spread (the terminal table too)


def test_info_says_what_a_statistics_file_is(tiny, folded, capsys):
    """`info stats.safetensors` describes the statistics (not "neither a model nor a checkpoint"); a
    checkpoint's weights file names its folder; any other file says what info reads."""
    model, _ = tiny
    assert main(["info", str(folded / "stats.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "expert statistics from `moetailor calibrate`" in out and "calibrated on" in out, out
    assert "mix (600 tokens" in out and "fold tables" in out and "yes" in out, out
    err = one_line_error(capsys, ["info", str(model / "model.safetensors")], "not a moetailor statistics file",
                         f"moetailor info {model.resolve()}")
    assert "neither a bundled model" not in err
    (folded / "notes.txt").write_text("hello")
    one_line_error(capsys, ["info", str(folded / "notes.txt")], "not a safetensors file", "plan .json")


def test_a_recorded_command_line_runs_again():
    """`serve --observe` recorded `--expert-plan '[]'` (an option's empty list) in its statistics' command."""
    import argparse
    import shlex

    from moetailor.cli.calibrate import command_line
    from moetailor.cli.main import build_parser

    args = argparse.Namespace(command="serve", func=None, model="reference", expert_plan=[], decode_pools_by_load=None,
                              port=8000, observe="live.safetensors")
    assert command_line(args, ("model",)) == "moetailor serve reference --port 8000 --observe live.safetensors"
    args.expert_plan, args.decode_pools_by_load = ["a=a.json", "b=b.json"], ["p1.json", "p2.json"]
    line = command_line(args, ("model",))
    parsed = build_parser().parse_args(shlex.split(line)[1:])
    assert parsed.expert_plan == ["a=a.json", "b=b.json"] and parsed.decode_pools_by_load == ["p1.json", "p2.json"]
