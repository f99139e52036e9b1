"""Can vLLM's CPU build serve a DeepSeek-V3 checkpoint with moetailor's plugin, with the engine's outputs?

A tiny random DeepSeek-V3 (grouped sigmoid routing: 16 experts in 4 groups, top-4 from 2 groups, a
correction bias, MLA attention) is written, moetailor's engine generates for it (main venv), then
vLLM does, stock and with a phase-aware plan plus per-request budgets (.venv-vllm):

    .venv/bin/python scripts/vllm_deepseek_v3.py engine build/dsv3
    .venv-vllm/bin/python scripts/vllm_deepseek_v3.py vllm build/dsv3 [--eager]

vLLM's CPU MLA decode kernel takes only head_dim 576 (kv_lora_rank 512 + rope 64) with v_head_dim
512, and vLLM's DeepSeek class reads the correction bias only when config.json says
``"topk_method": "noaux_tc"`` (real DeepSeek-V3 configs do; transformers' config class does not
write it): the checkpoint is shaped for both. Results: docs/vllm.md.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = ["hello world", "abc abc abc", "1+2=3, 2+3=", "the quick brown fox", "zzz", "MoE layers route tokens"]
BUDGETS = [None, 2, None, 1, 3, None]
NEW_TOKENS = 16


def engine(out: Path) -> None:
    from moetailor.engine import LLM, SamplingParams
    from moetailor.models.tiny import char_tokenizer, tiny_grouped_model
    from moetailor.plans import uniform_plan
    from moetailor.routing import LayerPolicy

    out.mkdir(parents=True, exist_ok=True)
    # MLA sizes vLLM's CPU kernel supports; head_dim / qk_head_dim are derived fields, set with them
    model = tiny_grouped_model(seed=1, hidden=128, expert_width=64, kv_lora_rank=512, qk_rope_head_dim=64,
                               qk_nope_head_dim=64, v_head_dim=64, head_dim=64, qk_head_dim=128)
    model.config.topk_method, model.config.scoring_func = "noaux_tc", "sigmoid"
    model.save_pretrained(out)
    char_tokenizer().save_pretrained(out)
    model.moetailor_source = str(out)
    plan = uniform_plan(model, decode=LayerPolicy(keep=tuple(range(0, 16, 2))))
    plan.save(out / "plan.json")
    greedy = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    planned = LLM(str(out), plan).generate(PROMPTS, [SamplingParams(**greedy, expert_top_k=k) for k in BUDGETS])
    full = LLM(str(out)).generate(PROMPTS, SamplingParams(**greedy))
    (out / "engine.json").write_text(json.dumps({"plan": [list(o.token_ids) for o in planned],
                                                 "full": [list(o.token_ids) for o in full]}))
    print(f"engine outputs written to {out / 'engine.json'}")


def vllm(out: Path, eager: bool) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations" / "vllm"))
    from vllm import SamplingParams
    from vllm_helpers import vllm_engine

    from moetailor.integrations.vllm.launch import engine_kwargs

    ref = json.loads((out / "engine.json").read_text())
    for name, plan, budgets in (("stock", None, [None] * len(PROMPTS)), ("plan + budgets", out / "plan.json", BUDGETS)):
        kwargs = engine_kwargs(out, decode_plan=plan, kv_cache_mib=32, max_num_batched_tokens=128, max_num_seqs=4,
                               max_model_len=128, enforce_eager=eager)
        params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                 extra_args=None if k is None else {"expert_top_k": k}) for k in budgets]
        with vllm_engine(**kwargs) as llm:
            got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        expected = ref["full"] if plan is None else ref["plan"]
        same_first = sum(g[0] == e[0] for g, e in zip(got, expected))
        print(f"{name}: {sum(g == e for g, e in zip(got, expected))}/{len(PROMPTS)} outputs equal the engine's, "
              f"{same_first}/{len(PROMPTS)} first tokens")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("engine", "vllm"):
        raise SystemExit(__doc__)
    if sys.argv[1] == "engine":
        engine(Path(sys.argv[2]))
    else:
        vllm(Path(sys.argv[2]), "--eager" in sys.argv)
