"""The checkpoint's tokenizer as moetailor loads it."""
import logging

from moetailor.models.loading import load_tokenizer


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_document_longer_than_the_tokenizers_limit_tokenizes_without_a_warning():
    """Calibration and held-out KL tokenize whole documents and cut windows themselves; transformers'
    "sequence length is longer than the specified maximum" warning leaked into every such verb."""
    tok = load_tokenizer("reference")
    collect, logger = Collect(), logging.getLogger("transformers")    # transformers' loggers do not propagate
    logger.addHandler(collect)
    try:
        ids = tok("the quick brown fox jumps over the lazy dog. " * 400)["input_ids"]
    finally:
        logger.removeHandler(collect)
    assert len(ids) > 1024                                                # over the tokenizer file's limit
    assert not [m for m in collect.messages if "longer than the specified maximum" in m]
