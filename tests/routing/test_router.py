"""The one routing function, on hand-built logits and fold tables."""
import math

import torch

from moetailor.models.architectures import RouterSemantics
from moetailor.routing.policy import LayerPolicy, PhasePolicy
from moetailor.routing.router import CompiledPolicy, FoldTables, route, select

E = 6
SEM = RouterSemantics(num_experts=E, top_k=3, scoring="softmax", normalise=True)
# token 0 prefers experts 0 > 1 > 2, token 1 prefers 5 > 4 > 3
LOGITS = torch.tensor([[3.0, 2.0, 1.0, -1.0, -2.0, -3.0],
                       [-3.0, -2.0, -1.0, 1.0, 2.0, 3.0]])


def tables():
    loss = torch.full((E, E), math.inf)
    scale = torch.zeros(E, E)
    # expert 2 folds best onto 1 (scale 0.5), worse onto 0; expert 3 best onto 4 (scale 2.0)
    loss[2, 1], scale[2, 1] = 0.1, 0.5
    loss[2, 0], scale[2, 0] = 0.4, 0.9
    loss[3, 4], scale[3, 4] = 0.2, 2.0
    loss[3, 5], scale[3, 5] = 0.3, 1.0
    return FoldTables(scale=scale, loss=loss, mean_norm=torch.ones(E))


def run(policy, fold=None, token_top_k=None):
    cp = CompiledPolicy.build(policy, SEM, "cpu", fold)
    return route(LOGITS, SEM, cp, token_top_k=token_top_k)


def as_dict(weights, index):
    """Per token {expert: total weight}; duplicate slots of one expert add up, as in the experts module."""
    out = []
    for ws, ix in zip(weights, index):
        row = {}
        for w, i in zip(ws.tolist(), ix.tolist()):
            if i < E:
                row[i] = row.get(i, 0.0) + w
        out.append({i: round(w, 7) for i, w in row.items()})
    return out


def test_identity_equals_stock_top_k():
    w, i = run(LayerPolicy())
    probs = torch.softmax(LOGITS, -1)
    top_w, top_i = probs.topk(3)
    assert torch.equal(i, top_i) and torch.allclose(w, top_w / top_w.sum(-1, keepdim=True))


def test_token_fold_adds_scaled_weight_to_lowest_loss_kept_expert():
    base = as_dict(*run(LayerPolicy()))
    folded = as_dict(*run(LayerPolicy(token_keep=2), tables()))
    # token 0 keeps 0 and 1; expert 2 folds onto 1 (loss 0.1 < 0.4) with scale 0.5
    assert set(folded[0]) == {0, 1}
    assert math.isclose(folded[0][1], base[0][1] + 0.5 * base[0][2], rel_tol=1e-5)
    assert math.isclose(folded[0][0], base[0][0], rel_tol=1e-5)
    # token 1 keeps 5 and 4; expert 3 folds onto 4 (loss 0.2 < 0.3) with scale 2.0
    assert math.isclose(folded[1][4], base[1][4] + 2.0 * base[1][3], rel_tol=1e-5)


def test_token_keep_without_fold_drops_and_full_keep_is_identity():
    base = as_dict(*run(LayerPolicy()))
    dropped = as_dict(*run(LayerPolicy(token_keep=2, fold=False)))
    assert dropped[0] == {0: base[0][0], 1: base[0][1]}
    assert as_dict(*run(LayerPolicy(token_keep=3), tables())) == base


def test_batch_pool_folds_routes_outside_the_pool():
    base = as_dict(*run(LayerPolicy()))
    # union is all 6 experts; a pool of 5 drops the least important one (2 or 3: equal mass,
    # tie broken by topk) and folds it onto its lowest-loss pool expert
    pooled = as_dict(*run(LayerPolicy(batch_pool=5), tables()))
    union = set(pooled[0]) | set(pooled[1])
    assert len(union) == 5
    dropped = ({0, 1, 2, 3, 4, 5} - union).pop()
    if dropped == 2:
        assert math.isclose(pooled[0][1], base[0][1] + 0.5 * base[0][2], rel_tol=1e-5)
    else:
        assert math.isclose(pooled[1][4], base[1][4] + 2.0 * base[1][3], rel_tol=1e-5)
    assert as_dict(*run(LayerPolicy(batch_pool=6), tables())) == base


def test_static_pool_fold_versus_mask():
    fold = as_dict(*run(LayerPolicy(keep=(0, 1, 4, 5), pool_mode="fold"), tables()))
    base = as_dict(*run(LayerPolicy()))
    assert math.isclose(fold[0][1], base[0][1] + 0.5 * base[0][2], rel_tol=1e-5)
    mask = as_dict(*run(LayerPolicy(keep=(0, 1, 4, 5))))
    assert set(mask[0]) == {0, 1, 4} and math.isclose(sum(mask[0].values()), 1.0, rel_tol=1e-5)
    drop = as_dict(*run(LayerPolicy(keep=(0, 1, 4, 5), pool_mode="drop")))
    assert drop[0] == {0: base[0][0], 1: base[0][1]}


def test_folded_routes_onto_an_expert_already_used_merge_into_one_route():
    for policy in (LayerPolicy(keep=(0, 1, 4, 5), pool_mode="fold"), LayerPolicy(batch_pool=4)):
        w, i = run(policy, tables())
        for row in i.tolist():
            live = [x for x in row if x < E]
            assert len(live) == len(set(live)), (policy, row)   # each expert runs once per token
    # token 0: expert 2 folds onto expert 1, which it already routes to: one slot, summed weight
    base = as_dict(*run(LayerPolicy()))
    w, i = run(LayerPolicy(keep=(0, 1, 4, 5), pool_mode="fold"), tables())
    slot = i[0].tolist().index(1)
    assert math.isclose(float(w[0, slot]), base[0][1] + 0.5 * base[0][2], rel_tol=1e-5)


def test_skip_beta_never_drops_the_top_expert_and_renormalises():
    for beta in (0.0, 0.3, 0.9, 1.0):
        w, i = run(LayerPolicy(skip_beta=beta))
        assert torch.equal(i[:, 0], torch.tensor([0, 5]))
        assert torch.allclose(w.sum(-1), torch.ones(2))
    w, i = run(LayerPolicy(skip_beta=1.0))
    assert (i[:, 1:] == E).all()


def test_per_token_k_trims_each_row():
    w, i = run(LayerPolicy(), token_top_k=torch.tensor([1, 3]))
    assert (i[0, 1:] == E).all() and i[0, 0] == 0 and math.isclose(float(w[0, 0]), 1.0, rel_tol=1e-6)
    assert (i[1] < E).all()


def test_deepseek_grouped_selection_respects_mask():
    sem = RouterSemantics(num_experts=8, top_k=2, scoring="sigmoid-grouped", normalise=True, scaling=2.0,
                          n_group=2, topk_group=1)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    w, i = select(logits, sem, 2, torch.tensor([True, False] * 4))
    assert (i % 2 == 0).all() and torch.allclose(w.sum(-1), torch.full((4,), 2.0))


def test_phase_policy_json_round_trip():
    policy = PhasePolicy({0: LayerPolicy(keep=(3, 1, 2)), 2: LayerPolicy(top_k=2, skip_beta=0.5)})
    again = PhasePolicy.from_json(policy.to_json())
    assert again == policy and again.layers[0].keep == (1, 2, 3)


def test_per_token_k_combines_with_drop_and_fold_pools():
    k_per_token = torch.tensor([1, 3])
    for mode in ("drop", "fold"):
        w, i = run(LayerPolicy(keep=(0, 1, 4, 5), pool_mode=mode), tables(), token_top_k=k_per_token)
        assert (i[0, 1:] == E).all() and i[0, 0] == 0
        assert set(i[1].tolist()) - {E} <= {0, 1, 4, 5}
