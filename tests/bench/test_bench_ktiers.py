"""`bench ktiers` end to end on a tiny checkpoint: every schedule serves the whole workload, the
k-aware ones keep budgets apart, and bad --mix values are named (counts and wiring, never timings)."""
import json

import pytest

from moetailor.bench.ktiers import SCHEDULES, parse_mix, run_ktiers, workload
from moetailor.models.tiny import tiny_model


def test_parse_mix_and_workload():
    assert parse_mix("2:0.5,8:0.5") == [(2, 0.5), (8, 0.5)]
    for bad in ("2-0.5", "0:1", "2:0", ""):
        with pytest.raises(ValueError, match="--mix"):
            parse_mix(bad)
    prompts, ks = workload([(1, 0.5), (4, 0.5)], 40, 12, vocab=50)
    assert len(prompts) == len(ks) == 40 and set(ks) == {1, 4}
    assert all(6 <= len(p) <= 12 and all(2 <= t < 50 for t in p) for p in prompts)
    assert ks != sorted(ks)                     # budgets arrive interleaved


def test_bench_ktiers_runs_every_schedule(tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_model("qwen2_moe", seed=2, num_experts=16, top_k=4).save_pretrained(model_dir)
    rep = run_ktiers(str(model_dir), "1:0.5,4:0.5", requests=12, prompt_len=8, max_tokens=5, max_num_seqs=4,
                     repeats=1, quick=True, synthetic_layers=1, out=tmp_path / "out")
    rep.write()
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(data["runs"]) == list(SCHEDULES)
    for schedule, runs in data["runs"].items():
        assert runs[0]["tokens"] == 12 * 5, schedule
    assert data["runs"]["max"][0]["mean_step_k"] == 4.0
    assert data["runs"]["tiers"][0]["mean_step_k"] < 4.0
    with pytest.raises(ValueError, match="routes 4 experts"):
        run_ktiers(str(model_dir), "8:1", 4, 8, 2, 4, 1, True, 1, tmp_path / "bad")
