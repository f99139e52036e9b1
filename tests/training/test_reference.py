"""The reference-model recipe's data side: packed task rows carry loss only on completions."""
import json

import pytest

from moetailor.data.corpus import DOMAIN_NAMES
from moetailor.models.loading import load_tokenizer
from moetailor.training.reference import Mixture


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "train").mkdir()
    for name in DOMAIN_NAMES:
        docs = [{"text": f"{name} document {i}. " * 40} for i in range(5)]
        (root / "train" / f"{name}.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    return root


def test_masked_task_rows_train_only_on_completions(corpus):
    tok = load_tokenizer("reference")
    mixture = Mixture(tok, corpus, seq_len=256, task_share=1.0, seed=0, mask_prompts=True)
    ids, labels = mixture.batch(4)                                   # [4, 256] each
    assert ids.shape == labels.shape == (4, 256)
    trained = labels != -100
    assert 0 < trained.float().mean() < 1                            # some masked, some trained
    assert (labels[trained] == ids[trained]).all()                   # trained labels are the inputs
    text = tok.decode(ids[0][trained[0]].tolist())
    assert "####" in text and "lookup" not in text                   # completions, not prompts


def test_unmasked_text_rows_and_task_weights(corpus):
    tok = load_tokenizer("reference")
    text_only = Mixture(tok, corpus, seq_len=128, task_share=0.0, seed=0, mask_prompts=True)
    ids, labels = text_only.batch(2)
    assert (labels == ids).all()                                      # text windows: every token
    lookup_only = Mixture(tok, corpus, seq_len=512, task_share=1.0, seed=0, mask_prompts=False,
                          task_weights={name: 0.0 for name in ("addition", "expressions", "brackets",
                                                                "sorting", "reverse")})
    ids, _ = lookup_only.batch(1)
    assert tok.decode(ids[0].tolist()).startswith("lookup\n")
