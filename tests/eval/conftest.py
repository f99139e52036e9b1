import pytest

from moetailor.models.tiny import char_tokenizer


@pytest.fixture(scope="session")
def char_tok():
    return char_tokenizer(98)
