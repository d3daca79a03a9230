"""Loader details the resume tests leave open: worker seeds change with the epoch, (seed, epoch) pairs
are not interchangeable, and a token budget's pools hold pool_batches batches' worth of items."""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import Dataset

from tformer.data import BucketBatchSampler, make_loader


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
