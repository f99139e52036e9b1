"""A merged `reference-qwen3` (`moetailor prune` of an HC-SMoE plan: 32 merged experts per layer, a stock
Qwen3-MoE checkpoint) exported by `moetailor export gguf` and run by llama.cpp: its last-token
log-probabilities and greedy outputs equal moetailor's fp32 engine on the merged checkpoint, and the
merge changes them from the full model's."""
from __future__ import annotations

import pytest

from llamacpp_helpers import MAX_TOKENS, SKIP_REASON, TOLERANCE, engine_run, top_logprob_gap

pytest.importorskip("llama_cpp", reason=SKIP_REASON)

from moetailor.integrations.llamacpp import greedy, last_logits, load   # noqa: E402

EOS = {0}


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """(merged checkpoint, its GGUF file), both written by the CLI."""
    from moetailor.calibration import calibrate
    from moetailor.cli.main import main
    from moetailor.models import load_model, load_tokenizer
    from moetailor.plans.criteria import make_plan

    root = tmp_path_factory.mktemp("merged-qwen3")
    model = load_model("reference-qwen3")
    stats = calibrate(model, load_tokenizer("reference-qwen3"), "tasks", 1024, batch_tokens=512, seq_len=128,
                      progress=False)
    plan = make_plan(stats, model, "frequency", keep=0.5, merge="hcsmoe").save(root / "plan.json")
    assert main(["prune", "reference-qwen3", str(plan), "--out", str(root / "merged")]) == 0
    assert main(["export", "gguf", str(root / "merged"), "--out", str(root / "merged.gguf")]) == 0
    return root / "merged", root / "merged.gguf"


def test_merged_qwen3_file_matches_the_engine_on_the_merged_checkpoint(merged, prompts):
    import gguf

    from moetailor.serving import LLM

    checkpoint, path = merged
    kv = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    assert kv["general.architecture"] == "qwen3moe" and kv["qwen3moe.expert_count"] == 32
    want, firsts, prompt_ids = engine_run(LLM(str(checkpoint)), prompts)
    llm = load(path)
    for ids, first in zip(prompt_ids, firsts):
        assert top_logprob_gap(first, last_logits(llm, ids)) < TOLERANCE
    got = [greedy(llm, ids, MAX_TOKENS, EOS) for ids in prompt_ids]
    assert got == want
    assert got != engine_run(LLM("reference-qwen3"), prompt_ids)[0], "the merge must change some outputs"
