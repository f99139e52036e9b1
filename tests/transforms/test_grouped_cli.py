"""calibrate -> plan -> prune -> generate -> eval from the command line on a tiny DeepSeek-V3-style
checkpoint (dense first layer, 16 experts in 4 groups, top-4 from 2 groups, one shared expert)."""
import json

from moetailor.cli.main import main
from moetailor.models.tiny import char_tokenizer, tiny_grouped_model
from moetailor.plans import Plan


def generated_text(out: str) -> str:
    return out.split("--- prompt: 'add 12 + 34'\n")[1].split("\n")[0]


def heldout_perplexity(results_dir, variant: str) -> float:
    rows = json.loads((results_dir / "results.json").read_text())["rows"]
    return next(r["perplexity"] for r in rows if r["variant"] == variant and r.get("perplexity") is not None)


def test_grouped_checkpoint_end_to_end(tmp_path, capsys):
    src, stats = tmp_path / "model", tmp_path / "stats.safetensors"
    tiny_grouped_model().save_pretrained(src)
    char_tokenizer().save_pretrained(src)
    assert main(["calibrate", str(src), "--data", "mix", "--tokens", "1500", "--batch-tokens", "512",
                 "--seq-len", "128", "--out", str(stats)]) == 0

    plan = tmp_path / "plan.json"
    assert main(["plan", str(stats), "--criterion", "reap", "--keep", "0.5", "--phase", "both",
                 "--out", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "per group" in out and "2 2 2 2" in out and "the same count kept in every group" in out
    assert Plan.load(plan).meta["groups"]["mode"] == "balanced"

    # a count that cannot be spread evenly over the groups is refused with the valid counts
    assert main(["plan", str(stats), "--criterion", "reap", "--keep-experts", "6", "--out", str(tmp_path / "x.json")]) == 2
    assert "choose a count in [8, 12, 16]" in capsys.readouterr().err

    # ignoring groups makes a masked-only plan: prune refuses it with the fix
    free = tmp_path / "free.json"
    assert main(["plan", str(stats), "--criterion", "frequency", "--keep-experts", "8", "--groups", "ignore",
                 "--out", str(free)]) == 0
    assert "masked serving only" in capsys.readouterr().out
    assert Plan.load(free).meta["groups"]["per_group"]["1"] != [2, 2, 2, 2]  # random routers: uneven use
    assert main(["prune", str(src), str(free), "--out", str(tmp_path / "no")]) == 2
    assert "group-balanced plan" in capsys.readouterr().err

    pruned = tmp_path / "pruned"
    assert main(["prune", str(src), str(plan), "--out", str(pruned)]) == 0
    assert "16 -> 8" in capsys.readouterr().out

    # the pruned checkpoint generates what the full model generates with the plan's masked router
    prompt = ["--prompt", "add 12 + 34", "--max-tokens", "10", "--ignore-eos"]
    assert main(["generate", str(pruned), *prompt]) == 0
    from_pruned = generated_text(capsys.readouterr().out)
    assert main(["generate", str(src), "--plan", str(plan), *prompt]) == 0
    assert generated_text(capsys.readouterr().out) == from_pruned and len(from_pruned) > 0

    quick = ["--tasks", "addition", "--n", "2", "--seeds", "1", "--max-tokens", "6", "--kl-docs", "1",
             "--kl-window", "32"]
    assert main(["eval", str(pruned), "--configs", "baseline", *quick, "--out", str(tmp_path / "e1")]) == 0
    assert main(["eval", str(src), "--plan", str(plan), "--configs", "baseline,pruned,phase-aware", *quick,
                 "--out", str(tmp_path / "e2")]) == 0
    # held-out perplexity of the checkpoint equals the masked full model's (the plan in both phases)
    ppl = heldout_perplexity(tmp_path / "e1", "baseline")
    masked = [r for r in json.loads((tmp_path / "e2" / "results.json").read_text())["rows"]
              if r["configuration"] == "pruned" and r.get("perplexity") is not None]
    assert masked and abs(masked[0]["perplexity"] - ppl) < 1e-3 * ppl
    assert abs(heldout_perplexity(tmp_path / "e2", "baseline") - ppl) > 1e-3 * ppl
