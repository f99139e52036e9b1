"""CLI round trip on a tiny checkpoint: calibrate -> plan -> prune -> plain-transformers reload."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from moetailor.calibration import ExpertStats
from moetailor.cli.main import main
from moetailor.models import load_model
from moetailor.models.tiny import char_tokenizer, tiny_model
from moetailor.plans import Plan
from moetailor.routing import RoutingController


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_cli_round_trip(arch, tmp_path, capsys):
    src = tmp_path / "model"
    tiny_model(arch, num_experts=8, top_k=2).save_pretrained(src)
    char_tokenizer().save_pretrained(src)
    stats, plan, out = tmp_path / "stats.safetensors", tmp_path / "plan.json", tmp_path / "pruned"

    assert main(["calibrate", str(src), "--data", "mix", "--tokens", "1500", "--batch-tokens", "512",
                 "--seq-len", "128", "--fold", "--out", str(stats)]) == 0
    s = ExpertStats.load(stats)
    assert s.meta["tokens"] == 1500 and s.meta["data"] == "mix" and s.has_fold
    assert sum(float(l.frequency.sum()) for l in s.layers.values()) == 1500 * 2 * len(s.layers)

    assert main(["plan", str(stats), "--criterion", "reap", "--keep", "0.5", "--model", str(src),
                 "--out", str(plan)]) == 0
    p = Plan.load(plan)
    assert p.meta["criterion"] == "reap" and p.fold_stats == str(stats)
    assert all(len(k) == 4 for k in p.kept_experts("decode").values()) and p.prefill.is_identity

    assert main(["prune", str(src), str(plan), "--out", str(out)]) == 0
    assert (out / "tokenizer.json").exists()
    assert main(["prune", str(src), str(plan), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err

    # the full model with the plan's masked router is what the pruned checkpoint must compute
    model = load_model(src)
    x = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    ctl = RoutingController(model)
    with torch.no_grad(), ctl.policy(p.decode):
        want = model(input_ids=x, use_cache=False).logits
    torch.save({"x": x, "want": want}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        m = AutoModelForCausalLM.from_pretrained({str(out)!r}, local_files_only=True).eval()
        AutoTokenizer.from_pretrained({str(out)!r}, local_files_only=True)
        io = torch.load({str(tmp_path / 'io.pt')!r})
        with torch.no_grad():
            got = m(input_ids=io["x"], use_cache=False).logits
        assert not any(k.startswith("moetailor") for k in sys.modules)
        print("maxdiff", float((got - io["want"]).abs().max()))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.split("maxdiff")[1]) <= 1e-5
    assert json.loads((out / "moetailor_pruning.json").read_text())["num_experts_kept"] == 4


def test_cli_errors(tmp_path, capsys):
    src = tmp_path / "model"
    tiny_model("olmoe", num_experts=8, top_k=2).save_pretrained(src)
    char_tokenizer().save_pretrained(src)
    stats = tmp_path / "stats.safetensors"
    assert main(["calibrate", str(src), "--data", "tasks", "--tokens", "300", "--out", str(stats)]) == 0
    assert main(["plan", str(stats), "--criterion", "reap", "--keep-experts", "1", "--out", str(tmp_path / "p.json")]) == 2
    assert "top-k=2" in capsys.readouterr().err
    assert main(["plan", str(stats), "--criterion", "mass", "--layers", "0:6,1:4", "--out", str(tmp_path / "p.json")]) == 0
    assert main(["prune", str(src), str(tmp_path / "p.json"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "keeps 6/4 of 8 experts per layer" in err and "moetailor serve MODEL --decode-plan PLAN" in err
    assert main(["calibrate", str(src), "--data", "nowhere.jsonl", "--out", str(stats)]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "cut.safetensors").write_bytes(stats.read_bytes()[:100])
    assert main(["plan", str(tmp_path / "cut.safetensors"), "--criterion", "reap", "--keep", "0.5",
                 "--out", str(tmp_path / "q.json")]) == 2
    assert "truncated" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", str(stats), "--criterion", "soft", "--keep", "0.5", "--out", str(tmp_path / "q.json")])
    assert "'frequency', 'mass'" in capsys.readouterr().err
