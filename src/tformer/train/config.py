"""Training configuration: what to train on, how to optimise, how often to evaluate and save."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tformer.config import ModelConfig
from tformer.schema import Config


@dataclass(frozen=True)
class DataConfig(Config):
    """corpus: a name from tformer.data's registry or `text:<path>`; vocab_size: BPE vocabulary trained
    on the training split; seq_len: tokens per training sequence (LM) or max length (seq2seq)."""

    corpus: str = "shakespeare"
    vocab_size: int = 2048
    seq_len: int = 256
    direction: str = "de-en"
    max_train_docs: int | None = None

    def check(self) -> None:
        self._require(self.vocab_size >= 64, "vocab_size", "must be >= 64")
        self._require(self.seq_len >= 2, "seq_len", "must be >= 2")
        if self.max_train_docs is not None:
            self._require(self.max_train_docs >= 1, "max_train_docs", "must be >= 1 (or null for all)")


@dataclass(frozen=True)
class OptimConfig(Config):
    """AdamW with decay / no-decay groups and a learning-rate schedule.

    schedule: "cosine" (linear warm-up then cosine to min_lr_ratio * lr), "constant" (warm-up then flat),
    "wsd" (warm-up, stable, then linear decay over the last `decay_frac` of training).
    """

    lr: float = 3e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    schedule: Literal["cosine", "constant", "wsd"] = "cosine"
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    decay_frac: float = 0.2
    grad_clip: float = 1.0
    fused: bool = True

    def check(self) -> None:
        self._require(self.lr > 0, "lr", "must be > 0")
        self._require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        self._require(0 <= self.beta1 < 1, "beta1", "must be in [0, 1)")
        self._require(0 <= self.beta2 < 1, "beta2", "must be in [0, 1)")
        self._require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        self._require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        self._require(0 < self.decay_frac <= 1, "decay_frac", "must be in (0, 1]")
        self._require(self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 = no clipping)")


@dataclass(frozen=True)
class TrainConfig(Config):
    """A whole run: model, data, optimiser and the loop's cadence."""

    task: Literal["lm", "translation", "classification"] = "lm"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int = 1000
    batch_size: int = 16
    grad_accum: int = 1
    eval_every: int = 100
    eval_batches: int = 20
    save_every: int = 200
    keep_last: int = 2
    log_every: int = 10
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"
    compile: bool = False
    device: str = "auto"
    max_nonfinite: int = 3
    label_smoothing: float = 0.0
    sample_every: int = 0
    sample_tokens: int = 200

    def check(self) -> None:
        for name in (
            "steps",
            "batch_size",
            "grad_accum",
            "eval_every",
            "eval_batches",
            "save_every",
            "keep_last",
            "log_every",
            "max_nonfinite",
        ):
            self._require(getattr(self, name) >= 1, name, "must be >= 1")
        self._require(0 <= self.label_smoothing < 1, "label_smoothing", "must be in [0, 1)")
        self._require(self.sample_every >= 0, "sample_every", "must be >= 0 (0 = never)")
        self._require(
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
            "device",
            "must be 'auto', 'cpu', 'cuda' or 'cuda:N'",
        )
