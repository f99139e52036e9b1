"""`scripts/gpu_check.py --device cpu` (the dry run of `make gpu-check`) runs every check end to end
on a tiny checkpoint: the verbs' device-vs-CPU comparisons pass, the CUDA-only checks say skipped,
and the table and JSON come out."""
import importlib.util
import json
from pathlib import Path

from moetailor.models.tiny import char_tokenizer, tiny_model

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def test_the_gpu_check_dry_run_on_the_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOETAILOR_NATIVE", "0")
    model = tmp_path / "tiny"
    tiny_model("qwen2_moe", num_experts=8, top_k=2, expert_width=16).save_pretrained(model)
    char_tokenizer().save_pretrained(model)
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--small", "--models", str(model), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["check"]: r for r in report["checks"]}
    assert set(rows) == {"calibrate tiny", "eval tiny", "distill tiny", "split tiny", "cuda-tests", "graph-routing",
                         "hbm-floor"}
    for name in ("calibrate tiny", "eval tiny", "distill tiny", "split tiny"):
        assert rows[name]["passed"] is True, rows[name]
    assert rows["calibrate tiny"]["moved_routes"] == 0 and rows["calibrate tiny"]["streamed_peak_device_bytes"] > 0
    assert rows["cuda-tests"]["passed"] is None and "skipped" in rows["cuda-tests"]["numbers"]
    assert rows["graph-routing"]["passed"] is None
    assert rows["hbm-floor"]["rows"]["1"]["step_us"] > 0
    assert "gpu check on cpu" in " ".join(capsys.readouterr().out.split())
