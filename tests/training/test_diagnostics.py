"""The copy probes on the bundled model: they separate a trained copy skill from an untrained one."""
import math

import pytest

from moetailor.models import load_model, load_tokenizer
from moetailor.training.diagnostics import copy_loss, repeat_gap


@pytest.fixture(scope="module")
def reference():
    return load_model("reference").eval(), load_tokenizer("reference")


def test_copy_probe_sees_the_trained_letter_copy_and_not_an_untrained_digit_copy(reference):
    model, tok = reference
    letters = copy_loss(model, tok, "abcdefghijklmnopqrstuvwxyz", n=6)
    digits = copy_loss(model, tok, "0123456789", n=6)
    assert letters < 0.5                      # the copy task is trained: near-free
    assert digits > 1.0                       # never trained on digits: no general copy mechanism
    assert digits < math.log(len(tok))        # better than uniform over the vocabulary: it knows digits come


def test_repeat_gap_measures_both_copies(reference):
    model, tok = reference
    gap = repeat_gap(model, tok, window=32)
    assert set(gap) == {"first_copy_nats", "second_copy_nats"}
    assert all(0 < v < math.log(len(tok)) + 3 for v in gap.values())


def test_progress_check_reports_accuracy_and_probes_and_leaves_the_model_training(reference):
    from moetailor.data.tasks import TASKS
    from moetailor.training.reference import progress_check

    model, tok = reference
    result = progress_check(model, tok, n_per_task=1)
    assert set(result) == {*TASKS, "mean", "first_copy_nats", "second_copy_nats", "copy_letters_nats",
                           "copy_digits_nats"}
    assert all(0.0 <= result[name] <= 1.0 for name in TASKS)
    assert model.training                      # the training loop goes on after the check
    model.eval()


def test_induction_drill_rows_are_symbols_and_the_loss_starts_at_guessing(reference):
    from moetailor.training.diagnostics import drill_model, induction_drill, symbol_tokens

    _, tok = reference
    symbols = symbol_tokens(tok)
    assert {tok.decode([i]).strip() for i in symbols} == set("abcdefghijklmnopqrstuvwxyz0123456789")
    model = drill_model("dense", len(tok), layers=1)
    reported = []
    curve = induction_drill(model, tok, steps=4, batch=2, seq=32, lengths=(4, 8), log_every=2, report=reported.append)
    assert [p["step"] for p in curve] == [2, 4] and reported == curve        # reported as measured
    assert abs(curve[0]["loss"] - math.log(len(tok))) < 1.0      # untrained: uniform over the vocabulary
    with pytest.raises(ValueError, match="reference.*dense"):
        drill_model("mixtral", len(tok))
