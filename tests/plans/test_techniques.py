"""Folding (ExFold) and skipping plans on tiny models, checked end to end through the model."""
import math

import pytest
import torch

from moetailor.calibration import StatsMismatch, calibrate_batches
from moetailor.models import moe_layers
from moetailor.models.tiny import tiny_model
from moetailor.plans.techniques import (
    Shape,
    attach_fold_tables,
    fold_decode,
    fold_prefill,
    interpolate_k,
    layer_k_policy,
    parse_k_list,
    plan_from_specs,
    policy_from_spec,
    pool_with_fold,
    skip_policy,
    technique_plan,
    top_k_policy,
)
from moetailor.routing import FoldTables, LayerPolicy, PhasePolicy, RoutingController
from moetailor.routing.router import select

E, K = 8, 4


def make_model(layers=2, seed=0):
    return tiny_model("qwen2_moe", seed=seed, num_experts=E, top_k=K, layers=layers)


def ids(seed=0, batch=2, length=12):
    return torch.randint(2, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def fold_stats(model, path):
    stats = calibrate_batches(model, [ids(s, 4, 16) for s in range(3)], fold=True, progress=False)
    stats.save(path)
    return stats


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def stats_path(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("stats") / "fold.safetensors"
    fold_stats(model, path)
    return path


def logits(model, policy):
    ctl = RoutingController.of(model)
    with torch.no_grad(), ctl.policy(policy):
        return model(input_ids=ids()).logits


def routes(model, policy, x=None):
    """Per MoE layer: (weights [T, K], index [T, K]) the experts module received."""
    ctl = RoutingController.of(model)
    seen = {}
    with torch.no_grad(), ctl.policy(policy), ctl.observing(lambda l, h, z, w, i: seen.__setitem__(l.index, (w, i))):
        model(input_ids=ids() if x is None else x)
    return seen


def test_full_budgets_reproduce_the_full_model_exactly(model, stats_path):
    shape = Shape.of(model)
    attach_fold_tables(model, stats_path)
    full = logits(model, None)
    for policy in (fold_decode(shape, E), fold_prefill(shape, K), fold_decode(shape, E, fold=False),
                   fold_prefill(shape, K, fold=False), PhasePolicy.uniform(list(shape.layers), LayerPolicy(top_k=K))):
        assert torch.equal(logits(model, policy), full), policy
    assert top_k_policy(shape, K).is_identity
    # and a real budget changes the output (the comparison can fail)
    assert not torch.allclose(logits(model, fold_prefill(shape, 1)), full)


def test_hand_built_fold_tables_fold_onto_expected_targets_end_to_end():
    """One MoE layer, top-3 of 8, K_pre=2: the third route folds onto the kept expert with the lower
    L, adding S * its gate; the block output changes by exactly S*g*E_t(x) - g*E_src(x)."""
    model = tiny_model("qwen2_moe", seed=3, num_experts=E, top_k=3, layers=1)
    layer = moe_layers(model)[0]
    loss = torch.full((E, E), math.inf)
    scale = torch.zeros(E, E)
    for src in range(E):
        for dst in range(E):
            if src != dst:
                loss[src, dst] = ((src * 5 + dst * 3) % 7) / 7.0 + 0.01 * dst   # distinct, fixed
                scale[src, dst] = 0.25 + 0.1 * dst
    ctl = RoutingController.of(model)
    ctl.fold_tables[layer.index] = FoldTables(scale=scale, loss=loss, mean_norm=torch.ones(E))
    policy = fold_prefill(Shape.of(model), 2)

    captured = {}
    hook = layer.block.register_forward_hook(lambda m, a, out: captured.setdefault("out", []).append(
        (a[0].reshape(-1, a[0].shape[-1]).clone(), (out[0] if isinstance(out, tuple) else out).reshape(-1, a[0].shape[-1]))))
    try:
        x = ids(5, 2, 10)
        folded = routes(model, policy, x)[layer.index]
        with torch.no_grad(), ctl.policy(None):
            model(input_ids=x)
    finally:
        hook.remove()
    (hidden, out_fold), (hidden_full, out_full) = captured["out"]
    assert torch.equal(hidden, hidden_full)           # one layer: the block sees the same input
    with torch.no_grad():
        w, i = select(layer.router_logits(hidden), layer.semantics, 3, None)  # the full router [T, 3]
        expected = torch.zeros_like(out_full)
        for t in range(hidden.shape[0]):
            src, kept = int(i[t, 2]), [int(e) for e in i[t, :2]]
            target = min(kept, key=lambda e: float(loss[src, e]))
            row = dict(zip(folded[1][t].tolist(), folded[0][t].tolist()))
            assert set(row) == set(kept)              # the folded expert no longer runs
            base = dict(zip(kept, w[t, :2].tolist()))
            base[target] += float(scale[src, target]) * float(w[t, 2])
            for e in kept:
                assert row[e] == pytest.approx(base[e], rel=1e-5)
            h = hidden[t:t + 1]
            expected[t] = (float(scale[src, target]) * float(w[t, 2]) * layer.expert_forward(target, h)
                           - float(w[t, 2]) * layer.expert_forward(src, h))[0]
    assert torch.allclose(out_fold - out_full, expected, atol=1e-5)


def test_decode_pool_folds_outside_routes_and_drop_baseline_uses_the_same_pool(model, stats_path):
    shape = Shape.of(model)
    attach_fold_tables(model, stats_path)
    x = ids(1, 6, 1)                                   # a decode-like step: 6 sequences, one token each
    full = routes(model, None, x)
    fold = routes(model, fold_decode(shape, 3), x)
    drop = routes(model, fold_decode(shape, 3, fold=False), x)
    for layer in shape.layers:
        for _, i in (fold[layer], drop[layer]):
            assert len(set(i[i < E].tolist())) <= 3
    # layer 0 sees the same input in all three runs: compare slot by slot with the full router
    first = shape.layers[0]
    (w0, i0), (wf, i_f), (wd, i_d) = full[first], fold[first], drop[first]
    pool = set(i_d[i_d < E].tolist())
    assert set(i_f[i_f < E].tolist()) <= pool            # folding targets lie in the same pool
    kept = i_d < E
    assert torch.equal(i_d[kept], i0[kept]) and torch.equal(wd[kept], w0[kept])   # drop: no renormalisation
    assert ((i_f != i0) & (i_f < E)).any()              # some routes were folded onto pool experts
    # per token: pool routes keep their weight, each outside route adds S[src, t] * w onto its
    # lowest-loss pool expert t; routes landing on one expert are one route (summed weight)
    tables = RoutingController.of(model).fold_tables[first]
    pool_ids = torch.tensor(sorted(pool))
    for t in range(i0.shape[0]):
        expected: dict[int, float] = {}
        for w, e in zip(w0[t].tolist(), i0[t].tolist()):
            if e >= E:
                continue
            target = e if e in pool else int(pool_ids[tables.loss[e, pool_ids].argmin()])
            expected[target] = expected.get(target, 0.0) + (w if e in pool else w * float(tables.scale[e, target]))
        live = [(e, w) for w, e in zip(wf[t].tolist(), i_f[t].tolist()) if e < E]
        assert len({e for e, _ in live}) == len(live)                       # each expert once per token
        got = dict(live)
        assert got.keys() == expected.keys()
        assert all(abs(got[e] - expected[e]) < 1e-6 for e in got), (got, expected)


def test_static_pool_fold_and_drop_from_a_pruning_policy(model, stats_path):
    shape = Shape.of(model)
    attach_fold_tables(model, stats_path)
    pruned = PhasePolicy.uniform(list(shape.layers), LayerPolicy(keep=(0, 1, 2, 3, 4)))
    folded, dropped = pool_with_fold(pruned), pool_with_fold(pruned, fold=False)
    assert folded.for_layer(0).pool_mode == "fold" and dropped.for_layer(0).pool_mode == "drop"
    for policy in (folded, dropped):
        for w, i in routes(model, policy).values():
            assert set(i[i < E].tolist()) <= {0, 1, 2, 3, 4}
    with pytest.raises(ValueError, match="no static expert pool"):
        pool_with_fold(fold_decode(shape, 4))


def test_per_layer_lists_apply_to_the_right_layers():
    model = make_model(layers=3, seed=1)
    shape = Shape.of(model)
    seen = routes(model, layer_k_policy(shape, [1, 4, 2]))
    assert [int((seen[i][1] < E).sum(-1).max()) for i in shape.layers] == [1, 4, 2]
    assert [int((seen[i][1] < E).sum(-1).min()) for i in shape.layers] == [1, 4, 2]
    # k' = k in one layer leaves that layer on the full router
    assert layer_k_policy(shape, [2, 4, 4]).layers.keys() == {0}


@pytest.mark.parametrize("args, expected", [
    ((6, 2, 8, 4, 2), [2, 5, 8, 7, 5, 4]),
    ((4, 1, 8, 8, 3), [1, 3, 6, 8]),
    ((3, 4, 4, 4, 1), [4, 4, 4]),
    ((5, 8, 8, 2, 0), [8, 7, 5, 4, 2]),   # 6.5 rounds half up to 7, 3.5 to 4
    ((1, 3, 3, 3, 0), [3]),
])
def test_four_tuple_interpolation(args, expected):
    assert interpolate_k(*args) == expected


def test_dynamic_skipping_never_drops_the_top_expert(model, tmp_path):
    shape = Shape.of(model)
    ctl = RoutingController.of(model)
    for beta in (1.0, 0.6):
        seen = {}
        with torch.no_grad(), ctl.policy(skip_policy(shape, None, beta)), \
                ctl.observing(lambda l, h, z, w, i: seen.__setitem__(l.index, (z, w, i))):
            model(input_ids=ids())
        for layer in shape.layers:
            z, w, i = seen[layer]                                       # this run's router logits [T, E]
            top = z.argmax(-1)                                          # the token's top expert
            assert ((i < E).sum(-1) >= 1).all()
            assert (i == top[:, None]).any(-1).all()
            assert torch.allclose(w.sum(-1), torch.ones(len(w)), atol=1e-5)   # renormalised (norm_topk_prob)
            if beta == 1.0:
                assert int((i < E).sum(-1).max()) == 1                 # only the top expert survives beta=1
    # beta from the statistics: each layer gets its own median w2/w1
    stats = fold_stats(model, tmp_path / "s.safetensors")
    policy = skip_policy(shape, stats)
    for layer in shape.layers:
        assert policy.for_layer(layer).skip_beta == pytest.approx(stats.layers[layer].beta, abs=1e-6)


def test_bad_input_gives_clear_errors(model, stats_path):
    shape = Shape.of(model)
    for bad in (0, E + 1):
        with pytest.raises(ValueError, match=rf"D={bad} must be in \[1, {E}\]"):
            fold_decode(shape, bad)
    for bad in (0, K + 1):
        with pytest.raises(ValueError, match=rf"K_pre={bad} must be in \[1, {K}\]"):
            fold_prefill(shape, bad)
        with pytest.raises(ValueError, match=rf"k'={bad} must be in \[1, {K}\]"):
            top_k_policy(shape, bad)
    with pytest.raises(ValueError, match="has 3 entries but the model has 2 MoE layers"):
        layer_k_policy(shape, [2, 2, 2])
    with pytest.raises(ValueError, match=r"k'=9 \(MoE layer 1\)"):
        layer_k_policy(shape, [2, 9])
    with pytest.raises(ValueError, match="p=6 is outside the MoE layers 0..5"):
        interpolate_k(6, 2, 8, 4, 6)
    with pytest.raises(ValueError, match="p=-1 is outside"):
        interpolate_k(6, 2, 8, 4, -1)
    with pytest.raises(ValueError, match="b .2. and h .8. must be equal"):
        interpolate_k(6, 2, 8, 4, 0)
    with pytest.raises(ValueError, match="beta=1.5 must be in"):
        skip_policy(shape, None, 1.5)
    with pytest.raises(ValueError, match="needs fold statistics"):
        technique_plan(model, decode=fold_decode(shape, 4))
    other = make_model(seed=7)
    with pytest.raises(StatsMismatch, match="router_hash"):
        attach_fold_tables(other, stats_path)
    with pytest.raises(StatsMismatch, match="router_hash"):
        plan_from_specs(other, "fold-prefill:2", None, stats_path)
    deeper = make_model(layers=3)
    with pytest.raises(StatsMismatch, match="moe_layers"):
        attach_fold_tables(deeper, stats_path)
    with pytest.raises(FileNotFoundError, match="moetailor calibrate MODEL --fold"):
        plan_from_specs(model, None, "fold-decode:4", stats_path.parent / "missing.safetensors")


def test_policy_specs_and_the_plan_they_make(model, stats_path):
    shape = Shape.of(model)
    assert policy_from_spec(model, "fold-prefill:2") == fold_prefill(shape, 2)
    assert policy_from_spec(model, "drop-decode:5") == fold_decode(shape, 5, fold=False)
    assert policy_from_spec(model, "topk:2") == top_k_policy(shape, 2)
    assert policy_from_spec(model, "layer-k:1/3") == layer_k_policy(shape, [1, 3])
    assert policy_from_spec(model, "bhep:1/3/3/1") == layer_k_policy(shape, [1, 3])
    assert policy_from_spec(model, "skip:0.5").for_layer(0).skip_beta == 0.5
    assert policy_from_spec(model, "skip", stats_path).for_layer(1).skip_beta is not None
    assert policy_from_spec(model, "full").is_identity
    assert parse_k_list("[2, 4]") == parse_k_list("2,4") == parse_k_list("2-4") == [2, 4]
    for bad, match in (("fold-decode", "needs an argument"), ("fold-decode:x", "must be an integer"),
                       ("halve", "unknown policy"), ("bhep:1/2/3", "four numbers"), ("skip:lots", "a beta")):
        with pytest.raises(ValueError, match=match):
            policy_from_spec(model, bad)
    plan = plan_from_specs(model, "fold-prefill:2", "fold-decode:3", stats_path)
    assert plan.fold_stats == str(stats_path)
    assert plan.prefill.for_layer(0).token_keep == 2 and plan.decode.for_layer(1).batch_pool == 3
    assert plan_from_specs(model, None, "topk:2", None).fold_stats is None
