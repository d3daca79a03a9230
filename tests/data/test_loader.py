"""Exact resume (RELIABILITY A4/A5): batches by sample id equal the uninterrupted stream."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import Dataset

from tformer.data import BucketBatchSampler, ResumableLoader, batches, make_bucket_loader, make_loader


class Ids(Dataset):
    """Item i is the sample id i; `lengths` are made up for bucketing."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

    def lengths(self) -> list[int]:
        return [1 + (i * 7919) % 37 for i in range(self.n)]


def ids(batch) -> list[int]:
    return list(batch)


def take(loader: ResumableLoader, k: int) -> list[list[int]]:
    return [ids(b) for b in itertools.islice(loader.batches(), k)]


def loader(n=10, batch_size=3, seed=7, **kwargs) -> ResumableLoader:
    return make_loader(Ids(n), batch_size, shuffle=True, seed=seed, collate_fn=ids, **kwargs)


def test_each_epoch_is_a_permutation_fixed_by_seed_and_epoch():
    stream = take(loader(), 12)  # 4 batches per epoch, 3 epochs
    epochs = [sum(stream[i : i + 4], []) for i in range(0, 12, 4)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert take(loader(), 12) == stream
    assert take(loader(seed=8), 12) != stream


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8, 9])  # mid-epoch, at the boundary (4, 8), just past it
def test_resume_equals_uninterrupted(k):
    full = take(loader(), 14)
    first = loader()
    head = take(first, k)
    state = first.state_dict()
    resumed = loader(seed=123)  # the saved seed wins
    resumed.load_state_dict(state)
    assert head + take(resumed, 14 - k) == full
    assert state["epoch"] == k // 4 and state["index_in_epoch"] == k % 4 and state["seed"] == 7


def test_resume_with_plain_for_loops_over_epochs():
    first = loader()
    for i, _ in enumerate(first):
        if i == 1:
            break
    assert first.state_dict() == {"epoch": 0, "index_in_epoch": 2, "seed": 7}
    rest = [ids(b) for b in first]  # the rest of epoch 0
    assert len(rest) == 2 and first.state_dict() == {"epoch": 1, "index_in_epoch": 0, "seed": 7}


def test_resume_with_worker_prefetch():
    full = take(loader(n=40, batch_size=2), 30)
    first = loader(n=40, batch_size=2, num_workers=2)
    head = take(first, 7)  # the workers have fetched further ahead; the state counts handed-out batches
    resumed = loader(n=40, batch_size=2, num_workers=2)
    resumed.load_state_dict(first.state_dict())
    assert head + take(resumed, 23) == full


def test_own_generators_and_global_rng_untouched():
    lo = loader()
    assert isinstance(lo.loader.generator, torch.Generator)
    assert isinstance(lo.batch_sampler.generator, torch.Generator)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = take(lo, 6)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(999)
    assert take(loader(), 6) == a


def test_drop_last_and_no_shuffle():
    lo = make_loader(Ids(10), 3, shuffle=False, collate_fn=ids, drop_last=True)
    assert len(lo) == 3 and take(lo, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    empty = make_loader(Ids(2), 3, drop_last=True, collate_fn=ids)
    with pytest.raises(ValueError, match="makes no full batch per process"):
        next(batches(empty))


@pytest.mark.parametrize("n, dropped", [(11, 0), (13, 1)])
def test_ranks_get_disjoint_equal_shares(n, dropped):
    """D8: every rank gets the same number of batches in every epoch (a count that does not divide by the
    world size drops the surplus batches on every rank), the ranks' samples are disjoint, and together
    they cover the epoch but the dropped batch. 11 samples in batches of 2: 6 batches, the ragged one
    (1 sample) on rank 1; 13: 7 batches, the last one (1 sample) dropped."""
    ranks = [loader(n=n, batch_size=2, rank=r, world_size=2) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == 3
    epochs = [take(lo, 6) for lo in ranks]  # two whole epochs per rank
    for epoch in range(2):
        shares = [e[3 * epoch : 3 * epoch + 3] for e in epochs]
        flat = [sum(share, []) for share in shares]
        assert len(set(flat[0]) & set(flat[1])) == 0
        assert len(set(flat[0]) | set(flat[1])) == len(flat[0]) + len(flat[1]) == n - dropped
    assert sorted(len(b) for b in epochs[1][:3]) == ([1, 2, 2] if n == 11 else [2, 2, 2])


@pytest.mark.parametrize("mode", [{"batch_size": 8}, {"max_tokens": 64}])
def test_bucketing_covers_every_sample_once_per_epoch(mode):
    data = Ids(203)
    lengths = data.lengths()
    lo = make_bucket_loader(data, seed=3, collate_fn=ids, pool_batches=4, **mode)
    per_epoch = []
    for _ in range(2):
        epoch = [ids(b) for b in lo]
        assert sorted(sum(epoch, [])) == list(range(203))
        if "max_tokens" in mode:
            assert all(len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 64 for b in epoch)
        per_epoch.append(epoch)
    assert per_epoch[0] != per_epoch[1]

    def spread(epoch):  # mean length range inside a batch
        return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in epoch) / len(epoch)

    random_batches = [
        ids(b) for b in make_loader(data, round(203 / len(per_epoch[0])), seed=3, collate_fn=ids)
    ]
    assert spread(per_epoch[0]) < 0.5 * spread(random_batches)  # similar lengths share a batch


def test_token_capped_batches_by_hand():
    """Sorted within a pool, a batch takes items while (its longest length) x (its size) <= max_tokens."""

    def cut(lengths, max_tokens):
        return BucketBatchSampler(lengths, max_tokens=max_tokens, shuffle=False).epoch_batches(0)

    assert cut([3, 3, 3, 3], 12) == [[0, 1, 2, 3]]  # exactly max_tokens fits
    assert cut([3, 3, 3, 3, 3], 12) == [[0, 1, 2, 3], [4]]
    assert cut([5, 1, 2, 9, 2], 6) == [[1, 2, 4], [0], [3]]  # 1, 2, 2 (3 x 2); 5; 9 alone, over the cap


def test_the_batch_order_is_shuffled_not_sorted_by_length():

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 200, (100,), generator=gen).tolist()
    batches = BucketBatchSampler(lengths, batch_size=4, pool_batches=100, seed=0).epoch_batches(0)
    longest = [max(lengths[i] for i in b) for b in batches]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)
    assert all(
        max(lengths[i] for i in b) - min(lengths[i] for i in b) < 30 for b in batches
    )  # one pool, sorted


def test_bucket_loader_resumes():
    data = Ids(101)

    def make():
        return make_bucket_loader(data, max_tokens=50, seed=5, collate_fn=ids, pool_batches=3)

    n = len(make())
    full = take(make(), 2 * n + 3)
    for k in (5, n, n + 1):
        first = make()
        head = take(first, k)
        resumed = make()
        resumed.load_state_dict(first.state_dict())
        assert head + take(resumed, 2 * n + 3 - k) == full


def test_bucket_sampler_rejects_ambiguous_budget():
    with pytest.raises(ValueError, match="exactly one"):
        BucketBatchSampler([1, 2], batch_size=2, max_tokens=10)
    with pytest.raises(ValueError, match="exactly one"):
        BucketBatchSampler([1, 2])  # neither
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        make_loader(Ids(4), 0)


def test_drop_last_keeps_every_batch_when_the_count_divides():
    lo = make_loader(Ids(9), 3, shuffle=False, collate_fn=ids, drop_last=True)
    assert take(lo, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]] and len(lo) == 3


def test_ranks_interleave_the_global_batches():
    """Rank r takes global batches r, r + W, ...: the layout a resume at another world size rescales
    ("W ranks at batch i used W * i batches")."""
    whole = loader(n=16, batch_size=2).batch_sampler.epoch_batches(0)
    for rank in (0, 1):
        assert (
            loader(n=16, batch_size=2, rank=rank, world_size=2).batch_sampler.epoch_batches(0)
            == whole[rank::2]
        )
    for rank, world in ((2, 2), (-1, 2)):
        with pytest.raises(ValueError, match=f"rank {rank} outside world_size {world}"):
            loader(rank=rank, world_size=world)


def test_bucket_pools_change_with_the_epoch():
    """Each epoch permutes the samples before pooling: batches hold other samples, not only another
    order of the same batches."""
    sampler = BucketBatchSampler(Ids(200).lengths(), batch_size=4, pool_batches=2, seed=0)
    first, second = (sorted(map(sorted, sampler.epoch_batches(e))) for e in (0, 1))
    assert first != second


def test_a_loaded_seed_replaces_batches_computed_before_the_load():
    fresh, saved = loader(seed=123), loader()
    assert len(fresh) == 4  # computes (and caches) seed 123's epoch 0
    fresh.load_state_dict(saved.state_dict())
    assert take(fresh, 4) == take(saved, 4)


def test_worker_seeds_follow_seed_and_epoch():
    """Randomness inside worker processes is a function of (seed, epoch): a loader resumed at an epoch
    boundary has its workers draw what the uninterrupted one's did. (Mid-epoch, a worker's stream restarts
    at the epoch's seed, so such draws differ; tformer's datasets draw nothing in workers.)"""

    class Draws(Ids):
        def __getitem__(self, i: int):
            return (i, torch.randint(0, 10**9, ()).item())

    def make() -> ResumableLoader:
        return make_loader(Draws(8), 2, seed=3, collate_fn=list, num_workers=1)

    full = [list(b) for b in itertools.islice(make().batches(), 8)]
    first = make()
    head = [list(b) for b in itertools.islice(first.batches(), 4)]  # epoch 0's four batches
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert head + [list(b) for b in itertools.islice(resumed.batches(), 4)] == full
