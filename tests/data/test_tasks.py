"""The task suite: generators are correct, scorers reject wrong answers, lengths grow."""
import random

import pytest

from moetailor.data.tasks import (
    TASKS,
    addition,
    brackets,
    eval_examples,
    expressions,
    extract_answer,
    get_task,
    score,
    sorting,
    training_rng,
)


@pytest.mark.parametrize("name", list(TASKS))
def test_reference_completion_scores_correct_and_wrong_answers_score_wrong(name):
    for ex in eval_examples(TASKS[name], 30, seed=1):
        assert score(ex, ex.completion)
        assert score(ex, ex.completion + "\n")          # trailing whitespace is not an error
        wrong = ex.completion.rsplit("####", 1)[0] + "#### " + ex.answer + "0"
        assert not score(ex, wrong)
        assert not score(ex, ex.completion.rsplit("####", 1)[0])  # no marker: wrong
        assert not score(ex, "")


@pytest.mark.parametrize("name", list(TASKS))
def test_output_length_grows_with_difficulty(name):
    task = TASKS[name]
    def mean_len(d):
        rng = random.Random(0)
        exs = [task.generate(rng, d) for _ in range(50)]
        return sum(len(e.completion) + len(e.prompt) for e in exs) / len(exs)
    assert mean_len(1) < mean_len(2) < mean_len(3)


def test_addition_trace_and_answer():
    ex = addition.solve(958, 67)
    assert ex.answer == "1025"
    assert ex.completion.splitlines()[0] == "8+7+0=15 c1 | 5"
    assert extract_answer(ex.completion) == "1025"


def test_expression_evaluator_is_ast_based_and_rejects_other_syntax():
    assert expressions.evaluate("(3+4)*2-(1-9)") == 22
    assert expressions.evaluate("16--5") == 21
    for bad in ("__import__('os')", "2**8", "1/2", "x+1"):
        with pytest.raises((ValueError, SyntaxError)):
            expressions.evaluate(bad)


def test_expression_trace_reduces_one_operation_per_line():
    rng = random.Random(3)
    for _ in range(50):
        ex = expressions.generate(rng, 3)
        lines = ex.completion.splitlines()[:-1]
        assert len(lines) == 3  # 4 operations: 3 intermediate lines, then the answer
        values = {expressions.evaluate(line) for line in lines}
        assert values == {int(ex.answer)}


def test_brackets_and_sorting_answers():
    assert brackets.solve("([]{})").answer == "yes"
    assert brackets.solve("([)]").answer == "no"
    assert brackets.solve("((").answer == "no"
    assert sorting.solve([5, 3, 41, 3]).answer == "3 3 5 41"


def test_training_and_evaluation_streams_are_disjoint():
    train_prompts = set()
    rng = training_rng(0)
    for task in TASKS.values():
        for i in range(300):
            train_prompts.add(task.generate(rng, task.difficulties[i % 3]).prompt)
    evals = [e.prompt for t in TASKS.values() for e in eval_examples(t, 300, seed=0)]
    # streams differ (only trivially small problems may coincide by chance)
    assert sum(p in train_prompts for p in evals) < 0.05 * len(evals)
    assert eval_examples(TASKS["lookup"], 5, seed=0) == eval_examples(TASKS["lookup"], 5, seed=0)


def test_unknown_task_lists_the_valid_ones():
    with pytest.raises(ValueError, match="addition.*lookup"):
        get_task("gsm8k")
    from moetailor.eval.user_tasks import select_tasks
    assert len(select_tasks("all")) == 6
    assert [t.name for t in select_tasks("sorting,reverse")] == ["sorting", "reverse"]


def test_lookup_value_is_the_token_after_its_key():
    """One-hop retrieval: each table line is key token then value token, and the query key is a
    different token (leading space), so the look-back has exactly one earlier match."""
    from moetailor.models.loading import load_tokenizer

    tok = load_tokenizer("reference")
    ex = TASKS["lookup"].generate(random.Random(5), 2)
    ids = tok(ex.prompt, add_special_tokens=False)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    target = ex.prompt.splitlines()[-1].split()[-1]
    assert pieces[-2:] == ["Ġ" + target, "Ċ"]
    hits = [i for i, piece in enumerate(pieces) if piece == target]
    assert len(hits) == 1 and pieces[hits[0] + 1] == ex.answer
    assert ex.completion == f"{target}{ex.answer}\n#### {ex.answer}"
