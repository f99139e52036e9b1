"""`moetailor demo`, the README's first command, run as a user runs it (smaller): quality on the trained
model, then the pools' decode speed on a real-shaped model whose experts stream from memory."""
import re
import subprocess
import sys


def test_demo_shows_what_the_pool_costs_and_what_it_saves():
    run = subprocess.run([sys.executable, "-m", "moetailor.cli.main", "demo", "--per-task", "1", "--speed-steps", "3"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "per task: correct answers and p90 output length" in out
    assert "why a second model for speed" in out
    rows = {int(m[0]): m for m in re.findall(r"│ (\d+)\s+│ ([\d.]+)\s+│ ([\d.]+)\s+│ ([\d.]+)\s+│ ([\d.]+)\s+│", out)}
    assert set(rows) >= {1, 8, 32}, out[-3000:]
    full_read, pool_read = float(rows[32][3]), float(rows[32][4])
    assert pool_read <= 32 < full_read     # the 50% pool reads at most half of the 64 experts, the full pool more


def test_one_stalled_step_does_not_set_the_demos_decode_speed():
    """A step stalled by another process (seconds on a shared machine) made one run of the same demo read
    75 tok/s and the other 4,794: the figure is the median step's."""
    from types import SimpleNamespace

    from moetailor.cli.demo import _decode_summary

    step = lambda seconds: SimpleNamespace(phase="decode", num_tokens=60, seconds=seconds,  # noqa: E731
                                           distinct_experts={0: 20}, expert_bytes=2**20)
    llm = SimpleNamespace(step_log=[step(0.01)] * 20 + [step(20.0)])
    summary = _decode_summary(llm)
    assert summary["tokens_per_s"] == 6000 and summary["step_s"] == 0.01
