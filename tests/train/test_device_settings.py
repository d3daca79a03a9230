"""What a run does about the device it computes on: deterministic kernels (exact resume on a GPU needs them,
tests/cuda) and the peak memory its records and report carry."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from tests.train.helpers import small_config
from tformer.tasks import make_task
from tformer.train.loop import Trainer


def test_deterministic_kernels_are_on_while_a_run_trains_and_put_back(
    corpus_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """deterministic=true: every step and evaluation runs under torch.use_deterministic_algorithms (what
    exact resume needs on a GPU, tests/cuda) with CUBLAS_WORKSPACE_CONFIG set, and the process's own
    setting and environment are back after fit; false leaves them as they are."""
    import tformer.train.loop as loop_module

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    seen: list[tuple[str, bool, str | None]] = []
    step, evaluate = loop_module.train_step, Trainer.evaluate

    def state() -> tuple[bool, str | None]:
        return torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")

    def spy_step(*args, **kwargs):
        seen.append(("step", *state()))
        return step(*args, **kwargs)

    def spy_eval(self):
        seen.append(("eval", *state()))
        return evaluate(self)

    monkeypatch.setattr(loop_module, "train_step", spy_step)
    monkeypatch.setattr(Trainer, "evaluate", spy_eval)
    for on in (True, False):
        seen.clear()
        cfg = small_config(corpus_dir, steps=2, eval_every=2, save_every=2, deterministic=on)
        Trainer(cfg, tmp_path / str(on), make_task("lm"), progress=False).fit()
        assert [kind for kind, *_ in seen] == ["step", "step", "eval"]
        assert all(tuple(flags) == ((True, ":4096:8") if on else (False, None)) for _, *flags in seen)
        assert state() == (False, None)


def test_deterministic_kernels_put_back_an_earlier_setting_also_after_an_error(monkeypatch) -> None:
    from tformer.train.step import deterministic_kernels

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own: kept
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.raises(RuntimeError, match="inside"), deterministic_kernels(True):
            assert not torch.is_deterministic_algorithms_warn_only_enabled()
            raise RuntimeError("inside")
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_switching_deterministic_on_resume_is_said_on_a_gpu_only() -> None:
    from tformer.train.resume import warn_deterministic_switch

    cfg = small_config(Path("unused"), deterministic=True)
    saved = {"train_config": {"deterministic": False}}
    with pytest.warns(UserWarning, match="deterministic=True on resume of a run with deterministic=False"):
        warn_deterministic_switch(cfg, saved, "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_deterministic_switch(cfg, saved, "cpu")  # the same kernels on the CPU
        warn_deterministic_switch(cfg, {"train_config": {"deterministic": True}}, "cuda")
        warn_deterministic_switch(cfg.replace(deterministic=False), {"train_config": {}}, "cuda")


def test_train_records_and_the_report_hold_the_peak_memory(corpus_dir: Path, tmp_path: Path) -> None:
    """Each train record and the report carry the run's peak memory so far in MiB (on the CPU the process's
    peak resident set, which only grows; on a GPU torch's peak allocation, tests/cuda)."""
    import resource

    cfg = small_config(corpus_dir, steps=3, eval_every=3, save_every=3)
    report = Trainer(cfg, tmp_path / "r", make_task("lm"), progress=False).fit()
    peaks = [r["peak_memory_mib"] for r in _records(tmp_path / "r") if r["kind"] == "train"]
    assert len(peaks) == 3 and peaks == sorted(peaks) and peaks[0] > 10  # a process with torch: > 10 MiB
    now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert peaks[-1] <= report["peak_memory_mib"] <= now + 0.1


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
