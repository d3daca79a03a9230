"""The resume scenarios of worker.py (resume1, resume2, resume3): a Trainer under torchrun saved and resumed across
processes, process groups and world sizes; a damaged shard and ranks that disagree on the step."""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from worker_common import full, moe_model_cfg

from tformer.config import MoEConfig
from tformer.distributed.plans import is_rank_local
from tformer.model import build_model
from tformer.train.config import OptimConfig, ParallelConfig


def lm_config(corpus: Path, log_every: int = 1, **parallel):
    from tformer.train.config import DataConfig
    from tformer.train.presets import tiny_lm

    base = tiny_lm()
    moe = parallel.pop("moe", None)
    model = base.model.replace(d_model=32, d_ff=64, n_heads=2, dropout=0.1, max_seq_len=32, moe=moe)
    return base.replace(
        model=model,
        data=DataConfig(corpus=f"text:{corpus}", vocab_size=300, seq_len=32),
        optim=OptimConfig(lr=1e-2, warmup_steps=2, fused=False),
        steps=8,
        batch_size=2,
        eval_every=4,
        eval_batches=1,
        save_every=4,
        log_every=log_every,
        parallel=ParallelConfig(**parallel),
    )


def run(cfg, run_dir: Path, resume=False, dump: Path | None = None) -> dict:
    """Train (or resume) to cfg.steps; per-rank parameter checksums. `dump`: the full state at the
    start (after the restore), written by rank 0."""
    from tformer.tasks import make_task
    from tformer.train.loop import Trainer

    trainer = Trainer(cfg, run_dir, make_task("lm"), resume=resume, progress=False)
    rng = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()  # this rank's, as restored
    if dump is not None:
        dump_full_state(trainer, dump)
    saved_windows, save = {}, trainer.save

    def save_noting_the_windows(*args, trainer=trainer, **kwargs):
        saved_windows[trainer.state.step] = routing_windows(trainer.model)
        return save(*args, **kwargs)

    trainer.save = save_noting_the_windows
    restored_windows = routing_windows(trainer.model)
    trainer.fit()
    del trainer.save  # (the wrapper holds the trainer)
    sums = [float(full(p.detach(), False).double().sum()).hex() for p in trainer.model.parameters()]
    trainer.close()  # releases model, optimizer, mesh (the process group is the launch's)
    del trainer
    gc.collect()
    return {
        "param_sums": sums,
        "rng_at_start": rng,
        "windows_saved": saved_windows,
        "windows_restored": restored_windows,
    }


def routing_windows(model) -> list[list[int]]:
    """This rank's own routing counts since the last log, per MoE layer (rank-local state)."""
    return [m.router.window_tokens.tolist() for m in model.modules() if hasattr(m, "router")]


def losses(run_dir: Path) -> list[str]:
    """Each logged step's loss, grad norm and routing statistics (MoE: summed over the ranks' windows)."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        f"{r['step']} {float(r['loss']).hex()} {float(r['grad_norm']).hex()} {json.dumps(r.get('moe'))}"
        for r in records
        if r["kind"] == "train"
    ]


VARIANTS = ("ddp_dense_sync", "fsdp_dense_async", "tp_dense_sync", "ddp_moe_sync", "ep_fsdp_moe_async")


def variant(name: str, corpus: Path):
    moe = MoEConfig(n_experts=4, top_k=2, aux_loss_coef=0.01, bias_update_rate=0.01)
    if name == "ddp_dense_sync":
        return lm_config(corpus, data="ddp")
    if name == "fsdp_dense_async":
        return lm_config(corpus, data="fsdp", async_save=True)
    if name == "tp_dense_sync":
        return lm_config(corpus, tensor=2)
    # MoE: logged every 3 steps, so that the step-4 saves hold each rank's own routing counts of step 4
    if name == "ddp_moe_sync":
        return lm_config(corpus, log_every=3, data="ddp", moe=moe)
    return lm_config(corpus, log_every=3, data="fsdp", experts="shard", async_save=True, moe=moe)


def resume1(env, out_dir: Path, out: dict) -> None:
    """Uninterrupted runs to step 8, saving at 4 and 8 while training goes on (their step-4 saves are
    resumed by the next launch: new processes, new process group); the 1 -> 2 reshard."""
    corpus = out_dir / "corpus"
    for name in VARIANTS:
        out[name] = run(variant(name, corpus), out_dir / f"{name}_a")
    # 1 -> 2: the pytest side saved a 1-process DCP checkpoint at step 4; resume it on 2 ranks (EP+FSDP2)
    cfg = variant("ep_fsdp_moe_async", corpus).replace(steps=5)  # and train one step on
    run(cfg, out_dir / "one_proc", resume=True, dump=out_dir / "from_one.safetensors")
    out["disagree"] = step_disagreement(env, out_dir / "disagree")
    out["corrupt"] = corrupt_shard(env, out_dir / "corrupt")
    out["nonfinite"] = nonfinite_on_one_rank(env, corpus, out_dir / "nonfinite")


class NaNOnRank1:
    """The LM task, its loss NaN on rank 1 only from its second step on."""

    def __init__(self, rank: int) -> None:
        from tformer.tasks import make_task

        self.inner, self.rank, self.calls = make_task("lm"), rank, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def loss(self, model, batch):
        self.calls += 1
        loss, n = self.inner.loss(model, batch)
        return (loss * float("nan") if self.rank == 1 and self.calls >= 2 else loss), n


def nonfinite_on_one_rank(env, corpus: Path, run_dir: Path) -> dict:
    """C3 on 2 ranks: a NaN loss on rank 1 alone makes both ranks skip the step and, at max_nonfinite=2,
    stop together at the same step with the error naming rank 1 and the checkpoint left intact."""
    from tformer.train.loop import Trainer
    from tformer.train.step import NonFiniteError

    cfg = lm_config(corpus, data="ddp").replace(steps=6, save_every=1, max_nonfinite=2)
    trainer = Trainer(cfg, run_dir, NaNOnRank1(env.rank), progress=False)
    try:
        trainer.fit()
        error = ""
    except NonFiniteError as e:
        error = str(e)
    step = trainer.state.step
    trainer.close()
    del trainer
    gc.collect()
    return {"error": error, "step": step}


def corrupt_shard(env, run_dir: Path) -> dict:
    """B7 on 2 ranks: one byte of a shard changed after the commit. Each file is hashed by one rank only;
    every rank must raise the same error (a rank that raised alone would leave the other in DCP's load)."""
    from tformer.distributed.checkpoint import DCPCheckpointer
    from tformer.train.checkpoint import CheckpointError

    torch.manual_seed(0)
    model = build_model(moe_model_cfg().replace(moe=None))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    checkpointer = DCPCheckpointer(env, 0)
    path = checkpointer.save(run_dir, 3, model, opt, sched, {}, {}, None)
    shards = sorted(p.name for p in path.iterdir() if p.suffix == ".distcp")
    if env.is_main:  # the first shard: sorted after .metadata, so rank 1 hashes it
        data = bytearray((path / shards[0]).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (path / shards[0]).write_bytes(bytes(data))
    env.barrier()
    try:
        checkpointer.load(path, model, opt, sched)
        error = ""
    except CheckpointError as e:
        error = str(e)
    checkpointer.save(run_dir, 4, model, opt, sched, {}, {}, None)
    try:  # ranks that see different newest checkpoints (e.g. a filesystem that is not shared)
        checkpointer.load(path.with_name(f"step_00000{3 + env.rank}"), model, opt, sched)
        differ = ""
    except CheckpointError as e:
        differ = str(e)
    checkpointer.close()
    del model, opt, sched, checkpointer
    return {"error": error, "shard": shards[0], "differ": differ}


def step_disagreement(env, run_dir: Path) -> dict:
    """B8: rank r asks to save step 5 + r: every rank raises before anything is written."""
    from tformer.distributed.checkpoint import DCPCheckpointer
    from tformer.train.checkpoint import CheckpointError

    torch.manual_seed(0)
    model = build_model(moe_model_cfg().replace(moe=None))
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    checkpointer = DCPCheckpointer(env, 0)
    try:
        checkpointer.save(run_dir, 5 + env.rank, model, opt, sched, {}, {}, None)
        error = ""
    except CheckpointError as e:
        error = str(e)
    env.barrier()
    written = sorted(p.name for p in run_dir.rglob("*")) if run_dir.exists() else []
    checkpointer.close()
    del model, opt, sched, checkpointer
    return {"error": error, "written": written}


def copy_run(src: Path, dst: Path, step_dir: str) -> None:
    """A run directory holding only `src`'s checkpoint `step_dir` (as if it had stopped there)."""
    shutil.copytree(src / "checkpoints" / step_dir, dst / "checkpoints" / step_dir)
    for f in ("tokenizer.json", "config.json", "metrics.jsonl"):
        shutil.copy(src / f, dst / f)


def resume2(env, out_dir: Path, out: dict) -> None:
    """Resume each run's step-4 save to step 8; the EP+FSDP2 one also dumps its state at step 4 and is
    left as a 2-rank checkpoint for the 1-process load on the pytest side (2 -> 1)."""
    for name in VARIANTS:
        a, b = out_dir / f"{name}_a", out_dir / f"{name}_b"
        if env.is_main:
            copy_run(a, b, "step_000004")
            copy_run(a, out_dir / f"{name}_two_proc", "step_000004")
        env.barrier()
        dump = out_dir / "two_proc.safetensors" if name == "ep_fsdp_moe_async" else None
        out[name] = run(variant(name, out_dir / "corpus"), b, resume=True, dump=dump)
        if env.is_main:
            out[name] |= {"losses_a": losses(a), "losses_b": losses(b)}


def resume3(env, out_dir: Path, out: dict) -> None:
    """2 -> 3 ranks, each resume only opened (no step): ddp_dense_sync's step-4 save, the tensor degree
    unchanged (ranks 0 and 1 take the streams they saved, rank 2 a fresh one; each loader position
    rescaled by 2 / 3), and tp_dense_sync's as DDP (new tensor groups: a fresh stream on every rank)."""
    from tformer.tasks import make_task
    from tformer.train.loop import Trainer

    cfg = variant("ddp_dense_sync", out_dir / "corpus")
    for name, saved_by in (("ddp", "ddp_dense_sync"), ("tp_as_ddp", "tp_dense_sync")):
        run_dir = out_dir / f"{name}_three"
        if env.is_main:
            copy_run(out_dir / f"{saved_by}_a", run_dir, "step_000004")
        env.barrier()
        trainer = Trainer(cfg, run_dir, make_task("lm"), resume=True, progress=False)
        rng = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
        out[name] = {"rng_at_start": rng, "loader": trainer.loader.state_dict(), "step": trainer.state.step}
        trainer.close()
        del trainer
        gc.collect()


def dump_full_state(trainer, dump: Path) -> None:
    """The full model + optimizer state (expert slices gathered), written by rank 0."""
    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer, options=options)
    sliced = set(trainer.parallel.rank_local)
    tensors = {f"model.{k}": full(v, k in sliced) for k, v in model_state.items() if not is_rank_local(k)}
    for k, v in optim_state.items():
        if isinstance(v, torch.Tensor):
            name = k.removeprefix("state.").rsplit(".", 1)[0]
            tensors[f"optim.{k}"] = full(v, name in sliced and v.dim() > 0)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in tensors.items()}, dump)
