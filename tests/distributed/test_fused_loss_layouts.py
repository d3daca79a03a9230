"""`fused_loss: true` under torchrun: DDP and FSDP2 take the fused head and loss inside the model's forward
(so their hooks see it), tensor parallelism keeps its vocabulary-split head and the logits path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.test_distributed import torchrun_train
from tests.words import write_word_corpus

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_word_corpus(root)
    return root


def logged(run: Path) -> list[tuple[float, float]]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in records if r["kind"] == "train"]


@pytest.mark.parametrize(
    "layout",
    [("parallel.data=ddp",), ("parallel.data=fsdp",), ("parallel.tensor=2",)],
    ids=["ddp", "fsdp", "tensor"],
)
def test_fused_loss_under_each_layout(layout: tuple[str, ...], tmp_path: Path, corpus: Path) -> None:
    """The same losses and gradient norms as the logits path (to fp32 rounding; under tensor parallelism,
    which ignores the switch, bit for bit), with label smoothing."""
    runs = {}
    for fused in (False, True):
        run = tmp_path / f"fused_{fused}"
        proc = torchrun_train(run, corpus, *layout, "label_smoothing=0.1", f"fused_loss={str(fused).lower()}")
        assert proc.returncode == 0, proc.stderr[-6000:]
        runs[fused] = logged(run)
    assert len(runs[False]) == 2
    if layout == ("parallel.tensor=2",):
        assert runs[True] == runs[False]
    else:
        for (loss, norm), (loss0, norm0) in zip(runs[True], runs[False]):
            assert loss == pytest.approx(loss0, rel=1e-5) and norm == pytest.approx(norm0, rel=1e-4)
