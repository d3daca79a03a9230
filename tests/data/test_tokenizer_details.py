"""Tokenizer details checked against the `tokenizers` library itself: custom special tokens, long runs cut
into LONG_RUN-character pieces (and nothing shorter cut), added tokens counted in the vocabulary."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from tformer.data import SPECIAL_TOKENS, Tokenizer


def library_bpe_model(pieces: list[str], vocab_size: int) -> dict:
    """The "model" part (vocabulary and merges) of byte-level BPE trained by the library on `pieces` as
    they are, with the settings train_bpe documents (specials first, every byte in the alphabet)."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(pieces, trainer=trainer)
    return json.loads(backend.to_str())["model"]


def model_of(tok: Tokenizer) -> dict:
    return json.loads(tok.to_json_str())["model"]


def test_custom_special_tokens_take_ids_0_to_3():
    specials = ("[PAD]", "[BOS]", "[EOS]", "[UNK]")
    tok = Tokenizer.train_bpe(["some text to learn from"] * 10, 270, special_tokens=specials)
    assert tok.special_tokens == specials
    library = Backend.from_str(tok.to_json_str())  # what the stored JSON holds, read by the library
    assert [library.token_to_id(t) for t in specials] == [0, 1, 2, 3]
    assert all(library.token_to_id(t) is None for t in SPECIAL_TOKENS)  # the defaults are not added
    ids = tok.encode("some", add_bos=True, add_eos=True)
    assert tok.decode(ids, skip_special=False) == "[BOS]some[EOS]"
    assert 2 not in tok.encode("[EOS]") and tok.decode(tok.encode("[EOS]")) == "[EOS]"  # literal text


def test_a_run_shorter_than_long_run_trains_whole_and_a_longer_one_in_pieces():
    """LONG_RUN is 1024 characters: a run of 1000 letters is one pre-token, trained as the library trains
    it; a run of 2500 is trained as the library trains its pieces of 1024, 1024 and 452 characters (every
    piece counts, the run's own letters included)."""
    rng = random.Random(0)
    short = "".join(rng.choice("abcde") for _ in range(1000))
    long = "".join(rng.choice("vwxyz") for _ in range(2500))
    pieces = [long[:1024], long[1024:2048], long[2048:]]
    cut_short = [short[i : i + 64] for i in range(0, 1000, 64)]
    assert library_bpe_model([short], 600) != library_bpe_model(cut_short, 600)  # a shorter cut would show
    assert library_bpe_model([long], 600) != library_bpe_model(pieces, 600)  # the cut shows in the merges
    assert model_of(Tokenizer.train_bpe([short], 600)) == library_bpe_model([short], 600)
    assert model_of(Tokenizer.train_bpe([long], 600)) == library_bpe_model(pieces, 600)
    both = library_bpe_model([short + " ", *pieces], 600)  # the text before the run is a piece of its own
    assert model_of(Tokenizer.train_bpe([short + " " + long], 600)) == both


def test_added_tokens_of_a_tokenizer_file_count_in_the_vocabulary():
    """A tokenizer.json with a token added after training (the library's add_tokens) loads with that
    token in the vocabulary: its id decodes, as the library decodes it."""
    tok = Tokenizer.train_bpe(["some text to learn from"] * 10, 270)
    library = Backend.from_str(tok.to_json_str())
    library.add_tokens(["<sep>"])
    sep = library.token_to_id("<sep>")
    loaded = Tokenizer.from_json_str(library.to_str())
    assert loaded.vocab_size == library.get_vocab_size(with_added_tokens=True) == tok.vocab_size + 1
    assert loaded.id_to_token(sep) == "<sep>"
    assert loaded.decode([5, sep]) == library.decode([5, sep])


def test_equality_with_other_objects_is_false_and_vocab_size_is_not_a_bool():
    tok = Tokenizer.train_bpe(["some text to learn from"] * 10, 270)
    assert tok != "some text" and tok != None and tok != tok.to_json_str()  # noqa: E711
    assert tok == Tokenizer.from_json_str(tok.to_json_str())
    with pytest.raises(TypeError, match="vocab_size must be an int, got True"):
        Tokenizer.train_bpe(["some text"] * 10, True)
