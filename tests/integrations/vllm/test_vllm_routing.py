"""The plugin's routing hook as a function (no vLLM needed): for every LayerPolicy the engine
applies, ``step_routes`` on a step that mixes prefill and decode tokens and budgets gives each
token the routes the engine's ``route`` gives it, reads no expert the engine's kept routes do not
read, and traces into one graph (no host read, no data-dependent branch)."""
from __future__ import annotations

import zlib

import pytest
import torch

from moetailor.integrations.vllm.routing import LayerRouting, redirect_dropped, step_routes
from moetailor.models.architectures import RouterSemantics
from moetailor.routing import CompiledPolicy, FoldTables, LayerPolicy, route

E, K, T = 16, 4, 14
SEM = RouterSemantics(num_experts=E, top_k=K, scoring="softmax", normalise=True)
SEM_NO_NORM = RouterSemantics(num_experts=E, top_k=K, scoring="softmax", normalise=False)
POOL = tuple(range(0, E, 2))

POLICIES = {
    "full": LayerPolicy(),
    "mask": LayerPolicy(keep=POOL),
    "drop": LayerPolicy(keep=POOL, pool_mode="drop"),
    "fold": LayerPolicy(keep=POOL, pool_mode="fold"),
    "top_k": LayerPolicy(top_k=2),
    "skip": LayerPolicy(skip_beta=0.5),
    "token_fold": LayerPolicy(token_keep=2),
    "token_drop": LayerPolicy(token_keep=2, fold=False),
    "batch_fold": LayerPolicy(batch_pool=5),
    "batch_drop": LayerPolicy(batch_pool=5, fold=False),
    "stacked": LayerPolicy(keep=POOL[:6] + (1, 3), pool_mode="fold", top_k=3, skip_beta=0.2, batch_pool=6),
}


def fold_tables(seed: int = 0) -> FoldTables:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(E, E, generator=g) * 1.5
    loss = torch.rand(E, E, generator=g)
    loss[torch.rand(E, E, generator=g) < 0.2] = float("inf")    # unobserved pairs
    scale.fill_diagonal_(1.0), loss.fill_diagonal_(0.0)
    return FoldTables(scale, loss, torch.rand(E, generator=g) + 0.5)


def step(seed: int = 0, n: int = T):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, E, generator=g) * 2                                 # [T, E]
    decode = torch.rand(n, generator=g) < 0.6                                  # [T]
    token_k = torch.randint(1, K + 1, (n,), generator=g)                      # [T]
    token_k[::3] = K                                                           # some requests set no budget
    return logits, decode, token_k


def dense(weights, index, n_experts=E):
    """[T, E] weight per (token, expert): what the experts compute, however the routes are written."""
    out = torch.zeros(index.shape[0], n_experts + 1, dtype=torch.float64)
    out.scatter_add_(1, index.long(), weights.double())
    return out[:, :n_experts]


def layer(prefill: LayerPolicy, decode: LayerPolicy, sem=SEM) -> LayerRouting:
    tables = fold_tables()
    cps = [CompiledPolicy.build(p, sem, "cpu", tables) for p in (prefill, decode)]
    width = max(p.top_k or sem.top_k for p in (prefill, decode))
    return LayerRouting(sem, cps[0], cps[1], width)


def engine_routes(logits, cp, sem, token_k):
    """The engine's routes for the tokens of one of its steps (a step has one phase)."""
    return route(logits, sem, cp, None, token_k)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("sem", [SEM, SEM_NO_NORM], ids=["renormalised", "softmax-over-all"])
def test_each_policy_gives_the_engines_routes_in_a_mixed_step(name, sem):
    policy = POLICIES[name]
    lr = layer(LayerPolicy(keep=POOL[:5] + (1, 3, 5)) if name != "full" else LayerPolicy(), policy, sem)
    logits, decode, token_k = step(seed=zlib.crc32(name.encode()) % 1000)   # the same seeds every run
    live = torch.ones(T, dtype=torch.bool)
    w, i = step_routes(logits, lr, live, decode, token_k)
    assert w.dtype == torch.float32 and i.shape == w.shape == (T, lr.width)
    assert bool(((i >= 0) & (i < E)).all()), "no sentinel or negative id may reach vLLM's kernel"
    got = dense(w, i)
    used = set()
    for phase, cp in ((False, lr.prefill), (True, lr.decode)):
        rows = decode == phase
        ew, ei = engine_routes(logits[rows], cp, sem, token_k[rows])
        torch.testing.assert_close(got[rows], dense(ew, ei), rtol=1e-6, atol=1e-7)
        used |= {int(e) for e in ei[(ei < E)].tolist()}
    assert {int(e) for e in i.reshape(-1).tolist()} <= used, "a dropped route must not make the step read an expert"


def test_a_phase_with_no_tokens_routes_nothing():
    """A step whose tokens are all of the other phase hands the router zero rows (and zero budgets)."""
    cp = layer(LayerPolicy(), LayerPolicy()).decode
    w, i = route(torch.empty(0, E), SEM, cp, None, torch.empty(0, dtype=torch.long))
    assert w.shape[0] == i.shape[0] == 0


def test_budgets_cut_the_experts_a_step_reads():
    lr = layer(LayerPolicy(), LayerPolicy())
    logits, decode, _ = step(seed=3, n=8)
    live = torch.ones(8, dtype=torch.bool)
    full = step_routes(logits, lr, live, decode, torch.full((8,), K))[1]
    cut = step_routes(logits, lr, live, decode, torch.full((8,), 1))[1]
    assert len(set(cut.reshape(-1).tolist())) == len(set(cut[:, 0].tolist())) < len(set(full.reshape(-1).tolist()))


def test_padding_tokens_rank_in_no_batch_pool():
    lr = layer(LayerPolicy(), POLICIES["batch_fold"])
    logits, _, token_k = step(seed=5)
    decode = torch.ones(T, dtype=torch.bool)
    live = torch.arange(T) < 6
    w, i = step_routes(logits, lr, live, decode, token_k)
    ew, ei = engine_routes(logits[:6], lr.decode, SEM, token_k[:6])
    torch.testing.assert_close(dense(w, i)[:6], dense(ew, ei), rtol=1e-6, atol=1e-7)


def test_redirect_keeps_a_token_with_no_kept_route_on_a_step_expert():
    index = torch.tensor([[E, E], [3, E], [E, 7]])
    weights = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    w, i = redirect_dropped(weights, index, E)
    assert i.tolist() == [[3, 3], [3, 3], [7, 7]] and w.tolist() == [[0, 0], [1, 0], [0, 1]]
    w, i = redirect_dropped(torch.zeros(2, 2), torch.full((2, 2), E), E)   # nothing kept at all: expert 0
    assert i.tolist() == [[0, 0], [0, 0]]


def test_hook_traces_to_one_graph_that_follows_every_step():
    """vLLM's CPU backend traces once and drops guards (CUDA graphs capture once): the hook must not
    graph-break or read a per-step value, and the one graph must follow budgets and phases."""
    import torch._dynamo

    torch._dynamo.reset()
    lr = layer(POLICIES["stacked"], POLICIES["batch_fold"])
    compiled = torch.compile(step_routes, fullgraph=True, backend="eager", dynamic=True)
    for seed in range(3):
        logits, decode, token_k = step(seed=seed, n=T + seed)
        live = torch.ones(T + seed, dtype=torch.bool)
        if seed == 2:
            decode[:] = True
            token_k[:] = K
        want = step_routes(logits, lr, live, decode, token_k)
        got = compiled(logits, lr, live, decode, token_k)
        torch.testing.assert_close(got[0], want[0]), torch.testing.assert_close(got[1], want[1])


def test_the_hook_is_one_opaque_op_with_a_fake_implementation():
    """The hook calls ``torch.ops.moetailor.step_routes``: vLLM's trace sees one node (nothing of the
    routing to specialise), the op passes torch's op checks (schema, fake tensors, dynamic shapes)
    and gives ``step_routes``'s routes."""
    import torch._dynamo
    from torch.library import opcheck

    from moetailor.integrations.vllm import routing

    lr = layer(POLICIES["stacked"], POLICIES["batch_fold"])
    key = f"{len(routing._ROUTINGS)}:test"
    routing._ROUTINGS[key] = lr
    logits, decode, token_k = step(seed=0, n=T)
    live = torch.ones(T, dtype=torch.bool)
    opcheck(torch.ops.moetailor.step_routes.default, (logits, live, decode, token_k, key))
    got = torch.ops.moetailor.step_routes(logits, live, decode, token_k, key)
    want = step_routes(logits, lr, live, decode, token_k)
    torch.testing.assert_close(got[0], want[0]), torch.testing.assert_close(got[1], want[1])
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    torch._dynamo.reset()
    hooked = torch.compile(lambda *a: torch.ops.moetailor.step_routes(*a, key), fullgraph=True, backend=backend,
                           dynamic=True)
    hooked(logits, live, decode, token_k)
    op = torch.ops.moetailor.step_routes
    assert len(graphs) == 1 and graphs[0][0] in (op, op.default)
    assert all("getitem" in str(t) for t in graphs[0][1:])


def test_route_recorder_counts_decode_steps_inside_a_traced_graph():
    """The recorder's in-place counters survive tracing (functionalised input mutation)."""
    import torch._dynamo

    from moetailor.integrations.vllm.routing import RouteRecorder

    torch._dynamo.reset()
    lr = layer(LayerPolicy(), LayerPolicy())
    rec = RouteRecorder([7], E, "cpu")

    def hooked(logits, live, decode, token_k):
        w, i = step_routes(logits, lr, live, decode, token_k)
        rec.record(7, i, live, decode)
        return w, i

    compiled = torch.compile(hooked, fullgraph=True, backend="aot_eager", dynamic=True)
    want = 0
    for seed, all_decode in ((0, False), (1, True), (2, True)):
        logits, decode, token_k = step(seed=seed, n=T + seed)
        decode[:] = decode | all_decode
        live = torch.arange(T + seed) < T        # the last `seed` tokens are padding
        i = compiled(logits, live, decode, token_k)[1]
        if bool(decode[:T].all()):
            want += len(set(i[:T].reshape(-1).tolist()))
    assert rec.totals() == {7: {"experts": want, "steps": 2}}


def novice_layer(prefill: LayerPolicy, decode: LayerPolicy, H: int = 6) -> LayerRouting:
    """A layer whose policies replace dropped experts by constants c_e [E, H] (novice pools)."""
    constants = torch.randn(E, H, generator=torch.Generator().manual_seed(9))
    cps = [CompiledPolicy.build(p, SEM, "cpu", None, constants) for p in (prefill, decode)]
    return LayerRouting(SEM, cps[0], cps[1], K)


def test_novice_routes_and_constants_are_the_engines_in_a_mixed_step():
    """A novice decode pool after a full prefill: each decode token's routes to replaced experts add
    g * c_e (``step_constants``) and reach the kernel as weight-0 routes to a kept expert, as the
    engine's experts path (``novice_split``) turns them into sentinels plus the constant; prefill tokens
    add nothing. The step reads no replaced expert."""
    from moetailor.integrations.vllm.routing import step_constants
    from moetailor.runtime.experts import novice_split

    lr = novice_layer(LayerPolicy(), LayerPolicy(keep=POOL, pool_mode="novice"))
    assert lr.has_constants
    logits, decode, token_k = step(seed=11)
    live = torch.ones(T, dtype=torch.bool)
    w, i = step_routes(logits, lr, live, decode, token_k)
    c = step_constants(logits, lr, live, decode, token_k, hidden=6)                    # [T, H]
    assert c.shape == (T, 6) and c.dtype == torch.float32
    assert bool((c[~decode] == 0).all())
    ew, ei = engine_routes(logits[decode], lr.decode, SEM, token_k[decode])
    want_c, ew, ei = novice_split(lr.decode, ew, ei)
    torch.testing.assert_close(dense(w, i)[decode], dense(ew, ei), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(c[decode], want_c, rtol=1e-6, atol=1e-6)
    assert want_c.abs().sum() > 0, "some decode token must route to a replaced expert"
    assert set(i[decode].reshape(-1).tolist()) <= set(POOL), "a replaced expert's weights must not be read"


def test_step_constants_is_one_opaque_op_that_traces():
    """``torch.ops.moetailor.step_constants`` passes torch's op checks and traces into one graph (as
    vLLM's compiled mode sees it); a layer with no novice policy adds zeros."""
    import torch._dynamo
    from torch.library import opcheck

    from moetailor.integrations.vllm import routing

    lr = novice_layer(LayerPolicy(keep=POOL[:6], pool_mode="novice"), LayerPolicy(keep=POOL, pool_mode="novice"))
    key = f"{len(routing._ROUTINGS)}:novice-test"
    routing._ROUTINGS[key] = lr
    logits, decode, token_k = step(seed=4)
    live = torch.ones(T, dtype=torch.bool)
    hidden = torch.randn(T, 6)
    opcheck(torch.ops.moetailor.step_constants.default, (hidden, logits, live, decode, token_k, key))
    want = routing.step_constants(logits, lr, live, decode, token_k, 6)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: torch.ops.moetailor.step_constants(*a, key), fullgraph=True,
                             backend="eager", dynamic=True)
    torch.testing.assert_close(compiled(hidden, logits, live, decode, token_k), want)
    plain = layer(LayerPolicy(), LayerPolicy(keep=POOL))
    assert not plain.has_constants
    assert bool((routing.step_constants(logits, plain, live, decode, token_k, 6) == 0).all())


def test_switching_to_a_novice_plan_needs_layers_hooked_for_constants():
    """A plan switched in on a running engine may replace experts by constants only where the layer's
    output was hooked for them at start (a novice start plan, or additional_config moetailor_novice)."""
    from moetailor.integrations.vllm import routing
    from moetailor.integrations.vllm.plan import RouterTables

    constants = torch.randn(E, 6)
    novice = CompiledPolicy.build(LayerPolicy(keep=POOL, pool_mode="novice"), SEM, "cpu", None, constants)
    full = CompiledPolicy.build(LayerPolicy(), SEM, "cpu")
    tables = RouterTables(SEM, {3: (full, novice)}, K, True)
    for hooked in (False, True):
        key = f"{len(routing._ROUTINGS)}:swap-test"
        routing._ROUTINGS[key] = LayerRouting(SEM, full, full, K, adds_constants=hooked)
        if not hooked:
            with pytest.raises(ValueError, match="layer 3's dropped experts by constants.*moetailor_novice"):
                routing.swap_tables({3: key}, tables)
            continue
        routing.swap_tables({3: key}, tables)
        assert routing._ROUTINGS[key].has_constants and routing._ROUTINGS[key].adds_constants
