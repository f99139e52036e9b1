"""`moetailor export gguf` on a tiny random model of every architecture llama.cpp's converter knows
(with the bundled tokenizer): the full and the pruned file compute what moetailor's engine computes
(the pruned one: what the engine computes with the plan)."""
from __future__ import annotations

import pytest
from llamacpp_helpers import SKIP_REASON, TOLERANCE, copy_bundled_tokenizer, engine_run, top_logprob_gap

pytest.importorskip("llama_cpp", reason=SKIP_REASON)

from moetailor.integrations.llamacpp import greedy, last_logits, load  # noqa: E402

PROMPTS = ["12+34=", "reverse: abc ->", "sort 3 1 2:", "the quick brown fox", "def f(x):\n    return x"]
KEEP = (0, 2, 5, 7)
# norm_topk_prob as llama.cpp's graph for the architecture hard-codes it, and the shapes its loaders take
# (transforms/gguf.py: routing_difference, loader_problem): OLMoE without GQA, DeepSeek with a query LoRA
ROUTING = {"qwen2_moe": dict(norm_topk_prob=False), "olmoe": dict(norm_topk_prob=False, num_key_value_heads=4),
           "qwen3_moe": dict(norm_topk_prob=True), "mixtral": {},
           "deepseek_v3": dict(norm_topk_prob=True, q_lora_rank=16)}


def tiny_checkpoint(arch: str, path):
    from moetailor.models.tiny import tiny_model
    from moetailor.plans import uniform_plan
    from moetailor.routing import LayerPolicy

    model = tiny_model(arch, seed=1, num_experts=8, top_k=2, hidden=64, expert_width=32, vocab=8192, **ROUTING[arch])
    model.save_pretrained(path)
    copy_bundled_tokenizer(path)
    model.moetailor_source = str(path)
    both = LayerPolicy(keep=KEEP)
    return uniform_plan(model, decode=both, prefill=both).save(path.parent / "plan.json")


@pytest.mark.parametrize("arch", list(ROUTING))
def test_tiny_model_full_and_pruned_match_the_engine(arch, tmp_path):
    from moetailor.cli.main import main
    from moetailor.serving import LLM

    src = tmp_path / "model"
    plan = tiny_checkpoint(arch, src)
    full_gguf, pruned_gguf = tmp_path / "full.gguf", tmp_path / "pruned.gguf"
    assert main(["export", "gguf", str(src), "--out", str(full_gguf)]) == 0
    assert main(["export", "gguf", str(src), "--plan", str(plan), "--out", str(pruned_gguf)]) == 0

    wants = []
    for gguf_path, engine in ((full_gguf, LLM(str(src))), (pruned_gguf, LLM(str(src), plan))):
        want, firsts, prompt_ids = engine_run(engine, PROMPTS, max_tokens=12)
        wants.append(want)
        llm = load(gguf_path)
        for ids, first, expected in zip(prompt_ids, firsts, want):
            assert top_logprob_gap(first, last_logits(llm, ids)) < TOLERANCE, (arch, gguf_path.name)
            assert greedy(llm, ids, 12, {0}) == expected, (arch, gguf_path.name)
    assert wants[0] != wants[1], f"{arch}: the plan must change some output for the pruned file to be tested"


def test_split_checkpoint_and_its_elastic_budget(tmp_path):
    """A `moetailor split` checkpoint (MoE-Prism sub-experts) is a stock MoE: its file computes what the
    engine computes, and a smaller sub-expert budget is llama.cpp's expert_used_count."""
    from moetailor.cli.main import main
    from moetailor.serving import LLM

    src, split = tmp_path / "model", tmp_path / "split"
    tiny_checkpoint("qwen3_moe", src)
    assert main(["split", str(src), "--parts", "4", "--method", "random", "--data", "tasks", "--tokens", "2048",
                 "--seq-len", "128", "--out", str(split)]) == 0                 # 32 sub-experts, top-8
    out = tmp_path / "split.gguf"
    assert main(["export", "gguf", str(split), "--out", str(out)]) == 0
    engine = LLM(str(split))
    outputs = {}
    for k in (None, 3):
        want, firsts, prompt_ids = engine_run(engine, PROMPTS, max_tokens=12, expert_top_k=k)
        llm = load(out, top_k=k)
        outputs[k] = [greedy(llm, ids, 12, {0}) for ids in prompt_ids]
        assert outputs[k] == want, k
        for ids, first in zip(prompt_ids, firsts):
            assert top_logprob_gap(first, last_logits(llm, ids)) < TOLERANCE, k
    assert outputs[3] != outputs[None]                 # the budget changes outputs
