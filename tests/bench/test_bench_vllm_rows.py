"""`bench vllm`'s rows and the paired ratio of a group of two rows (no vLLM needed)."""
from moetailor.bench.vllm import median_interval, paired_ratio, pairs_of, ratio_text, rows_of


def test_the_stock_row_needs_no_plans():
    """scripts/engine_vs_hf.py times vLLM's stock row alone, with no plan files."""
    assert [(r.name, r.engine, r.plan) for r in rows_of(["stock"], {}, 8)] == [("stock", "stock", None)]


def test_plan_rows_carry_their_plan_and_a_row_two_groups_name_is_timed_once():
    plans = {"masked-50": "p50.json", "masked-25": "p25.json", "fold-50": "f50.json", "skip": "skip.json"}
    rows = rows_of(["masked-50", "experts-kernel", "observe", "budgets"], plans, 8)
    by_name = {r.name: r for r in rows}
    assert by_name["masked 50%"].plan == "p50.json" and by_name["masked 25%, mt kernel"].plan == "p25.json"
    assert [r.name for r in rows].count("full k") == 1          # budgets and observe both name it
    assert by_name["mixed k"].budgets and max(by_name["mixed k"].budgets) <= 8


def test_observing_is_paired_with_full_k_on_its_own_kernel():
    assert pairs_of(["budgets", "observe", "observe-kernel", "stock"]) == [
        ("full k", "observing"), ("full k, mt kernel", "observing, mt kernel")]


def test_median_interval_takes_order_statistics_from_the_binomial():
    """15 values: the median is the 8th, the 95% interval the 4th to the 12th (coverage 96.5%; the 5th to
    the 11th covers only 88%)."""
    values = [float(v) for v in (9, 3, 14, 1, 7, 12, 5, 15, 2, 10, 6, 13, 4, 11, 8)]
    assert median_interval(values) == (8.0, 4.0, 12.0)
    assert median_interval([4.0, 1.0, 3.0, 2.0, 6.0, 5.0]) == (3.5, 1.0, 6.0)   # 6 values: the extremes, 96.9%


def test_too_few_rounds_give_no_interval():
    """5 values: even the smallest and the largest cover only 93.75% of the time."""
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) == (3.0, None, None)
    p = paired_ratio([2.0, 2.0], [2.5, 2.0])
    assert p["median"] == 0.9 and p["low"] is None and "too few" in ratio_text(p)


def test_the_paired_ratio_is_second_over_first_in_tokens_per_second():
    """Seconds per round in; the second row 10% slower in every round whatever the round's speed: 1/1.1."""
    first = [1.0, 2.0, 1.5, 1.2, 3.0, 1.1, 1.4]
    p = paired_ratio(first, [1.1 * s for s in first])
    assert abs(p["median"] - 1 / 1.1) < 1e-12 and abs(p["low"] - 1 / 1.1) < 1e-12 and abs(p["high"] - 1 / 1.1) < 1e-12
    assert ratio_text(p) == "0.909x [0.909-0.909]"
