"""Text classification: an encoder with a pooling head (cls or mean) over byte-level BPE tokens.

Each text keeps its first data.seq_len tokens (a BOS first when pooling is "cls": it is the token the
head reads); when more than 1% of the training texts are cut, data preparation warns. Batches are
length-bucketed. Evaluation reports loss, accuracy and macro-F1, and writes the confusion matrix as
confusion_<split>.png (and .json) into the run directory (`tformer eval`: eval_confusion_<split>.png,
so it never replaces training's).

Run directory, besides what the trainer writes: tokenizer.json and data.json (the corpus manifest,
whose "labels" are the class names in index order).
"""

from __future__ import annotations

import json
import numbers
import unicodedata
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.config import ModelConfig
from tformer.data.corpus_base import Document
from tformer.data.datasets import (
    ClassificationBatch,
    ClassificationCollator,
    ClassificationDataset,
    pad_sequences,
)
from tformer.data.tokenizer import Tokenizer
from tformer.eval.classification import ClassificationScores, plot_confusion, score_classification
from tformer.generate.engine import as_token_lists
from tformer.json_files import read_json
from tformer.model.checks import check_finite_outputs, check_finite_scores
from tformer.runs import LoadedRun, check_texts, require_task, truncated_note, warn_truncated, weights_words
from tformer.schema import ConfigError
from tformer.tasks.corpus import (
    MANIFEST,
    check_data_unchanged,
    load_task_corpus,
    train_tokenizer,
    warn_if_split_changed,
    write_manifest,
)
from tformer.tasks.losses import cross_entropy_sum, loss_unit
from tformer.tasks.stream import BatchStream, bucketed_train_stream, check_eval_args, check_own_items, spread
from tformer.tasks.translation import run_dir_of
from tformer.train.config import TrainConfig, require_task_arch


class Classifier:
    """A trained encoder classifier with its tokenizer and class names: texts in, probabilities out."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, labels: Sequence[str], max_len: int) -> None:
        if len(labels) != model.cfg.n_classes:
            raise ValueError(f"{len(labels)} class names for a model with {model.cfg.n_classes} classes")
        self.model, self.tokenizer, self.labels = model, tokenizer, tuple(labels)
        self.add_bos = model.cfg.pooling == "cls"
        self.max_len = min(max_len, model.cfg.max_seq_len)
        self.special = "BOS" if self.add_bos else None  # the token max_len counts beside the text's own

    def encode(self, texts: Sequence[str]) -> tuple[list[list[int]], list[int]]:
        """Token ids per text (its first max_len tokens) and the indices of the texts that were cut."""
        texts = check_texts(texts)
        ids = self.tokenizer.encode_batch(list(texts), add_bos=self.add_bos)
        return [x[: self.max_len] for x in ids], [i for i, x in enumerate(ids) if len(x) > self.max_len]

    @torch.no_grad()
    def probabilities(self, ids: Sequence[list[int]], batch_size: int = 32) -> Tensor:
        """(N, C) class probabilities, in the order of `ids` (lists of integer token ids)."""
        ids = as_token_lists(ids, self.model.cfg.vocab_size, "text")
        if any(len(x) == 0 for x in ids):
            raise ValueError("cannot classify an empty text")
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        device = next(self.model.parameters()).device
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out = torch.empty(len(ids), len(self.labels))
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                tokens, mask = pad_sequences([torch.tensor(ids[i]) for i in chunk], self.tokenizer.pad_id)
                logits = self.model(tokens.to(device), mask.to(device))  # (B, C)
                check_finite_outputs(logits, "class logits")
                out[chunk] = logits.float().softmax(dim=-1).cpu()
        finally:  # also when a batch raises: the caller's model keeps its mode
            self.model.train(was_training)
        return out

    def classify(self, texts: Sequence[str], warn: bool = True) -> list[tuple[str, dict[str, float]]]:
        """(label, class probabilities) per text; texts longer than max_len tokens are cut (`warn`: with a
        warning)."""
        ids, cut = self.encode(texts)
        if warn:
            warn_truncated(cut, self.max_len, self.special)
        probs = self.probabilities(ids)
        return [(self.labels[int(p.argmax())], dict(zip(self.labels, p.tolist()))) for p in probs]


def classification_loss_sum(
    model: nn.Module, batch: ClassificationBatch, label_smoothing: float = 0.0
) -> tuple[Tensor, int]:
    return cross_entropy_sum(model(batch.ids, batch.mask), batch.labels, label_smoothing, "labels")  # (B, C)


class ClassificationTask:
    """The task protocol of `tformer.tasks` for text classification."""

    @property
    def loss_unit(self) -> str:
        """loss.png's axis: one label per text."""
        return loss_unit("nats / text", self)

    def setup(self, cfg: TrainConfig, run_dir: Path, device: torch.device, resume: bool = False) -> None:
        self.cfg, self.device, self.run_dir = cfg, device, run_dir
        self.corpus = load_task_corpus(cfg.data, "classification")
        if resume:
            check_data_unchanged(run_dir, self.corpus, cfg.data)
        self.labels = self.corpus.labels
        train = spread(self.corpus["train"], cfg.data.max_train_docs)
        path = run_dir / "tokenizer.json"
        if path.exists():  # resuming: the run's own vocabulary
            self.tokenizer = Tokenizer.load(path)
        else:
            self.tokenizer = train_tokenizer([d.text for d in train], cfg.data.vocab_size)
            self.tokenizer.save(path)
        self.add_bos = cfg.model.pooling == "cls"
        self.collate = ClassificationCollator(self.tokenizer.pad_id)
        self.train_ds = self.dataset(train)
        self.val_ds = self.dataset(self.corpus["val"])
        if not resume:
            write_manifest(
                run_dir,
                self.corpus,
                train_docs_used=len(train),
                train_docs_truncated=self.train_ds.n_truncated,
            )
            warn_train_truncated(self.train_ds.n_truncated, len(train), cfg.data.seq_len, self.add_bos)

    def dataset(self, docs: Sequence[Document]) -> ClassificationDataset:
        index = {label: i for i, label in enumerate(self.labels)}
        texts, labels = [d.text for d in docs], [index[d.label] for d in docs]
        return ClassificationDataset.from_texts(
            self.tokenizer, texts, labels, self.cfg.data.seq_len, self.add_bos
        )

    def model_config(self, cfg: TrainConfig):
        require_task_arch(cfg)
        if cfg.model.n_classes not in (ModelConfig.n_classes, len(self.labels)):  # a value of the user's
            raise ConfigError(
                f"model.n_classes is set from the corpus's {len(self.labels)} labels: leave it out "
                f"(or at {len(self.labels)}), got {cfg.model.n_classes}"
            )
        return cfg.model.replace(
            vocab_size=self.tokenizer.vocab_size,
            n_classes=len(self.labels),
            max_seq_len=max(cfg.model.max_seq_len, cfg.data.seq_len),
        )

    def train_loader(self, cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> BatchStream:
        return bucketed_train_stream(self.train_ds, self.collate, cfg, rank, world_size)

    def loss(self, model: nn.Module, batch: ClassificationBatch) -> tuple[Tensor, int]:
        return classification_loss_sum(model, batch, self.cfg.label_smoothing)

    def count_targets(self, batch: ClassificationBatch) -> int:
        return batch.labels.numel()

    def count_inputs(self, batch: ClassificationBatch) -> int:
        return int(batch.mask.sum())

    def evaluate(self, model: nn.Module, max_batches: int, split: str = "val") -> dict[str, float]:
        check_eval_args(max_batches, split)
        ds = self.val_ds if split == "val" else self.dataset(self.corpus[split])
        result, scores = evaluate_dataset(
            model, ds, self.collate, self.labels, self.cfg.batch_size, max_batches
        )
        if not dist.is_initialized() or dist.get_rank() == 0:  # under torchrun every rank evaluates alike
            write_confusion(scores, self.run_dir, split)
        return result

    def tokenizer_json(self) -> str:
        return self.tokenizer.to_json_str()

    def describe_result(self, report: dict) -> str:
        if "eval_loss" not in report:
            return "no evaluation recorded"
        return (
            f"validation loss {report['eval_loss']:.4f} | accuracy {report['accuracy']:.2%} | "
            f"macro-F1 {report['macro_f1']:.4f} (confusion matrix: {self.run_dir / 'confusion_val.png'})\n"
            f"test split: tformer eval --run {self.run_dir}"
        )

    def show_sample(self, model: nn.Module, n: int = 5) -> str:
        docs = spread(self.corpus["test"], n)
        classifier = Classifier(model, self.tokenizer, self.labels, self.cfg.data.seq_len)
        lines = ["--- test texts ---"]
        for doc, (label, probs) in zip(docs, classifier.classify([d.text for d in docs], warn=False)):
            headline = doc.text.split("\n", 1)[0][:70]
            lines.append(f"{headline!r}: predicted {label} ({probs[label]:.2f}), true {doc.label}")
        return "\n".join(lines) + "\n---"


def warn_train_truncated(n_truncated: int, n_texts: int, seq_len: int, add_bos: bool) -> None:
    """Warn when more than 1% of the training texts are cut to seq_len tokens (as translation warns of the
    pairs it leaves out): recorded in data.json alone, it went unseen."""
    if n_truncated > 0.01 * n_texts:
        own = seq_len - 1 if add_bos else seq_len  # cls pooling's BOS takes one of the seq_len slots
        bos = f" (data.seq_len={seq_len} with the BOS that cls pooling puts first)" if add_bos else ""
        warnings.warn(
            f"{n_truncated:,} of the {n_texts:,} training texts are longer than {own} tokens{bos} and keep "
            f"only their first {own}",
            UserWarning,
            stacklevel=3,
        )


def eval_order(ds: ClassificationDataset, batch_size: int, max_batches: int | None) -> list[int]:
    """The texts an evaluation scores, in the order it batches them: by length, and with max_batches,
    that many batches' worth spread over the lengths."""
    lengths = ds.lengths()
    order = sorted(range(len(ds)), key=lambda i: lengths[i])
    return order if max_batches is None else spread(order, max_batches * batch_size)


@torch.no_grad()
def evaluate_dataset(
    model: nn.Module,
    ds: ClassificationDataset,
    collate: ClassificationCollator,
    labels: Sequence[str],
    batch_size: int,
    max_batches: int | None = None,
) -> tuple[dict[str, float], ClassificationScores]:
    """Loss, accuracy and macro-F1 over up to max_batches length-sorted batches (`eval_order`)."""
    device = next(model.parameters()).device
    order = eval_order(ds, batch_size, max_batches)
    total, y_true, y_pred = 0.0, [], []
    for start in range(0, len(order), batch_size):
        batch = collate([ds[i] for i in order[start : start + batch_size]]).to(device)
        logits = model(batch.ids, batch.mask)  # (B, C)
        total += float(F.cross_entropy(logits.float(), batch.labels, reduction="sum"))
        y_true += batch.labels.tolist()
        y_pred += logits.argmax(dim=-1).tolist()
    scores = score_classification(y_true, y_pred, labels)
    loss = total / max(1, len(y_true))
    # (no perplexity: e^loss of one choice among C classes means nothing a reader would look for)
    return {"eval_loss": loss, "accuracy": scores.accuracy, "macro_f1": scores.macro_f1}, scores


def write_confusion(
    scores: ClassificationScores,
    run_dir: Path,
    split: str,
    prefix: str = "",
    suffix: str = "",
    run: LoadedRun | None = None,
) -> Path | None:
    """run_dir/<prefix>confusion_<split><suffix>.png and .json; None when the directory is not writable.
    `run`: the weights scored (`tformer eval`, which may score an older checkpoint into the same files), named
    in the JSON ("checkpoint_step", "averaged_steps") and in the plot's title."""
    name = f"{prefix}confusion_{split}{suffix}"
    about = {} if run is None else {"checkpoint_step": run.step, "averaged_steps": list(run.averaged_steps)}
    try:
        (run_dir / f"{name}.json").write_text(json.dumps(about | scores.to_dict(), indent=2))
        title = f"{split}: accuracy {scores.accuracy:.1%}, macro-F1 {scores.macro_f1:.3f} (n={scores.n})"
        if run is not None:
            title += f", {run.weights_words()}"
        return plot_confusion(scores, run_dir / f"{name}.png", title)
    except OSError:
        return None


# ----------------------------------------------------------------------------- trained runs


def run_labels(run: LoadedRun) -> tuple[str, ...]:
    """A run's class names: from its data.json, else from its corpus."""
    path = run_dir_of(run.checkpoint) / MANIFEST
    if path.exists():
        labels = read_json(path).get("labels")
        if labels:
            return tuple(labels)
    return load_task_corpus(run.train_config.data, "classification").labels


def load_classifier(run: LoadedRun | str | Path) -> Classifier:
    """The Classifier of a run (loaded with `tformer.runs.load_run`, or its path)."""
    run = require_task(run, "classification", "classification")
    cfg = run.train_config
    return Classifier(run.model, run.tokenizer, run_labels(run), cfg.data.seq_len)


def evaluate_run(run: LoadedRun | str | Path, split: str = "test", max_batches: int | None = None) -> dict:
    """Loss, accuracy, macro-F1, per-class scores and the confusion matrix of a run (or its path) on a
    split; the matrix also goes to <run>/eval_confusion_<split>.png (training's evaluations write
    confusion_val.png; a sample of the split, max_batches, to eval_confusion_<split>_sample.png)."""
    check_eval_args(max_batches, split)
    run = require_task(run, "classification", "classification")
    cfg = run.train_config
    corpus = load_task_corpus(cfg.data, "classification")
    warn_if_split_changed(run_dir_of(run.checkpoint), corpus, split)
    docs = corpus[split]
    if split == "train":  # as the run trained on it (data.max_train_docs)
        docs = spread(docs, cfg.data.max_train_docs)
    unknown = f"the {split} split holds labels the run never trained on"
    cure = "restore the data's label names, or train a new run on it"
    return _evaluate(run, docs, f"{cfg.data.corpus} {split} split", split, max_batches, (unknown, cure))


def evaluate_labelled(
    run: LoadedRun | str | Path,
    items: Sequence[tuple[str, str]],
    name: str | None = None,
    max_batches: int | None = None,
) -> dict:
    """`evaluate_run` on labelled texts of the caller's own, (label, text) each, every one scored (repeats
    too, as in a test set), each label one of the run's classes; the result's "data" is `name` (or
    "labelled texts") and the matrix goes to <run>/eval_confusion_labelled[_<name>].png."""
    check_eval_args(max_batches)
    run = require_task(run, "classification", "classification")
    check_own_items(items, "items", ("label", "text"), name)
    classes = set(run_labels(run))  # a label as written, else without its surrounding spaces ("sport ")
    docs = [
        Document(f"{name or 'labelled'}:{i + 1}", text.strip(), label if label in classes else label.strip())
        for i, (label, text) in enumerate(items)
    ]
    unknown = "the labelled texts hold labels the run never trained on"
    cure = "use the run's class names"
    where = "labelled" + (f"_{name}" if name else "")
    return _evaluate(run, docs, name or "labelled texts", where, max_batches, (unknown, cure))


def _evaluate(
    run: LoadedRun,
    docs: Sequence[Document],
    data: str,
    where: str,
    max_batches: int | None,
    unknown_words: tuple[str, str],
) -> dict:
    """Score `docs` (a sample of them with max_batches); the matrix goes to eval_confusion_<where>[...].png."""
    classifier = load_classifier(run)
    cfg = run.train_config
    index = {label: i for i, label in enumerate(classifier.labels)}
    unknown = sorted({d.label for d in docs} - index.keys())
    if unknown:  # a label folder renamed or added since the run trained: no class of the model is it
        what, cure = unknown_words
        raise ValueError(
            f"{what}: {', '.join(map(repr, unknown))} (its classes: {', '.join(map(repr, classifier.labels))}); "
            f"{cure}"
        )
    ids, cut = classifier.encode([d.text for d in docs])
    ds = ClassificationDataset(ids, [index[d.label] for d in docs], classifier.max_len)
    collate = ClassificationCollator(classifier.tokenizer.pad_id)
    result, scores = evaluate_dataset(run.model, ds, collate, classifier.labels, cfg.batch_size, max_batches)
    check_finite_scores(result)  # before a matrix of NaN replaces one
    sample = "_sample" if scores.n < len(docs) else ""  # --max-batches: never in place of the whole split's
    png = write_confusion(
        scores, run_dir_of(run.checkpoint), where, prefix="eval_", suffix=sample + run.file_suffix(), run=run
    )
    return {
        "data": data,
        "checkpoint_step": run.step,
        "averaged_steps": list(run.averaged_steps),
        "texts_truncated": len(
            set(cut) & set(eval_order(ds, cfg.batch_size, max_batches))
        ),  # of those scored
        **result,
        "n": scores.n,
        "texts": len(docs),  # the split's (n: those scored, fewer with max_batches)
        "scored": "labelled" if where.startswith("labelled") else "split",  # the caller's texts, or a split
        "per_class": scores.per_class,
        "confusion": scores.to_dict()["confusion"],
        "labels": list(scores.labels),
        "confusion_png": str(png) if png else None,
    }


def one_line_label(label: str) -> str:
    """A label as text output prints it: control characters and line or paragraph separators escaped
    (`\\n`, `\\x1b`), so that one line answers one text. Labels holding them are refused since 2026-12-04;
    a run trained before keeps its names, and its JSON output keeps them as they are."""
    return "".join(
        c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in ("Cc", "Zl", "Zp") else c
        for c in label
    )


def format_result(result: dict) -> str:
    n, texts = result["n"], result.get("texts", result["n"])  # a sample of the split (--max-batches): said
    whose = "the labelled texts'" if result.get("scored") == "labelled" else "the split's"
    scored = f"{n} of {whose} {texts} texts, --max-batches" if n < texts else f"{n} texts"
    lines = [
        f"{result['data']} ({weights_words(result['checkpoint_step'], result.get('averaged_steps', ()))}, "
        f"{scored}): accuracy "
        f"{result['accuracy']:.2%} | macro-F1 {result['macro_f1']:.4f} | loss {result['eval_loss']:.4f}"
        + truncated_note(result["texts_truncated"], "text")
    ]
    for name, s in result["per_class"].items():
        lines.append(
            f"  {one_line_label(name):<14} precision {s['precision']:.3f}  recall {s['recall']:.3f}  f1 {s['f1']:.3f}  n {s['support']}"
        )
    if result["confusion_png"]:
        lines.append(f"confusion matrix: {result['confusion_png']}")
    return "\n".join(lines)
