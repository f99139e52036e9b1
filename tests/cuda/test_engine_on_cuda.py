"""The engine and the plugin's routing op on a CUDA device (skipped without one; CI has none: run
with ``pytest tests/cuda`` where a GPU is). What a CPU run cannot show: that every per-step tensor
follows the engine's device, and that the routing op vLLM captures in a CUDA graph follows each
replay's budgets and phases (buffers written in place) instead of the capture's."""
from __future__ import annotations

import contextlib

import pytest
import torch

from moetailor.integrations.vllm.routing import LayerRouting, step_routes
from moetailor.models.architectures import RouterSemantics
from moetailor.models.tiny import tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import CompiledPolicy, FoldTables, LayerPolicy, RoutingController
from moetailor.serving import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = "cuda"
LENGTHS = [3, 9, 17, 5, 1, 12, 30, 7]


def prompts(lengths, seed=0, vocab=96) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy_reference(model, prompt: list[int], new: int, decode_policy=None) -> list[int]:
    """transformers on the model's device, one prompt, the prefill on the full router and (with a
    policy) the decode steps on ``decode_policy``: the engine's phase-aware decode by hand."""
    ctl = RoutingController.of(model)
    with torch.no_grad():
        out = model(torch.tensor([prompt], device=CUDA), use_cache=True)
        cache, tokens = out.cache, [int(out.logits[0, -1].argmax())]
        with ctl.policy(decode_policy) if decode_policy is not None else contextlib.nullcontext():
            for _ in range(new - 1):
                out = model(torch.tensor([[tokens[-1]]], device=CUDA), cache=cache, use_cache=True)
                cache = out.cache
                tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "olmoe", "mixtral"])
def test_greedy_on_cuda_matches_transformers_on_cuda(arch):
    model = tiny_model(arch).to(CUDA)
    batch = prompts(LENGTHS)
    llm = LLM(model, device=CUDA, block_size=4, num_kv_blocks=128)
    outs = llm.generate(batch, SamplingParams(max_tokens=8, ignore_eos=True))
    for prompt, out in zip(batch, outs):
        assert out.token_ids == greedy_reference(model, prompt, 8), f"{arch}: prompt of {len(prompt)} tokens"
    assert llm.block_manager.num_free == 128


def test_phase_aware_decode_on_cuda_reads_only_the_pool():
    model = tiny_model("qwen2_moe", seed=1).to(CUDA)
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 2, 5)))
    batch = prompts([4, 13, 8], seed=1)
    llm = LLM(model, plan, device=CUDA, block_size=4)
    outs = llm.generate(batch, SamplingParams(max_tokens=10, ignore_eos=True))
    for prompt, out in zip(batch, outs):
        assert out.token_ids == greedy_reference(model, prompt, 10, plan.decode)
    decode = [r for r in llm.step_log if r.phase == "decode"]
    assert decode and all(max(r.distinct_experts.values()) <= 3 for r in decode)


def test_per_request_budgets_on_cuda_equal_the_plans_top_k():
    model = tiny_model("olmoe", seed=2).to(CUDA)
    batch = prompts([6, 10], seed=2)
    plan = uniform_plan(model, decode=LayerPolicy(top_k=1), prefill=LayerPolicy(top_k=1))
    by_plan = LLM(model, plan, device=CUDA).generate(batch, SamplingParams(max_tokens=6, ignore_eos=True))
    by_request = LLM(model, device=CUDA).generate(batch, SamplingParams(max_tokens=6, ignore_eos=True, expert_top_k=1))
    assert [o.token_ids for o in by_plan] == [o.token_ids for o in by_request]


# ---- the plugin's routing op in a captured CUDA graph (what vLLM does on a GPU) ----

E, K, T = 16, 4, 24
SEM = RouterSemantics(num_experts=E, top_k=K, scoring="softmax", normalise=True)
POOL = tuple(range(0, E, 2))
POLICIES = {
    "mask": LayerPolicy(keep=POOL),
    "fold": LayerPolicy(keep=POOL, pool_mode="fold"),
    "skip": LayerPolicy(skip_beta=0.5),
    "token_fold": LayerPolicy(token_keep=2),
    "batch_fold": LayerPolicy(batch_pool=5),
    "stacked": LayerPolicy(keep=POOL[:6] + (1, 3), pool_mode="fold", top_k=3, skip_beta=0.2, batch_pool=6),
}


def routing(decode: LayerPolicy, device) -> LayerRouting:
    g = torch.Generator().manual_seed(0)
    scale, loss = torch.rand(E, E, generator=g) * 1.5, torch.rand(E, E, generator=g)
    scale.fill_diagonal_(1.0), loss.fill_diagonal_(0.0)
    tables = FoldTables(scale.to(device), loss.to(device), (torch.rand(E, generator=g) + 0.5).to(device))
    prefill = LayerPolicy(keep=POOL[:5] + (1, 3, 5))
    cps = [CompiledPolicy.build(p, SEM, device, tables) for p in (prefill, decode)]
    return LayerRouting(SEM, cps[0], cps[1], max(p.top_k or K for p in (prefill, decode)))


def step_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 2                           # [T, E]
    decode = torch.rand(T, generator=g) < 0.6                            # [T]
    token_k = torch.randint(1, K + 1, (T,), generator=g)                 # [T]
    live = torch.arange(T) < T - seed % 4                                # the last few: padding
    return logits, live, decode, token_k


def dense(weights, index):
    out = torch.zeros(index.shape[0], E + 1, dtype=torch.float64, device=index.device)
    return out.scatter_add_(1, index.long(), weights.double())[:, :E].cpu()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_routes_on_cuda_equal_routes_on_the_cpu(name):
    cpu, gpu = routing(POLICIES[name], "cpu"), routing(POLICIES[name], CUDA)
    for seed in range(3):
        inputs = step_inputs(seed)
        logits, *rest = inputs
        want = step_routes(logits, cpu, *rest)
        got = step_routes(logits.to(CUDA), gpu, *[x.to(CUDA) for x in rest])
        torch.testing.assert_close(dense(*got), dense(*want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_captured_cuda_graph_follows_every_replays_budgets_and_phases(name):
    """Capture once on one step's buffers, then write other steps into them and replay: each replay
    gives the routes eager routing gives that step (a host read or a branch on a value would fail the
    capture; a value baked in at capture would fail the comparison)."""
    lr = routing(POLICIES[name], CUDA)
    buffers = [x.to(CUDA) for x in step_inputs(0)]                    # logits, live, decode, token_k
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step_routes(buffers[0], lr, *buffers[1:])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_w, out_i = step_routes(buffers[0], lr, *buffers[1:])
    for seed in range(1, 6):
        step = step_inputs(seed)
        for buf, value in zip(buffers, step):
            buf.copy_(value)
        graph.replay()
        want = step_routes(step[0].to(CUDA), lr, *[x.to(CUDA) for x in step[1:]])
        torch.testing.assert_close(dense(out_w, out_i), dense(*want), rtol=1e-5, atol=1e-6)


def test_the_op_compiled_with_cuda_graphs_follows_each_step():
    """``torch.compile(mode="reduce-overhead")`` (Inductor + CUDA graph trees, vLLM's GPU default in
    spirit) over the opaque op and an expert combine: budgets changed between calls change the output."""
    import torch._dynamo

    from moetailor.integrations.vllm import routing as plugin_routing

    lr = routing(POLICIES["stacked"], CUDA)
    key = f"{len(plugin_routing._ROUTINGS)}:cuda-test"
    plugin_routing._ROUTINGS[key] = lr
    experts = torch.randn(E, 8, device=CUDA)                                  # [E, D] one vector per expert

    def layer(logits, live, decode, token_k):
        w, i = torch.ops.moetailor.step_routes(logits, live, decode, token_k, key)   # [T, W] each
        return (w[..., None] * experts[i]).sum(1)                            # [T, D]

    torch._dynamo.reset()
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    outs = []
    for seed in (0, 1, 2, 1):
        step = [x.to(CUDA) for x in step_inputs(seed)]
        if seed == 2:
            step[3].fill_(1)                                                  # every request on budget 1
        for _ in range(2):                                                    # graph trees record, then replay
            got = compiled(*step).clone()
        torch.testing.assert_close(got, layer(*step), rtol=1e-5, atol=1e-5)
        outs.append(got)
    assert not torch.allclose(outs[1], outs[2]), "a budget written between replays must change the routes"
