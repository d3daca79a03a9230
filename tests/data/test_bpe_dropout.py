"""BPE-dropout: p = 0 is the tokenizers library's own encoding, every sample is a segmentation of the
text, a lone merge is skipped at rate p as the library's own dropout skips it, and samples are seeded."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest
import tokenizers
from tokenizers import normalizers, pre_tokenizers

from tformer.data import BPEDropout, Tokenizer, load_corpus

UNICODE = (
    "Caf\u00e9 na\u00efve \u2014 \u201cquoted\u201d, \u65e5\u672c\u8a9e, \U0001f3ad!\n\ttab  two spaces <eos>"
)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    pairs = load_corpus("trans-de-en", direction="de-en")["train"][:1500]
    return [t for p in pairs for t in (p.src, p.tgt)] + [UNICODE]


@pytest.fixture(scope="module")
def tok(texts) -> Tokenizer:
    return Tokenizer.train_bpe(texts, vocab_size=1000)


def test_rate_zero_is_the_librarys_encoding(tok, texts):
    assert BPEDropout(tok, 0.0).encode_batch(texts, seed=0, add_eos=True) == tok.encode_batch(
        texts, add_eos=True
    )


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_every_sample_is_a_segmentation_of_the_text(tok, texts, p):
    plain = tok.encode_batch(texts)
    samples = BPEDropout(tok, p).encode_batch(texts, seed=1)
    assert tok.decode_batch(samples) == texts
    assert all(0 <= i < tok.vocab_size for ids in samples for i in ids)
    # merges skipped: more tokens in all (a text may take fewer: a skipped merge can open another path)
    assert sum(map(len, samples)) > sum(map(len, plain)) * (1.05 if p == 0.1 else 1.5)


def test_rate_one_leaves_every_byte_a_token(tok, texts):
    samples = BPEDropout(tok, 1.0).encode_batch(texts[:50], seed=0)
    assert [len(s) for s in samples] == [len(t.encode("utf-8")) for t in texts[:50]]


def test_a_lone_merge_is_skipped_at_the_rate_the_library_skips_it():
    """A two-byte word with one merge is left in two tokens with probability p (the library's dropout,
    whose generator cannot be seeded, as the reference)."""
    tok = Tokenizer.train_bpe(["ab"] * 10, vocab_size=261)  # the one merge: a + b
    assert tok.encode("ab") == [tok.token_to_id("ab")]
    n, p = 20_000, 0.3
    ours = BPEDropout(tok, p).encode_batch(["ab"] * n, seed=0)
    backend = tokenizers.Tokenizer.from_str(tok.to_json_str())
    backend.model.dropout = p
    theirs = [e.ids for e in backend.encode_batch(["ab"] * n, add_special_tokens=False)]
    split_ours = sum(len(ids) == 2 for ids in ours) / n
    split_theirs = sum(len(ids) == 2 for ids in theirs) / n
    sigma = (p * (1 - p) / n) ** 0.5  # 0.0032
    assert abs(split_ours - p) < 5 * sigma
    assert abs(split_ours - split_theirs) < 7 * sigma


def naive_sample(word: str, ranks: dict[tuple[str, str], int], p: float, rng: random.Random) -> tuple:
    """The paper's rule written out: at each merge step, try the candidate merges in rank order (then
    position), each skipped with probability p; apply the first one kept; stop when all are skipped."""
    symbols = list(word)
    while True:
        candidates = sorted(
            (ranks[pair], i) for i, pair in enumerate(zip(symbols, symbols[1:])) if pair in ranks
        )
        for _, i in candidates:
            if rng.random() >= p:
                symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
                break
        else:
            return tuple(symbols)


@pytest.mark.parametrize("word", ["abab", "aaaa", "abcab", "abcabc"])
def test_segmentations_are_distributed_as_the_rule_written_out_draws_them(word):
    """Words with several candidate merges at a step (where rank order and one draw per candidate matter):
    the sampled segmentations' distribution equals the naive rule's (total variation distance; taking the
    candidates in position order, or stopping at the first skip, measured 0.10-0.50 on these words)."""
    tok = Tokenizer.train_bpe(["abab", "aaaa", "abcab", "abcabc"] * 10, vocab_size=270)
    merges = json.loads(tok.to_json_str())["model"]["merges"]
    ranks = {tuple(m): r for r, m in enumerate(merges)}
    n, p = 20_000, 0.35
    ours = Counter(
        tuple(map(tok.id_to_token, ids)) for ids in BPEDropout(tok, p).encode_batch([word] * n, seed=0)
    )
    rng = random.Random(1)
    theirs = Counter(naive_sample(word, ranks, p, rng) for _ in range(n))
    assert len(theirs) >= 5  # several outcomes to tell apart
    distance = sum(abs(ours[k] - theirs[k]) for k in ours.keys() | theirs.keys()) / (2 * n)
    assert distance < 0.03  # measured 0.005-0.008


def test_samples_are_seeded(tok, texts):
    drop = BPEDropout(tok, 0.1)
    first = drop.encode_batch(texts[:200], seed="run:0")
    assert drop.encode_batch(texts[:200], seed="run:0") == first
    assert BPEDropout(tok, 0.1).encode(texts[0], random.Random("run:0")) == first[0]
    assert drop.encode_batch(texts[:200], seed="run:1") != first


@pytest.mark.parametrize("p", [-0.1, 1.5, "0.1", True, float("nan")])
def test_a_bad_rate_is_named(tok, p):
    with pytest.raises(ValueError, match="p must be a number from 0 to 1"):
        BPEDropout(tok, p)


def test_bad_arguments_are_named(tok):
    drop = BPEDropout(tok, 0.1)
    with pytest.raises(TypeError, match="wrap one text in a list"):
        drop.encode_batch("ab", seed=0)
    for seed in (None, 1.5, True):  # None had drawn from an unseeded generator
        with pytest.raises(TypeError, match="seed must be an int or a str"):
            drop.encode_batch(["ab"], seed=seed)
    with pytest.raises(TypeError, match="add_eos"):
        drop.encode_batch(["ab"], seed=0, add_eos=2)
    with pytest.raises(
        TypeError, match=r"rng must be a random.Random \(encode_batch takes a seed\), got int"
    ):
        drop.encode("ab", 0)


def test_pre_tokens_are_the_pieces_encode_segments(tok):
    """Each piece encodes alone to the ids it takes in the whole text (BPE never merges across pieces);
    a normalizer applies first, and without a pre-tokenizer the text is one piece."""
    text = "Der Hund  bellt, 3x!\n" + UNICODE
    pieces = tok.pre_tokens(text)
    assert len(pieces) > 10
    assert [t.id for piece in pieces for t in tok._backend.model.tokenize(piece)] == tok.encode(text)
    backend = tokenizers.Tokenizer.from_str(tok.to_json_str())
    backend.normalizer = normalizers.Lowercase()
    assert Tokenizer(backend).pre_tokens("Der Hund") == tok.pre_tokens("der hund")
    backend.pre_tokenizer = None
    assert Tokenizer(backend).pre_tokens("Der Hund") == ["der hund"]


def test_a_tokenizer_unlike_tformers_is_refused_by_what_sets_it_apart(tok):
    """Only a byte-level BPE as tformer trains it encodes as its merges applied to the pre-tokens."""
    cases = {
        "normalizes text before it splits it": lambda b: setattr(b, "normalizer", normalizers.Lowercase()),
        "has added tokens that are not special": lambda b: b.add_tokens(["Hund"]),
        "sets BPE options tformer's do not: dropout": lambda b: setattr(b.model, "dropout", 0.2),
        "does not split text with the ByteLevel pre-tokenizer": lambda b: setattr(
            b, "pre_tokenizer", pre_tokenizers.Whitespace()
        ),
    }
    for said, change in cases.items():
        backend = tokenizers.Tokenizer.from_str(tok.to_json_str())
        change(backend)
        with pytest.raises(ValueError, match=f"this one {re.escape(said)}"):
            BPEDropout(Tokenizer(backend), 0.1)
