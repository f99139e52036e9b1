"""Layer-streamed held-out KL equals the in-memory computation, and a plan's KL equals its pruned checkpoint's."""
import json

import torch
import torch.nn.functional as F

from moetailor.eval.streamed_kl import heldout_kl_streamed
from moetailor.models.tiny import char_tokenizer, tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy, RoutingController
from moetailor.transforms.streaming import prune_checkpoint_streamed

KEEP = (0, 2, 3, 6)


def test_streamed_kl_matches_in_memory_and_the_pruned_checkpoint(tmp_path):
    model = tiny_model("qwen2_moe", num_experts=8, top_k=2, layers=3)
    model.save_pretrained(tmp_path / "full", max_shard_size="40KB")
    plan = uniform_plan(model, decode=LayerPolicy(keep=KEEP))
    windows = torch.randint(3, 96, (5, 24), generator=torch.Generator().manual_seed(0)).tolist()
    got = heldout_kl_streamed(tmp_path / "full", windows, plan=plan, batch_size=2, progress=False)

    ids = torch.tensor(windows)
    ctl = RoutingController(model)
    with torch.no_grad():
        lp_full = F.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
        with ctl.policy(plan.decode):
            lp = F.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
    ctl.remove()
    want = float((lp_full.exp() * (lp_full - lp)).sum(-1).mean())
    assert want > 1e-4 and abs(got.kl - want) < 1e-5
    assert abs(got.perplexity_full - float(torch.exp(-lp_full.gather(-1, ids[:, 1:, None]).mean()))) < 1e-3

    pruned = prune_checkpoint_streamed(tmp_path / "full", plan, tmp_path / "pruned", progress=False)
    other = heldout_kl_streamed(tmp_path / "full", windows, pruned=pruned, batch_size=2, progress=False)
    assert abs(other.kl - got.kl) < 1e-5 and abs(other.perplexity - got.perplexity) < 1e-3


def test_eval_metric_kl_cli(tmp_path):
    from moetailor.cli.main import main

    model = tiny_model("olmoe", num_experts=8, top_k=2)
    model.save_pretrained(tmp_path / "full")
    char_tokenizer().save_pretrained(tmp_path / "full")
    uniform_plan(model, decode=LayerPolicy(keep=KEEP)).save(tmp_path / "plan.json")
    rc = main(["eval", str(tmp_path / "full"), "--metric", "kl", "--plan", str(tmp_path / "plan.json"),
               "--kl-docs", "1", "--kl-window", "32", "--out", str(tmp_path / "out")])
    assert rc == 0
    record = json.loads((tmp_path / "out" / "kl.json").read_text())
    assert record["kl"] > 0 and record["tokens"] > 0
    assert main(["eval", str(tmp_path / "full"), "--metric", "kl", "--out", str(tmp_path / "o2")]) == 2


def test_a_plan_run_and_a_pruned_run_report_the_same_full_model_perplexity(tmp_path):
    """`eval --metric kl --plan P` and `eval --metric kl --pruned DIR` score one full model: its perplexity
    is the same number in both (the bundled model in its stored bf16 used to give 320.30 and 320.18: the
    full model ran through the routing controller in one and transformers' experts in the other)."""
    from moetailor.data.corpus import bundled_documents
    from moetailor.eval.metrics import heldout_windows
    from moetailor.models import load_tokenizer, resolve_model_path
    from moetailor.plans import Plan

    path = resolve_model_path("reference")
    plan = Plan.load(path.parent / "plans" / "reference-reap-50.json")
    windows = heldout_windows(load_tokenizer("reference"), bundled_documents("heldout"), 1, 64)
    pruned = prune_checkpoint_streamed(path, plan, tmp_path / "pruned", progress=False)
    masked = heldout_kl_streamed(path, windows, plan=plan, progress=False)
    again = heldout_kl_streamed(path, windows, plan=plan, progress=False)
    other = heldout_kl_streamed(path, windows, pruned=pruned, progress=False)
    assert masked.perplexity_full == again.perplexity_full == other.perplexity_full
    assert abs(masked.kl - other.kl) < 1e-3
