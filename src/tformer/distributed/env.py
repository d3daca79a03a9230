"""Who this process is in a run, and the few collectives the trainer needs.

`init_distributed(parallel)` reads torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK). Alone
(world size 1) it returns `Local`, a null object: no process group, every collective the identity,
rank 0 does everything. Under torchrun it joins (or creates) the default process group and returns
`ProcessGroup`. The trainer only ever calls the methods both share.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import inspect
import os
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tformer.schema import ConfigError
from tformer.train.config import ParallelConfig


class OtherRankFailed(Exception):
    """This rank's checks passed; those of the ranks named failed, and each of them says why."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        super().__init__(f"{which} failed with the error above; every rank stops")


def said_by_a_lower_rank(err: BaseException) -> bool | None:
    """For an error `checked_together` raised: whether a lower rank raised one of the same words (and says
    it); None for any other error."""
    return getattr(err, "tformer_said_by_a_lower_rank", None)


def rank_seed(seed: int, rank: int) -> int:
    """A 63-bit seed for one rank's RNG stream (dropout, router jitter) of a run seeded with `seed`."""
    digest = hashlib.sha256(f"tformer:rank-rng:{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """ "auto" picks CUDA when present; under torchrun a CUDA process uses the GPU of its local rank."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(name)
    except RuntimeError:
        raise ValueError(
            f"device {name!r} is not one torch knows (e.g. 'auto', 'cpu', 'cuda', 'cuda:1')"
        ) from None
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} asked for, but this machine has no CUDA device")
    if name == "cuda":
        name = f"cuda:{local_rank}"
    return torch.device(name)


class Local:
    """World size 1: no process group. Every collective is the identity."""

    rank, local_rank, world_size, is_main = 0, 0, 1, True
    timeout: datetime.timedelta | None = None  # of the process groups tformer makes (parallel.timeout_s)
    # the data-parallel coordinates: ranks of one tensor-parallel group share a data rank (same batches,
    # same dropout stream); without tensor parallelism they are rank and world_size
    data_rank, data_world_size = 0, 1

    def device(self, name: str) -> torch.device:
        return resolve_device(name)

    def seed_rank(self, seed: int) -> None:
        """One process keeps the stream `torch.manual_seed(seed)` started."""

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block (e.g. training and saving a tokenizer) before the others do."""
        yield

    @contextlib.contextmanager
    def checked_together(self) -> Iterator[None]:
        """Checks every rank makes alike (of the config, the run directory, a checkpoint to resume); one
        process just runs them."""
        yield

    def barrier(self) -> None:
        pass

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        pass

    def shutdown(self) -> None:
        pass


class ProcessGroup(Local):
    """Several processes on the default process group (gloo on CPU, nccl on CUDA)."""

    def __init__(self, owns_group: bool, tensor: int = 1, timeout_s: float | None = None) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.is_main = self.rank == 0
        self.owns_group = owns_group
        if self.world_size % tensor:
            raise ConfigError(
                f"parallel.tensor={tensor} must divide the world size {self.world_size} (the number of processes)"
            )
        # the device mesh is (data, tensor), row-major: ranks r*T .. r*T + T-1 form tensor-parallel group r
        self.data_rank, self.data_world_size = self.rank // tensor, self.world_size // tensor

    def device(self, name: str) -> torch.device:
        device = resolve_device(name, self.local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device

    def seed_rank(self, seed: int) -> None:
        """Different dropout / jitter streams per data rank (the model was initialised identically before);
        the ranks of one tensor-parallel group hold the same activations, so they draw the same stream."""
        torch.manual_seed(rank_seed(seed, self.data_rank))

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    @contextlib.contextmanager
    def checked_together(self) -> Iterator[None]:
        """Checks every rank makes of the same config and files, after which the ranks agree. A rank whose
        checks failed raises its error, marked where a lower rank raised the same words (the command line
        says such an error once, not once per rank: `said_by_a_lower_rank`); a rank whose checks passed
        raises OtherRankFailed naming the ranks that failed (it would otherwise wait for them in the next
        collective, then stop without saying why)."""
        failed: Exception | None = None
        try:
            yield
        except Exception as e:  # a Ctrl-C is not a check: that rank stops, torchrun stops the others
            failed = e
        words: list[str | None] = [None] * self.world_size
        dist.all_gather_object(words, None if failed is None else f"{type(failed).__name__}: {failed}")
        if failed is not None:  # said by this rank unless a lower rank says the same words
            failed.tformer_said_by_a_lower_rank = words.index(words[self.rank]) < self.rank
            raise failed
        if any(w is not None for w in words):
            raise OtherRankFailed([r for r, w in enumerate(words) if w is not None])

    def barrier(self) -> None:
        dist.barrier()

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])

    def shutdown(self) -> None:
        """Destroy the process group if this object created it. Release models, optimizers and meshes
        first: gloo can abort at exit when they outlive the group."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def world_size_from_env() -> int:
    """WORLD_SIZE (torchrun sets it), 1 where it is unset; an error naming it where it is not a number."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"the environment variable WORLD_SIZE={value!r} is not a whole number (torchrun sets it; unset it "
            "to run in one process)"
        ) from None


def init_distributed(parallel: ParallelConfig, device: str = "auto") -> Local:
    """`Local()` for one process; else join the default process group (creating it if needed)."""
    if dist.is_available() and dist.is_initialized():
        return (
            ProcessGroup(False, parallel.tensor, parallel.timeout_s) if dist.get_world_size() > 1 else Local()
        )
    if world_size_from_env() <= 1:
        # every setting but the checkpoint format (DCP works in one process, async saves with it: whether
        # a run under "auto" saves DCP, and so async, is said where its checkpointer is made) waits for
        # more processes
        defaults, one_process = type(parallel)(), {"checkpoint"} | ({"async_save"} if parallel.checkpoint != "safetensors" else set())  # fmt: skip
        unused = [
            f"parallel.{name}={getattr(parallel, name)}"
            for name in type(parallel).field_names()
            if name not in one_process and getattr(parallel, name) != getattr(defaults, name)
        ]
        if unused:
            warnings.warn(
                f"{', '.join(unused)}: this is one process, which trains the whole model; these settings take "
                "effect under torchrun (torchrun --nproc_per_node N -m tformer train ...)",
                UserWarning,
                stacklevel=2,
            )
        return Local()
    backend = parallel.backend
    if backend == "auto":
        backend = "nccl" if device != "cpu" and torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("parallel.backend=nccl needs CUDA GPUs; this machine has none (use gloo or auto)")
    if backend == "nccl":  # bind this process to its GPU before NCCL sees it
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=parallel.timeout_s))
    return ProcessGroup(True, parallel.tensor, parallel.timeout_s)


def new_group(env: Local, backend: str | None = None) -> dist.ProcessGroup:
    """A process group over every rank that times out after parallel.timeout_s, as the default one does
    (a new group's own default is 30 minutes for gloo, 10 for NCCL)."""
    return dist.new_group(backend=backend, timeout=env.timeout)


def set_mesh_timeout(mesh, env: Local) -> None:
    """The per-dimension groups `init_device_mesh` made for a mesh of several dimensions time out after
    parallel.timeout_s too (torch builds them with its default timeout)."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if env.timeout is None or set_timeout is None or mesh.ndim < 2:  # 1-D: the default group itself
        return
    for dim in range(mesh.ndim):
        set_timeout(env.timeout, mesh.get_group(dim))


# ---------------------------------------------------------------------------- per-rank roles
class NullMetrics:
    """Ranks other than 0 write no metrics (rank 0 logs the globally reduced values)."""

    def write(self, record: dict) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def train_loader(task, cfg, env: Local):
    """The task's training batches; under torchrun each data rank takes every W-th batch of one list (the
    ranks of a tensor-parallel group read the same batches)."""
    if env.data_world_size == 1:
        return task.train_loader(cfg)
    if "world_size" not in inspect.signature(task.train_loader).parameters:
        raise ValueError(f"task {cfg.task!r} cannot split its batches over ranks yet (run it in one process)")
    return task.train_loader(cfg, rank=env.data_rank, world_size=env.data_world_size)
