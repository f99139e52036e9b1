"""Grouped routing (DeepSeek-V3 style): group-balanced plans, and pruned checkpoints that route
exactly like the masked model, on a tiny model with a dense first layer, 16 experts in 4 groups,
top-4 from topk_group=2 groups and one shared expert."""
import pytest
import torch

from moetailor.calibration import calibrate_batches
from moetailor.models import moe_layers
from moetailor.models.groups import balanced_keep, checkpoint_problem, per_group_counts, same_group_only, unreachable
from moetailor.models.tiny import tiny_grouped_model
from moetailor.plans import uniform_plan
from moetailor.plans.criteria import expert_scores, make_plan
from moetailor.routing import LayerPolicy, RoutingController
from moetailor.transforms import prune_checkpoint
from moetailor.transforms.prune import checkpoint_kept, pruned_config


def logits_under(model, policy, x):
    existing = RoutingController.installed(model)
    ctl = existing or RoutingController(model)
    try:
        with torch.no_grad(), ctl.policy(policy):
            return model(input_ids=x, use_cache=False).logits
    finally:
        if existing is None:
            ctl.remove()


def routes_under(model, policy, x):
    """(layer, index [T, K], weights [T, K]) of every MoE layer for one forward."""
    ctl = RoutingController(model)
    seen = []
    try:
        with torch.no_grad(), ctl.policy(policy), ctl.observing(lambda l, h, lg, w, i: seen.append((l, i, w))):
            model(input_ids=x, use_cache=False)
    finally:
        ctl.remove()
    return seen


@pytest.fixture(scope="module")
def model():
    return tiny_grouped_model()


@pytest.fixture(scope="module")
def stats(model):
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 96, (4, 64), generator=gen) for _ in range(3)]
    return calibrate_batches(model, batches, progress=False)


def sem(model):
    return moe_layers(model)[0].semantics


def test_tiny_grouped_model_shape(model):
    layers = moe_layers(model)
    assert [l.index for l in layers] == [1, 2]  # dense first layer
    s = sem(model)
    assert (s.num_experts, s.top_k, s.n_group, s.topk_group, s.scaling) == (16, 4, 4, 2, 2.5)
    assert layers[0].shared_expert is not None and layers[0].router_bias is not None


def test_group_rules(model):
    s = sem(model)
    assert per_group_counts((0, 1, 4, 5, 8, 9, 12, 13), s) == [2, 2, 2, 2]
    assert checkpoint_problem((0, 1, 4, 5, 8, 9, 12, 13), s) is None
    assert "[4, 2, 1, 1]" in checkpoint_problem((0, 1, 2, 3, 4, 5, 8, 12), s)
    assert "at least 2" in checkpoint_problem((0, 4, 8, 12), s)
    scores = torch.arange(16, dtype=torch.float64).flip(0)  # expert 0 best
    assert balanced_keep(scores, 8, s) == (0, 1, 4, 5, 8, 9, 12, 13)
    with pytest.raises(ValueError, match=r"choose a count in \[8, 12, 16\].*--groups ignore"):
        balanced_keep(scores, 6, s)
    assert unreachable((0, 1, 2, 3, 4, 5, 8, 12), s) == [8, 12]
    loss = same_group_only(torch.zeros(16, 16), s)
    assert torch.isinf(loss[0, 4]) and loss[0, 3] == 0 and loss[15, 12] == 0


def test_balanced_plan_keeps_the_same_count_per_group(model, stats):
    plan = make_plan(stats, model, "reap", keep=0.5)
    scores = expert_scores(stats, "reap")
    for i, ids in plan.kept_experts("decode").items():
        assert per_group_counts(ids, sem(model)) == [2, 2, 2, 2]
        for g in range(4):  # ranked inside the group: the group's two best by REAP
            best = torch.argsort(-scores[i][4 * g:4 * g + 4], stable=True)[:2] + 4 * g
            assert set(best.tolist()) <= set(ids)
    assert plan.meta["groups"]["mode"] == "balanced"
    assert plan.meta["groups"]["per_group"] == {"1": [2, 2, 2, 2], "2": [2, 2, 2, 2]}
    # per-layer budgets respect the groups too, and a count that cannot be balanced is refused
    plan = make_plan(stats, model, "mass", layers="1:12,2:8")
    assert [len(k) for k in plan.kept_experts("decode").values()] == [12, 8]
    assert per_group_counts(plan.kept_experts("decode")[1], sem(model)) == [3, 3, 3, 3]
    with pytest.raises(ValueError, match="layer 2: keeping 10 experts cannot be split evenly"):
        make_plan(stats, model, "mass", layers="1:12,2:10")
    # ignoring groups ranks all experts together, and says which kept experts are unreachable
    free = make_plan(stats, model, "reap", keep=0.5, groups="ignore")
    scores = expert_scores(stats, "reap")
    for i, ids in free.kept_experts("decode").items():
        assert set(ids) == set(torch.argsort(-scores[i], stable=True)[:8].tolist())
    assert free.meta["groups"]["mode"] == "ignore"


def test_pruned_grouped_checkpoint_equals_masked_model(model, stats, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    plan = make_plan(stats, model, "reap", keep=0.5)
    out = prune_checkpoint(model, plan, tmp_path / "pruned")
    config = AutoConfig.from_pretrained(out)
    assert (config.n_routed_experts, config.n_group, config.topk_group, config.num_experts_per_tok) == (8, 4, 2, 4)
    assert config.routed_scaling_factor == 2.5 and config.norm_topk_prob and config.first_k_dense_replace == 1
    pruned = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    x = torch.randint(3, 96, (3, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = pruned(input_ids=x, use_cache=False).logits
    want = logits_under(model, plan.decode, x)
    assert (got - want).abs().max() <= 1e-5
    assert (got - logits_under(model, None, x)).abs().max() > 1e-3  # pruning changed the function
    full, small = dict(model.state_dict()), dict(pruned.state_dict())
    for layer in moe_layers(model):
        ids = list(plan.kept_experts("decode")[layer.index])
        p = f"model.layers.{layer.index}.mlp"
        assert torch.equal(small[f"{p}.gate.e_score_correction_bias"], full[f"{p}.gate.e_score_correction_bias"][ids])
        assert torch.equal(small[f"{p}.gate.weight"], full[f"{p}.gate.weight"][ids])
        for key in [k for k in full if k.startswith(f"{p}.shared_experts")]:
            assert torch.equal(small[key], full[key])  # shared experts untouched
    for key in [k for k in full if k.startswith("model.layers.0.mlp")]:
        assert torch.equal(small[key], full[key])  # the dense layer untouched


def test_unbalanced_plan_is_refused_but_masked_serving_never_uses_dropped_experts(model, stats, tmp_path):
    keep = (0, 1, 2, 3, 4, 5, 8, 12)  # 4, 2, 1, 1 per group: 8 and 12 can never be selected
    plan = uniform_plan(model, decode=LayerPolicy(keep=keep))
    with pytest.raises(ValueError, match=r"layer 1 keeps \[4, 2, 1, 1\] experts .* group-balanced plan"):
        prune_checkpoint(model, plan, tmp_path / "bad")
    with pytest.raises(ValueError, match="group-balanced"):
        checkpoint_kept(plan, model.config)
    x = torch.randint(3, 96, (2, 32), generator=torch.Generator().manual_seed(6))
    for layer, index, weights in routes_under(model, plan.decode, x):
        used = set(index[index < 16].tolist())
        assert used <= {0, 1, 2, 3, 4, 5} and (weights[index < 16] > 0).all()
    # when the chosen groups hold fewer than k kept experts, the rest become dropped routes (id E)
    one_group = tiny_grouped_model(topk_group=1)  # each token's 4 experts come from 1 group
    sparse = uniform_plan(one_group, decode=LayerPolicy(keep=(0, 1, 4, 5, 8, 9, 12, 13)))  # 2 per group
    for layer, index, weights in routes_under(one_group, sparse.decode, x):
        assert ((index == 16).sum(-1) == 2).all() and ((index == 16) == (weights == 0)).all()
        assert ((index[index < 16] // 4).view(-1, 2).diff(dim=1) == 0).all()  # both real routes in one group
        torch.testing.assert_close(weights.sum(-1), torch.full((index.shape[0],), 2.5))  # renormalised, scaled


def test_pruned_config_keeps_group_settings(model):
    config = pruned_config(model.config, 8)
    assert (config.n_routed_experts, config.n_group, config.topk_group) == (8, 4, 2)
    assert model.config.n_routed_experts == 16  # a copy


def test_distilled_grouped_decoder_becomes_a_pruned_checkpoint(tmp_path):
    """Distillation on a grouped router: the student starts as the masked model; its export prunes to a
    stock grouped checkpoint that equals the distilled model with the plan's masked router."""
    from transformers import AutoModelForCausalLM

    from moetailor.training.distill import Student, export
    from moetailor.transforms.artifacts import load_distilled

    model = tiny_grouped_model(seed=3)
    plan = uniform_plan(model, decode=LayerPolicy(keep=(0, 1, 4, 5, 8, 9, 12, 13)), criterion="test")
    student = Student(model, plan)
    x = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert (student(x, use_cache=False).logits - logits_under(tiny_grouped_model(seed=3), plan.decode, x)
                ).abs().max() <= 1e-6
        torch.manual_seed(1)  # a student that has moved: SE2 and router/norm updates
        for p in student.se2.parameters():
            p.normal_(0, 0.1)
        for p in student.params.values():
            p.add_(0.05 * torch.randn_like(p))
        want = student(x, use_cache=False).logits
    distilled = export(student, tmp_path / "distilled", source=None)
    student.close()
    path, saved = load_distilled(distilled)
    loaded = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    out = prune_checkpoint(loaded, saved, tmp_path / "pruned")
    pruned = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert (pruned.config.n_routed_experts, pruned.config.n_group, pruned.config.topk_group) == (8, 4, 2)
    with torch.no_grad():
        got = pruned(input_ids=x, use_cache=False).logits
    assert (got - want).abs().max() <= 1e-5


def test_split_grouped_router_routes_like_the_original(tmp_path):
    """Sub-expert splitting on a grouped router: N sub-groups per routing group, the full budget is
    exact, smaller per-request budgets stay inside the original's chosen groups."""
    from transformers import AutoModelForCausalLM

    from moetailor.models.groups import split_order
    from moetailor.transforms.split import SplitResult, group_agreement, plan_split, profile_neurons, split_model, write_split

    model = tiny_grouped_model(seed=2)
    batches = [torch.randint(3, 96, (4, 32), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    splits = plan_split(model, profile_neurons(model, batches, progress=False), 2, "anneal", "proxy", steps=200)
    split = split_model(model, splits, 2, "proxy")
    c = split.config
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group) == (32, 8, 8, 4)
    assert group_agreement(model, split, batches) == {"1": 1.0, "2": 1.0}
    order = split_order(sem(model), 2)
    assert order[:8].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]  # sub-group 0: part 0 of experts 0-3; sub-group 1: part 1
    x = torch.randint(3, 96, (3, 20), generator=torch.Generator().manual_seed(5))
    full = logits_under(model, None, x)
    assert (logits_under(split, None, x) - full).abs().max() < 1e-5
    out = write_split(SplitResult(split, splits, 2, "proxy", "anneal"), model, tmp_path / "split")
    stock = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    with torch.no_grad():
        assert (stock(input_ids=x, use_cache=False).logits - full).abs().max() < 1e-5
    # a per-request budget of 4 sub-experts (half) stays inside the original's 2 chosen groups
    ctl = RoutingController(split)
    used = []
    try:
        with torch.no_grad(), ctl.policy(None, token_top_k=torch.full((x.numel(),), 4)), \
                ctl.observing(lambda l, h, z, w, i: used.append(i)):
            half = split(input_ids=x, use_cache=False).logits
    finally:
        ctl.remove()
    assert (half - full).abs().max() > 1e-3
    for index in used:                                  # [T, 4] sub-expert ids
        groups = order[index] // 2 // 4                 # the original group of each sub-expert's parent
        assert all(len(set(row.tolist())) <= 2 for row in groups)


def test_benchmark_pools_of_a_grouped_router_are_balanced(model):
    """The decode benchmark's masked and pruned pools compute the same function on a grouped router."""
    from moetailor.bench.pools import kept_ids, mask_plan, pruned_model

    ids = kept_ids(16, 0.5, 4, sem=sem(model))
    assert len(ids) == 8 and checkpoint_problem(ids, sem(model)) is None
    x = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        got = pruned_model(model, 0.5)(input_ids=x, use_cache=False).logits
    assert (got - logits_under(model, mask_plan(model, 0.5).decode, x)).abs().max() <= 1e-5
