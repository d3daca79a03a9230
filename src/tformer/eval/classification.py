"""Classification metrics: accuracy, per-class precision / recall / F1, macro-F1, confusion matrix.

Shapes: y_true, y_pred (N,) class indices into `labels`; the confusion matrix is (C, C) with rows the
true class and columns the predicted one.
"""

from __future__ import annotations

import functools
import numbers
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ClassificationScores:
    accuracy: float  # 0..1
    macro_f1: float  # unweighted mean of the per-class F1 (a class never seen nor predicted counts 0)
    labels: tuple[str, ...]
    confusion: tuple[tuple[int, ...], ...]  # [true][predicted] counts
    per_class: dict[str, dict[str, float]] = field(default_factory=dict)  # precision, recall, f1, support

    @property
    def n(self) -> int:
        return sum(map(sum, self.confusion))

    def to_dict(self) -> dict:
        return {
            "accuracy": self.accuracy,
            "macro_f1": self.macro_f1,
            "n": self.n,
            "labels": list(self.labels),
            "confusion": [list(row) for row in self.confusion],
            "per_class": self.per_class,
        }


def _safe_div(a: float, b: float) -> float:
    return a / b if b else 0.0


def _class_ids(ids, name: str) -> list[int]:
    """Class ids from a list, a 1-D NumPy array or tensor; anything else that is not whole numbers is
    refused by name."""
    if hasattr(ids, "tolist") and getattr(ids, "ndim", 1) == 1:  # numpy arrays, torch tensors
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{name} must be a sequence of class ids, got {type(ids).__name__}")
    bad = next((x for x in ids if isinstance(x, bool) or not isinstance(x, numbers.Integral)), None)
    if bad is not None:
        raise TypeError(f"{name} must hold class ids (ints), got {bad!r}")
    return [int(x) for x in ids]


def score_classification(
    y_true: Sequence[int], y_pred: Sequence[int], labels: Sequence[str]
) -> ClassificationScores:
    y_true, y_pred = _class_ids(y_true, "y_true"), _class_ids(y_pred, "y_pred")
    if len(y_true) != len(y_pred):
        raise ValueError(f"{len(y_true)} true labels but {len(y_pred)} predictions")
    if not y_true:
        raise ValueError("nothing to score: no examples")
    if isinstance(labels, str) or len(set(labels)) != len(labels):  # per_class is keyed by name
        raise ValueError(f"labels must be distinct class names, one per class id, got {labels!r}")
    c = len(labels)
    matrix = [[0] * c for _ in range(c)]
    for t, p in zip(y_true, y_pred):
        if not (0 <= t < c and 0 <= p < c):
            raise ValueError(f"class index out of range for {c} labels: true {t}, predicted {p}")
        matrix[t][p] += 1
    per_class, f1s = {}, []
    for i, name in enumerate(labels):
        tp = matrix[i][i]
        predicted = sum(matrix[r][i] for r in range(c))
        support = sum(matrix[i])
        precision, recall = _safe_div(tp, predicted), _safe_div(tp, support)
        f1 = _safe_div(2 * precision * recall, precision + recall)
        per_class[name] = {"precision": precision, "recall": recall, "f1": f1, "support": support}
        f1s.append(f1)
    accuracy = sum(matrix[i][i] for i in range(c)) / len(y_true)
    return ClassificationScores(
        accuracy, sum(f1s) / c, tuple(labels), tuple(tuple(r) for r in matrix), per_class
    )


MAX_INCHES = 40.0  # the confusion plot's side at most (4,400 pixels at 110 dpi)
MAX_ANNOTATED = 40  # labels up to which each cell shows its count


@functools.cache
def _drawable_chars() -> frozenset[int] | None:
    """The code points the plot's font (with matplotlib's fallback fonts) has glyphs for; None when that
    cannot be told (labels are then drawn as written). Read once per process: a training run plots at every
    evaluation."""
    try:
        from matplotlib import font_manager

        prop = font_manager.FontProperties()
        find = getattr(font_manager.fontManager, "_find_fonts_by_props", None)  # the fallback list (>= 3.6)
        paths = find(prop) if find is not None else [font_manager.findfont(prop)]
        return frozenset(c for path in paths for c in font_manager.get_font(path).get_charmap())
    except Exception:  # an unreadable font file, matplotlib's internals changed: no escaping, no failure
        return None


def _tick_label(name: str, chars: frozenset[int] | None) -> str:
    """A label as the plot draws it: characters the font lacks (CJK in DejaVu Sans: empty boxes) as their
    escapes (\\u4f53), bytes that are not text as escapes, "$" not as maths ("$x$" had gone to
    matplotlib's math renderer, "$\\foo$" had stopped the run)."""
    if chars is None:
        name = name.encode("utf-8", "backslashreplace").decode("utf-8")
    else:
        name = "".join(c if ord(c) in chars else ascii(c)[1:-1] for c in name)
    return name.replace("$", r"\$")


def plot_confusion(scores: ClassificationScores, path: str | Path, title: str = "") -> Path:
    """Write the confusion matrix as a PNG: counts in each cell, colour by share of the true class. A label
    character the font has no glyph for is written as its escape (`\\u4f53`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matrix = scores.confusion
    chars = _drawable_chars()
    labels = [_tick_label(name, chars) for name in scores.labels]  # a label is a folder's name: any text
    rows = [[_safe_div(v, sum(row)) for v in row] for row in matrix]
    size = min(1.2 + 0.9 * len(labels), MAX_INCHES)  # hundreds of labels: one readable-size page, not GBs
    fig, ax = plt.subplots(figsize=(size + 1.5, size))
    image = ax.imshow(rows, cmap="Blues", vmin=0.0, vmax=1.0)
    if len(labels) <= MAX_ANNOTATED:  # beyond that the counts would overlap: the colours say it
        for i, row in enumerate(matrix):
            for j, count in enumerate(row):
                ax.text(
                    j, i, str(count), ha="center", va="center", color="white" if rows[i][j] > 0.5 else "black"
                )
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title or f"accuracy {scores.accuracy:.1%}, macro-F1 {scores.macro_f1:.3f} (n={scores.n})")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():  # labels are escaped where glyphs are missing: nothing left to say
            warnings.filterwarnings("ignore", message="Glyph .* missing from font", category=UserWarning)
            fig.tight_layout()
            fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
