"""Packing, filtering, truncation and padding masks, on tiny hand-made token ids."""

from __future__ import annotations

import pytest
import torch

from tformer.data import (
    IGNORE_INDEX,
    ClassificationCollator,
    ClassificationDataset,
    PackedLMDataset,
    Seq2SeqCollator,
    Seq2SeqDataset,
    Tokenizer,
    collate_lm,
    pad_sequences,
)

PAD, BOS, EOS = 0, 1, 2


def test_packed_windows_are_shifted_by_one():
    ds = PackedLMDataset([[5, 6, 7], [8, 9]], seq_len=2, eos_id=EOS)  # stream 5 6 7 2 8 9 2
    assert ds.n_tokens == 7 and len(ds) == 3
    x, y = ds[0]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (2,)
    assert x.tolist() == [5, 6] and y.tolist() == [6, 7]
    assert ds[2][0].tolist() == [8, 9] and ds[2][1].tolist() == [9, 2]
    assert ds[-1][0].tolist() == ds[2][0].tolist()
    targets = torch.cat([ds[i][1] for i in range(len(ds))])
    assert targets.tolist() == ds.stream[1:].tolist()  # every token after the first is a target once
    with pytest.raises(IndexError):
        ds[3]


def test_packed_windows_score_the_tail_when_asked():
    """A whole text's evaluation: one more window, the last T + 1 tokens, scores the predictions the
    whole windows left out (a text of 1.9 windows had been scored on its first window alone)."""
    docs = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]  # stream 5..11 2 12 13 2: 11 tokens, 10 predictions
    assert len(PackedLMDataset(docs, seq_len=4, eos_id=EOS)) == 2  # training: the tail is dropped
    ds = PackedLMDataset(docs, seq_len=4, eos_id=EOS, score_tail=True)
    assert len(ds) == 3 and ds.tail == 2
    x, y = ds[2]
    assert x.tolist() == [11, 2, 12, 13] and y.tolist() == [IGNORE_INDEX, IGNORE_INDEX, 13, 2]
    scored = torch.cat([ds[i][1] for i in range(len(ds))])
    assert scored[scored != IGNORE_INDEX].tolist() == ds.stream[1:].tolist()  # each prediction once
    even = PackedLMDataset([[5, 6, 7, 8, 9, 10, 11]], seq_len=4, eos_id=EOS, score_tail=True)  # 8 tokens
    assert len(even) == 2 and even.tail == 3  # 7 predictions: a window of 4, then a tail of 3
    assert PackedLMDataset([[5, 6, 7, 8]], seq_len=4, eos_id=EOS, score_tail=True).tail == 0  # 5 tokens


def test_packed_too_short_and_from_texts():
    with pytest.raises(ValueError, match="too few"):
        PackedLMDataset([[5]], seq_len=4, eos_id=EOS)
    texts = ["the cat sat on the mat. " * 40, "a dog. " * 40]
    tok = Tokenizer.train_bpe(texts, vocab_size=300)
    ds = PackedLMDataset.from_texts(tok, texts, seq_len=8)
    stream = tok.encode(texts[0], add_eos=True) + tok.encode(texts[1], add_eos=True)
    assert ds.stream.tolist() == stream and len(ds) == (len(stream) - 1) // 8
    batch = collate_lm([ds[0], ds[1], ds[2]])
    assert batch.ids.shape == batch.targets.shape == (3, 8)
    assert torch.equal(batch.ids[:, 1:], batch.targets[:, :-1])


def test_pad_sequences_mask():
    ids, mask = pad_sequences([torch.tensor([4, 5, 6]), torch.tensor([7])], PAD)
    assert ids.tolist() == [[4, 5, 6], [7, 0, 0]]
    assert mask.dtype == torch.bool and mask.tolist() == [[True] * 3, [True, False, False]]
    with pytest.raises(ValueError, match="empty"):
        pad_sequences([], PAD)


def test_seq2seq_filtering_and_collate():
    pairs = [([4, 5, EOS], [6, 7, 8]), ([4, EOS], [9]), ([4] * 9, [6]), ([4, EOS], []), ([4, EOS], [6] * 5)]
    pairs += [([4, 4, 4, EOS], [6] * 4), ([], [6])]  # a target of max_tgt_len (BOS + 4 > 4), an empty source
    ds = Seq2SeqDataset(pairs, max_src_len=4, max_tgt_len=4)
    assert ds.kept == [0, 1] and ds.n_filtered == 5 and len(ds) == 2
    assert ds.lengths() == [4, 2]
    b = Seq2SeqCollator(PAD, BOS, EOS)([ds[0], ds[1]])
    assert b.src.tolist() == [[4, 5, EOS], [4, EOS, PAD]]
    assert b.src_mask.tolist() == [[True, True, True], [True, True, False]]
    assert b.tgt_in.tolist() == [[BOS, 6, 7, 8], [BOS, 9, PAD, PAD]]
    assert b.tgt_out.tolist() == [[6, 7, 8, EOS], [9, EOS, IGNORE_INDEX, IGNORE_INDEX]]
    assert torch.equal(b.tgt_mask, b.tgt_out != IGNORE_INDEX)
    assert all(t.dtype == torch.int64 for t in (b.src, b.tgt_in, b.tgt_out))
    assert b.tgt_in.shape[1] <= ds.max_tgt_len


def test_seq2seq_from_texts_adds_source_eos():
    tok = Tokenizer.train_bpe(["guten Tag. good day. " * 20], vocab_size=280)
    ds = Seq2SeqDataset.from_texts([("good day.", "guten Tag.")], tok, max_src_len=64, max_tgt_len=64)
    src, tgt = ds[0]
    assert src[-1].item() == tok.eos_id and tok.decode(src.tolist()) == "good day."
    assert tok.decode(tgt.tolist()) == "guten Tag." and EOS not in tgt.tolist()


def test_classification_truncates_and_counts():
    ds = ClassificationDataset([[4, 5, 6, 7], [8], [9, 10, 11]], [2, 0, 1], max_len=3)
    assert ds.n_truncated == 1 and ds.lengths() == [3, 1, 3]  # exactly max_len is not truncated
    b = ClassificationCollator(PAD)([ds[0], ds[1]])
    assert b.ids.tolist() == [[4, 5, 6], [8, 0, 0]]
    assert b.mask.tolist() == [[True, True, True], [True, False, False]]
    assert b.labels.tolist() == [2, 0] and b.labels.dtype == torch.int64
    with pytest.raises(ValueError, match="empty"):
        ClassificationDataset([[4], []], [0, 1], max_len=3)
    with pytest.raises(ValueError, match="labels"):
        ClassificationDataset([[4]], [0, 1], max_len=3)
    with pytest.raises(ValueError, match=r"labels must be class ids \(ints >= 0\): label 1 is -100"):
        ClassificationDataset([[4], [5]], [0, -100], max_len=3)  # -100 would be ignored by the loss


def test_sizes_below_one_are_named():
    with pytest.raises(ValueError, match="seq_len must be >= 1, got 0"):
        PackedLMDataset([[4, 5, 6]], seq_len=0, eos_id=EOS)


def test_a_seq_len_that_is_not_an_int_is_named():
    for bad in (2.5, "4", True):
        with pytest.raises(TypeError, match=f"seq_len must be an int >= 1, got {bad!r}"):
            PackedLMDataset([[5, 6, 7]], seq_len=bad, eos_id=EOS)


def test_ids_that_are_not_token_ids_are_named():
    """A float id had been cut to an int (1.5 -> 1) and a negative id or EOS taken into the stream."""
    with pytest.raises(TypeError, match="the text: token ids must be ints, got torch.float32 values"):
        PackedLMDataset([[1.5, 2.7, 3] * 4], seq_len=4, eos_id=EOS)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*31\), got -3..6"):
        PackedLMDataset([[4, 5, 6, -3] * 3], seq_len=4, eos_id=EOS)
    for eos, error in ((-5, ValueError), (True, TypeError), (2.0, TypeError)):
        with pytest.raises(error, match=f"eos_id must be a token id \\(an int >= 0\\), got {eos!r}"):
            PackedLMDataset([[4, 5, 6] * 3], seq_len=4, eos_id=eos)
    assert PackedLMDataset([[4, 5, 6] * 3], seq_len=4, eos_id=EOS).stream.dtype == torch.int32
    with pytest.raises(ValueError, match="the text is 0 tokens, too few for one window"):  # no documents
        PackedLMDataset([], seq_len=4, eos_id=EOS)
