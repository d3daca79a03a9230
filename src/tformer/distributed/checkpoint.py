"""Checkpoints at any world size: the single-process safetensors format, or sharded DCP.

Which format a run writes is `parallel.checkpoint`: "auto" keeps the single-process safetensors
format (tformer.train.checkpoint) at world size 1 and writes DCP under torchrun. Loading looks at the
directory: a DCP checkpoint loads at any world size (2 -> 1, 1 -> 2, ...), a safetensors one at
world size 1.

A DCP checkpoint is `run_dir/checkpoints/step_000123/` (the same names, retention and commit rule):
  .metadata, __*_*.distcp  torch.distributed.checkpoint of the tensors of {"model": ..., "optim": ...}
                           from get_state_dict (optimizer state flattened, keyed by parameter name):
                           each rank writes only its shards (FSDP2 DTensors; expert-parallel slices
                           are described to DCP as DTensors sharded on dim 0, over the data
                           dimension, and under tensor parallelism split by width over the tensor
                           one, or replicated there if whole), any world size reads them
  trainer.json             (rank 0) step, world size, scheduler state, loader position, trainer state,
                           the optimizer's non-tensor entries (param-group settings; DCP would pickle them)
  meta.json                (rank 0) the resolved configs and tokenizer, as in the safetensors format
  rank{r}.json/.safetensors  (rank r) that rank's RNG states and rank-local buffers (MoE token
                           counters): per-rank keys, because DCP keeps one copy of same-key entries
  COMMITTED                (rank 0, last) format "dcp", step, world size, size + sha256 of the JSON
                           and safetensors files.
Ranks write into `.tmp-step_000123-dcp/`; rank 0 renames it once every rank's data is written.
DCP holds tensors only, the rest is JSON + safetensors. DCP writes its `.metadata` index with pickle;
tformer reads it with an unpickler that builds only the index's own classes (`SafeIndexReader`), so a
tampered index cannot run code. Its `.distcp` shards hold each tensor in `torch.save`'s zip format, which
torch's reader loads with `torch.load(weights_only=True)`: tensors only. The COMMITTED manifest
covers `.metadata` and the `.distcp` shards too.

`tformer generate / eval / translate / classify --run` read a DCP checkpoint's weights directly
(`load_dcp_weights`); `export_single_process(checkpoint_dir, new_run_dir)` converts one to the
single-process format, to continue training it in one process.
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tformer.config import ModelConfig
from tformer.distributed.env import Local, new_group, rank_seed, set_mesh_timeout
from tformer.distributed.expert_parallel import WIDTH_DIM, ExpertParallelDispatch
from tformer.distributed.plans import is_rank_local
from tformer.model import build_model
from tformer.model.moe import moe_layers
from tformer.train.checkpoint import (
    CHECKPOINTS_DIR,
    DCP_FORMAT,
    DCP_METADATA,
    FORMAT_VERSION,
    MARKER,
    STEP_DIR,
    CheckpointError,
    _clean_up,
    _fsync_dir,
    _json_bytes,
    _Reader,
    _write_file,
    _write_pair,
    file_entry,
    load_checkpoint,
    save_checkpoint,
    step_dir_name,
)
from tformer.train.config import ParallelConfig, TrainConfig
from tformer.train.optim import make_optimizer, make_scheduler
from tformer.train.state_io import capture_rng_state, restore_rng_state, rng_key

OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def is_dcp_checkpoint(path: str | Path) -> bool:
    return (Path(path) / DCP_METADATA).is_file()


def _dcp_call(what: str, path: Path, fn, *args, **kwargs):
    """DCP's CheckpointException derives from BaseException: re-raise it (and DCP's other errors) as
    the toolkit's CheckpointError, naming the directory. DCP's note that it runs in one process (a run
    without torchrun) is that run's intent, and is not shown."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return fn(*args, **kwargs)
    except dcp.CheckpointException as e:
        raise _carrying_errno(CheckpointError(f"{path}: DCP {what} failed: {_first_failure(e)}"), e) from None
    except (RuntimeError, ValueError, KeyError, OSError, AssertionError) as e:
        raise _carrying_errno(CheckpointError(f"{path}: DCP {what} failed: {e}"), e) from None


def _carrying_errno(error: CheckpointError, cause: BaseException) -> CheckpointError:
    """`error` with the errno of the OSError under `cause` (itself, or a rank's failure in DCP's
    CheckpointException), so a full disk reads as one after the wrapping (tformer.train.checkpoint.save_failed)."""
    failures = [
        f[0] if isinstance(f, tuple) else f for f in (getattr(cause, "failures", None) or {}).values()
    ]
    error.errno = next((c.errno for c in (cause, *failures) if isinstance(c, OSError)), None)
    return error


class _IndexUnpickler(pickle.Unpickler):
    """Builds what a DCP index holds (its metadata classes, torch.Size, dtypes, layouts, paths) and
    refuses every other global, so reading the index never runs code a file names. Names are looked up
    exactly (no dotted paths through a module's attributes) in an explicit list."""

    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch": {"Size"},
        "torch.serialization": {"_get_layout"},
        "collections": {"OrderedDict"},
        "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
        "pathlib._local": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # Python 3.13
    }  # fmt: skip

    def find_class(self, module: str, name: str):
        if "." not in name and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if "." in name or name not in self.ALLOWED.get(module, ()):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP index")
        return super().find_class(module, name)


class SafeIndexReader(FileSystemReader):
    """torch's FileSystemReader, reading the `.metadata` index with `_IndexUnpickler` instead of
    `pickle.load`. tformer's DCP checkpoints hold tensors only: an index that declares a bytes entry
    (which DCP would read back with `torch.load(weights_only=False)`) is refused too."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / DCP_METADATA
        try:
            with open(path, "rb") as f:
                metadata = _IndexUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}: not a DCP index ({e})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: not a DCP index (a {type(metadata).__name__})")
        entries = getattr(metadata, "state_dict_metadata", None)
        if not isinstance(entries, dict) or any(
            not isinstance(m, TensorStorageMetadata) for m in entries.values()
        ):
            raise CheckpointError(
                f"{path}: the index declares entries that are not tensors; refusing to read it"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _first_failure(e: dcp.CheckpointException) -> str:
    for rank, err in sorted((getattr(e, "failures", None) or {}).items()):
        err = err[0] if isinstance(err, tuple) else err  # (exception, traceback frames) on some paths
        first = str(err).splitlines()[0] if str(err) else ""
        return f"rank {rank}: {type(err).__name__}: {first}"
    return str(e)


class CheckpointFormatError(CheckpointError):
    """A sound checkpoint of a format this world size cannot resume (not damage: no fallback applies)."""


class SafetensorsCheckpointer:
    """World size 1: the single-process format, written exactly as tformer.train.checkpoint does.
    Loads a DCP checkpoint too (a distributed run resumed by one process)."""

    def __init__(self, env: Local, seed: int) -> None:
        self.env, self.seed = env, seed

    def save(self, run_dir: Path, step: int, model, optimizer, scheduler, trainer_state, meta, keep_last):
        return save_checkpoint(
            run_dir,
            step,
            model,
            optimizer,
            scheduler,
            tokens_seen=int(trainer_state.get("tokens_seen", 0)),
            trainer_state=trainer_state,
            rng_state=capture_rng_state(),
            meta=meta,
            keep_last=keep_last,
        )

    def load(self, path: Path, model, optimizer, scheduler) -> dict[str, Any]:
        if is_dcp_checkpoint(path):
            return DCPCheckpointer(self.env, self.seed).load(path, model, optimizer, scheduler)
        loaded = load_checkpoint(path, model, optimizer, scheduler)
        restore_rng_state(loaded.rng_state)
        return loaded.trainer_state

    def wait(self, barrier: bool = True) -> None:
        """Nothing runs in the background."""

    def close(self, alone: bool = False) -> None:
        pass


class DCPCheckpointer:
    """Sharded save (sync or async) and resume with torch.distributed.checkpoint."""

    def __init__(self, env: Local, seed: int, async_save: bool = False) -> None:
        self.env, self.seed, self.async_save = env, seed, async_save
        # async saves run collectives from a background thread: give them a group of their own
        self.group = new_group(env, "gloo") if env.world_size > 1 else None
        self._pending: tuple[Any, Path, Path, int, int | None] | None = None
        self._mesh = None

    def _state(self, model: nn.Module, optimizer) -> tuple[dict, dict, dict]:
        """(tensors for DCP {"model", "optim"}, rank-local buffers, the optimizer's non-tensor entries)."""
        model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
        local = {k: model_state.pop(k) for k in [k for k in model_state if is_rank_local(k)]}
        extra_keys = [k for k, v in optim_state.items() if not isinstance(v, torch.Tensor)]
        extra = {k: optim_state.pop(k) for k in extra_keys}
        return {"model": model_state, "optim": optim_state}, local, extra

    def _as_shards(self, model: nn.Module, state: dict) -> dict:
        """The same state with every expert-parallel slice (E / W, ...) wrapped as a DTensor sharded on
        dim 0 over the data-parallel ranks (all ranks without tensor parallelism), sharing storage, so
        that DCP saves and reshards it like an FSDP2 shard."""
        sliced = expert_slices(model)
        if not sliced:
            return state
        sizes = {layer.dispatch.world_size for _, layer in moe_layers(model) if isinstance(layer.dispatch, ExpertParallelDispatch)}  # fmt: skip
        if len(sizes) != 1 or self.env.world_size % next(iter(sizes)):
            raise CheckpointError(
                f"expert-parallel layers split over {sorted(sizes)} ranks of {self.env.world_size}"
            )
        split = partial(self._shard, data=sizes.pop())
        out = {"model": dict(state["model"]), "optim": dict(state["optim"])}
        for part, table in out.items():
            for key, t in table.items():
                name = key if part == "model" else key.removeprefix("state.").rsplit(".", 1)[0]
                if (
                    name in sliced
                    and isinstance(t, torch.Tensor)
                    and t.dim() >= 1
                    and not isinstance(t, DTensor)
                ):
                    table[key] = split(t, width_dim=sliced[name])
        return out

    def _shard(self, t: torch.Tensor, data: int, width_dim: int | None) -> DTensor:
        """Experts split over `data` ranks (all of them; or, with tensor parallelism, the data-parallel
        ones, each slice held by the ranks of a tensor-parallel group: replicated over the mesh's
        second dimension, or split by width on `width_dim` of the whole tensor)."""
        tensor = self.env.world_size // data
        if self._mesh is None:
            shape, names = ((data,), ("data",)) if tensor == 1 else ((data, tensor), ("data", "tensor"))
            self._mesh = init_device_mesh(t.device.type, shape, mesh_dim_names=names)
            set_mesh_timeout(self._mesh, self.env)
        shape = [t.shape[0] * data, *t.shape[1:]]
        placements = [Shard(0)] if tensor == 1 else [Shard(0), Replicate()]
        if tensor > 1 and width_dim is not None:
            shape[width_dim] *= tensor
            placements = [Shard(0), Shard(width_dim)]
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            t, self._mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
        )

    # ------------------------------------------------------------------ save
    def save(self, run_dir: Path, step: int, model, optimizer, scheduler, trainer_state, meta, keep_last):
        self.wait()
        self._agree_on_step(step)
        root = Path(run_dir) / CHECKPOINTS_DIR
        final = root / step_dir_name(step)
        if final.exists():
            raise CheckpointError(f"{final}: checkpoint exists already; refusing to overwrite it")
        tmp = root / f".tmp-{final.name}-{DCP_FORMAT}"
        if self.env.is_main:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save of this step
            tmp.mkdir()
        state, local, extra = self._state(model, optimizer)
        if self.env.is_main:
            trainer = {
                "step": step,
                "world_size": self.env.world_size,
                "data_world_size": self.env.data_world_size,  # world_size / tensor-parallel degree
                "scheduler": scheduler.state_dict(),
                "optim_extra": extra,
                "trainer_state": trainer_state,
            }
            _write_pair(tmp, "trainer", trainer, {}, indent=2)
            meta_json = _json_bytes({"format_version": FORMAT_VERSION, "meta": meta}, "meta")
            _write_file(tmp, "meta.json", meta_json, {})
        self.env.barrier()
        own = {"rng": capture_rng_state(self.env.rank), "buffers": local}
        _write_pair(tmp, rng_key(self.env.rank), own, {}, indent=None)
        state = self._as_shards(model, state)
        if self.async_save:
            response = _dcp_call(
                "async save", tmp, dcp.async_save, state, checkpoint_id=tmp, process_group=self.group
            )
            self._pending = (response, tmp, final, step, keep_last)
        else:
            _dcp_call("save", tmp, dcp.save, state, checkpoint_id=tmp, process_group=self.group)
            self._commit(tmp, final, step, keep_last)
        return final

    def _agree_on_step(self, step: int, loading: bool = False) -> None:
        """Every rank must save (or resume from) the same step: checked (one all-reduce) before anything
        is written (read), so ranks that drifted apart (or see different files) raise the same error
        instead of writing a mixed checkpoint, resuming different states, or hanging."""
        if self.group is None:
            return
        t = torch.tensor([step, -step], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        highest, lowest = int(t[0]), -int(t[1])
        if highest != lowest and loading:
            raise CheckpointError(
                f"ranks resume from different checkpoints (this rank step {step}, the ranks from {lowest} to "
                f"{highest}): every rank must see the same run directory; nothing was loaded"
            )
        if highest != lowest:
            raise CheckpointError(
                f"ranks disagree on the checkpoint step (this rank {step}, others from {lowest} to {highest}); "
                "nothing was written"
            )

    def wait(self, barrier: bool = True) -> None:
        """Finish the async save in flight, if any, and commit it (call before the next save / exit).
        barrier=False: rank 0 commits without waiting for the other ranks to see it (DCP's save returns on
        rank 0 once every rank has written: it writes the index last), for when they may not come."""
        if self._pending is None:
            return
        response, tmp, final, step, keep_last = self._pending
        self._pending = None
        future = getattr(response, "upload_completion", response)
        _dcp_call("async save", tmp, future.result)
        self._commit(tmp, final, step, keep_last, barrier)

    def _commit(self, tmp: Path, final: Path, step: int, keep_last: int | None, barrier: bool = True) -> None:
        """Rank 0 writes the manifest (every file's size and sha256) and renames the directory. Each rank
        hashes its own shards (one gather), unless the others may not come (barrier=False)."""
        hashed = self._hash_own_shards(tmp) if barrier else {}
        if self.env.is_main:
            files: dict[str, Any] = {}
            for f in sorted(tmp.iterdir()):
                if f.suffix in (".json", ".safetensors", ".distcp") or f.name == DCP_METADATA:
                    files[f.name] = hashed.get(f.name) or file_entry(f)
            commit = {
                "format_version": FORMAT_VERSION,
                "format": DCP_FORMAT,
                "step": step,
                "world_size": self.env.world_size,
                "files": files,
            }
            _write_file(tmp, MARKER, _json_bytes(commit, MARKER), {})
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(final.parent)
            _clean_up(final.parent, keep_last, final)  # what crashed saves left, then retention
        if barrier:
            self.env.barrier()  # every rank sees the committed directory before it goes on

    def _hash_own_shards(self, tmp: Path) -> dict[str, dict]:
        """{name: entry} of every rank's DCP shards (`__<rank>_*.distcp`, written by that rank), on rank 0;
        {} on the others and in one process (rank 0 hashes what is left itself)."""
        if self.group is None:
            return {}
        own = {f.name: file_entry(f) for f in sorted(tmp.glob(f"__{self.env.rank}_*.distcp"))}
        gathered: list[dict | None] | None = [None] * self.env.world_size if self.env.is_main else None
        dist.gather_object(own, gathered, dst=0, group=self.group)
        return {name: entry for part in gathered or [] for name, entry in (part or {}).items()}

    # ------------------------------------------------------------------ load
    def load(self, path: Path, model, optimizer, scheduler) -> dict[str, Any]:
        """Restore model, optimizer, scheduler, this rank's RNG and rank-local buffers; return the trainer
        state (loader position rescaled when the world size changed)."""
        path = Path(path)
        named = STEP_DIR.match(path.name)
        self._agree_on_step(int(named.group(1)) if named else -1, loading=True)  # before any rank reads
        if not is_dcp_checkpoint(path) and (path / "model.safetensors").is_file():  # the 1-process format
            check_resumable(path, self.env.world_size)
            # one process loads it as it was saved; this run's saves are DCP from now on
            return SafetensorsCheckpointer(self.env, self.seed).load(path, model, optimizer, scheduler)
        reader = _Reader(path, verify=True)
        if not is_dcp_checkpoint(path):
            raise CheckpointError(f"{path}: not a DCP checkpoint (no .metadata)")
        trainer = reader.pair("trainer")
        saved_world = int(trainer["world_size"])
        state, local, extra = self._state(model, optimizer)
        saved_extra = trainer["optim_extra"]  # checked, like everything read below, before DCP loads
        if set(saved_extra) != set(extra):
            diff = sorted(set(saved_extra) ^ set(extra))
            raise CheckpointError(
                f"{path}: optimizer parameter groups differ from the checkpoint's: {diff[:3]}"
            )
        saved_data_world = int(trainer.get("data_world_size", saved_world))
        own = self._rank_state(reader, saved_world, saved_world // saved_data_world, local)
        scheduler_state = match_groups(trainer["scheduler"], len(optimizer.param_groups), path)
        shards = self._as_shards(model, state)
        self._check_dcp_files(reader)
        index = SafeIndexReader(path)
        _dcp_call("load", path, dcp.load, shards, storage_reader=index, process_group=self.group)
        for part, table in shards.items():  # DCP may have replaced rather than filled a wrapped slice
            for key, t in table.items():
                if isinstance(t, DTensor) and not isinstance(state[part][key], DTensor):
                    state[part][key].copy_(t.to_local())
        model_state, optim_state = state["model"], {**state["optim"], **saved_extra}
        model_state.update(own["buffers"])
        _dcp_call("load", path, set_state_dict, model, optimizer, model_state_dict=model_state,
                  optim_state_dict=optim_state, options=OPTIONS)  # fmt: skip
        scheduler.load_state_dict(scheduler_state)
        same_tensor = saved_world // saved_data_world == self.env.world_size // self.env.data_world_size
        if own["rng"] is not None and same_tensor:
            restore_rng_state(own["rng"])
        else:  # a rank the saving run did not have, or new tensor-parallel groups: fresh per-data-rank streams
            torch.manual_seed(rank_seed(self.seed * 1_000_003 + int(trainer["step"]), self.env.data_rank))
        state = trainer["trainer_state"]
        if saved_data_world != self.env.data_world_size and "loader" in state:
            state["loader"] = rescale_loader_state(
                state["loader"], saved_data_world, self.env.data_world_size
            )
        return state

    def _check_dcp_files(self, reader: _Reader) -> None:
        """DCP's own files against the manifest (newer saves): every rank checks every size, and hashes its
        share of the files (each file once over the ranks, not once per rank); every rank then raises the
        same error, so none is left waiting in DCP's load."""
        names = [n for n in sorted(reader.files) if n == DCP_METADATA or n.endswith(".distcp")]
        problem = None
        try:
            for i, name in enumerate(names):
                reader.check(name, digest=i % self.env.world_size == self.env.rank)
        except CheckpointError as error:
            problem = str(error)
        if self.group is not None:
            problems = [None] * self.env.world_size
            dist.all_gather_object(problems, problem, group=self.group)
            problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            raise CheckpointError(problem)

    def _rank_state(
        self, reader: _Reader, saved_world: int, saved_tensor: int, local: dict[str, torch.Tensor]
    ) -> dict:
        """This rank's saved RNG and rank-local buffers (the MoE token counters). When the world size or
        the tensor-parallel degree changed, the global totals are kept: the ranks of the first
        tensor-parallel group (rank 0 alone without tensor parallelism) take the sum of all saved ranks'
        counters over the saved degree (the ranks of a group count the same tokens, and the totals
        divide by the degree: `global_routing_stats`), the others start from zero."""
        rank, tensor = self.env.rank, self.env.world_size // self.env.data_world_size
        if saved_world == self.env.world_size and saved_tensor == tensor:
            saved = reader.pair(rng_key(rank))
            return {"rng": saved["rng"], "buffers": _check_buffers(saved["buffers"], local, reader.path)}
        buffers = {k: torch.zeros_like(v) for k, v in local.items()}
        if self.env.data_rank == 0:
            for r in range(saved_world):
                for k, v in _check_buffers(reader.pair(rng_key(r))["buffers"], local, reader.path).items():
                    buffers[k] += v.to(buffers[k].device)
            for value in buffers.values():  # exact: each count is held saved_tensor times
                value.div_(saved_tensor, rounding_mode="floor")
        rng = reader.pair(rng_key(rank))["rng"] if rank < saved_world else None
        return {"rng": rng, "buffers": buffers}

    def close(self, alone: bool = False) -> None:
        """Finish the save in flight, then release the checkpoint group. alone=True after a failure: the
        other ranks may be stuck in a collective of the step that failed, so no barrier (which would
        hang until the timeout), and an error finishing the save is a warning, never in place of the
        failure's own."""
        if not alone:
            self.wait()
        else:
            pending = self._pending
            try:
                self.wait(barrier=False)
            except Exception as error:
                warnings.warn(
                    f"the checkpoint of step {pending[3]} being written when the run failed was not committed: "
                    f"{error}",
                    stacklevel=2,
                )
        if self.group is not None:
            dist.destroy_process_group(self.group)
        self.group = self._mesh = None


def _check_buffers(saved: dict, want: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    if set(saved) != set(want):
        diff = sorted(set(saved) ^ set(want))
        raise CheckpointError(f"{path}: rank-local buffers differ from the model's: {diff[:3]}")
    for k, v in saved.items():
        if v.shape != want[k].shape:
            raise CheckpointError(
                f"{path}: {k!r} has shape {tuple(v.shape)}, the model {tuple(want[k].shape)}"
            )
    return {k: v.to(want[k].device) for k, v in saved.items()}


def expert_slices(model: nn.Module) -> dict[str, int | None]:
    """Names of the expert weights that expert parallelism split over the ranks -> the dimension tensor
    parallelism split each by width (None: whole in a tensor-parallel group)."""
    return {
        f"{name}.experts.{pname}": WIDTH_DIM[pname] if getattr(layer.experts, "width_parts", 1) > 1 else None
        for name, layer in moe_layers(model)
        if isinstance(layer.dispatch, ExpertParallelDispatch)
        for pname, _ in layer.experts.named_parameters()
    }


def match_groups(scheduler_state: dict[str, Any], n_groups: int, path: Path) -> dict[str, Any]:
    """An LR scheduler's per-group lists for this optimizer's group count (plans can split groups into
    DTensor and plain parts): equal per-group values are repeated, different ones are an error."""
    out = dict(scheduler_state)
    for key, value in scheduler_state.items():
        if (
            key in ("base_lrs", "_last_lr", "lr_lambdas")
            and isinstance(value, list)
            and len(value) != n_groups
        ):
            if any(v != value[0] for v in value):
                raise CheckpointError(
                    f"{path}: scheduler {key} differs per group; cannot regroup {len(value)} -> {n_groups}"
                )
            out[key] = [value[0]] * n_groups
    return out


EXPORTED_FROM = "exported_from"  # trainer_state of an exported checkpoint: the saving run's rank counts


def saved_data_world_size(path: str | Path) -> int | None:
    """How many data-parallel ranks trained the checkpoint at `path`: a DCP checkpoint's, or the DCP one a
    single-process checkpoint was exported from (`export_single_process`); None for one saved by one
    process."""
    trainer = _Reader(Path(path), verify=False).pair("trainer")
    if not is_dcp_checkpoint(path):
        return (trainer.get("trainer_state") or {}).get(EXPORTED_FROM, {}).get("data_world_size")
    return int(trainer.get("data_world_size", trainer["world_size"]))


def rescale_loader_state(state: dict[str, int], saved_world: int, world: int) -> dict[str, int]:
    """Each rank counts its own batches; W ranks at index i have used W * i of the epoch's batches."""
    return {**state, "index_in_epoch": state["index_in_epoch"] * saved_world // world}


def check_resumable(path: Path, world_size: int) -> None:
    """CheckpointFormatError where `world_size` processes cannot resume the checkpoint `path`: a
    single-process (safetensors) one under torchrun."""
    if world_size > 1 and not is_dcp_checkpoint(path) and (path / "model.safetensors").is_file():
        raise CheckpointFormatError(
            f"{path} is a single-process (safetensors) checkpoint and {world_size} processes resume only "
            "DCP ones: resume it once in one process with --set parallel.checkpoint=dcp (its saves are then "
            "DCP), then under torchrun"
        )


def make_checkpointer(parallel: ParallelConfig, env: Local, seed: int, resume_from: Path | None = None):
    """The run's checkpointer. checkpoint="auto" saves the single-process format in one process, DCP under
    torchrun, and DCP in one process too when the run resumes from a DCP checkpoint (it had switched to
    the single-process format, which the run could then not take back to several processes)."""
    fmt = parallel.checkpoint
    if fmt == "auto":
        resumes_dcp = resume_from is not None and is_dcp_checkpoint(resume_from)
        fmt = "safetensors" if env.world_size == 1 and not resumes_dcp else DCP_FORMAT
    if fmt == "safetensors":
        if env.world_size > 1:
            raise CheckpointError("parallel.checkpoint='safetensors' is the single-process format; use 'dcp'")
        return SafetensorsCheckpointer(env, seed)
    return DCPCheckpointer(env, seed, parallel.async_save)


def load_dcp_weights(checkpoint: str | Path, model: nn.Module, train_cfg: TrainConfig) -> int:
    """Fill `model` (unsharded, one process) from a DCP checkpoint of any world size; return its step.
    For generation and evaluation: the optimizer the format needs is built and dropped, and this
    process's RNG state is left as it was."""
    path = Path(checkpoint)
    optimizer = make_optimizer(model, train_cfg.optim.replace(fused=False))
    scheduler = make_scheduler(optimizer, train_cfg.steps, train_cfg.optim)
    rng = capture_rng_state()
    try:
        DCPCheckpointer(Local(), train_cfg.seed).load(path, model, optimizer, scheduler)
    finally:
        restore_rng_state(rng)
    return int(_Reader(path, verify=False).pair("trainer")["step"])


def export_single_process(checkpoint: str | Path, out_run_dir: str | Path) -> Path:
    """Rewrite a DCP checkpoint (any world size) as a single-process safetensors checkpoint of the same
    step under `out_run_dir`, with model, optimizer, scheduler and trainer state. Run it in a process
    without a process group; it leaves the saved rank 0 RNG state in this process."""
    path = Path(checkpoint)
    reader = _Reader(path, verify=True)
    meta = reader.json("meta.json")["meta"]
    train_cfg = TrainConfig.from_dict(meta["train_config"])
    model = build_model(ModelConfig.from_dict(meta["model_config"]))
    optimizer = make_optimizer(model, train_cfg.optim)
    scheduler = make_scheduler(optimizer, train_cfg.steps, train_cfg.optim)
    state = DCPCheckpointer(Local(), train_cfg.seed).load(path, model, optimizer, scheduler)
    trainer = reader.pair("trainer")
    step = int(trainer["step"])
    rng = capture_rng_state()
    # the saving run's rank counts: a resume of the export says when its batch changes (batch_size is per rank)
    ranks = {"world_size": int(trainer["world_size"]), "data_world_size": saved_data_world_size(path)}
    return save_checkpoint(
        out_run_dir,
        step,
        model,
        optimizer,
        scheduler,
        tokens_seen=int(state.get("tokens_seen", 0)),
        trainer_state={**state, EXPORTED_FROM: ranks},
        rng_state=rng,
        meta=meta,
    )
