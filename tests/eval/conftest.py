import pytest


def char_tokenizer():
    """One token per character (newline and printable ASCII); id 0 = <eos>, 1 = <pad>. 98 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<pad>": 1, "\n": 2}
    vocab.update({chr(c): c - 29 for c in range(32, 127)})
    t = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    t.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", pad_token="<pad>")


@pytest.fixture(scope="session")
def char_tok():
    return char_tokenizer()
