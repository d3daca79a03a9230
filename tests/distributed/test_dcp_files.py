"""The DCP checkpoint format in one process, beyond the round trip: its shards checked by digest, a
save in flight committed by close(), errno kept through DCP's wrapping, generation's weight load leaving
the caller's RNG alone, and the small rules a resume at another world size applies."""

from __future__ import annotations

import errno

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.distributed.test_single_process import moe_model, trained
from tformer.distributed.checkpoint import (
    DCPCheckpointer,
    _dcp_call,
    load_dcp_weights,
    make_checkpointer,
    match_groups,
    rescale_loader_state,
)
from tformer.distributed.env import Local
from tformer.train.checkpoint import CheckpointError, latest_checkpoint
from tformer.train.config import ParallelConfig, TrainConfig


def test_a_shard_with_a_flipped_byte_is_refused_before_anything_loads(tmp_path) -> None:
    model = moe_model()
    optimizer, scheduler = trained(model)
    path = DCPCheckpointer(Local(), seed=0).save(tmp_path, 1, model, optimizer, scheduler, {}, {}, None)
    shard = sorted(path.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, other content
    shard.write_bytes(bytes(data))
    other = moe_model()
    opt2, sched2 = trained(other)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"{shard.name}: sha256 differs from the manifest"):
        DCPCheckpointer(Local(), seed=0).load(path, other, opt2, sched2)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_close_commits_an_async_save_in_flight(tmp_path) -> None:
    model = moe_model()
    optimizer, scheduler = trained(model)
    ckpt = DCPCheckpointer(Local(), seed=0, async_save=True)
    ckpt.save(tmp_path, 1, model, optimizer, scheduler, {}, {}, None)
    ckpt.close()
    assert latest_checkpoint(tmp_path) is not None and latest_checkpoint(tmp_path).name == "step_000001"


def test_a_full_disk_inside_dcps_wrapping_keeps_its_errno(tmp_path) -> None:
    """DCP wraps a rank's OSError in its CheckpointException; the error tformer raises carries the errno,
    so the save's message says the disk is full."""

    def fails():
        raise dcp.CheckpointException("save failed", {0: OSError(errno.ENOSPC, "No space left on device")})

    with pytest.raises(CheckpointError) as err:
        _dcp_call("save", tmp_path, fails)
    assert err.value.errno == errno.ENOSPC


def test_loading_weights_for_generation_leaves_the_callers_rng_alone(tmp_path) -> None:
    model = moe_model()
    optimizer, scheduler = trained(model)
    torch.manual_seed(123)  # the state the checkpoint stores
    path = DCPCheckpointer(Local(), seed=0).save(tmp_path, 1, model, optimizer, scheduler, {}, {}, None)
    cfg = TrainConfig(model=model.cfg, steps=10)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    other = moe_model()  # draws from the RNG too: start again from 7
    torch.manual_seed(7)
    assert load_dcp_weights(path, other, cfg) == 1
    assert torch.equal(torch.rand(3), expected)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_loader_position_at_another_world_size_repeats_a_batch_rather_than_skip_one() -> None:
    """One rank at batch 3 has used 3 batches; two ranks resume at their batch 1 (global batches 2, 3
    next): batch 2 is seen twice, none is skipped."""
    assert rescale_loader_state({"epoch": 0, "index_in_epoch": 3, "seed": 0}, 1, 2)["index_in_epoch"] == 1
    assert rescale_loader_state({"epoch": 2, "index_in_epoch": 4, "seed": 5}, 2, 1) == {
        "epoch": 2,
        "index_in_epoch": 8,
        "seed": 5,
    }


def test_scheduler_groups_regroup_only_equal_values(tmp_path) -> None:
    state = {"base_lrs": [0.1, 0.1], "_last_lr": [0.05, 0.05], "last_epoch": 3}
    assert match_groups(state, 3, tmp_path) == {
        "base_lrs": [0.1] * 3,
        "_last_lr": [0.05] * 3,
        "last_epoch": 3,
    }
    with pytest.raises(CheckpointError, match="scheduler base_lrs differs per group; cannot regroup 2 -> 3"):
        match_groups({"base_lrs": [0.1, 0.2]}, 3, tmp_path)


def test_the_single_process_format_is_refused_for_several_processes() -> None:
    class TwoRanks(Local):
        world_size = 2

    with pytest.raises(CheckpointError, match="'safetensors' is the single-process format; use 'dcp'"):
        make_checkpointer(ParallelConfig(checkpoint="safetensors"), TwoRanks(), 0)


def test_an_optimizer_over_other_parameters_is_refused_before_anything_loads(tmp_path) -> None:
    model = moe_model()
    optimizer, scheduler = trained(model)
    path = DCPCheckpointer(Local(), seed=0).save(tmp_path, 1, model, optimizer, scheduler, {}, {}, None)
    other = moe_model()
    one_group = torch.optim.AdamW(list(other.parameters())[:-1], lr=1e-3)  # one parameter left out
    sched2 = torch.optim.lr_scheduler.LambdaLR(one_group, lambda s: 1.0)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match="optimizer parameter groups differ from the checkpoint's"):
        DCPCheckpointer(Local(), seed=0).load(path, other, one_group, sched2)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
