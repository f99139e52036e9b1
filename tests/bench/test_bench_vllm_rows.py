"""`bench vllm`'s rows: what a run times for the process groups asked for (no vLLM needed)."""
from moetailor.bench.vllm import rows_of


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
