import warnings

import pytest

from tformer.tasks.corpus import train_tokenizer

TEXT = "the quick brown fox jumps over the lazy dog. " * 20


def test_short_vocabulary_warns_naming_the_field():
    with pytest.warns(UserWarning, match=r"fewer than data.src_vocab_size=4,000.*the model uses \d+"):
        tok = train_tokenizer([TEXT], 4000, "data.src_vocab_size")
    assert tok.vocab_size < 4000


def test_full_vocabulary_is_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tok = train_tokenizer([TEXT], 262)
    assert tok.vocab_size == 262
