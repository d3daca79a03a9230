"""The training loop: cadence only (step, log, evaluate, save, resume). The task supplies data, loss and
evaluation; `train_step` does one optimizer step.

Run directory: config.json (the resolved TrainConfig), tokenizer.json, metrics.jsonl, tensorboard/,
loss.png, checkpoints/step_XXXXXXX/ (see tformer.train.checkpoint); its lock and what a fresh run may
replace: tformer.train.run_dir; what a resumed run may change: tformer.train.resume.

Under torchrun the same loop runs on every rank: tformer.distributed supplies the process group, the
parallel plan (DDP / FSDP2 / expert parallel), the step's collectives, the rank's share of the batches
and the checkpoint format; rank 0 alone writes files, logs and shows progress. In one process those
are null objects (docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from tformer.data.corpora import user_corpus
from tformer.distributed.checkpoint import CheckpointFormatError, check_resumable, make_checkpointer
from tformer.distributed.env import NullMetrics, init_distributed, resolve_device, train_loader
from tformer.distributed.parallelize import global_routing_stats, parallelize
from tformer.distributed.plans import make_plan
from tformer.model import build_model
from tformer.model.recompute import checkpoint_blocks
from tformer.schema import require_bool
from tformer.train.checkpoint import (
    CheckpointError,
    checkpoint_meta,
    latest_checkpoint,
    list_checkpoints,
    refuse_unfinished,
    save_failed,
    step_of,
    why_none_committed,
)
from tformer.train.config import TrainConfig, refuse_ignored_settings, unread_settings
from tformer.train.interrupt import SIGPIPE, GuardedStream, RaiseOnSignals, Stopped, StopRequests
from tformer.train.metrics import MetricsLog, peak_memory_mib, plot_loss_curve
from tformer.train.optim import lr_factor, make_optimizer, make_scheduler
from tformer.train.resume import (
    absolute_data_paths,
    check_resume_config,
    warn_compile_switch,
    warn_deterministic_switch,
    warn_precision_switch,
    warn_rank_count_change,
)
from tformer.train.run_dir import (
    RUN_TOKENIZERS,
    lock_run_dir,
    outermost_missing,
    read_data_manifest,
    refuse_foreign_files,
    refuse_run_dir_in_checkpoints,
    refuse_run_dir_in_data,
    refuse_run_dir_in_use,
    release_run_dir,
    remove_run_files,
    restore_run_data_manifest,
    restore_run_tokenizer,
    take_over,
    writing,
)
from tformer.train.step import (
    NonFiniteError,
    autocast_context,
    deterministic_kernels,
    resolve_dtype,
    train_step,
)

__all__ = ["TrainState", "Trainer", "resolve_device"]


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    nonfinite_in_a_row: int = 0
    best_eval: float = math.inf
    loss_mean: float = 0.0  # running mean (EMA) of the finite step losses, for the spike detector
    loss_steps: int = 0  # finite steps folded into loss_mean


def _duration(seconds: float) -> str:
    """12s, 3.4 min, 1.2 h."""
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


class Trainer:
    """Builds everything a run needs from a TrainConfig and a task, and runs the loop."""

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: str | Path,
        task,
        resume: bool = False,
        progress: bool | Literal["lines"] = True,
    ):
        """progress: True a progress bar, with evaluations, samples and loss spikes printed above it;
        "lines" the same as plain lines, plus a line per logged step (for logs and non-interactive
        runs); False nothing on stdout. Rank 0 alone shows anything."""
        if progress not in (True, False, "lines"):
            raise ValueError(f"progress must be True, False or 'lines', got {progress!r}")
        require_bool(resume=resume)
        if not isinstance(cfg, TrainConfig):
            raise TypeError(
                f"cfg must be a TrainConfig (e.g. get_train_preset('tiny-lm')), got {type(cfg).__name__}"
            )
        if isinstance(task, str):
            from tformer.tasks import make_task

            task = make_task(task)
        elif not callable(getattr(task, "setup", None)):
            raise TypeError(
                f"task must be a task name or tformer.tasks.make_task(name), got {type(task).__name__}"
            )
        self.env = init_distributed(cfg.parallel, cfg.device)
        cfg = absolute_data_paths(cfg)  # the run's config names its data from any working directory
        self.cfg, self.task = cfg, task
        self._lock, self._holds, self._handed_over, self._failed = None, False, False, False
        self.progress, self.lines = bool(progress) and self.env.is_main, progress == "lines"
        self._signals: StopRequests | None = None  # while fit runs
        self._out: GuardedStream | None = None
        # the checks every rank makes alike, before anything is written; under torchrun the ranks then agree,
        # so that an error is said once (and a rank that passed does not wait for one that failed)
        with self.env.checked_together():
            cfg, resume_from, meta = self._checked(cfg, task, run_dir, resume)
        created = outermost_missing(self.run_dir)
        self.env.barrier()  # every rank has looked before any makes it: rank 0 knows whether the run did
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock_run_dir(self.run_dir, self, exclusive=self.env.is_main)
        self._holds = True
        # a SIGTERM or hang-up in these (long) minutes cleans up as a Ctrl-C does; a repeat cannot cut it short
        with RaiseOnSignals():
            try:
                if self.env.is_main and resume_from is None:  # a fresh run trains its own vocabulary
                    for name in RUN_TOKENIZERS:
                        (self.run_dir / name).unlink(missing_ok=True)
                    # first: the files that follow belong to a run (refuse_foreign_files)
                    self._write_config(cfg)
                self._build(task, cfg, meta, resume_from)
                self._start(cfg, resume_from, meta)
            except BaseException:  # bad data or model settings, a missing package, a full disk, a Ctrl-C (or
                # SIGTERM, SIGHUP) before training starts: leave no directory behind (a resumed run's
                # directory existed: created is None)
                self._release_lock()
                if created is not None and self.env.is_main:  # the outermost directory this run made
                    shutil.rmtree(created, ignore_errors=True)
                elif resume_from is None and self.env.is_main:  # a directory the user made: this run's files
                    remove_run_files(self.run_dir)
                raise

    def _checked(
        self, cfg: TrainConfig, task, run_dir, resume: bool
    ) -> tuple[TrainConfig, Path | None, dict | None]:
        """The run directory, the checkpoint to resume and the settings, checked before anything is written;
        sets run_dir, device and cfg; returns the config (its dtype decided), the checkpoint and its meta."""
        if not isinstance(run_dir, (str, os.PathLike)):
            raise TypeError(f"run_dir must be a path, got {type(run_dir).__name__}")
        self.run_dir = Path(run_dir)
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise FileExistsError(f"the run directory {self.run_dir} is a file; choose another --out")
        refuse_run_dir_in_checkpoints(self.run_dir)
        if self.env.is_main:  # (rank 0 holds the lock)
            refuse_run_dir_in_use(self.run_dir)
        serves = getattr(task, "run_dir", None)  # a task holds one run's data and tokenizer
        if serves is not None and Path(serves).resolve() != self.run_dir.resolve():
            raise ValueError(
                f"this task object holds the data and tokenizer of the run in {serves}; give each run its "
                f"own (task={cfg.task!r}, or make_task({cfg.task!r})): sharing one, that run would go on "
                "with this run's vocabulary and data"
            )
        self.device = self.env.device(cfg.device)
        torch.manual_seed(cfg.seed)
        take_over(self.run_dir)  # a Trainer in this process on the directory commits its saves first
        resume_from = latest_checkpoint(self.run_dir) if resume else None
        if resume and resume_from is None:
            raise FileNotFoundError(
                f"--resume: {self.run_dir} holds no committed checkpoint ({why_none_committed(self.run_dir)})"
            )
        if not resume and (self.run_dir / "checkpoints").exists() and latest_checkpoint(self.run_dir):
            raise ValueError(
                f"{self.run_dir} already holds checkpoints; pass --resume or choose another --out"
            )
        meta = None
        if resume_from is not None:  # checked before the task reads data or writes anything
            try:
                meta = checkpoint_meta(resume_from)
            except CheckpointError as e:
                raise self._name_the_previous(resume_from, e) from None
            if cfg.dtype == "auto":  # what the run recorded when it started, on whatever machine
                recorded = (meta.get("train_config") or {}).get("dtype")
                cfg = cfg.replace(dtype=recorded if recorded in ("float32", "bfloat16") else "auto")
            check_resume_config(cfg, meta, resume_from, model=False)
            check_resumable(resume_from, self.env.world_size)
            if self.env.is_main:
                warn_compile_switch(cfg, meta)
                warn_deterministic_switch(cfg, meta, self.device.type)
                warn_precision_switch(cfg, meta)
            at = step_of(resume_from)
            if cfg.steps < at:
                raise ValueError(
                    f"--resume: the run is at step {at} ({resume_from.name}); steps={cfg.steps} would end "
                    f"before it. Pass steps >= {at}, or start a new run with another --out"
                )
        refuse_unfinished(self.run_dir, resume_from)
        if cfg.dtype == "auto":  # decided once; config.json records the choice
            cfg = cfg.replace(dtype=resolve_dtype(cfg.dtype, self.device))
        self.cfg = cfg
        if resume_from is None:
            refuse_ignored_settings(cfg)
            if self.env.is_main:
                for setting in unread_settings(cfg):
                    warnings.warn(f"{setting} is not used by this run", UserWarning, stacklevel=4)
            refuse_foreign_files(self.run_dir)
            user = user_corpus(cfg.data.corpus)
            # (an installed corpus's folder under data.path is read by its own layout, not scanned)
            refuse_run_dir_in_data(self.run_dir, [user[1]] if user else [])
        return cfg, resume_from, meta

    def _start(self, cfg: TrainConfig, resume_from: Path | None, meta: dict | None) -> None:
        """Metrics, the compiled forward, then the checkpoint's state (or a clean log) and config.json."""
        self.state = TrainState()
        self._saved: tuple[int, Path] | None = None
        self.metrics = MetricsLog(self.run_dir) if self.env.is_main else NullMetrics()
        self.forward_model = torch.compile(self.parallel.model) if cfg.compile else self.parallel.model
        self.autocast = autocast_context(self.device, cfg.dtype)
        optim = cfg.optim
        steps_left = resume_from is None or step_of(resume_from) < cfg.steps  # else the schedule has run
        if optim.warmup_steps >= cfg.steps and self.env.is_main and steps_left:
            end = lr_factor(cfg.steps - 1, cfg.steps, optim)  # the warm-up takes every step
            if end < 1:  # (at any schedule: a rate far below lr may otherwise pass for a floor)
                nor = "" if optim.schedule == "constant" else " nor decays"
                warnings.warn(
                    f"optim.warmup_steps {optim.warmup_steps} > steps {cfg.steps}: the {optim.schedule} "
                    f"schedule never reaches optim.lr{nor} (the last step runs at {end:.3g} x optim.lr)",
                    stacklevel=2,
                )
            elif optim.schedule != "constant" and end > optim.min_lr_ratio:
                warnings.warn(
                    f"optim.warmup_steps {optim.warmup_steps} >= steps {cfg.steps}: the {optim.schedule} "
                    f"schedule never decays (the last step runs at {end:.3g} x optim.lr, not at "
                    f"min_lr_ratio {optim.min_lr_ratio:g})",
                    stacklevel=2,
                )
        if resume_from is not None:
            self._restore(resume_from)
            self._relay_schedule(meta)
        else:
            self.metrics.truncate_after(-1)  # records a crashed run left without a checkpoint: redone now
        if self.env.is_main:  # resolved (vocabulary, classes); a resumed run may have changed its cadence
            self._write_config(cfg.replace(model=self.model_cfg))

    def _write_config(self, cfg: TrainConfig) -> None:
        tmp = self.run_dir / "config.json.tmp"
        with writing(tmp):
            tmp.write_text(json.dumps(cfg.to_dict(), indent=2))
        tmp.replace(self.run_dir / "config.json")

    def _build(self, task, cfg: TrainConfig, meta: dict | None, resume_from: Path | None) -> None:
        """Data, tokenizer, model, parallel layout, optimizer, schedule and loader of the run."""
        with self.env.main_first():  # rank 0 trains and saves the tokenizer, the others read it
            if meta is not None and self.env.is_main:
                restore_run_tokenizer(self.run_dir, meta, resume_from)
                restore_run_data_manifest(self.run_dir, meta, resume_from)
            task.setup(cfg, self.run_dir, self.device, resume=meta is not None)
        # the run's data.json (its data when it started), kept in every checkpoint so that a resume can
        # still check its data after data.json is lost (restore_run_data_manifest)
        self._data_manifest = read_data_manifest(self.run_dir)
        self.model_cfg = task.model_config(cfg)
        if meta is not None:
            check_resume_config(cfg.replace(model=self.model_cfg), meta, resume_from, model=True)
        self.model: nn.Module = build_model(self.model_cfg).to(self.device)
        if cfg.activation_checkpointing != "none":  # before data parallelism wraps or shards the blocks
            checkpoint_blocks(self.model, cfg.activation_checkpointing)
        plan = make_plan(cfg.parallel, self.env.world_size)  # DDP / FSDP2 / expert parallel, or nothing
        self.parallel = parallelize(self.model, plan, self.env, self.device)
        self.env.seed_rank(cfg.seed)
        self.optimizer = self.parallel.adapt_optimizer(make_optimizer(self.model, cfg.optim))
        self.scheduler = make_scheduler(self.optimizer, cfg.steps, cfg.optim)
        self.loader = train_loader(task, cfg, self.env)
        self.checkpointer = make_checkpointer(cfg.parallel, self.env, cfg.seed, resume_from)
        if (
            cfg.parallel.async_save
            and not getattr(self.checkpointer, "async_save", False)
            and self.env.is_main
        ):
            warnings.warn(
                "parallel.async_save=True: this run saves single-process (safetensors) checkpoints, written "
                "when the step ends; async saves are DCP's (parallel.checkpoint=dcp, torchrun, or a resumed "
                "DCP run)",
                UserWarning,
                stacklevel=3,
            )

    def _hand_over(self) -> None:
        """A newer Trainer in this process takes the run directory over (tformer.train.run_dir): finish the
        saves in flight and write nothing more there. Every rank's Trainer is told, each in its process;
        the save is committed without a barrier (rank 0 commits what every rank has written)."""
        if not self._handed_over and getattr(self, "checkpointer", None) is not None:
            self.checkpointer.wait(barrier=False)
        self._lock, self._holds, self._handed_over = None, False, True

    def _check_open(self) -> None:
        if self.model is None:
            raise RuntimeError("this Trainer is closed; a new Trainer(..., resume=True) continues the run")
        if self._handed_over:
            raise RuntimeError(
                f"a newer Trainer in this process took the run directory {self.run_dir} over; use that one"
            )

    def _release_lock(self) -> None:
        if self._holds:
            release_run_dir(self.run_dir, self)
            self._lock, self._holds = None, False

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        """Checkpoint the current step (once: a second call at the same step returns the first)."""
        self._check_open()
        s = self.state
        if self._saved is not None and self._saved[0] == s.step:
            return self._saved[1]
        try:
            path = self.checkpointer.save(
                self.run_dir,
                s.step,
                self.model,
                self.optimizer,
                self.scheduler,
                trainer_state={**asdict(s), "loader": self.loader.state_dict()},
                meta={
                    "train_config": self.cfg.replace(model=self.model_cfg).to_dict(),
                    "model_config": self.model_cfg.to_dict(),
                    "task": self.cfg.task,
                    "tokenizer": self.task.tokenizer_json(),
                    **({"src_tokenizer": src} if (src := self._src_tokenizer_json()) is not None else {}),
                    **({"data_manifest": self._data_manifest} if self._data_manifest is not None else {}),
                },
                keep_last=self.cfg.keep_last,
            )
        except (OSError, CheckpointError) as e:  # a full disk, a file-size limit: say which save failed and
            # what is kept
            raise save_failed(e, self.run_dir, s.step) from e
        self._saved = (s.step, path)
        return path

    def _src_tokenizer_json(self) -> str | None:
        """A task's separate source vocabulary (translation with data.tokenizer=separate), else None."""
        read = getattr(self.task, "src_tokenizer_json", None)
        return None if read is None else read()

    def _restore(self, path: Path) -> None:
        try:
            t = self.checkpointer.load(path, self.model, self.optimizer, self.scheduler)  # + this rank's RNG
        except CheckpointFormatError:
            raise
        except CheckpointError as e:
            raise self._name_the_previous(path, e) from None
        if self.env.is_main:
            warn_rank_count_change(path, self.env.data_world_size)
        # fields a checkpoint predates (e.g. the spike detector's) keep their defaults
        try:  # the files' sizes and hashes were checked: what fails here was written by hand
            self.state = TrainState(**{f.name: t[f.name] for f in fields(TrainState) if f.name in t})
            self.loader.load_state_dict(t["loader"])
        except (KeyError, TypeError, ValueError) as e:
            error = CheckpointError(f"{path / 'trainer.json'}: the trainer state does not restore ({e})")
            raise self._name_the_previous(path, error) from None
        self.metrics.truncate_after(self.state.step)
        self._saved = (self.state.step, path)  # resuming a finished run must not save its step again

    def _relay_schedule(self, meta: dict | None) -> None:
        """A resume with another `steps` lays the schedule over the new length from the next step on
        (the optimizer's restored rate was the old schedule's), and says where the rate moves."""
        saved = ((meta or {}).get("train_config") or {}).get("steps")
        sched, optim = self.scheduler, self.cfg.optim
        if not isinstance(saved, int) or saved == self.cfg.steps or sched.last_epoch >= self.cfg.steps:
            return
        before = self.optimizer.param_groups[0]["lr"]
        for group, base, factor in zip(self.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * factor(sched.last_epoch)
        sched._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        after = self.optimizer.param_groups[0]["lr"]
        if optim.schedule != "constant" and self.env.is_main:
            warnings.warn(
                f"steps {saved} -> {self.cfg.steps}: the {optim.schedule} schedule now spans "
                f"{self.cfg.steps} steps, so step {sched.last_epoch + 1} runs at lr {after:.3g} "
                f"(the old schedule's {before:.3g})",
                stacklevel=2,
            )

    def _name_the_previous(self, path: Path, error: CheckpointError) -> CheckpointError:
        """A damaged newest checkpoint is an error (never a silent step back); it names the one before."""
        earlier = [p for p in list_checkpoints(self.run_dir) if p != path]
        if not earlier:
            return error
        return CheckpointError(
            f"{error}; the run's previous checkpoint is {earlier[-1]}: move {path.name} out of {path.parent} "
            "to resume from it"
        )

    def close(self) -> None:
        """Finish background saves, release model, optimizer and mesh, then leave the process group. After
        a fit that raised, the save in flight is finished without waiting for the other ranks."""
        self.checkpointer.close(alone=self._failed)
        self._release_lock()
        self.parallel.release()
        self.model = self.forward_model = self.optimizer = self.scheduler = None
        self.env.shutdown()

    # ------------------------------------------------------------------ loop
    def evaluate(self) -> dict[str, float]:
        """The task's evaluation of the model now (cfg.eval_batches batches of the validation split); the
        model's mode is left as it was."""
        self._check_open()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.autocast:
                return self.task.evaluate(self.model, self.cfg.eval_batches)
        finally:
            self.model.train(was_training)

    def fit(self, until: int | None = None) -> dict[str, Any]:
        """Train to cfg.steps (or stop after step `until`, leaving a checkpoint, as an interruption would).
        Ctrl-C, SIGTERM, a hang-up or lost output stops after the step in flight, with a checkpoint
        (tformer.train.interrupt)."""
        self._check_open()
        if until is not None and (isinstance(until, bool) or not isinstance(until, int) or until < 1):
            raise ValueError(f"until must be a step number >= 1 (or None), got {until!r}")
        s = self.state
        stop = self.cfg.steps if until is None else min(until, self.cfg.steps)
        self.model.train()
        bar = self._progress_bar()
        t0, tok0, step0 = time.perf_counter(), s.tokens_seen, s.step
        self._off_clock = 0.0  # seconds since t0 spent evaluating, sampling and saving (not training)
        self._failed = True  # until fit returns: close() then waits for no other rank
        try:
            with (
                StopRequests(announce=self.env.is_main) as signals,
                deterministic_kernels(self.cfg.deterministic),
            ):
                self._signals = signals  # lost output asks it to stop (`_output_lost`)
                with self._off_the_clock():
                    self._evaluate_the_step_resumed_at(bar)
                while s.step < stop:
                    self._one_step(bar, t0, tok0, step0)
                    signum = signals.agreed(self.parallel.comm)
                    if signum is not None and s.step < stop:  # at the last step: just finish
                        path = self.save()
                        self.checkpointer.wait()
                        raise Stopped(
                            signum, f"stopped at step {s.step}: checkpoint {path}; continue with --resume"
                        )
        except KeyboardInterrupt as e:
            if bar is not None:
                bar.close()
            if not self.env.is_main:
                raise
            if isinstance(e, Stopped):
                with contextlib.suppress(OSError):  # after a hang-up the terminal is gone: the plot is not
                    print(f"\n{e}", file=sys.stderr)
                self._plot_so_far()
            else:  # a second Ctrl-C, maybe mid-step: a checkpoint of this moment could not resume exactly
                where = self._last_checkpoint_words()
                print(f"\nstopped without saving (at step {s.step}); {where}", file=sys.stderr)
            raise
        except NonFiniteError:
            if self.env.is_main:
                self._plot_so_far()
            raise
        finally:
            self._signals = None
            if bar is not None:
                bar.close()
        self.save()
        self.checkpointer.wait()
        if self.env.is_main:
            self._plot_loss()
        self.metrics.close()
        self._failed = False
        report = self.final_report()
        if self.env.is_main:  # written through a temporary file: a reader never sees half of it
            tmp = self.run_dir / "report.json.tmp"
            tmp.write_text(json.dumps(report, indent=2))
            os.replace(tmp, self.run_dir / "report.json")
        return report

    def _plot_loss(self) -> None:
        plot_loss_curve(self.run_dir, unit=getattr(self.task, "loss_unit", "nats / token"))

    def _plot_so_far(self) -> None:
        """loss.png of a run that stops early (Ctrl-C, SIGTERM, the non-finite guard): the steps so far."""
        try:  # metrics.jsonl is written line by line: it holds every step so far
            self._plot_loss()
        except Exception as error:  # never in place of the reason the run stopped
            warnings.warn(f"loss.png not drawn: {error}", stacklevel=2)

    def _evaluate_the_step_resumed_at(self, bar) -> None:
        """A run resumed at an evaluation step (or at its last step) whose evaluation is not in the log (it
        failed after its step was saved, or the run was killed between the two) makes it now, where the run
        would have made it; rank 0 reads the log, every rank evaluates (a collective)."""
        s, cfg = self.state, self.cfg
        if s.step == 0 or (s.step % cfg.eval_every and s.step != cfg.steps):
            return
        unevaluated = self.env.is_main and self._last_eval_step() != s.step
        if self.parallel.comm.ranks_where(unevaluated):
            self._log_eval(bar)

    def _one_step(self, bar, t0: float, tok0: int, step0: int) -> None:
        """One optimizer step and its cadence: log, progress bar, evaluation, checkpoint."""
        cfg, s = self.cfg, self.state
        micro = [self.loader.next_batch(self.device) for _ in range(cfg.grad_accum)]
        result = train_step(
            self.forward_model,
            self.task.loss,
            micro,
            self.task.count_targets,
            self.optimizer,
            self.scheduler,
            cfg.optim.grad_clip,
            self.autocast,
            self.parallel.comm,
        )
        s.step += 1
        s.tokens_seen += int(self.parallel.comm.sum(sum(self.task.count_inputs(b) for b in micro)))
        self._guard(result)
        self._watch_spikes(result, bar)
        rate = (s.tokens_seen - tok0) / max(1e-9, time.perf_counter() - t0 - self._off_clock)
        if s.step % cfg.log_every == 0 or s.step == cfg.steps:
            self._log_train(result, rate)
            if self.lines and self.progress:
                eta = (cfg.steps - s.step) * (time.perf_counter() - t0) / max(1, s.step - step0)
                self._say(
                    f"step {s.step}/{cfg.steps}: loss {result.loss:.4f}, lr {result.lr:.2e}, "
                    f"{rate:,.0f} tok/s, ETA {_duration(eta)}"
                )
        if bar is not None:  # the step's numbers, then one redraw (update first had redrawn the last step's)
            bar.set_postfix(
                loss=f"{result.loss:.3f}", lr=f"{result.lr:.2e}", tok_s=f"{rate:,.0f}", refresh=False
            )
            bar.update(1)
        with self._off_the_clock():
            if s.step % cfg.eval_every == 0 or s.step == cfg.steps:
                self._log_eval_or_keep_the_step(bar)
            if cfg.sample_every and s.step % cfg.sample_every == 0 and self.env.world_size == 1:
                self._log_sample(bar)
            if s.step % cfg.save_every == 0:
                self.save()

    @contextlib.contextmanager
    def _off_the_clock(self):
        """Time that tokens/s leaves out (evaluations, samples, checkpoints); the ETA keeps it, as they
        recur until the end."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._off_clock += time.perf_counter() - start

    def _guard(self, result) -> None:
        s = self.state
        if result.skipped:
            s.skipped_steps += 1
            s.nonfinite_in_a_row += 1
            self.metrics.write(
                {
                    "kind": "skip",
                    "step": s.step,
                    "loss": result.loss,
                    "grad_norm": result.grad_norm,
                    "nonfinite_ranks": list(result.nonfinite_ranks),
                }
            )
            if s.nonfinite_in_a_row >= self.cfg.max_nonfinite:
                raise NonFiniteError(
                    nonfinite_stop(s.step, s.nonfinite_in_a_row, self.env.world_size, result)
                    + f" Lower the learning rate or check the data; {self._last_checkpoint_words()}."
                )
        else:
            s.nonfinite_in_a_row = 0

    def _last_checkpoint_words(self) -> str:
        last = latest_checkpoint(self.run_dir)
        return f"the last checkpoint, {last}, is intact" if last else "no checkpoint was written"

    SPIKE_WARMUP = 20  # finite steps before the running mean is trusted
    SPIKE_DECAY = 0.95  # EMA decay: the mean follows the last ~20 steps

    def _watch_spikes(self, result, bar) -> None:
        """A step whose loss exceeds cfg.spike_factor x the running mean of the previous steps' losses is
        logged as a "spike" record (and shown above the progress bar); training goes on."""
        s, factor = self.state, self.cfg.spike_factor
        if result.skipped:
            return
        if (
            factor > 0
            and s.loss_steps >= self.SPIKE_WARMUP
            and s.loss_mean > 0
            and result.loss > factor * s.loss_mean
        ):
            record = {"kind": "spike", "step": s.step, "loss": result.loss, "running_mean": s.loss_mean}
            self.metrics.write(record | {"factor": factor})
            self._say(
                f"step {s.step}: loss {result.loss:.4g} is {result.loss / s.loss_mean:.1f}x the running "
                f"mean {s.loss_mean:.4g} (spike_factor {factor})",
                bar,
            )
        d = self.SPIKE_DECAY if s.loss_steps else 0.0
        s.loss_mean = d * s.loss_mean + (1 - d) * result.loss
        s.loss_steps += 1

    def _log_train(self, result, rate: float) -> None:
        record = {
            "kind": "train",
            "step": self.state.step,
            "loss": result.loss,
            "aux_loss": result.aux_loss,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "tokens_per_s": rate,
            "tokens_seen": self.state.tokens_seen,
            "skipped_steps": self.state.skipped_steps,
            "peak_memory_mib": peak_memory_mib(self.device),
        }
        stats = global_routing_stats(self.model, self.env)
        if stats:
            record["moe"] = stats
        self.metrics.write(record)

    def _log_eval_or_keep_the_step(self, bar=None) -> None:
        """The evaluation of a step that has finished; where it raises (a model whose outputs went NaN, a
        decoding error), the step is saved first, so the steps since the last checkpoint are not lost (one
        process: under torchrun a save is a collective, which the other ranks may not reach)."""
        try:
            self._log_eval(bar)
        except Exception:
            if self.env.world_size == 1 and self.env.is_main:
                try:
                    path = self.save()
                    self.checkpointer.wait()
                except Exception as error:  # noqa: BLE001 (the evaluation's error is the one raised)
                    kept = f"saving the step failed too ({error})"
                else:
                    kept = f"the step itself is saved: {path}"
                warnings.warn(
                    f"the evaluation at step {self.state.step} failed (below); {kept}", stacklevel=2
                )
            raise

    def _log_eval(self, bar=None) -> None:
        result = self.evaluate()
        self.state.best_eval = min(self.state.best_eval, result["eval_loss"])
        self.metrics.write({"kind": "eval", "step": self.state.step, **result})
        shown = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v:.4g}" for k, v in result.items())
        # above the bar (printed past it, a stale copy of the bar had stayed above each evaluation)
        off_the_bar = "" if self.lines or bar is not None else "\n"
        self._say(f"{off_the_bar}step {self.state.step}: {shown}", bar)

    def sample(self) -> str:
        """The task's sample of what the model does now (`sample_tokens` new tokens for a language model;
        its own seeded generator: the training RNG streams are untouched, so an exact resume stays exact)."""
        self._check_open()
        was_training = self.model.training
        self.model.eval()
        try:
            kwargs = {"max_new_tokens": self.cfg.sample_tokens} if self.cfg.task == "lm" else {}
            return self.task.show_sample(self.model, **kwargs)
        finally:
            self.model.train(was_training)

    def _log_sample(self, bar) -> None:
        text = self.sample()
        self.metrics.write({"kind": "sample", "step": self.state.step, "text": text})
        self._say(f"step {self.state.step}:\n{text}", bar)

    def _say(self, text: str, bar=None) -> None:
        """A line for the user (rank 0, progress on): above the progress bar, or plain; to stdout, which a
        closed pipe or terminal turns into a stop with a checkpoint (`_output_lost`)."""
        if self.progress and bar is not None:
            bar.write(text, file=self._stdout)
        elif self.progress:
            print(text, file=self._stdout, flush=True)

    @property
    def _stdout(self) -> GuardedStream:
        """sys.stdout (the one in place now), guarded: a failed write stops the run (`_output_lost`)."""
        if self._out is None or self._out.stream is not sys.stdout:
            self._out = GuardedStream(sys.stdout, self._output_lost)
        return self._out

    def _output_lost(self) -> None:
        """stdout or stderr can no longer be written (its reader went away): stop after this step with a
        checkpoint, as on a signal (outside `fit`, nothing to stop)."""
        if self._signals is not None:
            self._signals.request(SIGPIPE)

    def _progress_bar(self):
        if not self.progress or self.lines:
            return None
        from tqdm.auto import tqdm

        return tqdm(
            total=self.cfg.steps,
            initial=self.state.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=GuardedStream(sys.stderr, self._output_lost),
        )

    def _evals(self) -> list[dict[str, Any]]:
        """The evaluation records of the run's metrics.jsonl (rank 0, which writes it; [] elsewhere)."""
        return [r for r in _read(self.run_dir) if r.get("kind") == "eval"] if self.env.is_main else []

    def _last_eval_step(self) -> int | None:
        evals = self._evals()
        return evals[-1]["step"] if evals else None

    def final_report(self) -> dict[str, Any]:
        """The run's step and counters, and its latest evaluation (made at `eval_step`)."""
        evals = self._evals()
        latest = {k: v for k, v in evals[-1].items() if k not in ("kind", "step")} if evals else {}
        return {
            "step": self.state.step,
            "tokens_seen": self.state.tokens_seen,
            "skipped_steps": self.state.skipped_steps,
            "peak_memory_mib": peak_memory_mib(self.device),
            **({"eval_step": evals[-1]["step"]} if evals else {}),
            **latest,
        }


def nonfinite_stop(step: int, in_a_row: int, world_size: int, result: Any) -> str:
    """Why a run stops on non-finite steps: the step, how many in a row, and under torchrun the ranks whose
    loss was not finite (a non-finite gradient behind finite losses is found after backward summed the
    gradients over the ranks, so no rank can be named)."""
    where = ""
    if world_size > 1 and result.nonfinite_ranks:
        where = f" (non-finite loss on rank {', '.join(map(str, result.nonfinite_ranks))})"
    elif world_size > 1:
        where = " (every rank's loss was finite; the gradients were summed over ranks, so no rank is named)"
    return (
        f"step {step}: {in_a_row} consecutive steps with a non-finite loss or gradient norm{where} "
        f"(loss {result.loss}, grad norm {result.grad_norm}); stopping."
    )


def _read(run_dir: Path) -> list[dict]:
    from tformer.train.metrics import read_metrics

    return read_metrics(run_dir)
