"""An endless, resumable stream of batches over a `ResumableLoader`, and the length-bucketed training
stream the sentence tasks (translation, classification) share."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from tformer.data.corpus_base import is_blank
from tformer.data.loader import ResumableLoader, make_bucket_loader


def spread(items: Sequence, n: int | None) -> list:
    """n items spread evenly over the sequence (all when n is None or >= len): sorted corpora (by label,
    by length) give evaluations a sample of the whole split."""
    if n is None or n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


SPLITS = ("train", "val", "test")


def check_eval_args(max_batches: int | None, split: str = "val") -> None:
    """An evaluation's arguments, refused by name: `max_batches` an integer >= 1 (None: the whole split;
    0 had scored nothing and read as a perfect score), `split` one of SPLITS."""
    if max_batches is not None and (
        isinstance(max_batches, bool) or not isinstance(max_batches, numbers.Integral) or max_batches < 1
    ):
        raise ValueError(
            f"max_batches must be an integer >= 1 (or None: the whole split), got {max_batches!r}"
        )
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; the splits are {', '.join(SPLITS)}")


def check_own_items(items: object, arg: str, fields: tuple[str, str], name: object) -> None:
    """A caller's own test set, refused by name unless it is a non-empty list of pairs of two non-empty
    str (`fields` names them: ("source", "reference"), ("label", "text")), and `name` None or a str
    usable in a file name."""
    pair = f"({fields[0]}, {fields[1]})"
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(f"{arg} must be a list of {pair} pairs, got {type(items).__name__}")
    if not items:
        raise ValueError(f"no {arg} to score")
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(t, str) for t in item)):
            raise TypeError(f"{arg}[{i}] must be a {pair} pair of two str, got {item!r:.80}")
        for field, text in zip(fields, item):
            if is_blank(text):  # spaces, or characters that draw nothing
                raise ValueError(f"{arg}[{i}] has an empty {field}")
    if name is not None and (not isinstance(name, str) or not name or any(c in name for c in "/\\\0")):
        raise ValueError(f"name must be a non-empty str usable in a file name (or None), got {name!r}")


class BatchStream:
    """`next_batch(device)` walks epochs forever; `state_dict()` says where the next batch comes from."""

    def __init__(self, loader: ResumableLoader) -> None:
        self.loader = loader
        self._it = None

    def next_batch(self, device: torch.device):
        if self._it is None:
            self._it = self.loader.batches()
        return next(self._it).to(device)

    def state_dict(self) -> dict[str, int]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loader.load_state_dict(state)
        self._it = None


def bucketed_train_stream(dataset, collate_fn, cfg, rank: int = 0, world_size: int = 1) -> BatchStream:
    """Shuffled length-bucketed batches of `dataset` (by `cfg.data.max_tokens` padded tokens when set,
    else `cfg.batch_size` examples); rank `rank` of `world_size` takes every world_size-th batch."""
    size = dict(max_tokens=cfg.data.max_tokens) if cfg.data.max_tokens else dict(batch_size=cfg.batch_size)
    loader = make_bucket_loader(
        dataset, shuffle=True, seed=cfg.seed, collate_fn=collate_fn, rank=rank, world_size=world_size, **size
    )
    return BatchStream(loader)
