"""Traffic statistics summed on the engine's device (``LayerSums``, what the vLLM plugin observes with)
against calibration's ``Collector`` on the same routes: the router-side sums in their torch form and
as the native op, and the expert outputs the experts kernel adds from its one pass (routes the step
serves and routes it does not), so that observed statistics stay calibration's."""
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from moetailor import kernels
from moetailor.calibration.calibrate import Collector
from moetailor.calibration.observe import LayerSums
from moetailor.models.architectures import RouterSemantics

needs_kernels = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                   reason="no C++ compiler: the native ops are not built")
E, K, H, I, T, LIVE = 12, 4, 64, 32, 9, 7       # rows LIVE.. are padding


def layer(scoring: str = "softmax") -> SimpleNamespace:
    return SimpleNamespace(index=0, num_experts=E, hidden_size=H,
                           semantics=RouterSemantics(E, K, scoring, normalise=True))


def step(seed: int = 0, scoring: str = "softmax"):
    """logits [T, E], the full router's weights / index [T, K] (one route dropped), live and decode [T]."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 2
    scores = logits.sigmoid() if scoring == "sigmoid-grouped" else logits.softmax(-1)
    weights, index = scores.topk(K, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    index[1, -1], weights[1, -1] = E, 0.0                      # a dropped route
    live = torch.arange(T) < LIVE
    decode = torch.zeros(T, dtype=torch.bool)
    decode[4:LIVE + 1] = True                                   # a padding row flagged decode counts nowhere
    return logits, weights, index, live, decode


def expert(gate_up, down, e: int, x: torch.Tensor) -> torch.Tensor:
    h = gate_up[e] @ x                                          # [2I]
    return down[e] @ (F.silu(h[:I]) * h[I:])                    # [H]


def collected(lay, hidden, logits, weights, index, gate_up=None, down=None) -> dict:
    """Collector's statistics of the live rows (experts' outputs through ``expert`` when given)."""
    outputs = gate_up is not None

    def expert_outputs(_, rows, experts):
        return torch.stack([expert(gate_up, down, int(e), x) for x, e in zip(rows, experts)])

    c = Collector([lay], expert_outputs=expert_outputs if outputs else None, outputs=outputs)
    c(lay, hidden[:LIVE], logits[:LIVE], weights[:LIVE], index[:LIVE])
    return c.stats[0].tensors()


def assert_sums(got: dict, want: dict, names) -> None:
    for name in names:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_kernels)])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid-grouped"])
def test_router_sums_equal_the_collector(native, scoring):
    """Live rows of an armed step count once: frequency, mass, co-selection and beta as calibration
    sums them, tokens and decode tokens counted; the call disarms the layer, so a second forward of the
    step (or one the engine did not report) adds nothing."""
    logits, weights, index, live, decode = step(1, scoring)
    sums = LayerSums(E, K, 16, "cpu", sigmoid=scoring == "sigmoid-grouped", native=native)
    armed = torch.tensor([0, 1])
    sums.add_routes(logits, weights, index, live, decode, armed, 1)
    assert armed.tolist() == [0, 0]
    assert sums.routes[:T].tolist() == torch.where((index < E) & live[:, None], index, E).tolist()
    sums.add_routes(logits, weights, index, live, decode, armed, 1)   # unarmed: nothing (no route to observe)
    assert (sums.routes[:T] == E).all()
    got, counts = sums.take()
    assert counts == (LIVE, LIVE - 4, 1)
    assert_sums(got, collected(layer(scoring), torch.zeros(T, H), logits, weights, index),
                ("frequency", "mass", "coselect", "beta_hist"))
    empty, counts = sums.take()                                            # take starts the sums again
    assert counts == (0, 0, 0) and float(empty["frequency"].sum()) == 0


@needs_kernels
@pytest.mark.parametrize("gate", ["renorm", "softmax"])
def test_softmax_routes_the_native_op_selects_equal_the_collector(gate):
    """A softmax router's full routes picked inside the op from the logits (``add_logits``, what the vLLM
    plugin observes with) are the top k of the softmax, and their sums the Collector's."""
    logits, _, _, live, decode = step(4)
    weights, index = logits.softmax(-1).topk(K, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    sums = LayerSums(E, K, 16, "cpu", gate=gate, native=True)
    armed = torch.ones(1, dtype=torch.long)
    sums.add_logits(logits, live, decode, armed, 0)
    assert armed.tolist() == [0]
    assert sums.routes[:T].tolist() == torch.where(live[:, None], index, E).tolist()
    got, counts = sums.take()
    assert counts == (LIVE, LIVE - 4, 1)
    lay = layer()
    c = Collector([lay], gate, outputs=False)
    c(lay, torch.zeros(LIVE, H), logits[:LIVE], weights[:LIVE], index[:LIVE])
    assert_sums(got, c.stats[0].tensors(), ("frequency", "mass", "coselect", "beta_hist"))
    with pytest.raises(RuntimeError, match="softmax"):
        LayerSums(E, K, 16, "cpu", sigmoid=True, native=True).add_logits(logits, live, decode, armed, 0)


@needs_kernels
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("served", ["full", "budget"])
@pytest.mark.parametrize("dtype,packed", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_expert_outputs_from_the_one_pass_equal_the_collector(native, served, dtype, packed):
    """The experts kernel's output is swiglu_experts' for the served routes, and its side sums are the
    Collector's EAN, weighted EAN and output statistics of the full router's routes: "full" serves them
    all; "budget" serves two of them and one other expert per token, so the rest run as extra rows."""
    torch.manual_seed(2)
    logits, weights, index, live, decode = step(2)
    gate_up, down = (torch.randn(E, 2 * I, H) * 0.2).to(dtype), (torch.randn(E, H, I) * 0.2).to(dtype)
    x = torch.randn(T, H)
    if served == "full":
        s_index, s_weight = index.clone(), weights.clone()
    else:
        other = (index[:, :1] + 5) % E                                     # often not one of the token's routes
        s_index, s_weight = torch.cat([index[:, :2], other], 1), torch.cat([weights[:, :2], weights[:, 2:3]], 1)
    sums = LayerSums(E, K, 16, "cpu", hidden_size=H, native=native)
    sums.add_routes(logits, weights, index, live, decode, torch.ones(1, dtype=torch.long), 0)
    held = [kernels.pack_weight(w) for w in (gate_up, down)] if packed else [gate_up, down]
    args = (x, *held, s_index.contiguous(), s_weight.contiguous())
    out = kernels.swiglu_experts_observed()(*args, sums.routes[:T], sums.gates[:T], sums.outputs)
    torch.testing.assert_close(out, kernels.swiglu_experts()(*args, torch.zeros(1, dtype=torch.long), -1))
    got, _ = sums.take()
    want = collected(layer(), x, logits, weights, index, gate_up.float(), down.float())
    assert set(got) == set(want)
    assert_sums(got, want, ("frequency", "mass", "coselect", "beta_hist"))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    for name in ("ean", "weighted_ean", "out_sum", "out_sq", "out_max"):
        torch.testing.assert_close(got[name], want[name], **tol, msg=name)


@needs_kernels
def test_observe_ops_are_torch_ops_with_fake_implementations():
    from torch.library import opcheck

    logits, weights, index, live, decode = step(3)
    sums = LayerSums(E, K, 16, "cpu", hidden_size=H, native=True)
    opcheck(torch.ops.moetailor.observe_routes.default,
            (logits, weights, index, live, decode, torch.ones(1, dtype=torch.long), 0, False, True, 1000, sums.sums,
             sums.routes, sums.gates))
    opcheck(torch.ops.moetailor.observe_routes.default,                  # the routes selected in the op
            (logits, *sums._select, live, decode, torch.ones(1, dtype=torch.long), 0, False, True, 1000, sums.sums,
             sums.routes, sums.gates))
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    opcheck(torch.ops.moetailor.swiglu_experts_observed.default,
            (torch.randn(T, H), gate_up, down, index, weights, index.clone(), weights.clone(), sums.outputs))
