"""The distributed package at world size 1 (no process group, fast, in the default suite): plans,
config, the DCP checkpoint format written and read by one process, and its error handling."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tformer.config import MoEConfig
from tformer.distributed.checkpoint import (
    CheckpointFormatError,
    DCPCheckpointer,
    SafetensorsCheckpointer,
    _dcp_call,
    is_dcp_checkpoint,
    make_checkpointer,
    rescale_loader_state,
)
from tformer.distributed.env import Local, init_distributed
from tformer.distributed.parallelize import parallelize, separate_dtensor_groups
from tformer.distributed.plans import make_plan
from tformer.model import build_model
from tformer.presets import tiny
from tformer.schema import ConfigError
from tformer.train.checkpoint import CheckpointError, latest_checkpoint
from tformer.train.config import OptimConfig, ParallelConfig, TrainConfig
from tformer.train.optim import make_optimizer, make_scheduler
from tformer.train.step import LOCAL


def moe_model(n_experts: int = 4, d_ff: int = 32):
    torch.manual_seed(0)
    return build_model(tiny().replace(d_model=32, d_ff=d_ff, n_heads=2, moe=MoEConfig(n_experts=n_experts)))


def trained(model):
    optimizer = make_optimizer(model, OptimConfig(fused=False))
    scheduler = make_scheduler(optimizer, 10, OptimConfig())
    model(torch.randint(0, 128, (2, 8))).square().mean().backward()
    optimizer.step()
    scheduler.step()
    return optimizer, scheduler


def test_world_size_one_is_a_null_object(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    env = init_distributed(ParallelConfig())
    assert isinstance(env, Local) and env.world_size == 1 and env.is_main
    model = moe_model()
    parallel = parallelize(
        model, make_plan(ParallelConfig(data="fsdp", experts="shard"), 1), env, torch.device("cpu")
    )
    assert parallel.model is model and parallel.comm is LOCAL
    optimizer = make_optimizer(model, OptimConfig(fused=False))
    groups = [list(g["params"]) for g in optimizer.param_groups]
    assert [list(g["params"]) for g in separate_dtensor_groups(optimizer).param_groups] == groups
    assert isinstance(make_checkpointer(ParallelConfig(), env, 0), SafetensorsCheckpointer)
    assert isinstance(make_checkpointer(ParallelConfig(checkpoint="dcp"), env, 0), DCPCheckpointer)


def test_plan_and_config() -> None:
    plan = make_plan(ParallelConfig(data="fsdp", experts="shard", param_dtype="bfloat16"), 2)
    assert plan.data == "fsdp" and plan.expert_parallel and plan.param_dtype == torch.bfloat16
    assert plan.is_fsdp_unit("blocks.3") and plan.is_fsdp_unit("encoder.blocks.0")
    assert not plan.is_fsdp_unit("blocks.3.attn") and not plan.is_fsdp_unit("tok_embed")
    with pytest.raises(ConfigError, match="param_dtype"):
        ParallelConfig(data="ddp", param_dtype="bfloat16")
    cfg = TrainConfig().with_overrides({"parallel.data": "fsdp", "parallel.async_save": True})
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert rescale_loader_state({"epoch": 1, "index_in_epoch": 3, "seed": 0}, 2, 1)["index_in_epoch"] == 6


def test_tensor_parallel_plan_and_its_limits() -> None:
    from tformer.distributed.parallelize import check_tensor_parallel

    plan = make_plan(ParallelConfig(tensor=2), 2)
    assert plan.tensor == 2 and plan.data == "none"  # one tensor-parallel group: no data parallelism
    names = {
        "blocks.0.attn.q_proj": "colwise",
        "decoder.blocks.1.cross_attn.v_proj": "colwise",
        "encoder.blocks.0.attn.o_proj": "rowwise",
        "blocks.2.ffn.gate_proj": "colwise",
        "blocks.2.ffn.up_proj": "colwise",
        "blocks.2.ffn.down_proj": "rowwise",
        "lm_head": "vocab",  # split by vocabulary (left whole where tied)
        "decoder.lm_head": None,
        "blocks.2.ffn.experts": None,  # experts: split by width (expert_width.py), not by these styles
        "blocks.2.ffn.shared.up_proj": "colwise",  # an MoE layer's shared experts
        "blocks.2.ffn.shared.down_proj": "rowwise_reduced",
        "blocks.0.attn": None,
    }
    assert {n: plan.tp_style(n) for n in names} == names
    assert make_plan(ParallelConfig(tensor=2, data="fsdp"), 4).data == "fsdp"
    with pytest.raises(ConfigError, match="needs parallel.data='fsdp'"):
        make_plan(ParallelConfig(tensor=2, data="ddp"), 4)
    with pytest.raises(ConfigError, match="must divide the world size 3"):
        make_plan(ParallelConfig(tensor=2), 3)
    # expert parallelism over the data dimension: needs more than one tensor-parallel group, and experts
    # that divide by the data-parallel ranks (checked before any process group is used)
    from tformer.distributed.parallelize import shard_experts_over

    ep_tp = make_plan(ParallelConfig(tensor=2, data="fsdp", experts="shard"), 6)
    assert ep_tp.expert_parallel
    with pytest.raises(ConfigError, match="4 experts over the 3 data-parallel ranks: model.moe.n_experts"):
        shard_experts_over(moe_model(4), ep_tp, 0, 3)
    with pytest.raises(ConfigError, match="has no MoE layer"):
        shard_experts_over(build_model(tiny()), ep_tp, 0, 3)
    with pytest.raises(ConfigError, match="experts=shard with parallel.tensor=2 on 2 processes"):
        make_plan(ParallelConfig(tensor=2, experts="shard"), 2)
    with pytest.raises(ConfigError, match="tensor"):
        ParallelConfig(tensor=0)
    with pytest.raises(ConfigError, match="param_dtype=bfloat16 is FSDP2 mixed precision"):
        make_plan(ParallelConfig(tensor=2, data="fsdp", param_dtype="bfloat16"), 2)
    check_tensor_parallel(build_model(tiny().replace(d_model=32, n_heads=4, d_ff=64, attn_dropout=0.1)), 2)
    check_tensor_parallel(moe_model(), 2)  # MoE layers: the same tokens in every rank, experts split by width
    with pytest.raises(ConfigError, match=r"must divide model.n_heads=2"):
        check_tensor_parallel(build_model(tiny().replace(d_model=32, n_heads=2, d_ff=64)), 4)
    check_tensor_parallel(build_model(tiny().replace(d_model=32, n_heads=4, d_ff=64)), 2)
    # sequence parallelism: inside a tensor-parallel group
    assert make_plan(ParallelConfig(tensor=2, sequence=True), 2).sequence
    assert not make_plan(ParallelConfig(tensor=2), 2).sequence
    with pytest.raises(ConfigError, match="sequence needs tensor > 1"):
        ParallelConfig(sequence=True)


def test_the_dcp_checkpointer_loads_a_single_process_checkpoint_in_one_process_only(tmp_path) -> None:
    """`--set parallel.checkpoint=dcp` on a safetensors run: one process loads the safetensors checkpoint
    as it was saved (weights, optimizer, scheduler, RNG); several processes get an error that says how
    to convert, not that the checkpoint is damaged."""
    model = moe_model()
    optimizer, scheduler = trained(model)
    torch.manual_seed(7)
    path = SafetensorsCheckpointer(Local(), 0).save(
        tmp_path, 1, model, optimizer, scheduler, {"loader": {}}, {}, 2
    )
    expected_rng = torch.rand(3)
    other = moe_model()
    opt2 = make_optimizer(other, OptimConfig(fused=False))
    sched2 = make_scheduler(opt2, 10, OptimConfig())
    assert DCPCheckpointer(Local(), seed=0).load(path, other, opt2, sched2)["loader"] == {}
    assert torch.equal(torch.rand(3), expected_rng)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    assert sched2.state_dict() == scheduler.state_dict()

    class TwoRanks(Local):
        world_size = 2

    two = DCPCheckpointer(Local(), seed=0)
    two.env = TwoRanks()  # as rank 0 of 2 sees it (the check comes before any collective)
    with pytest.raises(CheckpointFormatError, match="single-process .* parallel.checkpoint=dcp"):
        two.load(path, other, opt2, sched2)


def test_dcp_round_trip_in_one_process(tmp_path) -> None:
    """A DCP checkpoint written by one process restores model, optimizer, scheduler, RNG and the MoE
    counters exactly (the format distributed runs write; here without a process group)."""
    model = moe_model()
    optimizer, scheduler = trained(model)
    ckpt = DCPCheckpointer(Local(), seed=0)
    torch.manual_seed(123)
    path = ckpt.save(tmp_path, 1, model, optimizer, scheduler, {"loader": {}}, {"note": "x"}, keep_last=2)
    expected_rng = torch.rand(3)
    assert is_dcp_checkpoint(path) and latest_checkpoint(tmp_path) == path

    other = moe_model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    opt2 = make_optimizer(other, OptimConfig(fused=False))
    sched2 = make_scheduler(opt2, 10, OptimConfig())
    state = DCPCheckpointer(Local(), seed=0).load(path, other, opt2, sched2)
    assert state == {"loader": {}}
    assert torch.equal(torch.rand(3), expected_rng)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(optimizer.state.values(), opt2.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert sched2.state_dict() == scheduler.state_dict()
    with pytest.raises(CheckpointError, match="exists already"):
        ckpt.save(tmp_path, 1, model, optimizer, scheduler, {}, {}, keep_last=2)


def test_dcp_mismatch_is_a_checkpoint_error(tmp_path) -> None:
    """A9, B9: a changed architecture fails before anything is loaded, with the toolkit's error naming
    the tensor; DCP's own CheckpointException (a BaseException) becomes that error too."""
    model = moe_model(4)
    optimizer, scheduler = trained(model)
    path = DCPCheckpointer(Local(), seed=0).save(tmp_path, 1, model, optimizer, scheduler, {}, {}, None)
    bigger = moe_model(8)
    opt2, sched2 = trained(bigger)
    before = {k: v.clone() for k, v in bigger.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=r"blocks\.0\.ffn\.router\.\w+' has shape \(4,\), the model \(8,\)"
    ):
        DCPCheckpointer(Local(), seed=0).load(path, bigger, opt2, sched2)
    assert all(torch.equal(v, before[k]) for k, v in bigger.state_dict().items())  # nothing loaded
    wider = moe_model(4, d_ff=48)
    opt3, sched3 = trained(wider)
    weights = {k: v.clone() for k, v in wider.state_dict().items()}
    moments = {i: {k: v.clone() for k, v in st.items()} for i, st in enumerate(opt3.state.values())}
    schedule, rng = sched3.state_dict(), torch.get_rng_state()
    with pytest.raises(CheckpointError, match=r"rank 0: ValueError: Size mismatch .*experts\.\w+_proj"):
        DCPCheckpointer(Local(), seed=0).load(path, wider, opt3, sched3)
    # a mismatch DCP itself finds (mid-load) changes nothing either: weights, optimizer, schedule, RNG
    assert all(torch.equal(v, weights[k]) for k, v in wider.state_dict().items())
    for i, st in enumerate(opt3.state.values()):
        assert all(torch.equal(v, moments[i][k]) for k, v in st.items())
    assert sched3.state_dict() == schedule and torch.equal(torch.get_rng_state(), rng)

    def fails():
        raise dcp.CheckpointException("save failed", {1: OSError("disk full")})

    with pytest.raises(CheckpointError, match="rank 1: OSError: disk full"):
        _dcp_call("save", tmp_path, fails)


def test_a_crash_during_the_second_dcp_save_leaves_the_first_and_is_cleaned_up(tmp_path, monkeypatch) -> None:
    """B2 for the DCP format: the step-1 checkpoint stays the latest and loads; the directory the failed
    save left is never listed and goes with the next commit."""
    model = moe_model()
    optimizer, scheduler = trained(model)
    ckpt = DCPCheckpointer(Local(), seed=0)
    first = ckpt.save(tmp_path, 1, model, optimizer, scheduler, {"loader": {}}, {}, keep_last=None)
    real_save = dcp.save

    def dies(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(dcp, "save", dies)
    with pytest.raises(CheckpointError, match="no space left on device"):
        ckpt.save(tmp_path, 2, model, optimizer, scheduler, {"loader": {}}, {}, keep_last=None)
    root = tmp_path / "checkpoints"
    assert [p.name for p in root.glob(".tmp-*")] == [".tmp-step_000002-dcp"]
    assert latest_checkpoint(tmp_path) == first
    other = moe_model()
    opt2, sched2 = trained(other)
    assert ckpt.load(first, other, opt2, sched2) == {"loader": {}}
    monkeypatch.setattr(dcp, "save", real_save)
    third = ckpt.save(tmp_path, 3, model, optimizer, scheduler, {"loader": {}}, {}, keep_last=None)
    assert sorted(p.name for p in root.iterdir()) == [first.name, third.name]


def test_parallel_settings_in_one_process_are_named_as_unused() -> None:
    """`--set parallel.data=fsdp` without torchrun trains one whole model: said, not silent."""
    with pytest.warns(
        UserWarning,
        match="parallel.data=fsdp, parallel.tensor=2: this is one process, which trains the whole model",
    ):
        assert isinstance(init_distributed(ParallelConfig(data="fsdp", tensor=2)), Local)
    with pytest.warns(  # every setting that waits for torchrun (sequence had been left out)
        UserWarning,
        match=r"^parallel.tensor=2, parallel.sequence=True: this is one",
    ):
        init_distributed(ParallelConfig(tensor=2, sequence=True))
    with pytest.warns(UserWarning, match=r"^parallel.async_save=True, parallel.tensor=2: this is one"):
        init_distributed(ParallelConfig(tensor=2, checkpoint="safetensors", async_save=True))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        init_distributed(ParallelConfig())  # the defaults: nothing to say
        init_distributed(ParallelConfig(checkpoint="dcp", async_save=True))  # both work in one process


def test_accumulation_defers_ddps_all_reduce_also_under_torch_compile(tmp_path) -> None:
    """Collectives.micro_batch finds DDP inside torch.compile's wrapper (the trainer passes the compiled
    module): every micro-batch but the last runs under no_sync. A one-rank gloo group, nothing compiled
    (torch.compile wraps lazily)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tformer.distributed.parallelize import ProcessCollectives

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(2, 2))
        comm = ProcessCollectives(Local(), torch.device("cpu"), {})
        for module in (ddp, torch.compile(ddp)):
            with comm.micro_batch(module, last=False):
                assert not ddp.require_backward_grad_sync
            with comm.micro_batch(module, last=True):
                assert ddp.require_backward_grad_sync
        with comm.micro_batch(torch.nn.Linear(2, 2), last=False):  # FSDP2 / plain modules: nothing deferred
            pass
    finally:
        dist.destroy_process_group()


def test_settings_a_launch_cannot_honour_are_errors(monkeypatch) -> None:
    """Expert parallelism of a dense model had been ignored silently; nccl without CUDA had failed
    inside torch on every rank."""
    plan = make_plan(ParallelConfig(experts="shard"), 2)
    with pytest.raises(ConfigError, match="parallel.experts=shard, but the model has no MoE layer"):
        parallelize(build_model(tiny()), plan, Local(), torch.device("cpu"))
    if not torch.cuda.is_available():
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(ConfigError, match="parallel.backend=nccl needs CUDA GPUs"):
            init_distributed(ParallelConfig(backend="nccl"))


def test_the_groups_tformer_makes_time_out_after_parallel_timeout_s(tmp_path) -> None:
    """The checkpoint group and a 2-D mesh's per-dimension groups had torch's own default (30 minutes
    for gloo) whatever parallel.timeout_s said. A one-rank gloo group."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tformer.distributed.env import ProcessGroup, new_group, set_mesh_timeout

    def timeout(group) -> datetime.timedelta:
        return group._get_backend(torch.device("cpu")).options._timeout

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        env = ProcessGroup(False, 1, 7.0)
        assert timeout(dist.new_group(backend="gloo")) == datetime.timedelta(minutes=30)  # torch's default
        assert timeout(new_group(env, "gloo")) == datetime.timedelta(seconds=7)  # the checkpointer's group
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data", "tensor"))
        set_mesh_timeout(mesh, env)
        assert [timeout(mesh.get_group(d)) for d in range(2)] == [datetime.timedelta(seconds=7)] * 2
    finally:
        dist.destroy_process_group()


def test_split_dropout_applies_its_part_of_the_whole_mask_and_keeps_only_that_part() -> None:
    """Rank 1 of 2 with its sequence split: the output is the second half of `F.dropout` over the whole
    sequence from the same seed, and backward keeps only this rank's part of the mask (not the whole
    mask through a view of it)."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from tformer.distributed.sequence import SplitDropout

    mesh = SimpleNamespace(size=lambda: 2, get_local_rank=lambda: 1)
    drop = SplitDropout(0.3, SimpleNamespace(mesh=mesh, active=True))
    whole = torch.randn(2, 8, 4)
    torch.manual_seed(5)
    want = F.dropout(whole, 0.3, True)[:, 4:]
    x = whole[:, 4:].clone().requires_grad_()
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(5)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = drop(x)
    assert torch.equal(got, want)
    assert sum(kept.values()) == x.numel() * x.element_size()  # the (2, 4, 4) part, not the (2, 8, 4) mask
    drop.switch.active = False  # a length the group does not divide: plain dropout of what it is given
    torch.manual_seed(5)
    plain = drop(whole)
    torch.manual_seed(5)
    assert torch.equal(plain, F.dropout(whole, 0.3, True))
    assert torch.equal(drop.eval()(whole), whole)


class StubMesh:
    """What HeadSplitDropout reads of a device mesh: this rank's place in a group of `size`."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.n = rank, size

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.n


@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_head_split_attention_dropout_drops_what_one_process_drops(n_kv_heads: int) -> None:
    """Attention dropout under tensor parallelism: each of 2 ranks, from the same RNG state, computes its
    half of the heads (its K/V heads' share under GQA) and drops them as one process with the fused
    kernel drops those heads (causal and padded masks); in eval the fused kernel runs without dropout."""
    from tformer.distributed.heads import HeadSplitDropout
    from tformer.model.attention import ATTENTION_KERNELS
    from tformer.model.masks import causal_mask, padding_mask

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g)
    k, v = (torch.randn(2, n_kv_heads, 6, 8, generator=g) for _ in range(2))
    n_rep = 4 // n_kv_heads
    real = torch.ones(2, 6, dtype=torch.bool)
    real[1, 4:] = False
    for mask in (causal_mask(0, 6, None, q.device), padding_mask(6, real, 6, q.device)):
        fused = ATTENTION_KERNELS["sdpa"](0.3, n_rep).train()
        torch.manual_seed(7)
        want = fused(q, k, v, mask)
        halves = []
        for rank in range(2):
            kernel = HeadSplitDropout(
                ATTENTION_KERNELS["sdpa"](0.3, n_rep), 0.3, n_rep, StubMesh(rank, 2)
            ).train()
            torch.manual_seed(7)
            heads, kv = (
                slice(2 * rank, 2 * rank + 2),
                slice(rank * n_kv_heads // 2, (rank + 1) * n_kv_heads // 2),
            )
            halves.append(kernel(q[:, heads], k[:, kv], v[:, kv], mask))
        torch.testing.assert_close(torch.cat(halves, dim=1), want, rtol=0, atol=1e-6)
        assert not torch.allclose(
            halves[0],
            ATTENTION_KERNELS["sdpa"](0.0, n_rep)(
                q[:, :2], k[:, : n_kv_heads // 2], v[:, : n_kv_heads // 2], mask
            ),
        )  # it dropped
        kernel.eval()
        torch.testing.assert_close(
            kernel(q[:, 2:], k[:, n_kv_heads // 2 :], v[:, n_kv_heads // 2 :], mask),
            fused.eval()(q, k, v, mask)[:, 2:],
        )


def test_each_data_rank_draws_its_own_stream() -> None:
    """Dropout and router jitter differ between data-parallel ranks (the same masks on every rank would
    make data parallelism see one batch's noise W times); the same rank and seed give the same stream."""
    from tformer.distributed.env import rank_seed

    seeds = {rank_seed(0, rank) for rank in range(4)}
    assert len(seeds) == 4 and rank_seed(0, 1) == rank_seed(0, 1) and rank_seed(1, 0) not in seeds
    assert all(0 <= s < 2**63 for s in seeds)
