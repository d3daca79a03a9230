"""Resuming a run: bit-identical losses with dropout on, what a resume checks and may change, and the
run directory a new or resumed Trainer may take over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

import pytest

from tests.train.helpers import edit_checkpoint_json, losses, small_config
from tformer.tasks import make_task
from tformer.train.checkpoint import latest_checkpoint
from tformer.train.config import OptimConfig, TrainConfig
from tformer.train.loop import Trainer
from tformer.train.optim import lr_factor


def test_exact_resume_with_dropout(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir)
    whole = Trainer(cfg, tmp_path / "a", make_task("lm"), progress=False)
    whole.fit()
    Trainer(cfg, tmp_path / "b", make_task("lm"), progress=False).fit(until=4)
    assert len(losses(tmp_path / "b")) == 4
    resumed = Trainer(cfg, tmp_path / "b", make_task("lm"), resume=True, progress=False)
    assert resumed.state.step == 4 and resumed.state.tokens_seen > 0  # restored before the first step
    resumed.fit()
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert len(set(losses(tmp_path / "a"))) > 1
    # the counters too: step, tokens seen, skipped steps, the spike detector's running mean
    assert asdict(resumed.state) == asdict(whole.state)

    def records(run: Path) -> list[dict]:  # every logged step but its speed
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [  # (a resumed process holds less memory at first than one that ran through)
            {k: v for k, v in r.items() if k not in ("tokens_per_s", "peak_memory_mib")}
            for r in map(json.loads, lines)
        ]

    assert records(tmp_path / "a") == records(tmp_path / "b")  # lr, tokens_seen, evaluations


def test_exact_resume_with_onednn_training_products(corpus_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """With the fp32 training products on oneDNN (tformer.model.linear.OneDnnLinear, on for AVX512 CPUs;
    forced here, at 8 x 32 = 256 rows a step, its threshold), a run stopped at step 4 and resumed gives
    the uninterrupted run's losses and gradient norms bit for bit, and the products did take oneDNN."""
    import tformer.model.linear as linear_module

    monkeypatch.setattr(linear_module, "ONEDNN_LINEAR", True)
    taken = []
    apply = linear_module.OneDnnLinear.apply
    monkeypatch.setattr(linear_module.OneDnnLinear, "apply", lambda *a: taken.append(1) or apply(*a))
    cfg = small_config(corpus_dir, batch_size=8)
    Trainer(cfg, tmp_path / "a", make_task("lm"), progress=False).fit()
    assert taken
    Trainer(cfg, tmp_path / "b", make_task("lm"), progress=False).fit(until=4)
    Trainer(cfg, tmp_path / "b", make_task("lm"), resume=True, progress=False).fit()
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert len(losses(tmp_path / "a")) == 8


def test_rerun_without_resume_refuses_to_overwrite(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir, steps=2, save_every=1)
    report = Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit()
    assert json.loads((tmp_path / "r" / "report.json").read_text()) == report  # not only from the CLI
    with pytest.raises(ValueError, match="already holds checkpoints; pass --resume"):
        Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False)
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        Trainer(cfg, tmp_path / "empty", make_task("lm"), resume=True, progress=False)
    for step in (1, 2):  # every checkpoint's manifest damaged: the newest is named, not only "none"
        (tmp_path / "r" / "checkpoints" / f"step_{step:06d}" / "COMMITTED").write_text("{")
    named = r"r holds no committed checkpoint \(.*step_000002 has no readable commit manifest"
    with pytest.raises(FileNotFoundError, match=named):
        Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False)
    from tformer.runs import load_run

    with pytest.raises(FileNotFoundError, match=named):
        load_run(tmp_path / "r")
    with pytest.raises(TypeError, match="the run must be a path .*got NoneType"):
        load_run(None)
    with pytest.raises(TypeError, match="run_dir must be a path, got NoneType"):
        Trainer(cfg, None, make_task("lm"), progress=False)


def test_a_newer_trainer_takes_the_run_directory_over_in_a_process(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir, steps=4, save_every=2, eval_every=2)
    first = Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False)
    first.fit(until=2)
    second = Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False)
    for use in (first.fit, first.save):  # the first would write checkpoints and metrics beside it
        with pytest.raises(RuntimeError, match="a newer Trainer in this process took the run directory"):
            use()
    first.close()  # leaves the lock with the second
    second.fit(until=3)
    probe = "import pathlib, sys; from tformer.train.run_dir import lock_run_dir; lock_run_dir(pathlib.Path(sys.argv[1]), sys)"
    other = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "r")], capture_output=True, text=True)
    assert (
        other.returncode != 0 and f"in use by pid {os.getpid()}" in other.stderr
    )  # another process is refused
    del second  # dropped without close(): the next Trainer takes the directory over
    assert Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False).fit()["step"] == 4
    assert [r["step"] for r in map(json.loads, (tmp_path / "r" / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"] == [1, 2, 3, 4]  # fmt: skip


def test_a_resume_checks_its_documents_and_vocabulary(corpus_dir: Path, tmp_path: Path) -> None:
    """A document edited in place (same name) changes the data a resume would read: refused. The run's
    tokenizer.json, deleted, is restored from the checkpoint (a new one had been trained on the data as
    it is now); replaced by another vocabulary, it is an error."""
    import shutil

    from tformer.schema import ConfigError
    from tformer.train.checkpoint import CheckpointError

    corpus = tmp_path / "corpus"
    shutil.copytree(corpus_dir, corpus)
    cfg = small_config(corpus, steps=4, save_every=2, eval_every=2)
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit(until=2)
    doc = sorted(corpus.iterdir())[0]
    original = doc.read_text()
    doc.write_text(" ".join(reversed(original.split())) + "\n")
    with pytest.raises(ConfigError, match=r"split\(s\) of .* differ .* added, removed, renamed or edited"):
        Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False)
    doc.write_text(original)
    tokenizer = (tmp_path / "r" / "tokenizer.json").read_text()
    (tmp_path / "r" / "tokenizer.json").unlink()
    with pytest.warns(UserWarning, match=r"tokenizer.json was missing: restored from .*step_000002"):
        resumed = Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False)
    assert json.loads((tmp_path / "r" / "tokenizer.json").read_text()) == json.loads(tokenizer)
    resumed.close()
    other = json.loads(tokenizer)  # two tokens' ids swapped: another vocabulary
    vocab = other["model"]["vocab"]
    a, b = sorted(vocab)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "r" / "tokenizer.json").write_text(json.dumps(other))
    with pytest.raises(CheckpointError, match=r"is not the vocabulary step_000002 was trained with"):
        Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False)


def test_a_deleted_data_json_is_restored_so_changed_data_is_still_refused(
    corpus_dir: Path, tmp_path: Path
) -> None:
    """With data.json deleted, a resume on an edited corpus had gone on without a word and recorded the
    data anew. The checkpoint keeps a copy: it is written back (a warning) and the edit refused; with the
    data unchanged the run resumes."""
    import shutil

    from tformer.schema import ConfigError

    corpus = tmp_path / "corpus"
    shutil.copytree(corpus_dir, corpus)
    cfg = small_config(corpus, steps=4, save_every=2, eval_every=2)
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit(until=2)
    recorded = json.loads((tmp_path / "r" / "data.json").read_text())
    (tmp_path / "r" / "data.json").unlink()
    doc = sorted(corpus.iterdir())[0]
    original = doc.read_text()
    doc.write_text(" ".join(reversed(original.split())) + "\n")
    edited = r"split\(s\) of .* differ .* added, removed, renamed or edited"
    with pytest.warns(UserWarning, match=r"data.json was missing: restored from .*step_000002"), pytest.raises(ConfigError, match=edited):  # fmt: skip
        Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False)
    assert json.loads((tmp_path / "r" / "data.json").read_text()) == recorded
    doc.write_text(original)
    (tmp_path / "r" / "data.json").unlink()
    with pytest.warns(UserWarning, match=r"data.json was missing: restored"):
        Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False).fit()
    assert json.loads((tmp_path / "r" / "data.json").read_text()) == recorded


def test_a_resume_at_its_last_step_reports_that_step_evaluated(corpus_dir: Path, tmp_path: Path) -> None:
    """steps lowered to the checkpoint's step: no step runs, but the run ends as a run does, evaluated at
    its last step; the report's step is the run's, its evaluation's step `eval_step` (it had said 3)."""
    cfg = small_config(corpus_dir, steps=8, save_every=5, eval_every=3)
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit(until=5)
    report = Trainer(cfg.replace(steps=5), tmp_path / "r", make_task("lm"), resume=True, progress=False).fit()
    assert report["step"] == 5 and report["eval_step"] == 5 and "eval_loss" in report
    partial = Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False).fit(until=7)
    assert partial["step"] == 7 and partial["eval_step"] == 6


def test_a_run_saved_before_a_setting_existed_resumes(corpus_dir: Path, tmp_path: Path) -> None:
    """A checkpoint written before a config field was added (rope.yarn_ramp here) lacks it: the field
    takes its default, not a refused change ("None in the checkpoint")."""
    from tformer.train.checkpoint import CheckpointError, checkpoint_meta
    from tformer.train.resume import check_resume_config

    cfg = small_config(corpus_dir, steps=4, save_every=2, eval_every=2)
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit(until=2)
    ckpt = latest_checkpoint(tmp_path / "r")
    meta = checkpoint_meta(ckpt)
    del meta["train_config"]["model"]["rope"]["yarn_ramp"]

    from tformer import ModelConfig

    cfg = cfg.replace(model=ModelConfig.from_dict(meta["model_config"]))  # as the task resolves it
    for model in (False, True):
        check_resume_config(cfg, meta, ckpt, model=model)
    with pytest.raises(
        CheckpointError, match=r"model.rope.yarn_ramp: 'rotations' in the checkpoint, 'dims' now"
    ):
        changed = cfg.model.replace(rope=cfg.model.rope.replace(yarn_ramp="dims"))
        check_resume_config(cfg.replace(model=changed), meta, ckpt, model=True)


def test_switching_compile_on_resume_with_dropout_is_said(corpus_dir: Path, tmp_path: Path) -> None:
    cfg = small_config(corpus_dir, steps=4, save_every=2, eval_every=2)
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit(until=2)
    with pytest.warns(
        UserWarning,
        match=r"compile=True on resume of a run with compile=False and model.dropout=0.1: .* not be bit-identical",
    ):
        Trainer(
            cfg.replace(compile=True), tmp_path / "r", make_task("lm"), resume=True, progress=False
        ).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet = cfg.replace(model=cfg.model.replace(dropout=0.0))
        Trainer(quiet, tmp_path / "q", make_task("lm"), progress=False).fit(until=2)
        Trainer(
            quiet.replace(compile=True), tmp_path / "q", make_task("lm"), resume=True, progress=False
        ).close()


def test_a_newer_trainer_resumes_from_the_save_the_older_had_in_flight(
    corpus_dir: Path, tmp_path: Path
) -> None:
    """The older Trainer's fit failed in step 5 with step 4's async save in flight: the newer one commits
    it before choosing where to resume (it had resumed from an older step, then met step 4 again as
    'checkpoint exists already')."""
    from tformer.train.config import ParallelConfig

    parallel = ParallelConfig(checkpoint="dcp", async_save=True)
    cfg = small_config(corpus_dir, steps=6, save_every=2, eval_every=100, parallel=parallel)
    task, calls = make_task("lm"), []
    loss = task.loss

    def failing_loss(model, batch):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("step 5 fails")
        return loss(model, batch)

    task.loss = failing_loss
    first = Trainer(cfg, tmp_path / "r", task, progress=False)
    with pytest.raises(RuntimeError, match="step 5 fails"):
        first.fit()
    second = Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False)
    assert second.state.step == 4 and second.fit()["step"] == 6


def test_a_new_run_never_replaces_files_no_run_wrote(corpus_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """A directory holding a config or tokenizer of the user's own is refused, untouched; a run that
    stopped before its first checkpoint (its config.json, written first, is a run's) is started again
    (one that failed with an error removed what it wrote; one killed outright had not)."""
    cfg = small_config(corpus_dir, steps=1, save_every=1)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").write_text('{"mine": 1}')
    (mine / "notes.txt").write_text("kept")
    with pytest.raises(FileExistsError, match="holds tokenizer.json, which a new run would replace"):
        Trainer(cfg, mine, make_task("lm"), progress=False)
    assert (mine / "tokenizer.json").read_text() == '{"mine": 1}'
    (mine / "tokenizer.json").unlink()
    (mine / "config.json").write_text('{"my": "settings"}')
    with pytest.raises(FileExistsError, match="holds config.json, which .* not a tformer run"):
        Trainer(cfg, mine, make_task("lm"), progress=False)
    assert (mine / "config.json").read_text() == '{"my": "settings"}'
    (mine / "config.json").unlink()
    for name in (
        "src_tokenizer.json",
        "data.json",
        "metrics.jsonl",
        "loss.png",
        "report.json",
        "tensorboard",
    ):
        path = mine / name
        path.mkdir() if name == "tensorboard" else path.write_text("the user's")
        with pytest.raises(FileExistsError, match=f"holds {name}, which a new run would replace"):
            Trainer(cfg, mine, make_task("lm"), progress=False)
        assert path.is_dir() if name == "tensorboard" else path.read_text() == "the user's"
        path.rmdir() if name == "tensorboard" else path.unlink()

    stopped = tmp_path / "stopped"
    stopped.mkdir()

    def fails(_):
        raise MemoryError("out of memory")

    monkeypatch.setattr("tformer.train.loop.build_model", fails)  # after the tokenizer and data.json
    with pytest.raises(MemoryError):  # an error: the files this run wrote go again
        Trainer(cfg, stopped, make_task("lm"), progress=False)
    assert [p.name for p in stopped.iterdir()] == [".lock"]
    # a run killed outright (SIGKILL, a power cut) removes nothing
    monkeypatch.setattr("tformer.train.loop.remove_run_files", lambda run_dir: None)
    with pytest.raises(MemoryError):
        Trainer(cfg, stopped, make_task("lm"), progress=False)
    assert {"config.json", "tokenizer.json", "data.json"} <= {p.name for p in stopped.iterdir()}
    monkeypatch.undo()
    Trainer(cfg, stopped, make_task("lm"), progress=False).fit()  # a second try goes ahead
    assert latest_checkpoint(stopped).name == "step_000001"


def test_a_resume_with_more_steps_lays_the_schedule_over_them_from_the_next_step(
    corpus_dir: Path, tmp_path: Path
) -> None:
    """The first resumed step had run at the old schedule's rate (its floor), the next ones jumped to the
    new schedule's; now every resumed step runs at the new schedule's rate, and a warning says so."""
    cfg = small_config(corpus_dir, optim=OptimConfig(lr=1e-2, warmup_steps=2, fused=False, min_lr_ratio=0.1))
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit()
    longer = cfg.replace(steps=16)
    with pytest.warns(UserWarning, match=r"steps 8 -> 16: the cosine schedule now spans 16 steps, so step 9"):
        Trainer(longer, tmp_path / "r", make_task("lm"), resume=True, progress=False).fit()
    records = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["lr"] for r in records if r["kind"] == "train"}
    assert lr[8] == pytest.approx(1e-3)  # the first schedule's floor
    for step in range(9, 17):
        assert lr[step] == pytest.approx(1e-2 * lr_factor(step - 1, 16, longer.optim)), step
    with pytest.raises(
        ValueError, match=r"the run is at step 16 \(step_000016\); steps=12 would end before it"
    ):
        Trainer(cfg.replace(steps=12), tmp_path / "r", make_task("lm"), resume=True, progress=False)
    assert json.loads((tmp_path / "r" / "config.json").read_text())["steps"] == 16  # untouched


def test_a_relative_data_path_is_recorded_absolute(corpus_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """A run trained on `text:notes/` had recorded the path as typed: a resume or `tformer eval` started
    in another directory looked for the data there."""
    from tformer.runs import load_run

    monkeypatch.chdir(corpus_dir.parent)
    cfg = small_config(Path(corpus_dir.name), steps=2, save_every=2)
    assert cfg.data.corpus == f"text:{corpus_dir.name}"
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit()
    saved = json.loads((tmp_path / "r" / "config.json").read_text())["data"]["corpus"]
    assert saved == f"text:{corpus_dir}"
    monkeypatch.chdir(tmp_path)  # elsewhere: the run's own config finds the data
    assert load_run(tmp_path / "r").train_config.data.corpus == saved
    longer = TrainConfig.load(tmp_path / "r" / "config.json").replace(steps=3)
    assert Trainer(longer, tmp_path / "r", make_task("lm"), resume=True, progress=False).fit()["step"] == 3


def test_what_a_resume_may_change(corpus_dir: Path, tmp_path: Path) -> None:
    """Cadence and retention may change; the seed (it drew the steps so far: dropout, batch order) and what
    the data is may not; where a user corpus lives may (a moved folder, the same kind)."""
    from tformer.train.checkpoint import CheckpointError, checkpoint_meta
    from tformer.train.resume import check_resume_config

    cfg = small_config(corpus_dir, steps=4, save_every=2, eval_every=2)
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit(until=2)
    ckpt = latest_checkpoint(tmp_path / "r")
    meta = checkpoint_meta(ckpt)
    cadence = cfg.replace(steps=9, eval_every=3, save_every=3, keep_last=5, log_every=5, max_nonfinite=7)
    check_resume_config(cadence, meta, ckpt, model=False)
    moved = cfg.data.replace(corpus=f"text:{tmp_path / 'moved'}")
    check_resume_config(cfg.replace(data=moved), meta, ckpt, model=False)
    for changed, needle in (
        (cfg.replace(seed=cfg.seed + 1), rf"seed: {cfg.seed} in the checkpoint, {cfg.seed + 1} now"),
        (cfg.replace(data=cfg.data.replace(corpus=f"pairs:{corpus_dir}")), r"data.corpus: 'text:.*'pairs:"),
    ):
        with pytest.raises(CheckpointError, match=needle):
            check_resume_config(changed, meta, ckpt, model=False)


def test_a_missing_tokenizer_is_restored_not_retrained(corpus_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """The vocabulary of a resumed run is the checkpoint's, written back byte for byte (a new one trained
    on the data as it is now could differ)."""
    from tformer.train.checkpoint import checkpoint_meta

    cfg = small_config(corpus_dir, steps=4, save_every=2, eval_every=2)
    Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit(until=2)
    (tmp_path / "r" / "tokenizer.json").unlink()

    def no_training(*args, **kwargs):
        raise AssertionError("a resumed run trained a new tokenizer")

    monkeypatch.setattr("tformer.tasks.lm.train_tokenizer", no_training)
    with pytest.warns(UserWarning, match="tokenizer.json was missing: restored"):
        Trainer(cfg, tmp_path / "r", make_task("lm"), resume=True, progress=False).fit()
    saved = checkpoint_meta(latest_checkpoint(tmp_path / "r"))["tokenizer"]
    assert (tmp_path / "r" / "tokenizer.json").read_text(encoding="utf-8") == saved


def test_a_write_that_dies_while_metrics_are_rewound_keeps_the_old_records(
    tmp_path: Path, monkeypatch
) -> None:
    """A resume rewinds metrics.jsonl to its step through a temporary file: a crash in that write leaves
    the records as they were."""
    from tformer.train.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "train", "step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6)]
    path.write_text("".join(lines))

    def dies(self, data, *args, **kwargs):
        with open(self, "w") as f:
            f.write(data[: len(data) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", dies)
    with pytest.raises(OSError, match="disk full"):
        MetricsLog(tmp_path, tensorboard=False).truncate_after(3)
    monkeypatch.undo()
    assert path.read_text() == "".join(lines)


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (lambda state: state.update(loader="x"), "a loader state holds int seed, epoch and index_in_epoch"),
        (lambda state: state["loader"].update(index_in_epoch=-5), "a loader position is >= 0, got epoch"),
        (lambda state: state["loader"].update(epoch=1.5), "a loader state holds int seed"),
    ],
)
def test_a_hand_edited_trainer_state_is_named_on_resume(
    corpus_dir: Path, tmp_path: Path, edit, error
) -> None:
    """trainer.json edited and its manifest entry rewritten to match: the resume names the file, instead
    of 'string indices must be integers' from inside the loader."""
    from tformer.train.checkpoint import CheckpointError

    cfg = small_config(corpus_dir, steps=2, save_every=2)
    trainer = Trainer(cfg, tmp_path / "run", "lm", progress=False)
    trainer.fit()
    trainer.close()
    edit_checkpoint_json(
        latest_checkpoint(tmp_path / "run"), "trainer.json", lambda data: edit(data["trainer_state"])
    )
    with pytest.raises(
        CheckpointError, match=rf"trainer\.json: the trainer state does not restore \({error}"
    ):
        Trainer(cfg.replace(steps=4), tmp_path / "run", "lm", resume=True, progress=False)
