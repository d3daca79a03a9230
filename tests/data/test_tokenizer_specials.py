"""Special tokens train_bpe refuses before training: one named twice, or one that is a character of the
byte-level alphabet (the vocabulary's own token for a byte)."""

from __future__ import annotations

import pytest

from tformer.data import Tokenizer

TEXTS = ["to be or not to be, that is the question"] * 10


@pytest.mark.parametrize(
    ("specials", "twice"),
    [
        (("<pad>", "<pad>", "<eos>", "<unk>"), "<pad>"),
        (("<pad>", "<bos>", "<eos>", "<eos>"), "<eos>"),
    ],
)
def test_a_special_token_named_twice_is_refused(specials: tuple[str, ...], twice: str) -> None:
    with pytest.raises(ValueError) as err:
        Tokenizer.train_bpe(TEXTS, 300, special_tokens=specials)
    assert str(err.value) == f"special_tokens name {twice!r} twice; the 4 (pad, bos, eos, unk) must differ"


@pytest.mark.parametrize("byte", ["a", "Ġ", "!"])
def test_a_special_token_of_one_byte_level_character_is_refused(byte: str) -> None:
    with pytest.raises(ValueError, match=r"^special token .* is a character of the byte-level alphabet"):
        Tokenizer.train_bpe(TEXTS, 300, special_tokens=(byte, "<bos>", "<eos>", "<unk>"))


def test_specials_are_checked_before_the_texts() -> None:
    with pytest.raises(ValueError, match="twice"):  # not "no text to train a tokenizer on"
        Tokenizer.train_bpe([""], 300, special_tokens=("<a>", "<a>", "<b>", "<c>"))


def test_other_special_tokens_still_train() -> None:
    tok = Tokenizer.train_bpe(TEXTS, 300, special_tokens=("[PAD]", "[BOS]", "[EOS]", "ab"))
    assert tok.special_tokens == ("[PAD]", "[BOS]", "[EOS]", "ab")
    assert tok.decode(tok.encode("a b")) == "a b"
