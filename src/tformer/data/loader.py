"""Resumable, deterministic batching on top of torch.utils.data.DataLoader.

Each epoch's batches are a pure function of (seed, epoch): the batch samplers draw from their own
`torch.Generator`, reseeded per epoch, and never touch the global RNG. `ResumableLoader` counts the
batches it has handed out, so `state_dict()` -> {"epoch", "index_in_epoch", "seed"} (index_in_epoch
counts batches) and `load_state_dict()` resume exactly, mid-epoch or at an epoch boundary, whatever
the DataLoader prefetched.

    loader = make_loader(dataset, batch_size=32, shuffle=True, seed=0, collate_fn=collate_lm)
    for batch in loader.batches():     # endless: walks epochs
        ...
        ckpt["data"] = loader.state_dict()
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from tformer.schema import require_bool


def epoch_seed(seed: int, epoch: int, stream: str = "batches") -> int:
    """A 63-bit seed for one (seed, epoch, stream); unrelated streams stay unrelated."""
    digest = hashlib.sha256(f"tformer:{stream}:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class EpochBatchSampler(Sampler[list[int]]):
    """Base batch sampler: `epoch_batches(epoch)` is deterministic; iteration starts at `set_position`.

    With world_size > 1 every rank takes batches rank, rank + W, ... of the same global list, cut to
    a multiple of W so that all ranks run the same number of steps (up to W - 1 batches dropped).
    """

    def __init__(self, seed: int, shuffle: bool, rank: int = 0, world_size: int = 1):
        # a float or str seed had made a stream whose state (`state_dict`) the loader then refused to load,
        # a str for shuffle switched it on ("no" is truthy)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        seed = int(seed)  # (a numpy integer: the state holds an int, which loads back)
        require_bool(shuffle=shuffle)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.seed, self.shuffle, self.rank, self.world_size = seed, shuffle, rank, world_size
        self.generator = torch.Generator()  # private: the global RNG is never used
        self.epoch, self.start = 0, 0
        self._cache: tuple[int, int, list[list[int]]] | None = None

    def _global_batches(self, generator: torch.Generator) -> list[list[int]]:
        raise NotImplementedError

    def describe_batch(self) -> str:
        """What one batch holds, for messages: "8 samples", "at most 4096 tokens"."""
        raise NotImplementedError

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches for an epoch (cached for the latest epoch)."""
        if self._cache is None or self._cache[:2] != (self.seed, epoch):
            self.generator.manual_seed(epoch_seed(self.seed, epoch))
            batches = self._global_batches(self.generator)
            usable = len(batches) - len(batches) % self.world_size
            self._cache = (self.seed, epoch, batches[self.rank : usable : self.world_size])
        return self._cache[2]

    def set_position(self, epoch: int, start: int = 0) -> None:
        """Iterate epoch `epoch` from its batch number `start` on."""
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.epoch_batches(self.epoch)[self.start :]

    def __len__(self) -> int:
        return len(self.epoch_batches(self.epoch))


def require_positive_int(**values: object) -> None:
    """TypeError / ValueError naming the first of `values` (name=value) that is not an int >= 1."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int >= 1, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


class RandomBatchSampler(EpochBatchSampler):
    """Consecutive slices of a per-epoch permutation (or of 0..n-1 when shuffle is off)."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__(seed, shuffle, rank, world_size)
        require_positive_int(batch_size=batch_size)
        require_bool(drop_last=drop_last)
        self.n, self.batch_size, self.drop_last = n, batch_size, drop_last

    def describe_batch(self) -> str:
        return f"{self.batch_size} samples"

    def _global_batches(self, generator: torch.Generator) -> list[list[int]]:
        order = torch.randperm(self.n, generator=generator) if self.shuffle else torch.arange(self.n)
        stop = self.n - self.n % self.batch_size if self.drop_last else self.n
        return [order[i : i + self.batch_size].tolist() for i in range(0, stop, self.batch_size)]


class BucketBatchSampler(EpochBatchSampler):
    """Batches of similar lengths: every sample exactly once per epoch, order shuffled per epoch.

    Each epoch: permute the indices, cut them into pools of `pool_batches` batches' worth, sort each
    pool by length, form batches of `batch_size` items or, with `max_tokens`, of at most max_tokens
    padded tokens (a longer single item gets a batch of its own), then shuffle the batch order.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int | None = None,
        max_tokens: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        pool_batches: int = 50,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__(seed, shuffle, rank, world_size)
        if (batch_size is None) == (max_tokens is None):
            raise ValueError("give exactly one of batch_size or max_tokens")
        # (0 had raised a TypeError, -1 given no batches, max_tokens 0, -5 or 2.5 been taken)
        require_positive_int(
            **({"batch_size": batch_size} if max_tokens is None else {"max_tokens": max_tokens})
        )
        require_positive_int(pool_batches=pool_batches)
        self.lengths = torch.as_tensor(list(lengths), dtype=torch.long)
        self.batch_size, self.max_tokens = batch_size, max_tokens
        mean = max(1, int(self.lengths.float().mean().item())) if len(self.lengths) else 1
        self.pool_size = pool_batches * (batch_size or max(1, max_tokens // mean))

    def describe_batch(self) -> str:
        return (
            f"{self.batch_size} samples"
            if self.batch_size is not None
            else f"at most {self.max_tokens} tokens"
        )

    def _global_batches(self, generator: torch.Generator) -> list[list[int]]:
        n = len(self.lengths)
        order = torch.randperm(n, generator=generator) if self.shuffle else torch.arange(n)
        batches: list[list[int]] = []
        for start in range(0, n, self.pool_size):
            pool = order[start : start + self.pool_size]
            pool = pool[torch.sort(self.lengths[pool], stable=True).indices].tolist()
            batches.extend(self._cut(pool))
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        return batches

    def _cut(self, pool: list[int]) -> list[list[int]]:
        if self.batch_size is not None:
            return [pool[i : i + self.batch_size] for i in range(0, len(pool), self.batch_size)]
        batches, current, longest = [], [], 0
        for i in pool:
            longest_if_added = max(longest, int(self.lengths[i]))
            if current and longest_if_added * (len(current) + 1) > self.max_tokens:
                batches.append(current)
                current, longest_if_added = [], int(self.lengths[i])
            current.append(i)
            longest = longest_if_added
        return batches + [current] if current else batches


class ResumableLoader:
    """A DataLoader over an EpochBatchSampler that knows where it is: iterate one epoch at a time."""

    def __init__(
        self,
        dataset: Dataset,
        batch_sampler: EpochBatchSampler,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        require_bool(pin_memory=pin_memory)
        self.batch_sampler = batch_sampler
        self.generator = torch.Generator()  # seeds worker processes; reseeded per epoch from (seed, epoch)
        self.loader = DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=pin_memory,
            generator=self.generator,
        )
        self.epoch, self.index_in_epoch = 0, 0

    @property
    def seed(self) -> int:
        return self.batch_sampler.seed

    def __len__(self) -> int:
        """Batches in the current epoch."""
        return len(self.batch_sampler.epoch_batches(self.epoch))

    def __iter__(self) -> Iterator:
        """The rest of the current epoch; finishing it moves the position to the next epoch."""
        self.batch_sampler.set_position(self.epoch, self.index_in_epoch)
        self.generator.manual_seed(epoch_seed(self.seed, self.epoch, "workers"))
        for batch in self.loader:
            self.index_in_epoch += 1
            yield batch
        self.epoch, self.index_in_epoch = self.epoch + 1, 0

    def batches(self) -> Iterator:
        """Endless batches, walking epochs."""
        while True:
            if len(self) == 0:
                world = self.batch_sampler.world_size
                raise ValueError(
                    f"the training data ({len(self.loader.dataset)} samples) makes no full batch per process "
                    f"({self.batch_sampler.describe_batch()}) in epoch {self.epoch}"
                    + (f" for {world} processes" if world > 1 else "")
                    + ": lower the batch size, or train on more data"
                )
            yield from self

    def state_dict(self) -> dict[str, int]:
        epoch, index = self.epoch, self.index_in_epoch
        if index >= len(self):  # the last batch was handed out: the next one opens the next epoch
            epoch, index = epoch + 1, 0
        return {"epoch": epoch, "index_in_epoch": index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; the saved seed wins, so the batch stream is the saved one.
        ValueError for a state `state_dict` cannot have written (not ints, a negative position)."""
        if not isinstance(state, dict) or any(
            type(state.get(k)) is not int for k in ("seed", "epoch", "index_in_epoch")
        ):
            raise ValueError(f"a loader state holds int seed, epoch and index_in_epoch, got {state!r}")
        if state["epoch"] < 0 or state["index_in_epoch"] < 0:  # (a position past this epoch's end, from a
            # run of fewer data-parallel ranks, opens the next epoch)
            raise ValueError(
                f"a loader position is >= 0, got epoch {state['epoch']}, batch {state['index_in_epoch']}"
            )
        self.batch_sampler.seed = state["seed"]
        self.epoch, self.index_in_epoch = state["epoch"], state["index_in_epoch"]


def make_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    collate_fn: Callable | None = None,
    drop_last: bool = False,
    *,
    num_workers: int = 0,
    pin_memory: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> ResumableLoader:
    """Fixed-size batches over a per-epoch permutation f(seed, epoch); resumable by sample position."""
    sampler = RandomBatchSampler(len(dataset), batch_size, shuffle, seed, drop_last, rank, world_size)
    return ResumableLoader(dataset, sampler, collate_fn, num_workers, pin_memory)


def make_bucket_loader(
    dataset: Dataset,
    *,
    lengths: Sequence[int] | None = None,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    collate_fn: Callable | None = None,
    pool_batches: int = 50,
    num_workers: int = 0,
    pin_memory: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> ResumableLoader:
    """Length-bucketed batches (by count or token budget); lengths default to `dataset.lengths()`."""
    lengths = dataset.lengths() if lengths is None else lengths
    if len(lengths) != len(dataset):  # the sampler would batch len(lengths) items: the rest never seen
        raise ValueError(f"lengths has {len(lengths)} entries for a dataset of {len(dataset)} items")
    sampler = BucketBatchSampler(
        lengths, batch_size, max_tokens, shuffle, seed, pool_batches, rank, world_size
    )
    return ResumableLoader(dataset, sampler, collate_fn, num_workers, pin_memory)


def batches(loader: ResumableLoader) -> Iterator:
    """Endless batches from a ResumableLoader, walking epochs (same as `loader.batches()`)."""
    return loader.batches()
