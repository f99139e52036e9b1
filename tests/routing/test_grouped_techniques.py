"""Every routing technique on a grouped (DeepSeek-V3 style) router: top-k reduction, dynamic
skipping, folding (targets stay in the source's group, so a token's experts still span at most
topk_group groups), on the tiny model with a dense first layer, 16 experts in 4 groups, top-4 from
topk_group=2 groups and one shared expert."""
import pytest
import torch

from moetailor.calibration import calibrate_batches
from moetailor.models import moe_layers
from moetailor.models.groups import balanced_keep
from moetailor.models.tiny import tiny_grouped_model
from moetailor.plans.techniques import Shape, fold_decode, fold_prefill, skip_policy, top_k_policy
from moetailor.routing import LayerPolicy, PhasePolicy, RoutingController
from moetailor.routing.router import CompiledPolicy

E, K, GROUPS, TOPK_GROUP = 16, 4, 4, 2


def ids(seed=0, batch=2, length=24):
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_grouped_model()


@pytest.fixture(scope="module")
def stats(model):
    return calibrate_batches(model, [ids(s, 4, 32) for s in range(4)], fold=True, all_experts=True, progress=False)


@pytest.fixture(scope="module")
def ctl(model, stats):
    ctl = RoutingController(model, fold_tables=stats.fold_tables())
    yield ctl
    ctl.remove()


def routes(ctl, policy, x=None):
    """Per MoE layer: (weights [T, K], index [T, K]) the experts module received, and the logits."""
    seen = {}
    with torch.no_grad(), ctl.policy(policy), ctl.observing(lambda l, h, z, w, i: seen.__setitem__(l.index, (w, i))):
        out = ctl.model(input_ids=ids() if x is None else x, use_cache=False).logits
    return seen, out


def groups_used(index):
    """Distinct routing groups per token [T] (dropped routes, id E, do not count)."""
    g = torch.where(index < E, index // (E // GROUPS), -1)
    return torch.tensor([len(set(row.tolist()) - {-1}) for row in g])


def test_top_k_reduction_keeps_the_groups_and_takes_the_best_experts(ctl):
    full, _ = routes(ctl, None)
    fewer, _ = routes(ctl, top_k_policy(Shape.of(ctl.model), 2))
    first = moe_layers(ctl.model)[0].index  # same input under both policies (later layers' inputs differ)
    (w, idx), (_, fidx) = fewer[first], full[first]
    assert idx.shape[1] == 2
    for t in range(idx.shape[0]):
        assert set(idx[t].tolist()) <= set(fidx[t].tolist())  # 2 of the token's 4, inside its chosen groups
    for w, idx in (v for v in fewer.values()):
        assert (groups_used(idx) <= TOPK_GROUP).all()
        torch.testing.assert_close(w.sum(-1), torch.full((idx.shape[0],), 2.5))  # renormalised, scaled


def test_dynamic_skipping_drops_weak_ranks_only(ctl, stats):
    policy = skip_policy(Shape.of(ctl.model), stats, beta=0.9)
    full, _ = routes(ctl, None)
    skipped, _ = routes(ctl, policy)
    first = moe_layers(ctl.model)[0].index
    (w, idx), (fw, fidx) = skipped[first], full[first]
    for t in range(idx.shape[0]):
        assert set(idx[t][idx[t] < E].tolist()) <= set(fidx[t].tolist())
        assert int(fidx[t][fw[t].argmax()]) in idx[t].tolist()  # the top expert never drops
    assert (idx == E).any()
    for w, idx in skipped.values():
        assert ((idx == E) == (w == 0)).all()
        torch.testing.assert_close(w.sum(-1), torch.full((idx.shape[0],), 2.5))


def test_fold_targets_stay_in_the_source_group(ctl, stats):
    sem = moe_layers(ctl.model)[0].semantics
    for layer in moe_layers(ctl.model):
        keep = balanced_keep(stats.layers[layer.index].reap, 8, sem)
        cp = CompiledPolicy.build(LayerPolicy(keep=keep, pool_mode="fold"), sem, "cpu", ctl.fold_tables[layer.index])
        moved = cp.pool_scale != 0
        assert moved.sum() >= 8  # folding happens (all-experts calibration observes every pair)
        assert torch.equal((cp.pool_target // 4)[moved], (torch.arange(E) // 4)[moved])
        unrestricted = ctl.fold_tables[layer.index].loss[:, list(keep)].argmin(1)
        assert (torch.tensor(keep)[unrestricted] // 4 != torch.arange(E) // 4).any()  # across groups would differ


@pytest.mark.parametrize("kind", ["plan+fold", "fold-decode", "fold-prefill"])
def test_folded_tokens_still_use_at_most_topk_group_groups(ctl, stats, kind):
    shape, sem = Shape.of(ctl.model), moe_layers(ctl.model)[0].semantics
    if kind == "plan+fold":
        policy = PhasePolicy({l: LayerPolicy(keep=balanced_keep(stats.layers[l].reap, 8, sem), pool_mode="fold")
                              for l in shape.layers})
    elif kind == "fold-decode":
        policy = fold_decode(shape, 6)
    else:
        policy = fold_prefill(shape, 2)
    full, full_logits = routes(ctl, None)
    folded, logits = routes(ctl, policy)
    for i, (w, idx) in folded.items():
        assert (groups_used(idx) <= TOPK_GROUP).all()
        assert (groups_used(full[i][1]) <= TOPK_GROUP).all()
    assert (logits - full_logits).abs().max() > 1e-4  # the technique did act
