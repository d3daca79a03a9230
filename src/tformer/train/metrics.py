"""Where a run's numbers go: JSON lines, TensorBoard event files, and a loss-curve PNG."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tformer.json_files import read_json_lines

TENSORBOARD_DIR = "tensorboard"  # a run directory's folder of TensorBoard event files


class MetricsLog:
    """Appends one JSON object per record to run_dir/metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.tb_dir, self.tb = run_dir / TENSORBOARD_DIR, None
        self.use_tb = tensorboard

    def _writer(self, purge_step: int | None = None):
        if self.tb is None and self.use_tb:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_writer_threads()
            with self._named():
                self.tb = self._last_writer(SummaryWriter, purge_step)
        return self.tb

    def _last_writer(self, make, purge_step: int | None):
        """A TensorBoard writer whose event file sorts after those already in the folder. TensorBoard reads
        a folder's files in name order, and a resume's purge (`truncate_after`) hides only the events read
        before it. A name holds the second, the process id and a count of the process's writers without
        padding, so a writer opened in the same process and second as an earlier one can sort first (its
        count 10 before 9): its file is then removed and the writer opened again in the next second, once.
        Files that still sort after it (from a machine whose clock ran ahead) are warned of."""
        before = set(self._event_files())
        tb = make(log_dir=str(self.tb_dir), purge_step=purge_step)
        if self._sorts_last(before):
            return tb
        tb.close()
        for name in set(self._event_files()) - before:
            (self.tb_dir / name).unlink(missing_ok=True)
        time.sleep(1.0 - time.time() % 1.0 + 0.01)
        tb = make(log_dir=str(self.tb_dir), purge_step=purge_step)
        if not self._sorts_last(before):
            warnings.warn(
                f"{self.tb_dir}: an earlier event file sorts after this run's (a clock ahead of this "
                "machine's?); TensorBoard may show the steps this run writes again twice",
                stacklevel=3,
            )
        return tb

    def _sorts_last(self, before: set[str]) -> bool:
        """Whether the files added to the folder since `before` sort after every file in it."""
        new = set(self._event_files()) - before
        return all(n > old for n in new for old in before)

    def _event_files(self) -> list[str]:
        return [p.name for p in self.tb_dir.glob("events.out.tfevents.*")] if self.tb_dir.is_dir() else []

    @contextlib.contextmanager
    def _named(self):
        """An OSError of TensorBoard's writer (a full disk) names the run's tensorboard folder (its own
        message names no file)."""
        try:
            yield
        except OSError as e:
            if e.filename is not None:
                raise
            raise OSError(e.errno, e.strerror or str(e), str(self.tb_dir)) from e

    def write(self, record: dict[str, Any]) -> None:
        from tformer.train.run_dir import writing

        with writing(self.path), self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        tb = self._writer()
        if tb is not None and "step" in record:
            kind = record.get("kind")  # skip / spike records get tags of their own, off the loss curve
            prefix = "" if kind in ("train", "eval", None) else f"{kind}/"
            with self._named():
                for key, value in _scalars(record):
                    if key != "step" and math.isfinite(value):
                        tb.add_scalar(prefix + key, value, record["step"])

    def truncate_after(self, step: int) -> None:
        """Before the first record of a run: drop the records of steps after `step`, which will be written
        again (a resume from `step`; -1 for a fresh start in a directory a crashed run left), and hide
        the TensorBoard events after it. A line a killed process left half-written is dropped too."""
        if self.use_tb:
            self.close()
            self._writer(purge_step=step + 1)
        if not self.path.exists():
            return
        kept = [r for r in read_json_lines(self.path, is_record) if r["step"] <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)

    def close(self) -> None:
        if self.tb is not None:
            tb, self.tb = self.tb, None
            with self._named():
                tb.close()


def _quiet_writer_threads() -> None:
    """TensorBoard writes events from a thread of its own; an OSError there (a full disk) is printed by
    threading.excepthook as that thread's traceback and raised again by the writer's next call in the
    training thread, which names it (MetricsLog._named). The hook skips the printed copy; every other
    thread's exception is printed as before. Installed once per process."""
    global _HOOKED
    if _HOOKED:
        return
    previous = threading.excepthook

    def hook(args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    threading.excepthook = hook
    _HOOKED = True


_HOOKED = False


def is_record(record: dict[str, Any]) -> bool:
    """A record MetricsLog writes: a kind and an integer step (a line edited into anything else is not)."""
    step = record.get("step")
    return isinstance(record.get("kind"), str) and isinstance(step, int) and not isinstance(step, bool)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's records; a line a killed process left half-written, or one that is not a record, is
    skipped."""
    return read_json_lines(Path(run_dir) / "metrics.jsonl", is_record)


def _scalars(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, number) of a record's numbers, nested dicts as tag paths: the MoE routing statistics as
    moe/<layer>/max_vio, ... (they had been left out of TensorBoard); lists (per-expert loads) are not."""
    for key, value in record.items():
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}/")
        elif _number(value):
            yield prefix + key, value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot_loss_curve(run_dir: Path, title: str = "", unit: str = "nats / token") -> Path:
    """run_dir/loss.png: training loss per step and evaluation loss at each evaluation; `unit` labels the
    loss axis (the task's `loss_unit`: a classifier's loss is per text, not per token)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train" and _number(r.get("loss"))]
    evals = [
        (r["step"], r["eval_loss"]) for r in records if r["kind"] == "eval" and _number(r.get("eval_loss"))
    ]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel(f"cross-entropy ({unit})")
    ax.set_title(title or run_dir.name)
    ax.grid(alpha=0.3)
    if train or evals:
        ax.legend()
    else:  # every step so far was skipped (non-finite), or none ran
        ax.text(0.5, 0.5, "no loss recorded", transform=ax.transAxes, ha="center", va="center")
    out = run_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def peak_memory_mib(device) -> float:
    """The most memory the run has held so far, in MiB: on a GPU the peak of the tensors torch allocated
    there (`torch.cuda.max_memory_allocated`), on the CPU the process's peak resident set (the model,
    optimizer, activations, data and Python together; whatever the process held before the run too)."""
    if device.type == "cuda":
        import torch

        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux (bytes on macOS)
    return round(kib / (2**20 if sys.platform == "darwin" else 2**10), 1)
