"""Every verb that writes: an existing output needs --overwrite, an input is never overwritten (not
even with --overwrite, not through a symlink), file-vs-folder mistakes are one line before any
work, outputs get normal permissions, and no temporary file or folder is left behind, also when
the process gets SIGTERM in the middle of writing a checkpoint."""
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from moetailor.cli.main import main
from moetailor.models.tiny import char_tokenizer, tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny checkpoint, its statistics and a plan; a checkpoint folder without weights (any verb
    that loaded a model before checking --out would fail on it with another message)."""
    root = tmp_path_factory.mktemp("outputs")
    model = tiny_model("qwen2_moe", num_experts=8, top_k=2)
    model.save_pretrained(root / "model")
    char_tokenizer().save_pretrained(root / "model")
    uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3))).save(root / "plan.json")
    assert main(["calibrate", str(root / "model"), "--data", "tasks", "--tokens", "256", "--out",
                 str(root / "stats.safetensors")]) == 0
    (root / "weightless").mkdir()
    shutil.copy(root / "model" / "config.json", root / "weightless" / "config.json")
    return root


def _one_line_error(capsys, *fragments):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], err
    return lines[0]


def _files(folder):
    return sorted(p.name for p in folder.iterdir())


def test_plan_refuses_to_write_over_its_statistics(work, capsys):
    stats = work / "stats.safetensors"
    before = stats.read_bytes()
    capsys.readouterr()
    argv = ["plan", str(stats), "--criterion", "reap", "--keep", "0.5", "--overwrite", "--out"]
    assert main(argv + [str(stats)]) == 2
    _one_line_error(capsys, "same path as the input", "even with --overwrite")
    link = work / "stats-link.json"
    link.symlink_to(stats)
    assert main(argv + [str(link)]) == 2
    _one_line_error(capsys, "same path as the input")
    assert stats.read_bytes() == before


def test_calibrate_refuses_an_existing_file_before_loading_the_model(work, tmp_path, capsys):
    plan = tmp_path / "existing_plan.json"
    shutil.copy(work / "plan.json", plan)
    capsys.readouterr()
    assert main(["calibrate", str(work / "weightless"), "--data", "tasks", "--tokens", "64", "--out", str(plan)]) == 2
    _one_line_error(capsys, "already exists", "--overwrite")
    assert plan.read_bytes() == (work / "plan.json").read_bytes()
    assert main(["calibrate", str(work / "model"), "--data", "tasks", "--tokens", "64", "--overwrite", "--out",
                 str(work / "model" / "model.safetensors")]) == 2
    _one_line_error(capsys, "is a file of the input")


@pytest.mark.parametrize("verb", [
    lambda w, out: ["calibrate", str(w / "weightless"), "--data", "tasks", "--tokens", "64", "--out", out],
    lambda w, out: ["plan", str(w / "stats.safetensors"), "--criterion", "reap", "--keep", "0.5", "--out", out],
    lambda w, out: ["search-k", str(w / "weightless"), "--data", "tasks", "--budget", "6", "--out", out],
])
def test_a_folder_where_a_file_goes_is_one_line_before_any_work(verb, work, tmp_path, capsys):
    capsys.readouterr()
    assert main(verb(work, str(tmp_path))) == 2
    _one_line_error(capsys, "is a directory, but this writes a file")
    (tmp_path / "f").write_text("")
    assert main(verb(work, str(tmp_path / "f" / "x.json"))) == 2
    _one_line_error(capsys, "is a file, not a folder")


def test_written_files_get_normal_permissions_and_no_temp_file(work, tmp_path, capsys):
    old = os.umask(0o022)
    try:
        assert main(["plan", str(work / "stats.safetensors"), "--criterion", "reap", "--keep", "0.5",
                     "--out", str(tmp_path / "p.json")]) == 0
        assert main(["calibrate", str(work / "model"), "--data", "tasks", "--tokens", "64",
                     "--out", str(tmp_path / "s.safetensors")]) == 0
        assert main(["prune", str(work / "model"), str(work / "plan.json"), "--out", str(tmp_path / "pruned")]) == 0
    finally:
        os.umask(old)
    assert _files(tmp_path) == ["p.json", "pruned", "s.safetensors"]
    written = [tmp_path / "p.json", tmp_path / "s.safetensors", *(tmp_path / "pruned").iterdir()]
    assert tmp_path / "pruned" / "model.safetensors" in written
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path   # not 0600 (mkstemp, safetensors)


@pytest.mark.parametrize("verb", [
    lambda w, out: ["prune", str(w / "model"), str(w / "plan.json"), "--out", out],
    lambda w, out: ["split", str(w / "model"), "--parts", "2", "--data", "text", "--tokens", "64", "--out", out],
    lambda w, out: ["distill", str(w / "model"), str(w / "plan.json"), "--data", "tasks", "--steps", "1", "--out", out],
])
def test_checkpoint_verbs_never_replace_their_source(verb, work, tmp_path, capsys):
    config = (work / "model" / "config.json").read_bytes()
    (tmp_path / "link").symlink_to(work / "model")
    capsys.readouterr()
    for out in (work / "model", tmp_path / "link", work):     # itself, through a symlink, a folder holding it
        assert main(verb(work, str(out)) + ["--overwrite"]) == 2
        _one_line_error(capsys, "never writes over its own input")
    assert (work / "model" / "config.json").read_bytes() == config


def test_eval_and_bench_outputs_are_checked_before_the_work(work, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    capsys.readouterr()
    assert main(["eval", str(work / "weightless"), "--configs", "baseline", "--out", str(tmp_path / "file")]) == 2
    _one_line_error(capsys, "is an existing file, but this writes a directory")
    assert main(["eval", str(work / "model"), "--configs", "baseline", "--out", str(work / "model")]) == 2
    _one_line_error(capsys, "same path as the input")
    assert main(["eval", str(work / "weightless"), "--configs", "baseline", "--out", str(tmp_path)]) == 2
    _one_line_error(capsys, "holds files but no earlier evaluation")
    bench = ["bench", "project", "--gpu", "h200", "--model-shape", "olmoe-1b-7b", "--out", str(tmp_path / "b")]
    assert main(bench) == 0
    capsys.readouterr()
    assert main(bench) == 2
    _one_line_error(capsys, "already holds a benchmark report", "--overwrite")
    assert main(bench + ["--overwrite"]) == 0
    assert not [n for n in _files(tmp_path / "b") if n.startswith(".")]


BARRIER = textwrap.dedent("""
    import signal, sys
    import moetailor.transforms.streaming as streaming   # the pruner `moetailor prune` runs (shard-streamed)
    from moetailor.cli.main import main

    real = streaming.copy_tokenizer
    def copy_then_wait(source, dest):   # runs inside the write: the weights are in the hidden folder
        real(source, dest)
        print("writing", flush=True)
        signal.pause()                  # a barrier, not a stand-in: the test sends SIGTERM now
    streaming.copy_tokenizer = copy_then_wait
    sys.exit(main(sys.argv[1:]))
""")


def test_sigterm_while_prune_writes_leaves_no_hidden_folder(work, tmp_path):
    out = tmp_path / "pruned"
    proc = subprocess.Popen([sys.executable, "-c", BARRIER, "prune", str(work / "model"), str(work / "plan.json"),
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
        hidden = tmp_path / f".pruned.tmp-{proc.pid}"
        assert (hidden / "model.safetensors").is_file()       # the signal lands in the middle of the write
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err
    assert _files(tmp_path) == []
