"""Classification details from an audit: training says when it cuts texts to data.seq_len, the confusion
plot draws labels its font has no glyphs for."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tformer.eval import classification as E
from tformer.tasks import make_task
from tformer.tasks.classification import format_result, warn_train_truncated
from tformer.train.presets import tiny_classification


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_training_says_how_many_texts_it_cuts_to_seq_len(
    bbc_root: Path, tmp_path: Path, pooling: str
) -> None:
    """Texts longer than data.seq_len keep their first tokens: that had been recorded in data.json alone
    (739 of the 1,702 BBC training texts in the bbc preset), as translation's too-long pairs once were."""
    cfg = tiny_classification()
    cfg = cfg.replace(data=cfg.data.replace(path=str(bbc_root)), model=cfg.model.replace(pooling=pooling))
    task = make_task("classification")
    with pytest.warns(UserWarning) as seen:
        task.setup(cfg, tmp_path, torch.device("cpu"))
    cut, total = task.train_ds.n_truncated, len(task.corpus["train"])
    assert 0 < cut <= total  # the premise: 60-word bodies, 64 tokens of a 300-token vocabulary
    own, bos = (
        (63, " (data.seq_len=64 with the BOS that cls pooling puts first)") if pooling == "cls" else (64, "")
    )
    said = [str(w.message) for w in seen if "training texts" in str(w.message)]
    assert said == [
        f"{cut} of the {total} training texts are longer than {own} tokens{bos} and keep only their first {own}"
    ]


def test_a_few_cut_texts_are_not_warned_about() -> None:
    """Translation's rule: more than 1% of the training texts."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_train_truncated(0, 10, 64, False)
        warn_train_truncated(2, 200, 64, False)
    with pytest.warns(UserWarning, match="^3 of the 200 training texts are longer than 64 tokens and"):
        warn_train_truncated(3, 200, 64, False)
    with pytest.warns(UserWarning, match="^1,234 of the 2,000 training texts"):
        warn_train_truncated(1234, 2000, 64, False)


def _result(n: int, texts: int) -> dict:
    return {
        "data": "bbc-news val split", "checkpoint_step": 60, "averaged_steps": [], "texts_truncated": 0,
        "eval_loss": 1.0, "accuracy": 0.5, "macro_f1": 0.5, "n": n, "texts": texts, "per_class": {},
        "confusion_png": None,
    }  # fmt: skip


def test_the_result_line_says_when_it_scored_a_sample() -> None:
    """LM eval says "N of its M windows (--max-batches)"; classification had said "16 texts" alone."""
    assert "(step 60, 16 of the split's 213 texts, --max-batches): accuracy" in format_result(
        _result(16, 213)
    )
    assert "(step 60, 213 texts): accuracy" in format_result(_result(213, 213))
    older = _result(16, 16)
    del older["texts"]  # a result dict made before "texts" existed
    assert "(step 60, 16 texts): accuracy" in format_result(older)


def test_the_confusion_png_escapes_characters_its_font_lacks(tmp_path: Path, monkeypatch) -> None:
    """DejaVu Sans has no CJK glyphs: such labels had been empty boxes (and matplotlib warned "Glyph ...
    missing"); they are written as escapes, characters the font has as they are."""
    import matplotlib.axes

    ticks: list[list[str]] = []
    real = matplotlib.axes.Axes.set_yticks
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "set_yticks",
        lambda self, t, labels=None, **k: ticks.append(list(labels)) or real(self, t, labels, **k),
    )
    scores = E.score_classification([0, 1, 2, 3], [0, 1, 1, 3], ["体育", "économie", "$x$", "a\udcffb"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Glyph ... missing from font(s)"
        E.plot_confusion(scores, tmp_path / "real_font.png")
    chars = E._drawable_chars()
    assert chars is not None and ord("é") in chars
    drawn = ticks[-1]
    assert drawn[1:] == ["économie", r"\$x\$", r"a\udcffb"]
    assert drawn[0] == ("体育" if ord("体") in chars else r"\u4f53\u80b2")  # a CJK font: drawn
    monkeypatch.setattr(E, "_drawable_chars", lambda: frozenset(map(ord, "abcdefghijklmnopqrstuvwxyz$")))
    E.plot_confusion(scores, tmp_path / "ascii_font.png")
    assert ticks[-1] == [r"\u4f53\u80b2", r"\xe9conomie", r"\$x\$", r"a\udcffb"]
    monkeypatch.setattr(E, "_drawable_chars", lambda: None)  # the font cannot be read: drawn as written
    E.plot_confusion(scores, tmp_path / "unknown_font.png")
    assert ticks[-1] == ["体育", "économie", r"\$x\$", r"a\udcffb"]
