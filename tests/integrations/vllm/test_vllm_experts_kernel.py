"""moetailor's experts kernel in place of vLLM's CPU fused-MoE (``integrations/vllm/experts.py``):
the same layer output as vLLM's own kernel on the same routes, with weight-0 routes (what the
routing hook makes of a dropped one) skipped; a bad key is refused by name. The served-model check
(outputs equal moetailor's engine with mixed budgets, compiled) is the third engine of
``test_vllm_plugin.py``."""
from __future__ import annotations

import pytest
import torch
from vllm_helpers import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moetailor_kernel_equals_vllm_kernel_on_the_same_routes(dtype):
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    from moetailor.integrations.vllm.experts import run_experts
    from moetailor.kernels import swiglu_experts

    if swiglu_experts() is None:
        pytest.skip("moetailor's native kernels did not build here")
    g = torch.Generator().manual_seed(0)
    E, H, I, T, K = 16, 128, 64, 9, 4
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, K, generator=g)
    weights[::2, K - 1] = 0.0                         # dropped routes (weight 0 on a kept expert)
    weights[3] = 0.0                                  # a token with no route at all: output 0

    ours = torch.empty(T, H, dtype=dtype)
    run_experts(ours, x, w13, w2, weights, ids, None, False)
    theirs = torch.empty(T, H, dtype=dtype)
    cpu_fused_moe(theirs, x, cpu_prepack_moe_weight(w13, "vec"), cpu_prepack_moe_weight(w2, "vec"), None, None,
                  weights, ids, "silu", "vec")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), theirs.float(), atol=tol, rtol=tol)
    assert ours[3].abs().max() == 0
    # and the weight-0 routes are really skipped: the same result with their ids pointed anywhere
    moved = torch.where(weights == 0, (ids + 1) % E, ids)
    again = torch.empty(T, H, dtype=dtype)
    run_experts(again, x, w13, w2, weights, moved, None, False)
    assert torch.equal(again, ours)


@pytest.mark.parametrize("value", ["yes", 1])
def test_a_non_boolean_key_is_refused_by_name(value):
    from moetailor.integrations.vllm.experts import KEY, wanted

    with pytest.raises(ValueError, match=f"{KEY} must be true or false"):
        wanted({KEY: value})
    assert wanted({KEY: True}) and not wanted({}) and not wanted(None)
