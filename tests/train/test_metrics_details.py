"""metrics.jsonl, the TensorBoard mirror and loss.png (tformer/train/metrics.py), without a training run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tformer.train.metrics import MetricsLog, plot_loss_curve, read_metrics


def scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for the run: tag -> [(step, value)], purged events left out."""
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_mirrors_the_finite_numbers_at_their_steps_and_tags_skips_apart(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path)
    records = [
        {"kind": "train", "step": 1, "loss": 2.5, "lr": 0.01},
        {"kind": "skip", "step": 2, "loss": math.nan, "grad_norm": 7.0},
        {"kind": "train", "step": 3, "loss": 2.0, "lr": 0.02},
        {"kind": "eval", "step": 3, "eval_loss": 2.25},
        {"kind": "spike", "step": 4, "loss": 9.0, "running_mean": 2.0},
        {"kind": "train", "step": 5, "loss": math.inf, "lr": 0.03},
    ]
    for r in records:
        log.write(r)
    log.close()
    got = scalars(tmp_path / "tensorboard")
    want: dict[str, list[tuple[int, float]]] = {}
    for r in records:  # the reference: train / eval on the plain tags, other kinds under "kind/", no step
        prefix = "" if r["kind"] in ("train", "eval") else r["kind"] + "/"
        for key, value in r.items():
            if key not in ("kind", "step") and math.isfinite(value):
                want.setdefault(prefix + key, []).append((r["step"], pytest.approx(value)))
    assert got == want
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        r["step"] for r in records
    ]  # every record kept in the JSON lines, in order, non-finite values included


def test_tensorboard_shows_the_moe_routing_statistics_by_layer(tmp_path: Path) -> None:
    """A train record's nested `moe` statistics (they had been left out): numbers as moe/<layer>/<name>,
    the per-expert lists not."""
    log = MetricsLog(tmp_path)
    moe = {"blocks.1.ffn": {"max_vio": 0.5, "dropped": 3, "load": [0.25, 0.75], "dead_experts": [2]}}
    log.write({"kind": "train", "step": 1, "loss": 2.5, "moe": moe})
    log.close()
    got = scalars(tmp_path / "tensorboard")
    assert got["moe/blocks.1.ffn/max_vio"] == [(1, 0.5)] and got["moe/blocks.1.ffn/dropped"] == [(1, 3.0)]
    assert not [tag for tag in got if tag.endswith(("load", "dead_experts"))]


@pytest.mark.parametrize("writers_before", [None, 9], ids=["as-is", "count-9"])
def test_a_resume_hides_the_tensorboard_events_after_its_step(
    tmp_path: Path, monkeypatch, writers_before: int | None
) -> None:
    """count-9: the process had opened 9 writers, so the resumed run's file is its 10th, whose name sorts
    before the 9th's within one second (the writers' clock stands still here until MetricsLog waits);
    TensorBoard read it first and its purge hid nothing (the test had failed so when run after other
    tests). The resumed run's file sorts last."""
    if writers_before is not None:
        from tensorboard.summary.writer import event_file_writer

        from tformer.train import metrics

        monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(writers_before))
        clock = [1_800_000_000.25]  # one second for both writers unless MetricsLog sleeps past it
        fake = SimpleNamespace(time=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s))
        monkeypatch.setattr(event_file_writer, "time", fake)
        monkeypatch.setattr(metrics, "time", fake)
    first = MetricsLog(tmp_path)
    for step in range(1, 6):
        first.write({"kind": "train", "step": step, "loss": float(step)})
    first.close()  # the run died after step 5, its last checkpoint was at step 3
    resumed = MetricsLog(tmp_path)
    resumed.truncate_after(3)
    for step in (4, 5, 6):
        resumed.write({"kind": "train", "step": step, "loss": 10.0 * step})
    resumed.close()
    assert scalars(tmp_path / "tensorboard")["loss"] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
        (5, 50.0),
        (6, 60.0),
    ]
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0),
    ]  # fmt: skip


def test_a_resume_in_the_same_process_hides_the_events_after_its_step(tmp_path: Path) -> None:
    """The same MetricsLog rewound while its writer is still open (a trainer resumed in-process)."""
    log = MetricsLog(tmp_path)
    for step in range(1, 5):
        log.write({"kind": "train", "step": step, "loss": float(step)})
    log.truncate_after(2)
    for step in (3, 4):
        log.write({"kind": "train", "step": step, "loss": -float(step)})
    log.close()
    assert scalars(tmp_path / "tensorboard")["loss"] == [(1, 1.0), (2, 2.0), (3, -3.0), (4, -4.0)]


def test_rewinding_keeps_the_records_up_to_and_including_the_step(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(5):
        log.write({"kind": "train", "step": step, "loss": 1.0})
        log.write({"kind": "eval", "step": step, "eval_loss": 2.0})
    log.truncate_after(2)
    assert [(r["kind"], r["step"]) for r in read_metrics(tmp_path)] == [
        (kind, step) for step in range(3) for kind in ("train", "eval")
    ]
    log.write({"kind": "train", "step": 3, "loss": 0.5})  # appended after the kept ones
    assert [r["step"] for r in read_metrics(tmp_path)][-2:] == [2, 3]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_record_needs_a_kind_and_an_integer_step(tmp_path: Path) -> None:
    lines = [
        {"kind": "train", "step": 1, "loss": 1.0},
        {"kind": "train", "step": True, "loss": 1.0},  # a bool is an int to Python, not a step
        {"kind": "train", "step": 2.0, "loss": 1.0},
        {"kind": 3, "step": 2, "loss": 1.0},
        {"step": 2, "loss": 1.0},
        {"kind": "eval", "step": 2, "eval_loss": 1.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert read_metrics(tmp_path) == [lines[0], lines[-1]]


@pytest.fixture
def drawn(monkeypatch):
    """The figures plot_loss_curve saves, caught as they are saved."""
    figures = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self) or real(self, *a, **k))
    return figures


def test_the_loss_curve_draws_train_and_eval_losses_at_their_steps(tmp_path: Path, drawn) -> None:
    run = tmp_path / "my-run"
    run.mkdir()
    log = MetricsLog(run, tensorboard=False)
    records = [
        {"kind": "train", "step": 1, "loss": 3.0},
        {"kind": "train", "step": 2, "loss": 2.5},
        {"kind": "skip", "step": 3, "loss": 1e9},  # a skipped step and a spike are off the curve
        {"kind": "spike", "step": 4, "loss": 8.0, "running_mean": 2.5},
        {"kind": "train", "step": 4, "loss": 8.0},
        {"kind": "eval", "step": 4, "eval_loss": 2.75},
        {"kind": "train", "step": 5, "loss": None},
        {"kind": "eval", "step": 5, "eval_loss": True},
        {"kind": "eval", "step": 6, "eval_loss": 2.5},
    ]
    for r in records:
        log.write(r)
    before = set(plt.get_fignums())
    out = plot_loss_curve(run)
    assert out == run / "loss.png" and out.read_bytes().startswith(b"\x89PNG")
    assert set(plt.get_fignums()) == before  # the figure is closed (a long session would pile them up)
    (fig,) = drawn
    (ax,) = fig.axes
    lines = {line.get_label(): line.get_xydata().tolist() for line in ax.get_lines()}

    def number(x) -> bool:  # a loss to draw: a number, not None nor a bool edited in
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    assert lines == {
        "train loss": [[r["step"], r["loss"]] for r in records if r["kind"] == "train" and number(r["loss"])],
        "eval loss": [
            [r["step"], r["eval_loss"]] for r in records if r["kind"] == "eval" and number(r["eval_loss"])
        ],
    }
    assert ax.get_title() == "my-run"  # the run directory's name unless a title is given
    plot_loss_curve(run, title="given")
    assert drawn[1].axes[0].get_title() == "given"


def test_rewinding_replaces_the_file_whole(tmp_path: Path) -> None:
    """The kept records go to a new file renamed over the old: a reader that opened metrics.jsonl before
    the rewind reads every old record, never a file cut down in place."""
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(1, 6):
        log.write({"kind": "train", "step": step, "loss": 1.0 / step})
    with (tmp_path / "metrics.jsonl").open() as reader:
        log.truncate_after(2)
        assert [json.loads(x)["step"] for x in reader.read().splitlines()] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_a_full_disk_under_tensorboard_names_its_folder_and_prints_no_thread_traceback(tmp_path, monkeypatch):
    """TensorBoard's writer thread had printed its traceback, and the run ended in "No space left on
    device" naming no file. The error names the run's tensorboard folder; the thread's copy is not
    printed (other threads' exceptions still are)."""
    import errno
    import threading

    from torch.utils.tensorboard import SummaryWriter

    log = MetricsLog(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", full)
    with pytest.raises(OSError) as err:
        log.write({"kind": "train", "step": 1, "loss": 1.0})
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(tmp_path / "tensorboard"))
    assert str(err.value) == f"[Errno 28] No space left on device: '{tmp_path / 'tensorboard'}'"
    log.close()

    import collections

    from tformer.train import metrics

    class _AsyncWriterThread(threading.Thread):  # the name TensorBoard's writer thread has
        pass

    seen = []
    monkeypatch.setattr(threading, "excepthook", seen.append)  # what was there before: gets the rest
    monkeypatch.setattr(metrics, "_HOOKED", False)
    metrics._quiet_writer_threads()
    args = collections.namedtuple("ExceptHookArgs", "exc_type exc_value exc_traceback thread")
    threading.excepthook(args(OSError, OSError(errno.ENOSPC, "writer"), None, _AsyncWriterThread()))
    threading.excepthook(args(OSError, OSError(errno.ENOSPC, "other"), None, threading.Thread()))
    threading.excepthook(args(ValueError, ValueError("writer"), None, _AsyncWriterThread()))
    assert [(type(a.exc_value).__name__, str(a.exc_value)) for a in seen] == [
        ("OSError", "[Errno 28] other"),
        ("ValueError", "writer"),
    ]


def test_an_event_file_that_still_sorts_after_a_new_writer_is_warned_of(tmp_path: Path, monkeypatch) -> None:
    """A file named by a clock far ahead (another machine's) sorts after every writer this one opens, even
    after MetricsLog's wait for the next second (skipped here): the warning names the folder."""
    from tformer.train import metrics

    folder = tmp_path / "tensorboard"
    folder.mkdir()
    (folder / "events.out.tfevents.9999999999.elsewhere.1.0").write_bytes(b"")
    monkeypatch.setattr(metrics, "time", SimpleNamespace(time=metrics.time.time, sleep=lambda s: None))
    log = MetricsLog(tmp_path)
    with pytest.warns(UserWarning, match="an earlier event file sorts after this run's") as caught:
        log.write({"kind": "train", "step": 1, "loss": 1.0})
    log.close()
    assert str(folder) in str(caught[0].message)
    assert len(list(folder.glob("events.out.tfevents.*"))) == 2  # the first try's file was removed
