"""A bad plan stops vLLM before it serves anything, with moetailor's one-line error."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from vllm_helpers import BUNDLED_PLAN, SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)

START = """
if __name__ == "__main__":
    import sys
    from vllm import LLM
    from moetailor.models.loading import resolve_model_path
    LLM(str(resolve_model_path("reference")), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
        max_model_len=256, enable_prefix_caching=sys.argv[2] == "prefix-cache",
        additional_config={"moetailor_decode_plan": sys.argv[1]})
    print("STARTED")
"""


@pytest.fixture
def bad_plans(tmp_path):
    data = json.loads(BUNDLED_PLAN.read_text())
    out_of_range = json.loads(json.dumps(data))
    out_of_range["decode"]["0"]["keep"] = out_of_range["decode"]["0"]["keep"][:-1] + [99]
    other_model = json.loads(json.dumps(data))
    other_model["model"]["router_hash"] = "0123456789abcdef"
    folding = json.loads(json.dumps(data))   # a fold pool needs ExFold tables; this plan names none
    folding["decode"]["1"]["pool_mode"] = "fold"
    paths = {}
    for name, plan in (("out_of_range", out_of_range), ("other_model", other_model), ("folding", folding)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(plan))
    return paths


def test_launcher_checks_the_plan_before_vllm_starts(bad_plans):
    from moetailor.integrations.vllm.launch import engine_kwargs
    from moetailor.plans.plan import PlanMismatch

    with pytest.raises(ValueError, match=r"expert ids \[99\] out of range 0..63 \(.*decode layer 0\)"):
        engine_kwargs("reference", decode_plan=bad_plans["out_of_range"])
    with pytest.raises(PlanMismatch, match="router_hash"):
        engine_kwargs("reference", decode_plan=bad_plans["other_model"])
    with pytest.raises(ValueError, match=r"folding\.json folds experts but names no fold statistics.*--fold"):
        engine_kwargs("reference", decode_plan=bad_plans["folding"])


def test_cli_prints_one_line_and_exits_2(bad_plans):
    r = subprocess.run([sys.executable, "-m", "moetailor.cli.main", "serve", "reference", "--backend", "vllm",
                        "--decode-plan", str(bad_plans["other_model"])], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "plan" in r.stderr and "does not match the model vLLM serves" in r.stderr
    assert "Traceback" not in r.stderr


def test_plain_vllm_start_fails_with_moetailor_line(bad_plans, tmp_path):
    """Without moetailor's launcher (LLM(..., additional_config=...) or `vllm serve`), the plugin
    checks the plan when the model loads: the start fails and the log names the problem."""
    script = tmp_path / "start.py"
    script.write_text(START)
    runs = [(subprocess.Popen([sys.executable, str(script), str(plan), cache], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True), line)
            for plan, cache, line in ((bad_plans["out_of_range"], "off", "expert ids [99] out of range 0..63"),
                                      (BUNDLED_PLAN, "prefix-cache", "needs prefix caching off"))]
    for proc, line in runs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode != 0 and "STARTED" not in out
        assert line in out, out[-3000:]
