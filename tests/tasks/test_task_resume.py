"""Exact resume for the translation and classification tasks, which share the language model's trainer but
not its data: length buckets under a token budget (and BPE-dropout's sampled pairs), gradient accumulation,
dropout on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train.helpers import losses
from tformer.tasks import make_task
from tformer.train.loop import Trainer
from tformer.train.presets import tiny_classification, tiny_translation


def _config(task: str, dictionary_file: Path, bbc_root: Path):
    if task.startswith("translation"):  # token-budget buckets (the preset's batching), 2 micro-batches
        cfg = tiny_translation()
        data = cfg.data.replace(path=str(dictionary_file), max_tokens=200)
        if task == "translation-bpe-dropout":  # training pairs in sampled segmentations
            data = data.replace(bpe_dropout=0.1, bpe_dropout_copies=2)
        cfg = cfg.replace(data=data, grad_accum=2)
    else:
        cfg = tiny_classification()
        cfg = cfg.replace(data=cfg.data.replace(path=str(bbc_root)))
    model = cfg.model.replace(dropout=0.1)
    return cfg.replace(model=model, steps=6, save_every=3, eval_every=3, log_every=1)


@pytest.mark.parametrize("variant", ["translation", "translation-bpe-dropout", "classification"])
def test_a_run_stopped_off_a_save_step_and_resumed_logs_the_same_bits(
    variant: str, dictionary_file: Path, bbc_root: Path, tmp_path: Path
) -> None:
    cfg = _config(variant, dictionary_file, bbc_root)
    task = variant.split("-")[0]
    Trainer(cfg, tmp_path / "whole", make_task(task), progress=False).fit()
    Trainer(cfg, tmp_path / "part", make_task(task), progress=False).fit(until=4)  # saved at 4, off cadence
    resumed = Trainer(cfg, tmp_path / "part", make_task(task), resume=True, progress=False)
    assert resumed.state.step == 4
    resumed.fit()
    whole, part = losses(tmp_path / "whole"), losses(tmp_path / "part")
    assert (
        len(whole) == 6 and whole == part and len(set(whole)) == 6
    )  # every step's loss and norm, bit for bit

    def evals(run: Path) -> list[dict]:
        records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        return [{k: v for k, v in r.items() if k != "time_s"} for r in records if r["kind"] == "eval"]

    assert evals(tmp_path / "whole") == evals(tmp_path / "part") and len(evals(tmp_path / "whole")) == 2
