import math

import pytest
import torch

from moetailor.eval.metrics import (Generation, HeldoutScorer, accuracy, kl_divergence, length_stats, mean_std, percentile,
                                    sign_test, versus_full)
from moetailor.models.tiny import tiny_model
from moetailor.routing import LayerPolicy, PhasePolicy


def gen(length, finish="stop", max_tokens=10, correct=True):
    return Generation("addition", 1, correct, length, finish, max_tokens)


def test_percentiles_on_known_values():
    values = list(range(1, 11))  # 1..10
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)  # linear interpolation: 9 + 0.1 * (10 - 9)
    assert percentile([7], 90) == 7
    assert math.isnan(percentile([], 50))


def test_length_stats_budget_hits_and_eos():
    gens = [gen(3), gen(5), gen(10, "length"), gen(10, "length"), gen(4, "abort")]
    s = length_stats(gens)
    assert s.n == 5
    assert s.p50 == 5
    assert s.p90 == pytest.approx(10)
    assert s.budget_hit == pytest.approx(2 / 5)
    assert s.eos == pytest.approx(2 / 5)
    assert s.mean == pytest.approx(32 / 5)


def test_generation_that_stopped_on_eos_at_the_budget_is_not_a_hit():
    # EOS as the last allowed token: the model did stop by itself
    assert length_stats([gen(10, "stop")]).budget_hit == 0.0
    assert length_stats([gen(10, "error")]).budget_hit == 1.0


def test_accuracy_and_mean_std():
    assert accuracy([gen(1, correct=True), gen(1, correct=False), gen(1, correct=True), gen(1, correct=True)]) == 0.75
    mean, std = mean_std([0.5, 0.7, 0.9])
    assert mean == pytest.approx(0.7)
    assert std == pytest.approx(0.2)  # sample std (ddof=1)
    assert mean_std([0.4]) == (0.4, 0.0)


def test_generation_json_round_trip():
    g = Generation("sorting", 2, False, 17, "length", 32)
    assert Generation.from_json(g.to_json()) == g


def test_kl_of_identical_distributions_is_zero():
    logp = torch.log_softmax(torch.randn(4, 7, 50), -1)
    assert torch.allclose(kl_divergence(logp, logp), torch.zeros(4, 7), atol=1e-6)


def test_kl_of_a_known_pair():
    p = torch.tensor([0.5, 0.5])
    q = torch.tensor([0.25, 0.75])
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # 0.1438 nats
    assert float(kl_divergence(p.log(), q.log())) == pytest.approx(expected, rel=1e-6)
    assert float(kl_divergence(q.log(), p.log())) != pytest.approx(expected)  # KL is not symmetric


def test_heldout_scorer_full_model_has_zero_kl_and_pruning_has_positive_kl():
    model = tiny_model("qwen2_moe", num_experts=8, top_k=2)
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(2, 96, (3, 24), generator=g).tolist()
    scorer = HeldoutScorer(model, windows, batch_size=2)
    full = scorer.score(None, None)
    assert full.kl == pytest.approx(0.0, abs=1e-6)
    assert full.tokens == 3 * 12
    # perplexity of the full model equals exp(NLL) from a plain single forward on the same tokens
    ids = torch.tensor(windows)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[:, 11:-1].float(), -1)
    nll = -logp.gather(-1, ids[:, 12:, None]).mean()
    assert full.perplexity == pytest.approx(math.exp(float(nll)), rel=1e-4)

    pruned = PhasePolicy.uniform([0, 1], LayerPolicy(keep=(0, 1, 2)))
    decode_only = scorer.score(None, pruned)
    prefill_only = scorer.score(pruned, None)
    both = scorer.score(pruned, pruned)
    assert decode_only.kl > 1e-4 and prefill_only.kl > 1e-4
    assert both.kl > 1e-4
    # pruning the prefix (KV cache) and pruning the scored tokens are different interventions
    assert decode_only.kl != pytest.approx(prefill_only.kl)


# ---- the quality-floor verdict: paired ratio of accuracies against the full model ---------------

def test_the_score_statistic_at_ratio_one_is_mcnemars():
    from moetailor.eval.metrics import PairedCounts, ratio_score
    c = PairedCounts(both=269, gained=5, lost=9, neither=17)
    assert ratio_score(c, 1.0) == pytest.approx((5 - 9) / math.sqrt(5 + 9))


def test_all_prompts_right_on_both_sides_gives_the_closed_form_bound():
    """With every prompt right on both sides the statistic is sqrt(n (1 - r) / r), so the lower bound
    is n / (n + z^2): 300 prompts prove 98.7%, and 124 identical prompts do not prove 97% while 126 do."""
    from moetailor.eval.metrics import MEETS, UNDECIDED, Z95, PairedCounts, floor_verdict, ratio_interval
    low, high = ratio_interval(PairedCounts(300, 0, 0, 0))
    assert low == pytest.approx(300 / (300 + Z95 ** 2), abs=1e-9) and high > 1
    small = floor_verdict(PairedCounts(5, 0, 0, 0), 0.97)
    assert small.verdict == UNDECIDED and small.prompts_to_decide == math.ceil(Z95 ** 2 * 0.97 / 0.03) + 1 == 126
    assert floor_verdict(PairedCounts(124, 0, 0, 0), 0.97).verdict == UNDECIDED
    assert floor_verdict(PairedCounts(126, 0, 0, 0), 0.97).verdict == MEETS


def test_one_gained_prompt_of_sixty_is_not_enough_to_tell():
    """`tune --n 10`: 101.9% of full on +1/-0 changed prompts straddles 97%; the verdict says so and
    names the prompts that would decide at these rates."""
    from moetailor.eval.metrics import UNDECIDED, PairedCounts, floor_verdict
    full = [True] * 53 + [False] * 7
    cand = [True] * 53 + [True] + [False] * 6
    v = floor_verdict(PairedCounts.of(cand, full), 0.97)
    assert v.ratio == pytest.approx(54 / 53) and (v.gained, v.lost, v.prompts) == (1, 0, 60)
    assert v.verdict == UNDECIDED and v.low < 0.97 < 1 < v.high and v.prompts_to_decide > 60
    text = v.describe(per_task=6)
    assert "101.9% of full (95% CI" in text and "not enough prompts to tell" in text
    assert f"about {v.prompts_to_decide} prompts would decide (meets; --n {-(-v.prompts_to_decide // 6)})" in text


def test_clear_losses_miss_and_clear_agreement_meets():
    from moetailor.eval.metrics import MEETS, MISSES, PairedCounts, floor_verdict
    miss = floor_verdict(PairedCounts(both=250, gained=5, lost=28, neither=17), 0.97)   # 90.6% of full
    assert miss.verdict == MISSES and miss.high < 0.97 and miss.prompts_to_decide is None
    assert "misses" in miss.describe() and "would decide" not in miss.describe()
    meet = floor_verdict(PairedCounts(both=995, gained=3, lost=2, neither=0), 0.97)
    assert meet.verdict == MEETS and meet.low >= 0.97


def test_undefined_share_and_mismatched_prompts():
    from moetailor.eval.metrics import UNDECIDED, PairedCounts, floor_verdict
    v = floor_verdict(PairedCounts(0, 3, 0, 7), 0.97)         # the full model answers none
    assert v.verdict == UNDECIDED and math.isnan(v.ratio) and "share of full undefined" in v.describe()
    with pytest.raises(ValueError, match="same prompts"):
        PairedCounts.of([True], [True, False])


def test_the_interval_covers_the_true_ratio_in_repeated_paired_draws():
    """Seeded draws of 60 paired prompts where the candidate never gains a prompt (the case a bootstrap
    over prompts collapses on): the 95% interval holds the true ratio at least 93% of the time."""
    import numpy as np

    from moetailor.eval.metrics import PairedCounts, ratio_interval
    rng = np.random.default_rng(0)
    probs = [0.5, 0.0, 0.02, 0.48]                     # both, gained, lost, neither: true ratio 0.5 / 0.52
    hits = 0
    for _ in range(300):
        low, high = ratio_interval(PairedCounts(*map(int, rng.multinomial(60, probs))))
        hits += low <= 0.5 / 0.52 <= high
    assert hits / 300 >= 0.93


def test_sign_test_matches_the_exact_binomial():
    assert sign_test(0, 0) == 1.0
    assert sign_test(3, 9) == pytest.approx(0.146, abs=1e-3)      # docs/techniques.md: 3 up, 9 down, p = 0.15
    assert sign_test(22, 7) == pytest.approx(0.0081, abs=1e-4)    # 22 gained, 7 lost: p = 0.008
    assert sign_test(5, 5) == 1.0
    assert sign_test(0, 6) == pytest.approx(2 / 64)


def test_versus_full_counts_a_repeated_prompt_once():
    """Three results, the first prompt twice: its second result (which would add a loss) is not counted."""
    got = versus_full([True, False, True], [True, True, False], ["a", "a", "b"], floor=0.9)
    assert (got["prompts"], got["gained"], got["lost"]) == (2, 1, 0)
    assert got["ratio"] == 2.0 and got["verdict"] == "not enough prompts to tell"
    assert "verdict" not in versus_full([True], [True], ["a"], floor=None)
    assert versus_full([True], [False], ["a"], floor=0.9)["ratio"] is None     # the full model answers none
