"""Stopping on a signal (Ctrl-C / SIGTERM) at a step boundary, and the step's learning-rate bookkeeping."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.train.helpers import losses, small_config
from tformer.tasks import make_task
from tformer.train.checkpoint import latest_checkpoint, list_checkpoints
from tformer.train.interrupt import Stopped
from tformer.train.loop import Trainer


@pytest.fixture(autouse=True)
def _signals_as_in_a_terminal():
    """A job started in the background by a non-interactive shell inherits SIGINT ignored (which tformer
    leaves ignored, as asked); these tests play a terminal's Ctrl-C, so they start from the defaults."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


class SignalTask:
    """Wraps the LM task; sends `signals` to this process from inside the loss of the step `at` (1-based),
    i.e. in the middle of that step, as a Ctrl-C typed while it runs would."""

    def __init__(self, at: int, signals: tuple[int, ...] = (signal.SIGINT,)) -> None:
        self.inner, self.calls, self.at, self.signals = make_task("lm"), 0, at, signals

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def loss(self, model, batch):
        self.calls += 1
        if self.calls == self.at:
            for sig in self.signals:
                os.kill(os.getpid(), sig)
        return self.inner.loss(model, batch)


def test_ctrl_c_mid_step_saves_at_the_step_end_and_resume_is_exact(
    corpus_dir: Path, tmp_path: Path, capsys
) -> None:
    cfg = small_config(corpus_dir, save_every=100)  # no cadence save: the stop's save is the only one
    Trainer(cfg, tmp_path / "a", make_task("lm"), progress=False).fit()
    trainer = Trainer(cfg, tmp_path / "b", SignalTask(at=6), progress=False)
    with pytest.raises(Stopped) as stopped:
        trainer.fit()
    assert stopped.value.signum == signal.SIGINT
    assert "SIGINT: stopping when this step ends, after saving a checkpoint (Ctrl-C again stops at once" in (
        capsys.readouterr().err
    )
    assert trainer.state.step == 6  # step 6 ran to its end
    assert latest_checkpoint(tmp_path / "b").name == "step_000006"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back
    Trainer(cfg, tmp_path / "b", make_task("lm"), resume=True, progress=False).fit()
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_sigterm_stops_with_a_checkpoint_too(corpus_dir: Path, tmp_path: Path, capsys) -> None:
    cfg = small_config(corpus_dir, save_every=100)
    trainer = Trainer(cfg, tmp_path / "t", SignalTask(at=3, signals=(signal.SIGTERM,)), progress=False)
    with pytest.raises(Stopped) as stopped:
        trainer.fit()
    assert stopped.value.signum == signal.SIGTERM
    err = capsys.readouterr().err  # no word of a second Ctrl-C, which a SIGTERM is not
    assert "SIGTERM: stopping when this step ends, after saving a checkpoint\n" in err and "Ctrl-C" not in err
    assert [p.name for p in list_checkpoints(tmp_path / "t")] == ["step_000003"]
    assert (tmp_path / "t" / "loss.png").is_file()  # the curve so far (it had waited for the run's end)


def test_a_hang_up_stops_with_a_checkpoint_and_resumes_exactly(
    corpus_dir: Path, tmp_path: Path, capsys
) -> None:
    """SIGHUP (the terminal of the run closed) had ended training at once, without a checkpoint."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        cfg = small_config(corpus_dir, save_every=100)
        Trainer(cfg, tmp_path / "a", make_task("lm"), progress=False).fit()
        trainer = Trainer(cfg, tmp_path / "h", SignalTask(at=4, signals=(signal.SIGHUP,)), progress=False)
        with pytest.raises(Stopped) as stopped:
            trainer.fit()
        assert stopped.value.signum == signal.SIGHUP
        assert "SIGHUP: stopping when this step ends, after saving a checkpoint\n" in capsys.readouterr().err
        assert [p.name for p in list_checkpoints(tmp_path / "h")] == ["step_000004"]
        Trainer(cfg, tmp_path / "h", make_task("lm"), resume=True, progress=False).fit()
        assert losses(tmp_path / "a") == losses(tmp_path / "h")
    finally:
        signal.signal(signal.SIGHUP, previous)


class GoneReader:
    """stdout piped into a reader that went away after `lines` writes (`| head`)."""

    def __init__(self, lines: int) -> None:
        self.lines = lines

    def write(self, text: str) -> int:
        if self.lines <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.lines -= 1
        return len(text)

    def flush(self) -> None:
        if self.lines <= 0:
            raise BrokenPipeError(32, "Broken pipe")


def test_output_that_cannot_be_written_stops_the_run_with_a_checkpoint(
    corpus_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """`tformer train ... | head -2`: the first line printed after the reader left had raised out of the
    loop, and the steps since the last checkpoint were lost. The command exits 141, as on SIGPIPE."""
    from tformer.cli.main import main

    out = tmp_path / "p"
    argv = ["train", "--preset", "tiny-lm", "--set", f"data.corpus=text:{corpus_dir}", "--set", "steps=40"]
    argv += ["--set", "save_every=1000", "--set", "log_every=1", "--no-progress", "--no-sample"]
    monkeypatch.setattr("sys.stdout", GoneReader(lines=3))
    assert main([*argv, "--out", str(out)]) == 141
    assert "output lost: stopping when this step ends, after saving a checkpoint" in capsys.readouterr().err
    saved = latest_checkpoint(out)
    assert saved is not None and 1 <= int(saved.name.split("_")[1]) < 40
    monkeypatch.undo()
    assert main([*argv, "--out", str(out), "--resume"]) == 0
    assert latest_checkpoint(out).name == "step_000040"


def test_a_second_ctrl_c_stops_at_once_without_saving_mid_step(
    corpus_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    from tformer.train.interrupt import StopRequests

    monkeypatch.setattr(StopRequests, "REPEAT_S", 0.0)  # the second press counts as a second one
    cfg = small_config(corpus_dir, save_every=2)
    trainer = Trainer(
        cfg, tmp_path / "c", SignalTask(at=5, signals=(signal.SIGINT, signal.SIGINT)), progress=False
    )
    with pytest.raises(KeyboardInterrupt) as raised:
        trainer.fit()
    assert not isinstance(raised.value, Stopped)
    assert trainer.state.step == 4  # step 5 never finished
    assert [p.name for p in list_checkpoints(tmp_path / "c")] == ["step_000002", "step_000004"]


def test_a_quick_repeat_and_torchruns_forwarded_signal_count_as_one(
    corpus_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    cfg = small_config(corpus_dir, save_every=100)
    for name, env in (("quick", None), ("torchrun", "1")):
        if env:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", env)
            monkeypatch.setattr("tformer.train.interrupt.StopRequests.REPEAT_S", 0.0)
        trainer = Trainer(
            cfg, tmp_path / name, SignalTask(at=3, signals=(signal.SIGINT,) * 2), progress=False
        )
        with pytest.raises(Stopped):
            trainer.fit()
        assert latest_checkpoint(tmp_path / name).name == "step_000003"


def test_a_signal_in_the_last_step_lets_the_run_finish(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir, save_every=100)
    report = Trainer(cfg, tmp_path / "e", SignalTask(at=8), progress=False).fit()  # 8 steps, one batch each
    assert report is not None and (tmp_path / "e" / "loss.png").exists()
    assert latest_checkpoint(tmp_path / "e").name == "step_000008"


def test_logged_lr_is_the_rate_the_step_ran_at(corpus_dir: Path, tmp_path: Path) -> None:
    import json

    from tformer.train.optim import lr_factor

    cfg = small_config(corpus_dir)  # warm-up 2 of 8 steps, cosine to min_lr_ratio
    Trainer(cfg, tmp_path / "l", make_task("lm"), progress=False).fit()
    records = [json.loads(x) for x in (tmp_path / "l" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["lr"] for r in records if r["kind"] == "train"]
    assert logged == pytest.approx([cfg.optim.lr * lr_factor(i, cfg.steps, cfg.optim) for i in range(8)])
    assert logged[0] == pytest.approx(cfg.optim.lr / 2) and logged[-1] == pytest.approx(
        cfg.optim.lr * cfg.optim.min_lr_ratio
    )


def test_metrics_survive_a_torn_line_and_a_crashed_run_without_checkpoint(
    corpus_dir: Path, tmp_path: Path
) -> None:
    import json

    cfg = small_config(corpus_dir, steps=4, save_every=2, eval_every=4)
    Trainer(cfg, tmp_path / "m", make_task("lm"), progress=False).fit(until=2)
    with (tmp_path / "m" / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 3, "lo')  # a process killed mid-write
    Trainer(cfg, tmp_path / "m", make_task("lm"), resume=True, progress=False).fit()
    steps = [json.loads(x)["step"] for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps] == sorted(steps) and steps.count(3) == 1 and steps[-1] == 4

    crashed = tmp_path / "c"  # records but no checkpoint: a fresh run starts the log again
    crashed.mkdir()
    (crashed / "config.json").write_text(json.dumps(cfg.to_dict()))  # a run writes it first
    (crashed / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 9.0}\n')
    Trainer(cfg.replace(steps=1), crashed, make_task("lm"), progress=False).fit()
    records = [json.loads(x) for x in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1] and records[0]["loss"] != 9.0


def test_a_damaged_newest_checkpoint_is_an_error_naming_the_previous_one(
    corpus_dir: Path, tmp_path: Path
) -> None:
    import json

    from tformer.train.checkpoint import CheckpointError

    cfg = small_config(corpus_dir, steps=4, save_every=2, eval_every=4, keep_last=3)
    Trainer(cfg, tmp_path / "d", make_task("lm"), progress=False).fit()
    newest = tmp_path / "d" / "checkpoints" / "step_000004"
    assert json.loads((newest / "trainer.json").read_text())["tokens_seen"] > 0
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes
    (newest / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"sha256 .*previous checkpoint is .*step_000002: move step_000004"
    ):
        Trainer(cfg, tmp_path / "d", make_task("lm"), resume=True, progress=False)


def test_an_unfinished_newer_step_directory_is_named_not_stepped_over(
    corpus_dir: Path, tmp_path: Path
) -> None:
    from tformer.train.checkpoint import CheckpointError

    cfg = small_config(corpus_dir, steps=4, save_every=2, eval_every=4)
    Trainer(cfg, tmp_path / "u", make_task("lm"), progress=False).fit()
    ckpts = tmp_path / "u" / "checkpoints"
    (ckpts / "step_000004" / "COMMITTED").unlink()  # damaged: a later save of step 4 would meet it
    with pytest.raises(
        CheckpointError, match=r"step_000004 is not a committed checkpoint .* move step_000004"
    ):
        Trainer(cfg, tmp_path / "u", make_task("lm"), resume=True, progress=False)
    assert (ckpts / "step_000004").is_dir()  # nothing moved or deleted
    (ckpts / "step_000004").rename(tmp_path / "kept")
    trainer = Trainer(cfg, tmp_path / "u", make_task("lm"), resume=True, progress=False)
    assert trainer.state.step == 2
    trainer.fit()
    assert latest_checkpoint(tmp_path / "u").name == "step_000004"


def test_a_fresh_run_trains_its_own_tokenizer_over_a_failed_runs(corpus_dir: Path, tmp_path: Path) -> None:
    import json

    from tformer.data.tokenizer import Tokenizer

    run = tmp_path / "f"
    run.mkdir()
    cfg = small_config(corpus_dir, steps=1, save_every=1, eval_every=1)
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))  # left by a failed run, with its
    Tokenizer.train_bpe(["a b c d e f g"] * 20, 270).save(run / "tokenizer.json")  # tokenizer
    trainer = Trainer(cfg, run, make_task("lm"), progress=False)
    assert trainer.model_cfg.vocab_size == Tokenizer.load(run / "tokenizer.json").vocab_size > 270


def test_samples_during_training_are_logged_and_leave_the_run_exact(corpus_dir: Path, tmp_path: Path) -> None:
    import json

    cfg = small_config(corpus_dir, sample_every=2, sample_tokens=5)
    Trainer(cfg, tmp_path / "s", make_task("lm"), progress=False).fit()
    Trainer(small_config(corpus_dir), tmp_path / "n", make_task("lm"), progress=False).fit()
    records = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    samples = [r for r in records if r["kind"] == "sample"]
    assert [r["step"] for r in samples] == [2, 4, 6, 8] and all("--- sample" in r["text"] for r in samples)
    assert losses(tmp_path / "s") == losses(tmp_path / "n")  # sampling drew from no training RNG


def test_a_guarded_stream_is_the_stream_it_guards_for_tqdm(capsys) -> None:
    """tqdm clears its bar before a line written above it, and redraws it after, only when the line's
    file is the bar's: a line through the guarded stream had landed on top of the bar."""
    import sys

    from tqdm import tqdm

    from tformer.train.interrupt import GuardedStream

    lost = []
    out = GuardedStream(sys.stdout, lambda: lost.append(1))
    assert out == sys.stdout and hash(out) == hash(sys.stdout) and out != sys.stderr
    bar = tqdm(total=3, file=GuardedStream(sys.stderr, lambda: None), ascii=True, mininterval=0)
    bar.update(1)
    capsys.readouterr()
    bar.write("EVAL", file=GuardedStream(sys.stderr, lambda: None))
    err = capsys.readouterr().err
    bar.close()
    before, after = err.split("EVAL")
    assert "\r" in before and "1/3" in after  # cleared, then redrawn
    gone = GuardedStream(GoneReader(lines=0), lambda: lost.append(1))
    gone.write("x")
    gone.write("y")  # told at each write after the loss (a later fit of the same trainer stops too)
    assert lost == [1, 1]


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_a_full_disk_names_the_failed_save_and_keeps_the_last_checkpoint(
    fmt: str, corpus_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A write that fails mid-save (ENOSPC from a file of the checkpoint; under DCP, EFBIG from DCP's own
    writers) had printed "No space left on device" alone: the error names the step and the whole
    checkpoint a --resume takes, and no step directory of the failed save is left; the run then resumes
    from that checkpoint once there is room."""
    import errno

    import torch.distributed.checkpoint as dcp

    import tformer.train.checkpoint as checkpoint
    from tformer.cli.main import main

    real_write, real_save = checkpoint._write_file, dcp.save

    def fills_up(directory, name, data, manifest):
        if directory.name.startswith(".tmp-step_000008"):  # the second save: the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(directory, name, data, manifest)

    def too_large(state, checkpoint_id, **kwargs):
        if Path(checkpoint_id).name.startswith(".tmp-step_000008"):
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
        return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

    out = tmp_path / "full"
    argv = ["train", "--preset", "tiny-lm", "--set", f"data.corpus=text:{corpus_dir}", "--set", "steps=8"]
    argv += ["--set", "save_every=4", "--set", "eval_every=100", "--set", f"parallel.checkpoint={fmt}"]
    argv += ["--no-progress", "--no-sample", "--out", str(out)]
    if fmt == "dcp":
        monkeypatch.setattr(dcp, "save", too_large)
    else:
        monkeypatch.setattr(checkpoint, "_write_file", fills_up)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    if fmt == "dcp":  # DCP's error, wrapped, names its directory
        assert err.startswith(
            "tformer train: error: the checkpoint save at step 8 failed: "
            f"{out / 'checkpoints' / '.tmp-step_000008-dcp'}: DCP save failed: "
        ), err
        assert err.endswith(
            "File too large; the last checkpoint, step_000004, is whole: make room, then --resume"
        )
    else:
        assert err == (
            f"tformer train: error: {out / 'checkpoints'}: the checkpoint save at step 8 failed: No space left "
            "on device; the last checkpoint, step_000004, is whole: make room, then --resume"
        )
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")] == ["step_000004"]
    monkeypatch.undo()
    assert main([*argv, "--resume"]) == 0
    assert latest_checkpoint(out).name == "step_000008"


def test_a_fresh_run_that_cannot_write_its_config_leaves_no_directory(tmp_path: Path) -> None:
    """A file-size limit (or a full disk) at the run's first file: the error names the file, and the
    directory the run made is removed (the config had been written before the clean-up's guard)."""
    import resource
    import subprocess
    import sys

    def limit():  # 1 KiB per file: config.json is larger (Python ignores SIGXFSZ, so write() fails)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    out = tmp_path / "made" / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tformer", "train", "--preset", "tiny-lm", "--out", str(out)],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"tformer train: error: {out / 'config.json.tmp'}: File too large"
    assert not (tmp_path / "made").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_sigterm_or_hang_up_before_training_starts_cleans_up_as_a_ctrl_c_does(
    sig: int, corpus_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """SIGTERM / SIGHUP while the run is being set up (here: while the metrics log opens, after the
    vocabulary is trained) raise Stopped with the signal, so the directory the run made is removed; they
    had ended the process at once, leaving config.json, data.json and tokenizer.json behind. A repeat
    during the cleanup is ignored; the handlers are the process's own again afterwards."""
    from tformer.train.metrics import MetricsLog

    before = signal.getsignal(sig)
    monkeypatch.setattr(MetricsLog, "truncate_after", lambda self, step: os.kill(os.getpid(), sig))
    release = Trainer._release_lock

    def signalled_again(self):  # a repeat (a scheduler, torchrun) during the cleanup: it had ended the
        os.kill(os.getpid(), sig)  # process there, the directory half removed
        release(self)

    monkeypatch.setattr(Trainer, "_release_lock", signalled_again)
    with pytest.raises(Stopped) as stopped:
        Trainer(small_config(corpus_dir, steps=3), tmp_path / "new" / "run", "lm", progress=False)
    assert stopped.value.signum == sig and not (tmp_path / "new").exists()
    assert signal.getsignal(sig) is before


def test_a_ctrl_c_before_training_starts_leaves_no_directory(
    corpus_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """A Ctrl-C after the vocabulary is trained but before the loop starts (here: while the metrics log opens,
    where a launch's first seconds had ended) removes the directory the run made, or from a directory the
    user made the files the run wrote; they had stayed (config.json, data.json, tokenizer.json). A resumed
    run's directory is not touched."""
    from tformer.train.metrics import MetricsLog

    def interrupted(self, step):
        raise KeyboardInterrupt

    cfg = small_config(corpus_dir, steps=3, save_every=3)
    Trainer(cfg, tmp_path / "kept", "lm", progress=False).fit()
    monkeypatch.setattr(MetricsLog, "truncate_after", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, tmp_path / "new" / "run", "lm", progress=False)
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()  # a directory the user made stays, without what the run wrote there
    (tmp_path / "mine" / "notes.txt").write_text("the user's")
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, tmp_path / "mine", "lm", progress=False)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == [".lock", "notes.txt"]
    monkeypatch.setattr(Trainer, "_restore", lambda self, path: interrupted(self, 0))
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg.replace(steps=6), tmp_path / "kept", "lm", resume=True, progress=False)
    assert latest_checkpoint(tmp_path / "kept").name == "step_000003"
