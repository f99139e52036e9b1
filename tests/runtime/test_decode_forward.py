"""The engine's own decoder (runtime/decoder.py) against transformers' stock modules: with torch's
ops for the dense layers, the same greedy tokens and logprobs bit for bit and the same experts read,
under a decode pool, skipping and mixed per-request budgets; with the native linear and norm ops
(packed or not), the same first tokens and close logprobs; the native graph equals the decoder's
Python loop bit for bit. Hooks and uncovered layers keep the module path."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import random_prompts

from moetailor import kernels
from moetailor.models.adapters import moe_layers
from moetailor.models.tiny import tiny_grouped_model, tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy
from moetailor.serving import LLM, SamplingParams


def run(model, plan, lean: bool, prompts, params, **engine):
    llm = LLM(model, plan, own_decoder=lean, **engine)
    assert (llm.runner.decoder is not None) == lean
    outs = llm.generate(prompts, params)
    reads = [r.distinct_experts for r in llm.step_log if r.phase == "decode"]
    return [(o.token_ids, o.logprobs) for o in outs], reads


def torch_dense_ops(monkeypatch) -> None:
    """Engines built after this run their dense layers (projections, norms) on torch's ops, as
    transformers' modules do: no native linear or norm op (attention, routing and experts stay native)."""
    monkeypatch.setattr(kernels, "rows_linear_pays", lambda: False)
    monkeypatch.setattr(kernels, "rms_norm", lambda: None)


def close_to(got, want, atol: float) -> None:
    """The same first two tokens of every sequence, their logprobs within ``atol`` (other summation orders)."""
    for (a, la), (b, lb) in zip(got, want):
        assert a[:2] == b[:2]
        torch.testing.assert_close(torch.tensor([e.logprob for e in la[:2]]), torch.tensor([e.logprob for e in lb[:2]]),
                                   atol=atol, rtol=0)


def plan_case(arch, dtype, seed):
    model = tiny_model(arch, seed=seed)
    with torch.no_grad():              # qwen2_moe's q/k/v biases start at zero: give them values to get wrong
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.1)
    model = model.to(dtype)
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 2, 3, 5), skip_beta=0.2))
    prompts = random_prompts([5, 17, 9, 12, 3, 8, 21, 4, 6, 11, 2, 14], seed=3)   # steps above and below 8 rows
    params = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2, expert_top_k=(None, 1, 2)[i % 3])
              for i in range(len(prompts))]
    return model, plan, prompts, params


@pytest.mark.parametrize("arch,dtype", [("qwen2_moe", torch.float32), ("qwen3_moe", torch.float32),
                                        ("olmoe", torch.float32), ("mixtral", torch.float32),
                                        ("qwen2_moe", torch.bfloat16), ("qwen3_moe", torch.bfloat16),
                                        ("olmoe", torch.bfloat16), ("mixtral", torch.bfloat16)])
def test_own_decoder_equals_the_module_path(one_thread, monkeypatch, arch, dtype):
    """With torch's ops for the dense layers the decoder is transformers' arithmetic: bf16 (what real
    checkpoints ship) rounds where transformers' modules round, bit for bit."""
    torch_dense_ops(monkeypatch)
    model, plan, prompts, params = plan_case(arch, dtype, seed=3)
    lean, modules = run(model, plan, True, prompts, params), run(model, plan, False, prompts, params)
    assert lean == modules
    full = run(model, None, True, prompts, params)
    assert full[0] != lean[0]          # the plan changes outputs, so the equality above can fail


@pytest.mark.parametrize("arch,dtype,packed", [("qwen2_moe", torch.float32, False), ("olmoe", torch.float32, True),
                                                ("qwen2_moe", torch.bfloat16, False), ("qwen3_moe", torch.bfloat16, True),
                                                ("olmoe", torch.bfloat16, True), ("mixtral", torch.bfloat16, True)])
def test_own_decoder_on_the_native_ops_is_close_to_the_module_path(one_thread, arch, dtype, packed):
    """With the native linear and norm ops (and the dense weights packed copies where the engine packs)
    the decoder sums in another order than torch's GEMM: the same first tokens, logprobs close."""
    if packed and not kernels.packed_weights_pay():
        pytest.skip("the engine packs only where the packed tile is compiled (AVX-512)")
    model, plan, prompts, params = plan_case(arch, dtype, seed=3)
    lean = LLM(model, plan, pack_weights=packed)
    assert lean.runner.native_norm is not None and (not packed or kernels.is_packed(lean.runner.decoder.layers[0].o))
    got = [(o.token_ids, o.logprobs) for o in lean.generate(prompts, params)]
    close_to(got, run(model, plan, False, prompts, params)[0], 1e-3 if dtype == torch.float32 else 0.05)


class CountingOps:
    """A bound decode graph, counting the calls of each of its methods."""
    def __init__(self, ops):
        self.ops, self.calls = ops, {}

    def __getattr__(self, name):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return getattr(self.ops, name)(*args)
        return call


@pytest.mark.parametrize("arch,dtype,packed", [("qwen2_moe", torch.float32, None), ("qwen3_moe", torch.float32, None),
                                                ("qwen3_moe", torch.bfloat16, False), ("olmoe", torch.bfloat16, True),
                                                ("mixtral", torch.bfloat16, True), ("qwen2_moe", torch.bfloat16, True),
                                                ("qwen2_moe", torch.bfloat16, False)])
def test_decode_layers_run_in_one_native_call_under_the_full_router(one_thread, arch, dtype, packed):
    """Steps of at most 8 rows: the whole step in one native call (the bound ``DecodeGraph``) under
    the full router, else one call of each bound layer (``layer``), and its ``attention`` + the
    controller + its ``moe`` under a plan; each equals the decoder's Python loop (bf16: converted and rounded where the
    Python loop converts and rounds, OLMoE's q/k norm over the whole projection, Mixtral's routing
    weights kept in fp32, Qwen2-MoE's shared expert through its own projections; packed projections as
    real-size bf16 checkpoints have them)."""
    if packed and not kernels.packed_weights_pay():
        pytest.skip("the engine packs only where the packed tile is compiled (AVX-512)")
    model = tiny_model(arch, seed=4).to(dtype)
    prompts = random_prompts([5, 17, 9, 3], seed=4)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    layers, steps = len(model.model.layers), 5
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 2, 5)))
    for plan, whole_step, calls in ((None, True, {"forward": steps}), (None, False, {"layer": steps * layers}),
                                    (plan, True, {"attention": steps * layers, "moe": steps * layers})):
        llm = LLM(model, plan, pack_weights=packed)
        graph = llm.runner.decoder.graph
        assert graph is not None and graph.whole_step and (not packed or kernels.is_packed(llm.runner.decoder.layers[0].qkv))
        counting = CountingOps(graph.op)
        llm.runner.decoder = dataclasses.replace(llm.runner.decoder, graph=dataclasses.replace(
            graph, op=counting, whole_step=whole_step))
        got = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
        assert counting.calls == calls
        loop = LLM(model, plan, pack_weights=packed)                   # the decoder's Python loop, op for op
        loop.runner.decoder = dataclasses.replace(loop.runner.decoder, graph=None)
        assert got == [(o.token_ids, o.logprobs) for o in loop.generate(prompts, params)]


@pytest.mark.parametrize("arch,masked", [("qwen2_moe", False), ("qwen3_moe", False), ("olmoe", False),
                                         ("mixtral", False), ("qwen2_moe", True)])
def test_decode_steps_run_the_native_router_with_the_stock_routes(one_thread, monkeypatch, arch, masked):
    """Decode steps route through the native ``softmax_topk`` op (logits through the step's linear
    op): the outputs equal the stock router's (torch's linear, softmax and top-k) up to float
    rounding."""
    model = tiny_model(arch, seed=5)
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 2, 3, 5), pool_mode="mask")) if masked else None
    prompts = random_prompts([5, 17, 9, 3, 12], seed=5)
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    native = LLM(model, plan, own_decoder=False)
    calls = []
    op = torch.ops.moetailor.softmax_topk
    monkeypatch.setattr(torch.ops.moetailor, "softmax_topk", lambda *args: calls.append(args[0].shape[0]) or op(*args))
    got = [(o.token_ids, o.logprobs) for o in native.generate(prompts, params)]
    assert len(calls) == 9 * len(model.model.layers)          # every decode step's every layer; no prefill
    stock = LLM(model, plan)
    stock.runner.decode_ops = dataclasses.replace(stock.runner.decode_ops, router=False)   # torch's routing
    want = [(o.token_ids, o.logprobs) for o in stock.generate(prompts, params)]
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        for x, y in zip(a, b):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_the_bundled_model_decodes_through_the_lean_forward():
    llm = LLM("reference")
    assert llm.runner.decoder is not None and len(llm.runner.decoder.layers) == 6
    assert llm.runner.native_norm is not None
    assert (llm.runner.native_linear is not None) == kernels.rows_linear_pays()   # torch's GEMV where it is faster


@pytest.mark.parametrize("arch,masked", [("olmoe", False), ("mixtral", False), ("qwen2_moe", True)])
def test_bf16_decode_steps_route_natively_with_the_stock_routes(one_thread, monkeypatch, arch, masked):
    """A bf16 model's decode steps route through the native selection too (the bf16 logits widened,
    as the stock router widens them; the weights cast back to bf16 where it casts them, Mixtral's
    kept in fp32): the lean loop (bf16) and the module path both, and the routes are the stock
    router's: the same tokens, logprobs as close as bf16 allows."""
    model = tiny_model(arch, seed=5).to(torch.bfloat16)
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 2, 3, 5), pool_mode="mask")) if masked else None
    prompts = random_prompts([5, 17, 9], seed=5)
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)
    native = LLM(model, plan)
    assert native.runner.native_router is not None
    calls, routed = [], []
    op = torch.ops.moetailor.softmax_topk
    monkeypatch.setattr(torch.ops.moetailor, "softmax_topk", lambda *args: calls.append(args[0].dtype) or op(*args))
    observe = native.controller.observing(lambda layer, hidden, logits, weights, index: routed.append(weights.dtype))
    with observe:
        got = native.generate(prompts, params)
    assert calls == [torch.float32] * (3 * len(model.model.layers))   # every decode step's layers, fp32 logits
    assert set(routed) == {torch.float32 if arch == "mixtral" else torch.bfloat16}
    stock = LLM(model, plan)
    stock.runner.decode_ops = dataclasses.replace(stock.runner.decode_ops, router=False)   # torch's routing
    for a, b in zip(got, stock.generate(prompts, params)):
        assert a.token_ids[:2] == b.token_ids[:2]
        torch.testing.assert_close(torch.tensor([e.logprob for e in a.logprobs[:2]]),
                                   torch.tensor([e.logprob for e in b.logprobs[:2]]), atol=0.05, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe"])
def test_a_projection_the_native_op_does_not_take_keeps_the_module_path(one_thread, arch):
    """A linear layer the native op does not take (here a non-contiguous weight): the decoder would
    run the op on it, so the engine keeps transformers' modules."""
    model = tiny_model(arch, seed=1).to(torch.bfloat16)
    o = model.model.layers[1].self_attn.o_proj
    o.weight = torch.nn.Parameter(o.weight.detach().t().contiguous().t(), requires_grad=False)   # same values
    llm = LLM(model)
    assert llm.runner.decoder is None or llm.runner.native_linear is None
    prompts = random_prompts([5, 9, 3], seed=1)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, params)] == \
        [o.token_ids for o in LLM(model, own_decoder=False).generate(prompts, params)]


def test_a_forward_hook_sends_the_step_through_the_modules(one_thread):
    model = tiny_model("qwen2_moe", seed=4)
    llm = LLM(model)
    calls = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, args, out: calls.append(out.shape[-2]))
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        handle.remove()
    assert len(calls) == 4             # the prefill and every decode step called the LM head module
    calls.clear()
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert calls == []


def test_a_bf16_norm_on_the_native_op_rounds_as_transformers():
    """A bf16 checkpoint's RMSNorms (OLMoE: 17 a step on the 4-layer real-size model, each eight torch
    ops) run the native op in the decoders' decode steps, rounding where transformers' bf16 norm does
    (rare last-bit flips from the variance's order); without the op, transformers' norm bit for bit."""
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    from moetailor.runtime.decoder import rms_norm

    torch.manual_seed(0)
    stock = OlmoeRMSNorm(256, eps=1e-5)
    stock.weight.data = torch.randn(256)
    stock = stock.bfloat16()
    x = (3 * torch.randn(2, 5, 256)).bfloat16()
    y = rms_norm(x, stock.weight, stock.variance_epsilon, kernels.rms_norm())
    assert y.dtype is torch.bfloat16 and y.shape == x.shape
    assert (y == stock(x)).float().mean() > 0.99
    torch.testing.assert_close(y.float(), stock(x).float(), rtol=2 ** -7, atol=1e-6)
    assert torch.equal(rms_norm(x, stock.weight, stock.variance_epsilon, None), stock(x))


@pytest.mark.parametrize("flags, onednn, fast", [
    ("fpu avx2 fma avx512f avx512bw avx512_vnni", True, False),   # AVX-512 without bf16: oneDNN says yes, widens in software
    ("fpu avx512f avx512bw avx512_bf16", True, True),
    ("fpu avx512f amx_bf16 amx_tile", True, True),
    ("fpu avx512f avx512_bf16", False, False),                     # a torch built without oneDNN's bf16
    ("fpu avx2 fma", False, False),
    ("", False, False)])                                         # no /proc/cpuinfo
def test_torch_bf16_gemm_counts_as_fast_only_with_bf16_in_hardware(monkeypatch, flags, onednn, fast):
    """A bf16 layer of more than a few rows leaves the native op for torch's GEMM only where the processor
    multiplies bf16 itself: on an AVX-512 core without it oneDNN claims bf16 support, and ran 2-3x slower
    than the op (2026-12-03)."""
    from moetailor.runtime import decoder

    monkeypatch.setattr(kernels, "_cpu_flags", lambda: f"flags\t\t: {flags}\n")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
    monkeypatch.setattr(decoder, "_BF16_GEMM_FAST", [])
    assert decoder.bf16_gemm_is_fast() is fast


@pytest.mark.parametrize("rows", [3, 32])
def test_a_bf16_linear_in_a_decode_step_runs_the_native_op_and_rounds_once(monkeypatch, rows):
    """A bf16 checkpoint's projections in a decoder's decode step: the bf16 rows go to the op, whose fp32
    sums of the bf16 weights are rounded to bf16 once, as torch's bf16 GEMM computes them (in another
    order: equal within bf16 rounding), at any row count where that GEMM has no hardware kernels;
    outside a step torch's own op."""
    from moetailor.runtime.decoder import bf16_gemm_is_fast, native_linear
    from moetailor.runtime.step import NativeOps, Step, running

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 40).bfloat16()
    x = torch.randn(rows, 64).bfloat16()
    calls = []

    op = kernels.rows_linear()

    def kernel(rows, weight, bias=None):
        calls.append((rows.dtype, weight.dtype))
        return op(rows, weight, bias)

    monkeypatch.setattr(torch.ops.moetailor, "rows_linear", kernel)
    with running(Step(is_prefill=False, native=NativeOps(linear=True))):
        y = native_linear(x, layer.weight, layer.bias)
    native = rows <= 8 or not bf16_gemm_is_fast()
    assert calls == ([(torch.bfloat16, torch.bfloat16)] if native else []) and y.dtype is torch.bfloat16
    assert y.shape == (rows, 40)
    torch.testing.assert_close(y, (x.float() @ layer.weight.float().T + layer.bias.float()).bfloat16())
    assert torch.equal(native_linear(x, layer.weight, layer.bias), torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("arch,dtype,decoder,packed", [("qwen2_moe", torch.float32, "Decoder", False),
                                                        ("olmoe", torch.bfloat16, "Decoder", False),
                                                        ("deepseek_v3", torch.float32, "MlaDecoder", False),
                                                        ("deepseek_v3", torch.bfloat16, "MlaDecoder", True),
                                                        ("grouped", torch.float32, "MlaDecoder", False),
                                                        ("grouped", torch.float32, "MlaDecoder", True)])
def test_prefill_and_decode_steps_run_the_engines_decoder(one_thread, monkeypatch, arch, dtype, decoder, packed):
    """Where the engine's decoder applies, no engine step calls transformers' modules, prefill steps
    (prompt logprobs included) as well as decode steps, and the outputs are the module path's (bit for
    bit on torch's dense ops; the first tokens, logprobs close with the dense weights packed for the
    native op, as for a checkpoint the engine loads itself), under a plan (which changes them) as
    under the full router. DeepSeek-V3
    (multi-head latent attention; ``grouped``: grouped routing and a dense first layer) has its own decoder."""
    if packed and not kernels.packed_weights_pay():
        pytest.skip("the engine packs only where the packed tile is compiled (AVX-512)")
    if not packed:
        torch_dense_ops(monkeypatch)
    model = (tiny_grouped_model(seed=1) if arch == "grouped" else tiny_model(arch, seed=2)).to(dtype)
    prompts = random_prompts([5, 9, 3], seed=2)
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    E = moe_layers(model)[0].num_experts
    plan = uniform_plan(model, decode=LayerPolicy(keep=tuple(range(0, E, 2)), pool_mode="mask"),
                        prefill=LayerPolicy(top_k=1))
    modules = [LLM(model, p, own_decoder=False, pack_weights=packed).generate(prompts, params) for p in (None, plan)]
    assert [o.token_ids for o in modules[0]] != [o.token_ids for o in modules[1]]   # the plan changes outputs
    engines = [LLM(model, p, pack_weights=packed) for p in (None, plan)]
    assert type(engines[0].runner.decoder).__name__ == decoder

    def refuse(*args, **kwargs):
        raise AssertionError("an engine step called transformers' forward")

    monkeypatch.setattr(type(model), "forward", refuse)
    for llm, want in zip(engines, modules):
        got = llm.generate(prompts, params)
        if packed:
            close_to([(o.token_ids, o.logprobs) for o in got], [(o.token_ids, o.logprobs) for o in want],
                     1e-3 if dtype == torch.float32 else 0.05)
        else:
            assert [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in got] == \
                [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in want]
