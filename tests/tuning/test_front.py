"""Pareto fronts, paired counts and the choice against floor and target."""
import pytest

from moetailor.eval.metrics import MEETS, MISSES, UNDECIDED
from moetailor.tuning.front import choose, paired, pareto


def test_paired_counts_need_the_same_prompts():
    assert paired([True, False, True, True], [True, True, False, False]) == (2, 1, 1.0)
    with pytest.raises(ValueError, match="same prompts"):
        paired([True], [True, False])


def test_pareto_keeps_only_undominated_points_cheapest_first():
    pts = [{"k": "a", "budget": 0.5, "q": 0.8}, {"k": "b", "budget": 0.5, "q": 0.9},
           {"k": "c", "budget": 0.4, "q": 0.85}, {"k": "d", "budget": 0.7, "q": 0.88}, {"k": "e", "budget": 1.0, "q": 1.0}]
    front = pareto(pts, cost=lambda p: p["budget"], quality=lambda p: p["q"])
    assert [p["k"] for p in front] == ["c", "b", "e"]


def test_choice_names_both_sides_when_the_floor_is_missed_at_the_target():
    pts = [{"key": "full", "budget": 1.0, "q": 1.0}, {"key": "p60", "budget": 0.6, "q": 0.98},
           {"key": "p50", "budget": 0.5, "q": 0.95}, {"key": "p40", "budget": 0.4, "q": 0.90}]
    q = lambda p: p["q"]  # noqa: E731
    verdict = lambda p: MEETS if p["q"] >= 0.97 else MISSES  # noqa: E731
    met = choose(pts, verdict, lambda p: p["budget"] <= 0.6, q, "accuracy")
    assert met.met and met.chosen["key"] == "p60" and met.cheapest_meeting_floor["key"] == "p60"
    missed = choose(pts, verdict, lambda p: p["budget"] <= 0.5, q, "accuracy")
    assert not missed.met and missed.chosen is None
    assert missed.cheapest_meeting_floor["key"] == "p60" and missed.best_at_target["key"] == "p50"


def test_a_point_the_prompts_cannot_tell_about_is_never_chosen():
    """101.9% of full on +1/-0 changed prompts is no proof of 97%: the point is named, not chosen."""
    pts = [{"key": "full", "budget": 1.0, "q": 1.0, "v": MEETS},
           {"key": "p50", "budget": 0.5, "q": 1.019, "v": UNDECIDED},
           {"key": "p40", "budget": 0.4, "q": 0.90, "v": MISSES}]
    c = choose(pts, lambda p: p["v"], lambda p: p["budget"] <= 0.5, lambda p: p["q"], "accuracy")
    assert not c.met and c.chosen is None
    assert c.best_at_target["key"] == "p50" and c.cheapest_meeting_floor["key"] == "full"
