"""Sub-expert splitting on tiny models: parts sum to the parent, the full budget reproduces the
original exactly, the partition is disjoint and complete and beats random on its objective, and
the checkpoint loads in stock transformers; bad input gets clear errors."""
import pytest
import torch

from moetailor.models import moe_layers
from moetailor.models.tiny import TINY_ARCHITECTURES, tiny_model
from moetailor.routing import RoutingController
from moetailor.transforms.split import (
    SplitResult,
    anneal_partition,
    check_parts,
    greedy_partition,
    objective,
    plan_split,
    profile_neurons,
    random_partition,
    read_split_sidecar,
    split_model,
    write_split,
)

WIDTH, PARTS = 16, 4


def batches(n=2, seed=0, shape=(4, 24)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, shape, generator=g) for _ in range(n)]


def logits(model, x, token_top_k=None):
    ctl = RoutingController.of(model)
    with torch.no_grad(), ctl.policy(None, token_top_k=token_top_k):
        return model(input_ids=x, use_cache=False).logits


@pytest.fixture(scope="module")
def profiled():
    out = {}
    for arch in TINY_ARCHITECTURES:
        model = tiny_model(arch, num_experts=8, top_k=2, expert_width=WIDTH)
        out[arch] = (model, profile_neurons(model, batches(), progress=False))
    return out


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_full_budget_reproduces_original_exactly(arch, profiled):
    model, prof = profiled[arch]
    splits = plan_split(model, prof, PARTS, "anneal", "exact", steps=300)
    split = split_model(model, splits, PARTS, "exact")
    layers = moe_layers(split)
    assert layers[0].num_experts == 8 * PARTS and layers[0].top_k == 2 * PARTS
    assert split_width(split) == WIDTH // PARTS
    x = batches(1, seed=5, shape=(3, 20))[0]
    want, got = logits(model, x), logits(split, x)
    assert (got - want).abs().max() < 1e-4
    # routing through moetailor at the full per-token budget is the same function
    assert (logits(split, x, torch.full((x.numel(),), 2 * PARTS)) - want).abs().max() < 1e-4
    # fewer sub-experts is a different function (the test can fail)
    assert (logits(split, x, torch.full((x.numel(),), PARTS)) - want).abs().max() > 1e-3


def split_width(model):
    return moe_layers(model)[0].experts.down_proj.shape[-1]


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe"])
def test_parts_sum_to_parent(arch, profiled):
    model, prof = profiled[arch]
    splits = plan_split(model, prof, PARTS, "anneal", "proxy", steps=200)
    split = split_model(model, splits, PARTS, "proxy")
    h = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    for parent, child in zip(moe_layers(model), moe_layers(split)):
        shares = splits[parent.index].shares
        for e in range(parent.num_experts):
            # the proxy scales part p's down projection by 1 / s_p; undo that to compare raw slices
            total = sum(child.expert_forward(e * PARTS + p, h) * shares[e, p] for p in range(PARTS))
            assert torch.allclose(total, parent.expert_forward(e, h), atol=1e-5)


def test_proxy_orders_parts_and_is_near_exact(profiled):
    model, prof = profiled["qwen2_moe"]
    splits = plan_split(model, prof, PARTS, "anneal", "proxy", steps=200)
    for s in splits.values():
        assert (s.shares[:, :-1] >= s.shares[:, 1:]).all()                 # heaviest part first
        assert torch.allclose(s.shares.sum(1), torch.ones(8, dtype=s.shares.dtype))
        assert s.spread is not None and s.spread >= 0
    split = split_model(model, splits, PARTS, "proxy")
    for parent, child in zip(moe_layers(model), moe_layers(split)):
        s = splits[parent.index]
        offset = torch.log(PARTS * s.shares.clamp_min(1e-3)).reshape(-1, 1) * s.direction[None, :]
        want_rows = parent.router.weight.repeat_interleave(PARTS, 0).double() + offset
        assert torch.allclose(child.router.weight.double(), want_rows, atol=1e-5)
    x = batches(1, seed=5, shape=(3, 20))[0]
    want = torch.log_softmax(logits(model, x), -1)

    def kl(m, k):
        got = torch.log_softmax(logits(m, x, torch.full((x.numel(),), k)), -1)
        return float((want.exp() * (want - got)).sum(-1).mean())
    # more sub-experts bring the proxy closer to the original
    assert kl(split, 2 * PARTS) < kl(split, PARTS) < kl(split, 1)


def check_partition(groups: torch.Tensor, width: int) -> None:
    """Each expert's groups are disjoint, equal-sized and cover 0..width-1."""
    E, N, size = groups.shape
    assert N * size == width, (groups.shape, width)
    assert torch.equal(groups.reshape(E, -1).sort(dim=1).values, torch.arange(width).expand(E, width))


def test_partition_disjoint_complete_and_better_than_random(profiled):
    _, prof = profiled["qwen3_moe"]
    p = next(iter(prof.values()))
    corr = p.correlation()
    greedy = greedy_partition(corr, p.mean_abs(), PARTS)
    annealed = anneal_partition(corr, greedy, steps=800)
    rand = random_partition(8, WIDTH, PARTS)
    for g in (greedy, annealed, rand):
        check_partition(g, WIDTH)
        assert g.shape == (8, PARTS, WIDTH // PARTS)
    assert (objective(corr, annealed) >= objective(corr, greedy) - 1e-9).all()
    seen = p.count > 1
    assert objective(corr, annealed)[seen].mean() > objective(corr, rand)[seen].mean()


def test_anneal_delta_bookkeeping_matches_objective():
    """The incremental swap score equals a recomputation (a brute-force check on random C)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 12, 12, generator=g)
    corr = (a + a.transpose(1, 2)) / 2
    start = random_partition(3, 12, 3, seed=1)
    best, tracked = anneal_partition(corr, start, steps=2000, seed=2, return_score=True)
    check_partition(best, 12)
    # the score the swaps accumulated is the objective of the partition they ended on
    assert torch.allclose(tracked, objective(corr.double(), best), atol=1e-9)
    assert (objective(corr, best) > objective(corr, start)).all()
    # exhaustive check is too big; compare with many random partitions instead
    rand = torch.stack([objective(corr, random_partition(3, 12, 3, seed=s)) for s in range(200)])
    assert (objective(corr, best) >= rand.max(0).values - 1e-9).all()


def test_bad_parts():
    with pytest.raises(ValueError, match="does not divide the expert width 16"):
        check_parts(16, 3)
    with pytest.raises(ValueError, match="at least 2"):
        check_parts(16, 1)
    model = tiny_model("qwen2_moe", expert_width=WIDTH)
    prof = profile_neurons(model, batches(1), progress=False)
    with pytest.raises(ValueError, match="does not divide"):
        plan_split(model, prof, 5)
    with pytest.raises(ValueError, match="--gate"):
        plan_split(model, prof, 2, gate="magic")


def test_checkpoint_loads_in_stock_transformers(profiled, tmp_path):
    from transformers import AutoModelForCausalLM

    model, prof = profiled["qwen2_moe"]
    splits = plan_split(model, prof, PARTS, "random", "exact")
    result = SplitResult(split_model(model, splits, PARTS, "exact"), splits, PARTS, "exact", "random")
    out = write_split(result, model, tmp_path / "split")
    with pytest.raises(FileExistsError, match="--overwrite"):
        write_split(result, model, tmp_path / "split")
    assert not list(tmp_path.glob(".split.tmp-*"))
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert loaded.config.num_experts == 8 * PARTS and loaded.config.num_experts_per_tok == 2 * PARTS
    assert loaded.config.moe_intermediate_size == WIDTH // PARTS
    x = batches(1, seed=9, shape=(2, 10))[0]
    with torch.no_grad():
        got = loaded(input_ids=x, use_cache=False).logits
    assert (got - logits(model, x)).abs().max() < 1e-4
    side = read_split_sidecar(out)
    assert side["parts"] == PARTS and side["method"] == "random" and side["num_experts_original"] == 8
    assert read_split_sidecar(tmp_path) is None


def test_router_finetune_lowers_kl_and_trains_only_routers(profiled):
    from moetailor.training.split_finetune import budget_cycle, finetune_router

    assert budget_cycle(8) == [2, 4, 6, 8] and budget_cycle(2) == [1, 2]
    model, prof = profiled["qwen3_moe"]
    split = split_model(model, plan_split(model, prof, PARTS, "anneal", "proxy", steps=100), PARTS, "proxy")
    before = {n: p.clone() for n, p in split.named_parameters()}
    ids = batches(1, seed=11)[0]
    summary = finetune_router(model, split, [ids], steps=12, lr=3e-3, budgets=[PARTS], progress=False)
    assert summary["kl_last_cycle"] < summary["kl_first_cycle"]
    changed = {n for n, p in split.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.endswith("mlp.gate.weight") for n in changed)
