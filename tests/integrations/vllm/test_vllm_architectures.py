"""The plugin on a tiny random model of each architecture whose vLLM class routes through
vLLM's fused-MoE layer: phase-aware masking and per-request budgets equal moetailor's engine."""
from __future__ import annotations

import pytest
from vllm_helpers import SKIP_REASON, vllm_engine

pytest.importorskip("vllm", reason=SKIP_REASON)

from moetailor.integrations.vllm.rpc import call, experts_kernel_layers  # noqa: E402

PROMPTS = ["hello world", "abc abc abc", "1+2=3, 2+3=", "the quick brown fox", "zzz", "MoE layers route tokens"]


def tiny_checkpoint(arch: str, path):
    from moetailor.models.tiny import char_tokenizer, tiny_model
    from moetailor.plans import uniform_plan
    from moetailor.routing import LayerPolicy

    # head_dim 32: a size vLLM's CPU attention kernels support
    model = tiny_model(arch, seed=1, num_experts=8, top_k=2, hidden=128, expert_width=64)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    model.moetailor_source = str(path)
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 2, 5)))
    return plan.save(path / "plan.json"), plan


@pytest.mark.parametrize("arch, experts_kernel", [("qwen2_moe", False), ("qwen3_moe", False), ("olmoe", False),
                                                  ("mixtral", False), ("olmoe", True), ("mixtral", True)])
def test_tiny_model_phase_aware_and_budget_equal_engine(arch, experts_kernel, tmp_path):
    """experts_kernel: the MoE layers on moetailor's experts kernel (vLLM's compiled mode traces
    through these architectures' MoE layers, so the kernel's path must be traceable)."""
    from moetailor.integrations.vllm.launch import engine_kwargs
    from moetailor.serving import LLM, SamplingParams

    plan_path, plan = tiny_checkpoint(arch, tmp_path)
    ks = [None, 1, None, 1, 2, None]
    engine = LLM(str(tmp_path), plan)
    expected = [list(o.token_ids) for o in engine.generate(
        PROMPTS, [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, expert_top_k=k) for k in ks])]
    full = [list(o.token_ids) for o in LLM(str(tmp_path)).generate(
        PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))]
    kwargs = engine_kwargs(tmp_path, decode_plan=plan_path, kv_cache_mib=32, max_num_batched_tokens=16,
                           max_num_seqs=4, max_model_len=128, experts_kernel=experts_kernel)
    with vllm_engine(**kwargs) as llm:
        assert call(llm, experts_kernel_layers)[0] == (
            len(plan.decode.layers) if experts_kernel else 0)
        from vllm import SamplingParams as VSP

        params = [VSP(max_tokens=16, temperature=0.0, ignore_eos=True,
                      extra_args=None if k is None else {"expert_top_k": k}) for k in ks]
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    assert got != full
