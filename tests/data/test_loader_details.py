"""Loader details the resume tests leave open: worker seeds change with the epoch, (seed, epoch) pairs
are not interchangeable, and a token budget's pools hold pool_batches batches' worth of items."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from tformer.data import BucketBatchSampler, make_bucket_loader, make_loader
from tformer.data.loader import epoch_seed


class Draws(Dataset):
    """Item i is (i, a random draw made where the item is loaded: in a worker process)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        return (i, torch.randint(0, 10**9, ()).item())


def test_worker_draws_change_from_epoch_to_epoch():
    """Workers are reseeded from (seed, epoch): the same items in the same order draw anew each epoch
    (a worker seed fixed for the whole run repeated epoch 0's draws in every epoch)."""
    lo = make_loader(Draws(), 2, shuffle=False, seed=3, collate_fn=list, num_workers=1)
    stream = [list(b) for b in itertools.islice(lo.batches(), 4)]  # 2 batches per epoch, 2 epochs
    first, second = sum(stream[:2], []), sum(stream[2:], [])
    assert [i for i, _ in first] == [i for i, _ in second] == [0, 1, 2, 3]  # same items, same order
    assert [d for _, d in first] != [d for _, d in second]


def test_seed_and_epoch_are_not_interchangeable():
    """Epoch e of seed s is its own permutation: seeds s and s + 1 do not share epochs shifted by one
    (a seed mixed as seed + epoch gave run seed 1's epoch 0 the order of run seed 0's epoch 1)."""
    orders = [
        make_loader(range(20), 20, seed=seed).batch_sampler.epoch_batches(epoch)[0]
        for seed, epoch in ((0, 3), (1, 2), (2, 1), (3, 0))
    ]
    assert all(sorted(o) == list(range(20)) for o in orders)
    assert len({tuple(o) for o in orders}) == 4


def test_a_token_budget_pools_pool_batches_batches_worth_of_items():
    """With max_tokens, a batch's worth is max_tokens // (mean length) items: lengths 4, 1, 4, 1, ...
    (mean 2) and max_tokens 4 make 2 items a batch's worth, so pool_batches=2 sorts pools of 4 items:
    [0, 1, 2, 3] sorts to 1, 3, 0, 2 and cuts into [1, 3] (2 x 1 tokens), [0], [2] (4 tokens each)."""
    lengths = [4, 1, 4, 1, 4, 1, 4, 1]
    batches = BucketBatchSampler(lengths, max_tokens=4, shuffle=False, pool_batches=2).epoch_batches(0)
    assert batches == [[1, 3], [0], [2], [5, 7], [4], [6]]
    whole = BucketBatchSampler(lengths, max_tokens=4, shuffle=False, pool_batches=4).epoch_batches(0)
    assert whole == [[1, 3, 5, 7], [0], [2], [4], [6]]  # one pool of 8: the four short items together


class Draws8(Dataset):
    """Item i is (i, a draw made where the item is loaded)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return (i, torch.randint(0, 10**9, ()).item())


def reference_draws(seed: int, epoch: int, items: list[int]) -> list:
    """What plain torch DataLoader workers draw for `items` (batches of 2, one worker) when the loader's
    generator is seeded with epoch_seed(seed, epoch, "workers"): the documented worker stream."""
    g = torch.Generator().manual_seed(epoch_seed(seed, epoch, "workers"))
    batches = [items[i : i + 2] for i in range(0, len(items), 2)]
    dl = DataLoader(Draws8(), batch_sampler=batches, num_workers=1, collate_fn=list, generator=g)
    return [list(b) for b in dl]


def test_worker_draws_are_the_workers_stream_of_seed_and_epoch():
    """Each epoch's worker processes draw what a DataLoader seeded from epoch_seed(seed, epoch, "workers")
    draws: not the batch-order stream, not (epoch, seed) or (seed + epoch) mixes."""
    lo = make_loader(Draws8(), 2, shuffle=False, seed=3, collate_fn=list, num_workers=1)
    stream = [list(b) for b in itertools.islice(lo.batches(), 12)]  # 4 batches per epoch, 3 epochs
    for epoch in range(3):
        assert stream[4 * epoch : 4 * epoch + 4] == reference_draws(3, epoch, list(range(8)))


def test_worker_draws_of_seed_and_epoch_are_not_interchangeable():
    """Run seed 1's epoch 0 and run seed 0's epoch 1 load the same items in the same order, but their
    workers draw differently (a worker seed mixed as seed + epoch made them equal)."""

    def epoch_draws(seed: int, epoch: int) -> list:
        lo = make_loader(Draws8(), 2, shuffle=False, seed=seed, collate_fn=list, num_workers=1)
        lo.load_state_dict({"epoch": epoch, "index_in_epoch": 0, "seed": seed})
        return [d for b in lo for _, d in b]

    assert epoch_draws(1, 0) != epoch_draws(0, 1)


def test_a_mid_epoch_resume_restarts_the_worker_stream_at_the_epochs_seed():
    """As documented beside test_worker_seeds_follow_seed_and_epoch: resumed mid-epoch, the workers are
    seeded from (seed, epoch) alone, so the rest of the epoch draws what a fresh epoch-seeded worker does."""
    lo = make_loader(Draws8(), 2, shuffle=False, seed=3, collate_fn=list, num_workers=1)
    lo.load_state_dict({"epoch": 1, "index_in_epoch": 2, "seed": 3})
    assert [list(b) for b in lo] == reference_draws(3, 1, [4, 5, 6, 7])


class WhereLoaded(Dataset):
    def __init__(self, n: int = 6):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return get_worker_info() is not None

    def lengths(self) -> list[int]:
        return [1 + i % 3 for i in range(self.n)]


def test_bucket_loader_loads_in_worker_processes_when_asked():
    lo = make_bucket_loader(WhereLoaded(), batch_size=2, collate_fn=list, num_workers=1)
    assert all(all(b) for b in lo)
    assert not any(any(b) for b in make_bucket_loader(WhereLoaded(), batch_size=2, collate_fn=list))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(shuffle=True, seed=5, pool_batches=2),
        dict(shuffle=False, seed=5, pool_batches=2),
        dict(shuffle=True, seed=9, pool_batches=3, rank=1, world_size=2),
    ],
)
def test_bucket_loader_batches_are_its_samplers(kwargs):
    """make_bucket_loader passes seed, shuffle, pool_batches and the rank's share to the sampler: its
    epochs are those of a BucketBatchSampler built with the same arguments."""
    lengths = [1 + (i * 7919) % 37 for i in range(60)]
    lo = make_bucket_loader(list(range(60)), lengths=lengths, batch_size=4, collate_fn=list, **kwargs)
    ref = BucketBatchSampler(lengths, batch_size=4, **kwargs)
    got = [list(b) for b in itertools.islice(lo.batches(), 3 * len(ref.epoch_batches(0)))]
    want = sum((ref.epoch_batches(e) for e in range(3)), [])
    assert got == want


def test_len_is_the_current_epochs_batch_count_when_epochs_differ():
    """With a token budget the batch count changes from epoch to epoch; len() is the current epoch's,
    after a whole epoch and after load_state_dict alike."""
    lengths = [1 + (i * 7919) % 37 for i in range(101)]
    lo = make_bucket_loader(
        list(range(101)), lengths=lengths, max_tokens=50, seed=5, collate_fn=list, pool_batches=3
    )
    counts = [len(lo.batch_sampler.epoch_batches(e)) for e in range(4)]
    assert len(set(counts)) > 1  # the premise: epochs differ in length
    for e in range(4):
        assert len(lo) == counts[e] == len(list(lo))
    other = make_bucket_loader(
        list(range(101)), lengths=lengths, max_tokens=50, seed=5, collate_fn=list, pool_batches=3
    )
    for e in (3, 1, 2):
        other.load_state_dict({"epoch": e, "index_in_epoch": 0, "seed": 5})
        assert len(other) == counts[e]


def test_batch_sizes_and_token_budgets_must_be_positive_ints():
    """The bucket sampler had checked nothing: batch_size 0 raised a TypeError deep inside, -1 gave no
    batches, max_tokens 0, -5 or 2.5 were taken."""
    from tformer.data.loader import BucketBatchSampler, RandomBatchSampler

    for kwargs, error in (
        ({"batch_size": 0}, ValueError),
        ({"batch_size": -1}, ValueError),
        ({"max_tokens": 0}, ValueError),
        ({"max_tokens": 2.5}, TypeError),
        ({"batch_size": 2, "pool_batches": 0}, ValueError),
    ):
        with pytest.raises(error, match="must be"):
            BucketBatchSampler([3, 4, 5], **kwargs)
    with pytest.raises(TypeError, match="batch_size must be an int >= 1, got True"):
        RandomBatchSampler(5, True)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"seed": 1.5}, "seed must be an int, got float 1.5"),
        ({"seed": "a"}, "seed must be an int, got str 'a'"),
        ({"seed": True}, "seed must be an int, got bool True"),  # had drawn another stream than seed 1
        ({"shuffle": "no"}, "shuffle must be True or False, got 'no'"),  # had shuffled
        ({"drop_last": "no"}, "drop_last must be True or False, got 'no'"),  # had dropped the last batch
        ({"pin_memory": 1}, "pin_memory must be True or False, got 1"),
    ],
)
def test_a_loader_refuses_a_seed_or_switch_of_another_type(kwargs: dict, said: str) -> None:
    """A float or str seed had made a loader whose own state_dict it then refused to load (resuming
    failed); a truthy string turned a switch on."""
    import re

    with pytest.raises(TypeError, match=re.escape(said)):
        make_loader(Draws(), 2, **kwargs)
    if set(kwargs) <= {"seed", "shuffle"}:
        with pytest.raises(TypeError, match=re.escape(said)):
            make_bucket_loader(Draws(), lengths=[1, 2, 3, 4], batch_size=2, **kwargs)
    import numpy as np

    state = make_loader(Draws(), 2, seed=np.int64(7)).state_dict()  # a numpy integer is an int seed
    assert type(state["seed"]) is int
    make_loader(Draws(), 2).load_state_dict(state)  # and its state loads
