import pytest
import torch

from engine_helpers import char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model steps in ~5 ms on one thread; two threads on a loaded 2-core machine are 20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
