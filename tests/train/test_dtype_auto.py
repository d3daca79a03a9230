"""dtype=auto: bf16 autocast where the device multiplies bf16 natively, decided once per run."""

from __future__ import annotations

import torch

from tests.train.helpers import small_config


def test_dtype_auto_is_decided_once_and_recorded(corpus_dir, tmp_path, monkeypatch) -> None:
    """dtype=auto: bfloat16 where the CPU multiplies bf16 natively, float32 elsewhere, written into the
    run's config.json; a resume keeps what the run recorded, on a machine that would decide otherwise."""
    import json

    from tformer.tasks import make_task
    from tformer.train import step
    from tformer.train.loop import Trainer

    cfg = small_config(corpus_dir, dtype="auto", steps=2, save_every=1, eval_every=2)
    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(step, "cpu_has_native_bf16", lambda native=native: native)
        assert step.resolve_dtype("auto", torch.device("cpu")) == expected
        assert step.resolve_dtype("float32", torch.device("cpu")) == "float32"  # asked for: as asked
        run = tmp_path / expected
        Trainer(cfg, run, make_task("lm"), progress=False).fit(until=1)
        assert json.loads((run / "config.json").read_text())["dtype"] == expected
    monkeypatch.setattr(step, "cpu_has_native_bf16", lambda: True)  # the float32 run resumed elsewhere
    resumed = Trainer(cfg, tmp_path / "float32", make_task("lm"), resume=True, progress=False)
    assert resumed.cfg.dtype == "float32"
    assert resumed.fit()["step"] == 2
