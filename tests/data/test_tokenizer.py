"""Byte-level BPE: exact round trips, stable ids for special tokens, JSON storage, determinism."""

from __future__ import annotations

import json

import pytest

from tformer.data import SPECIAL_TOKENS, Tokenizer, load_corpus

UNICODE = "Caf\u00e9 na\u00efve \u2014 \u201cquoted\u201d, \u65e5\u672c\u8a9e, \U0001f3ad!\n\ttab  two spaces <eos> <pad>\n"


@pytest.fixture(scope="module")
def texts() -> list[str]:
    corpus = load_corpus("shakespeare")
    return [d.text[:60_000] for d in corpus["train"][:4]]


@pytest.fixture(scope="module")
def tok(texts) -> Tokenizer:
    return Tokenizer.train_bpe(texts, vocab_size=600)


def test_special_tokens_have_fixed_ids(tok):
    assert tok.special_tokens == SPECIAL_TOKENS
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.vocab_size == 600


def test_round_trip_is_exact_on_shakespeare_and_unicode(tok):
    heldout = load_corpus("shakespeare")["test"][0].text[:20_000]
    for text in (heldout, UNICODE, heldout[:500] + UNICODE, "", " leading and trailing "):
        assert tok.decode(tok.encode(text)) == text


def test_bos_eos_and_literal_special_text(tok):
    ids = tok.encode("To be", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "To be"
    assert tok.decode(ids, skip_special=False) == "<bos>To be<eos>"
    literal = tok.encode("<eos>")
    assert tok.eos_id not in literal and tok.decode(literal) == "<eos>"  # text never becomes a control token


def test_encode_batch_matches_encode(tok, texts):
    lines = texts[0].splitlines()[:50] + [UNICODE]
    assert tok.encode_batch(lines, add_eos=True) == [tok.encode(t, add_eos=True) for t in lines]
    assert tok.decode_batch(tok.encode_batch(lines)) == lines


def test_training_is_deterministic(tok, texts):
    again = Tokenizer.train_bpe(texts, vocab_size=600)
    assert again == tok and again.fingerprint() == tok.fingerprint()


def test_save_load_json(tok, tmp_path):
    path = tok.save(tmp_path / "run")
    assert path.name == "tokenizer.json"
    assert json.loads(path.read_text())["model"]["type"] == "BPE"  # the library's own JSON, no pickle
    for loaded in (
        Tokenizer.load(path),
        Tokenizer.load(tmp_path / "run"),
        Tokenizer.from_json_str(tok.to_json_str()),
    ):
        assert loaded == tok
        assert loaded.encode(UNICODE) == tok.encode(UNICODE)
        assert tok.eos_id not in loaded.encode("<eos>")


def test_bad_settings_fail_loudly(texts):
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.train_bpe(texts, vocab_size=100)
    with pytest.raises(ValueError, match="special_tokens"):
        Tokenizer.train_bpe(texts, vocab_size=600, special_tokens=("<pad>",))


def test_bad_tokenizer_input_is_named(tmp_path):
    """The library had raised a bare Exception for a bad file, trained on a string's characters or on
    nothing, and dropped unknown ids from decode."""
    (tmp_path / "bad.json").write_text("{1: 2}")
    with pytest.raises(ValueError, match="bad.json is not a tokenizer.json file"):
        Tokenizer.load(tmp_path / "bad.json")
    with pytest.raises(TypeError, match=r"wrap one text in a list: \[text\]"):
        Tokenizer.train_bpe("just one text", 300)
    for empty in ([], ["", "  "]):
        with pytest.raises(ValueError, match="no text to train a tokenizer on"):
            Tokenizer.train_bpe(empty, 300)
    tok = Tokenizer.train_bpe(["some text to learn from"] * 10, 270)
    with pytest.raises(ValueError, match="token id 99999 is outside this tokenizer's vocabulary"):
        tok.decode([99999, 5])
    for ids in ([99999], [-1]):  # the batch had dropped the first silently and overflowed on the second
        with pytest.raises(ValueError, match=f"token id {ids[0]} is outside"):
            tok.decode_batch([[5], ids])
    with pytest.raises(TypeError, match=r"wrap one text in a list: \[text\]"):
        tok.encode_batch("abc")  # had encoded each character as a text
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str, got NoneType"):
        tok.encode_batch(["a", None])
    with pytest.raises(TypeError, match="text must be a str, got NoneType"):
        tok.encode(None)
    with pytest.raises(ValueError, match="the text is not a tokenizer.json file"):
        Tokenizer.from_json_str("junk")
    with pytest.raises(ValueError, match=r"vocab_size 2,000,000 is above the 1,048,576"):
        Tokenizer.train_bpe(["some text"] * 10, 2_000_000)
    assert tok.save(tmp_path / "tok.JSON").name == "tok.JSON" and (tmp_path / "tok.JSON").is_file()


def test_decode_takes_one_row_of_int_ids_and_names_anything_else():
    """A 2-D tensor, bools, floats, None and a string had failed inside the library or decoded silently."""
    import torch

    tok = Tokenizer.train_bpe(["some text to learn from"] * 10, 270)
    ids = tok.encode("some text")
    assert tok.decode(torch.tensor(ids)) == tok.decode(ids) == "some text"  # a 1-D tensor is a row
    assert tok.decode(list(torch.tensor(ids))) == "some text"  # 0-d tensors and NumPy ints are ids too
    assert tok.id_to_token(torch.tensor(ids)[0]) == tok.id_to_token(ids[0])
    assert tok.decode_batch(torch.tensor([ids, ids])) == ["some text"] * 2
    for bad, needle in (
        (torch.tensor([ids]), r"ids must be one sequence of token ids \(1-D\), got shape \(1, \d+\)"),
        ([True, False], r"ids\[0\] must be an int token id, got True"),
        ([5, 1.5], r"ids\[1\] must be an int token id, got 1.5"),
        ([None], r"ids\[0\] must be an int token id, got None"),
        ("abc", "ids must be a sequence of int token ids, got str"),
    ):
        with pytest.raises(TypeError, match=needle):
            tok.decode(bad)
    with pytest.raises(TypeError, match=r"batch\[1\] must be a sequence of int token ids, got str"):
        tok.decode_batch([ids, "ab"])
    assert tok.id_to_token(-1) is None and tok.id_to_token(10**9) is None and tok.id_to_token(5) is not None


def test_encode_and_training_name_bad_arguments():
    tok = Tokenizer.train_bpe(["some text to learn from"] * 10, 270)
    with pytest.raises(
        ValueError, match=r"text is not valid Unicode: a lone surrogate '\\ud800' at character 1"
    ):
        tok.encode("a\ud800b")  # the library said "TextInputSequence must be str"
    with pytest.raises(ValueError, match=r"texts\[1\] is not valid Unicode"):
        tok.encode_batch(["a", "\udcff"])
    with pytest.raises(TypeError, match="add_bos must be True or False, got 2"):
        tok.encode("a", add_bos=2)  # had added two BOS tokens
    with pytest.raises(TypeError, match=r"texts\[0\] must be a str, got int"):
        Tokenizer.train_bpe([1, 2], 300)
    with pytest.raises(ValueError, match="min_frequency must be an int >= 0, got -1"):
        Tokenizer.train_bpe(["a b"], 300, min_frequency=-1)
    with pytest.raises(ValueError, match=r"special_tokens must be 4 strings .*got 'abcd'"):
        Tokenizer.train_bpe(["a b"], 300, special_tokens="abcd")  # had been 4 one-letter tokens
    with pytest.raises(TypeError, match="texts must be a list of strings, got NoneType"):
        Tokenizer.train_bpe(None, 300)  # had been "'NoneType' object is not iterable"
    with pytest.raises(TypeError, match=r"token must be a str \(id_to_token turns an id into one\), got int"):
        tok.token_to_id(5)  # the library's "'int' object is not an instance of 'str'"
    assert tok.token_to_id("<bos>") == tok.bos_id and tok.token_to_id("no such token") is None
    for decode in (tok.decode, tok.decode_batch):
        with pytest.raises(TypeError, match="skip_special must be True or False, got 'no'"):
            decode([5] if decode == tok.decode else [[5]], skip_special="no")


def test_long_runs_without_spaces_train_in_pieces(monkeypatch):
    """A 100,000-letter line had taken ~3 s to train on (300,000: a minute); texts without such runs learn
    exactly what they learned before."""
    import random
    import string
    import time

    import tformer.data.tokenizer as T

    normal = ["some text to learn from, with words and more words"] * 20
    rng = random.Random(0)
    line = "".join(rng.choice(string.ascii_letters) for _ in range(50_000))

    def train(texts: list[str], vocab: int) -> tuple[Tokenizer, float]:
        start = time.perf_counter()
        return Tokenizer.train_bpe(texts, vocab), time.perf_counter() - start

    pieces, fast = train([line, *normal], 600)
    before, _ = train(normal, 300)
    monkeypatch.setattr(T, "_pieces", lambda texts: iter(texts))  # training on the texts as they are
    whole, slow = train([line, *normal], 600)
    assert train(normal, 300)[0].to_json_str() == before.to_json_str()
    assert slow > 2 * fast, (slow, fast)  # ~8x here, measured side by side
    assert pieces.decode(pieces.encode(line[:5000])) == line[:5000]
    spaces = "a" + " " * 50_000 + "b"  # whitespace is one pre-token too
    monkeypatch.undo()
    _, cut = train([spaces, *normal], 600)
    monkeypatch.setattr(T, "_pieces", lambda texts: iter(texts))
    _, uncut = train([spaces, *normal], 600)
    assert uncut > 2 * cut, (uncut, cut)


def test_the_size_and_frequency_limits_hold_at_their_edges():
    """260 (256 bytes + 4 specials) is the smallest vocabulary, 259 is refused; min_frequency 0 trains."""
    texts = ["some text to learn from"] * 10
    assert Tokenizer.train_bpe(texts, 260).vocab_size == 260
    with pytest.raises(ValueError, match="vocab_size 259 < 256 bytes"):
        Tokenizer.train_bpe(texts, 259)
    assert (
        Tokenizer.train_bpe(texts, 280, min_frequency=0).decode(Tokenizer.train_bpe(texts, 280).encode("x"))
        == "x"
    )
    from tformer.data.tokenizer import MAX_BPE_VOCAB

    with pytest.raises(ValueError, match="is above the"):
        Tokenizer.train_bpe(texts, MAX_BPE_VOCAB + 1)


def test_ids_stop_at_the_vocabulary_size_in_every_decode():
    tok = Tokenizer.train_bpe(["some text to learn from"] * 10, 270)
    last = tok.vocab_size - 1
    tok.decode([last])
    for call in (lambda: tok.decode([tok.vocab_size]), lambda: tok.decode_batch([[5], [tok.vocab_size]])):
        with pytest.raises(ValueError, match=f"token id {tok.vocab_size} is outside"):
            call()


def test_decode_batch_keeps_special_tokens_when_asked():
    tok = Tokenizer.train_bpe(["some text to learn from"] * 10, 270)
    rows = tok.encode_batch(["some", "text"], add_bos=True, add_eos=True)
    assert tok.decode_batch(rows, skip_special=False) == ["<bos>some<eos>", "<bos>text<eos>"]
    assert tok.decode_batch(rows) == ["some", "text"]
    with pytest.raises(TypeError, match="add_eos must be True or False, got 2"):
        tok.encode_batch(["a"], add_eos=2)  # would add two EOS tokens


def test_a_tokenizer_file_whose_special_tokens_sit_elsewhere_is_refused(tmp_path):
    """pad / bos / eos / unk must be ids 0..3: a file that puts them elsewhere would make the model's
    padding and stopping ids ordinary tokens."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.add_tokens(["a", "b"])  # ordinary tokens take ids 0 and 1
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    (tmp_path / "shifted.json").write_text(backend.to_str())
    with pytest.raises(
        ValueError, match=r"4 special tokens with ids 0..3 in the order \(pad, bos, eos, unk\)"
    ):
        Tokenizer.load(tmp_path / "shifted.json")
