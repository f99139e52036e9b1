"""A split (sub-expert) checkpoint on the engine's fast decode path: its sub-experts are narrower than
the native kernel's 16-wide vectors (48 / 4 = 12), so the engine pads them with zero neurons and runs
the engine decoder's bound graph; it must give the greedy tokens the module path and torch's kernels give
(logprobs within 1e-4: the fp32 sums run in another order), at the
full budget and at a per-request budget (which changes the output), and a model handed in keeps its
own weights."""
from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import random_prompts

from moetailor.models import moe_layers
from moetailor.models.tiny import tiny_model
from moetailor.runtime.experts import runs_natively
from moetailor.serving import LLM, SamplingParams
from moetailor.transforms.split import LayerSplit, random_partition, split_model

WIDTH, PARTS = 48, 4


@pytest.fixture(scope="module")
def split():
    """A tiny Qwen2-MoE (8 experts of 48, top-2) split in 4: 32 sub-experts of 12, top-8; the copied
    router rows get a little noise so that sub-experts of one parent do not tie."""
    model = tiny_model("qwen2_moe", num_experts=8, top_k=2, expert_width=WIDTH, seed=5)
    E = 8
    splits = {l.index: LayerSplit(random_partition(E, WIDTH, PARTS, seed=l.index), torch.full((E, PARTS), 1 / PARTS))
              for l in moe_layers(model)}
    out = split_model(model, splits, PARTS, "exact")
    with torch.no_grad():
        for l in moe_layers(out):
            l.router.weight.add_(torch.randn_like(l.router.weight) * 0.05)
    return out


def generate(model, budget, **engine):
    llm = LLM(copy.deepcopy(model), **engine)
    prompts = random_prompts([5, 9, 3, 12, 7, 4], seed=2)
    params = [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, expert_top_k=budget(i)) for i in range(6)]
    outs = llm.generate(prompts, params)
    return llm, [o.token_ids for o in outs], [o.logprobs for o in outs]


@pytest.mark.parametrize("budget", [lambda i: None, lambda i: 3, lambda i: (None, 2, 5)[i % 3]],
                         ids=["full", "one budget", "mixed budgets"])
def test_split_checkpoint_runs_the_bound_graph_and_equals_the_module_path(one_thread, split, budget):
    llm, tokens, logprobs = generate(split, budget)
    assert moe_layers(split)[0].experts.down_proj.shape[-1] == WIDTH // PARTS
    assert llm.runner.decoder is not None and llm.runner.decoder.graph is not None   # the fast path
    assert all(runs_natively(l.experts) for l in llm.runner.controller.layers)
    for path in ({"own_decoder": False}, {"native_kernels": False}):   # the module path; unpadded, torch's kernels
        _, other_tokens, other_logprobs = generate(split, budget, **path)
        assert tokens == other_tokens
        for a, b in zip(logprobs, other_logprobs):
            for x, y in zip(a, b):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4


def test_a_budget_changes_the_split_models_output(one_thread, split):
    _, full, _ = generate(split, lambda i: None)
    _, low, _ = generate(split, lambda i: 2)
    assert full != low


def test_a_model_handed_in_keeps_its_own_expert_width(one_thread, split):
    """Without leave to change the model's layout (pack_weights unset, the model handed in) the engine
    pads copies; with pack_weights=True it pads (and packs) in place, as it packs."""
    model = copy.deepcopy(split)
    llm = LLM(model, pack_weights=False)
    assert llm.runner.padded and llm.runner.decoder.graph is not None
    assert moe_layers(model)[0].experts.down_proj.shape[-1] == WIDTH // PARTS
