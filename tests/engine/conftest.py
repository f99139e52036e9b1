import pytest

from engine_helpers import char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()
