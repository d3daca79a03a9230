"""Map-style datasets of token ids and the collate functions that pad them into batches.

Shapes: B batch, T sequence length (padded to the longest in the batch), S source length.
Masks are key-padding masks: bool, True = real token. Padded target positions hold IGNORE_INDEX.

    PackedLMDataset[i]        -> (ids (T,), targets (T,))            int64, targets = ids shifted by one
    Seq2SeqDataset[i]         -> (src (S,), tgt (T,))                int64, tgt without BOS/EOS
    ClassificationDataset[i]  -> (ids (T,), label ())                int64
    Seq2SeqCollator           -> Seq2SeqBatch(src, src_mask, tgt_in, tgt_out, tgt_mask)
    ClassificationCollator    -> ClassificationBatch(ids, mask, labels)
    collate_lm                -> LMBatch(ids (B, T), targets (B, T))
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from tformer.data.tokenizer import Tokenizer
from tformer.model.loss import IGNORE_INDEX  # noqa: F401  (torch's default; the fused loss skips it)


def _check_nonempty(n: int, what: str) -> None:
    if n == 0:
        raise ValueError(f"{what} is empty")


# ---------------------------------------------------------------- language modelling


class PackedLMDataset(Dataset):
    """Documents joined into one stream, each followed by EOS, cut into windows of seq_len + 1 tokens.

    Window i holds stream[i*T : i*T + T + 1]; ids are its first T tokens, targets its last T, so
    every stream token after the first is a target exactly once. The tail shorter than a window
    is dropped, unless `score_tail` (evaluating a whole text): then one more window, the last T + 1
    tokens, scores only the predictions the others left out (its other targets are IGNORE_INDEX).
    """

    def __init__(
        self,
        docs: Sequence[Sequence[int]],
        seq_len: int,
        eos_id: int,
        what: str = "the text",
        score_tail: bool = False,
    ):
        if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral):  # (2.5, "4": raw
            # TypeErrors deeper in; a numpy integer is an integer)
            raise TypeError(f"seq_len must be an int >= 1, got {seq_len!r}")
        seq_len = int(seq_len)
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if isinstance(eos_id, bool) or not isinstance(eos_id, numbers.Integral):
            raise TypeError(f"eos_id must be a token id (an int >= 0), got {eos_id!r}")
        if eos_id < 0:
            raise ValueError(f"eos_id must be a token id (an int >= 0), got {eos_id!r}")
        stream: list[int] = []
        for doc in docs:
            stream.extend(doc)
            stream.append(eos_id)
        values = torch.tensor(
            stream, dtype=None if stream else torch.int32
        )  # a float id (1.5) had been cut to 1
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"{what}: token ids must be ints, got {values.dtype} values")
        if values.numel() and (values.min() < 0 or values.max() >= 2**31):
            raise ValueError(
                f"{what}: token ids must be in [0, 2**31), got {int(values.min())}..{int(values.max())}"
            )
        self.stream = values.to(torch.int32)  # int32 halves memory; items are int64
        self.seq_len = seq_len
        self.n_windows = max(0, (len(stream) - 1) // seq_len)
        if self.n_windows == 0:
            raise ValueError(
                f"{what} is {len(stream)} tokens, too few for one window of seq_len + 1 = {seq_len + 1} "
                "(it needs more text, or a run with a smaller data.seq_len)"
            )
        self.tail = (len(stream) - 1) % seq_len if score_tail else 0  # predictions the last window adds
        self.n_windows += self.tail > 0

    @classmethod
    def from_texts(
        cls,
        tokenizer: Tokenizer,
        texts: Sequence[str],
        seq_len: int,
        what: str = "the text",
        score_tail: bool = False,
    ) -> PackedLMDataset:
        """`what` names the texts in the error a too-short stream raises (e.g. "the val split of ...")."""
        return cls(tokenizer.encode_batch(texts), seq_len, tokenizer.eos_id, what, score_tail)

    @property
    def n_tokens(self) -> int:
        """Tokens in the stream, EOS separators included."""
        return len(self.stream)

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            index += self.n_windows
        if not 0 <= index < self.n_windows:
            raise IndexError(f"window {index} out of range for {self.n_windows} windows")
        if self.tail and index == self.n_windows - 1:  # the last T + 1 tokens, only the new predictions
            window = self.stream[-(self.seq_len + 1) :].long()
            targets = window[1:].clone()
            targets[: self.seq_len - self.tail] = IGNORE_INDEX
            return window[:-1], targets
        start = index * self.seq_len
        window = self.stream[start : start + self.seq_len + 1].long()  # (T + 1,)
        return window[:-1], window[1:]


class LMBatch(NamedTuple):
    ids: torch.Tensor  # (B, T) int64
    targets: torch.Tensor  # (B, T) int64

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LMBatch:
        return LMBatch(*(t.to(device, non_blocking=non_blocking) for t in self))


def collate_lm(batch: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> LMBatch:
    _check_nonempty(len(batch), "batch")
    ids, targets = zip(*batch)
    return LMBatch(torch.stack(ids), torch.stack(targets))


# ---------------------------------------------------------------- padding


def pad_sequences(seqs: Sequence[torch.Tensor], pad_value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D int64 tensors to (B, T_max); also return the mask (B, T_max), True = real token."""
    _check_nonempty(len(seqs), "batch")
    lengths = torch.tensor([len(s) for s in seqs])
    out = torch.full((len(seqs), int(lengths.max())), pad_value, dtype=torch.long)  # (B, T)
    for row, seq in enumerate(seqs):
        out[row, : len(seq)] = seq
    mask = torch.arange(out.shape[1]) < lengths[:, None]  # (B, T)
    return out, mask


# ---------------------------------------------------------------- translation


class Seq2SeqDataset(Dataset):
    """(src ids, tgt ids) pairs; pairs too long (or empty) are filtered out and counted.

    A pair is kept when 1 <= len(src) <= max_src_len and 1 <= len(tgt) <= max_tgt_len - 1 (the
    collator adds BOS/EOS to the target, one token each side; an empty target is dropped). `kept[i]` is the index in the
    input of dataset item i, to line hypotheses up with reference texts.
    """

    def __init__(
        self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], max_src_len: int, max_tgt_len: int
    ):
        for name, value, least in (("max_src_len", max_src_len, 1), ("max_tgt_len", max_tgt_len, 2)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.kept = [
            i
            for i, (s, t) in enumerate(pairs)
            if 1 <= len(s) <= max_src_len and 1 <= len(t) <= max_tgt_len - 1
        ]
        self.src = [torch.tensor(pairs[i][0], dtype=torch.long) for i in self.kept]
        self.tgt = [torch.tensor(pairs[i][1], dtype=torch.long) for i in self.kept]
        self.n_filtered = len(pairs) - len(self.kept)
        self.max_src_len, self.max_tgt_len = max_src_len, max_tgt_len

    @classmethod
    def from_texts(
        cls,
        pairs: Sequence[tuple[str, str]],
        tokenizer: Tokenizer,
        max_src_len: int,
        max_tgt_len: int,
        tgt_tokenizer: Tokenizer | None = None,
    ) -> Seq2SeqDataset:
        """Tokenize (src text, tgt text) pairs (or corpora `Pair`s); the source gets a trailing EOS."""
        pairs = [(p.src, p.tgt) if hasattr(p, "src") else tuple(p) for p in pairs]
        src = tokenizer.encode_batch([s for s, _ in pairs], add_eos=True)
        tgt = (tgt_tokenizer or tokenizer).encode_batch([t for _, t in pairs])
        return cls(list(zip(src, tgt)), max_src_len, max_tgt_len)

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.src[index], self.tgt[index]

    def lengths(self) -> list[int]:
        """Per-item cost for length bucketing: the longer of source and decoder input."""
        return [max(len(s), len(t) + 1) for s, t in zip(self.src, self.tgt)]


class Seq2SeqBatch(NamedTuple):
    src: torch.Tensor  # (B, S) int64, pad_id at padding
    src_mask: torch.Tensor  # (B, S) bool, True = real token
    tgt_in: torch.Tensor  # (B, T) int64: BOS + y, pad_id at padding
    tgt_out: torch.Tensor  # (B, T) int64: y + EOS, IGNORE_INDEX at padding
    tgt_mask: torch.Tensor  # (B, T) bool, True = real token

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Seq2SeqBatch:
        return Seq2SeqBatch(*(t.to(device, non_blocking=non_blocking) for t in self))


class Seq2SeqCollator:
    """Pad (src, tgt) items into a Seq2SeqBatch; a class, not a closure, so DataLoader workers can pickle it."""

    def __init__(self, pad_id: int, bos_id: int, eos_id: int, ignore_index: int = IGNORE_INDEX):
        self.pad_id, self.bos_id, self.eos_id, self.ignore_index = pad_id, bos_id, eos_id, ignore_index

    def __call__(self, batch: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Seq2SeqBatch:
        _check_nonempty(len(batch), "batch")
        srcs, tgts = zip(*batch)
        src, src_mask = pad_sequences(srcs, self.pad_id)
        bos, eos = torch.tensor([self.bos_id]), torch.tensor([self.eos_id])
        tgt_in, tgt_mask = pad_sequences([torch.cat([bos, t]) for t in tgts], self.pad_id)
        tgt_out, _ = pad_sequences([torch.cat([t, eos]) for t in tgts], self.ignore_index)
        return Seq2SeqBatch(src, src_mask, tgt_in, tgt_out, tgt_mask)


# ---------------------------------------------------------------- classification


class ClassificationDataset(Dataset):
    """(ids, label) items; sequences longer than max_len keep their first max_len tokens (counted)."""

    def __init__(self, ids: Sequence[Sequence[int]], labels: Sequence[int], max_len: int):
        if len(ids) != len(labels):
            raise ValueError(f"{len(ids)} sequences but {len(labels)} labels")
        if isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral) or max_len < 1:
            raise ValueError(f"max_len must be an integer >= 1, got {max_len!r}")
        labels = labels.tolist() if isinstance(labels, (torch.Tensor, np.ndarray)) else labels
        bad = [(i, y) for i, y in enumerate(labels) if isinstance(y, bool) or not isinstance(y, numbers.Integral) or y < 0]  # fmt: skip
        if bad:  # a float label had been truncated to a class id
            raise ValueError(f"labels must be class ids (ints >= 0): label {bad[0][0]} is {bad[0][1]!r}")
        empty = [i for i, seq in enumerate(ids) if len(seq) == 0]
        if empty:
            raise ValueError(f"{len(empty)} empty sequences (first at index {empty[0]})")
        self.ids = [torch.tensor(seq[:max_len], dtype=torch.long) for seq in ids]
        self.labels = torch.tensor(labels, dtype=torch.long)
        self.n_truncated = sum(len(seq) > max_len for seq in ids)
        self.max_len = max_len

    @classmethod
    def from_texts(
        cls,
        tokenizer: Tokenizer,
        texts: Sequence[str],
        labels: Sequence[int],
        max_len: int,
        add_bos: bool = False,
    ) -> ClassificationDataset:
        return cls(tokenizer.encode_batch(texts, add_bos=add_bos), labels, max_len)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ids[index], self.labels[index]

    def lengths(self) -> list[int]:
        return [len(seq) for seq in self.ids]


class ClassificationBatch(NamedTuple):
    ids: torch.Tensor  # (B, T) int64, pad_id at padding
    mask: torch.Tensor  # (B, T) bool, True = real token
    labels: torch.Tensor  # (B,) int64

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ClassificationBatch:
        return ClassificationBatch(*(t.to(device, non_blocking=non_blocking) for t in self))


class ClassificationCollator:
    """Pad (ids, label) items into a ClassificationBatch."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> ClassificationBatch:
        _check_nonempty(len(batch), "batch")
        seqs, labels = zip(*batch)
        ids, mask = pad_sequences(seqs, self.pad_id)
        return ClassificationBatch(ids, mask, torch.stack(labels))
