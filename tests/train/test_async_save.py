"""A3: with `parallel.async_save` training goes on while a checkpoint's files are written; the next save
and the end of the run wait for it. The save's completion is held back until the test sees an optimizer
step after the save (or the trainer asks to wait), so a trainer that blocked on its own save would be
seen to release it with no step in between."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.optim.optimizer import register_optimizer_step_post_hook

from tests.train.helpers import losses, small_config
from tformer.distributed.checkpoint import DCPCheckpointer
from tformer.tasks import make_task
from tformer.train.checkpoint import MARKER, list_checkpoints
from tformer.train.config import ParallelConfig
from tformer.train.loop import Trainer


class HeldSaves:
    """Wraps dcp.async_save: each save's future completes only once an optimizer step ran after the save
    began, or once the trainer waits on it. `released` records (steps at save, why it was released)."""

    def __init__(self, monkeypatch) -> None:
        self.steps = 0
        self.released: list[tuple[int, str]] = []
        self._waiting = threading.Event()
        real_async_save, real_wait = dcp.async_save, DCPCheckpointer.wait

        def async_save(*args, **kwargs):
            at = self.steps
            response = real_async_save(*args, **kwargs)
            done: Future = Future()
            threading.Thread(target=self._release, args=(at, response, done), daemon=True).start()
            return done

        def wait(checkpointer) -> None:
            self._waiting.set()
            try:
                real_wait(checkpointer)
            finally:
                self._waiting.clear()

        monkeypatch.setattr(dcp, "async_save", async_save)
        monkeypatch.setattr(DCPCheckpointer, "wait", wait)
        self.hook = register_optimizer_step_post_hook(lambda *_: self._count())

    def _count(self) -> None:
        self.steps += 1

    def _release(self, at: int, response, done: Future) -> None:
        deadline = time.monotonic() + 60
        while self.steps == at and not self._waiting.is_set() and time.monotonic() < deadline:
            time.sleep(0.002)
        why = "step" if self.steps > at else "wait" if self._waiting.is_set() else "timeout"
        self.released.append((at, why))  # "step" however many steps ran before this thread woke
        try:
            getattr(response, "upload_completion", response).result()
            done.set_result(None)
        except BaseException as error:  # handed to the trainer, which reports it
            done.set_exception(error)


@pytest.fixture
def held_saves(monkeypatch):
    held = HeldSaves(monkeypatch)
    yield held
    held.hook.remove()


def test_training_continues_while_an_async_save_is_written(corpus_dir: Path, tmp_path: Path, request) -> None:
    sync = small_config(
        corpus_dir,
        steps=6,
        save_every=2,
        eval_every=6,
        keep_last=10,
        parallel=ParallelConfig(checkpoint="dcp"),
    )
    Trainer(sync, tmp_path / "sync", make_task("lm"), progress=False).fit()

    held = request.getfixturevalue("held_saves")  # only now: the synchronous run above is not watched
    cfg = sync.replace(parallel=ParallelConfig(checkpoint="dcp", async_save=True))
    Trainer(cfg, tmp_path / "async", make_task("lm"), progress=False).fit()

    # step 3 (and 5) ran while the save of step 2 (and 4) was in flight; the last save is waited on
    assert held.released == [(2, "step"), (4, "step"), (6, "wait")]
    saved = list_checkpoints(tmp_path / "async")
    assert [p.name for p in saved] == ["step_000002", "step_000004", "step_000006"]
    assert all((p / MARKER).is_file() for p in saved)
    assert sorted(p.name for p in (tmp_path / "async" / "checkpoints").iterdir()) == [p.name for p in saved]
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
