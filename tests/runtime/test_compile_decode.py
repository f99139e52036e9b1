"""`compile_decode=True` (`--compile-decode`): decode steps through torch.compile of transformers'
modules, for checkpoints the engine's decoders do not cover (here OLMoE's module path, as
``own_decoder=False`` runs it). The compiled steps must compute what the eager ones do, and must
actually run compiled."""
from __future__ import annotations

from moetailor.models.tiny import tiny_model
from moetailor.serving import LLM, SamplingParams


def test_compiled_decode_equals_the_eager_module_path():
    import torch._dynamo

    model = tiny_model("olmoe", seed=3, vocab=256)
    prompts = [[5, 9, 17, 33, 2], [7, 7, 1], [40, 41, 42, 43, 44, 45, 46]]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    eager = LLM(model, max_num_seqs=4, max_model_len=64, own_decoder=False)
    assert eager.runner.decoder is None and eager.runner._compiled is None
    expected = eager.generate(prompts, params)
    torch._dynamo.reset()
    compiled = LLM(model, max_num_seqs=4, max_model_len=64, compile_decode=True)
    calls = []
    forward = compiled.runner._compiled.forward
    compiled.runner._compiled.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    got = compiled.generate(prompts, params)
    assert len(calls) >= 5                                         # every decode step ran the compiled model
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in g.logprobs]),
                                   torch.tensor([lp.logprob for lp in e.logprobs]), rtol=1e-4, atol=1e-4)
