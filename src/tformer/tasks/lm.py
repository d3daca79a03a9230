"""Language modelling: byte-level BPE on the training split, packed fixed-length windows, next-token loss.

Evaluation reports loss per token (nats), perplexity, and bits per character, using the held-out split's
own token/character ratio: bits/char = loss * tokens / characters / ln 2.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from tformer.data.datasets import LMBatch, PackedLMDataset, collate_lm
from tformer.data.loader import make_loader
from tformer.data.tokenizer import Tokenizer
from tformer.generate.engine import generate
from tformer.generate.sampling import SamplingConfig
from tformer.tasks.corpus import (
    JOINED,
    check_data_unchanged,
    joins_pieces,
    load_task_corpus,
    train_tokenizer,
    write_manifest,
)
from tformer.tasks.losses import cross_entropy_sum, fuses_loss, loss_unit, perplexity, target_count
from tformer.tasks.stream import BatchStream, check_eval_args
from tformer.train.config import TrainConfig, require_task_arch

SAMPLE_PROMPT = "ROMEO.\n"


def lm_loss_sum(
    model: nn.Module, batch: LMBatch, label_smoothing: float = 0.0, fused: bool = False
) -> tuple[Tensor, int]:
    """(summed next-token loss, target count); `fused`: the model's fused head and loss, else its logits."""
    if fused:
        return model(batch.ids, targets=batch.targets, label_smoothing=label_smoothing), target_count(
            batch.targets
        )
    return cross_entropy_sum(model(batch.ids), batch.targets, label_smoothing)  # logits (B, T, V)


def load_or_train_tokenizer(run_dir: Path, texts: list[str], vocab_size: int) -> Tokenizer:
    path = run_dir / "tokenizer.json"
    if path.exists():
        return Tokenizer.load(path)
    tokenizer = train_tokenizer(texts, vocab_size)
    tokenizer.save(path)
    return tokenizer


class LMTask:
    """The task protocol of `tformer.tasks` for language modelling."""

    @property
    def loss_unit(self) -> str:
        """loss.png's axis."""
        return loss_unit("nats / token", self)

    def setup(self, cfg: TrainConfig, run_dir: Path, device: torch.device, resume: bool = False) -> None:
        self.cfg, self.device, self.run_dir = cfg, device, run_dir
        corpus = load_task_corpus(cfg.data, "lm")  # checks the corpus is text for a language model
        if (
            resume or (run_dir / "tokenizer.json").exists()
        ):  # a run going on (a fresh one deleted its tokenizer)
            check_data_unchanged(run_dir, corpus, cfg.data)
        else:
            write_manifest(run_dir, corpus, **({JOINED: True} if corpus.pieces else {}))
        self.join = joins_pieces(run_dir, corpus)  # how this run packs one file's chunks, from its start
        train_texts = corpus.lm_texts("train", cfg.data.max_train_docs, self.join)
        self.tokenizer = load_or_train_tokenizer(run_dir, train_texts, cfg.data.vocab_size)
        self.corpus = corpus
        limit = cfg.data.max_train_docs  # the train text is then that many documents, not the whole split
        what = f"the train split of {cfg.data.corpus!r}" + (
            f" (its first {limit} document(s), data.max_train_docs)" if limit is not None else ""
        )
        self.train_ds = PackedLMDataset.from_texts(self.tokenizer, train_texts, cfg.data.seq_len, what)
        self.val_ds, self.val_chars = self.split_dataset("val")
        if not resume:  # not needed to train, but better said before than after (`tformer eval` scores it)
            try:
                self.split_dataset("test")
            except ValueError as err:
                warnings.warn(f"{err}: `tformer eval --split test` will not score this run", stacklevel=2)

    def split_dataset(self, split: str) -> tuple[PackedLMDataset, int]:
        texts = self.corpus.lm_texts(split, join=self.join)
        what = f"the {split} split of {self.cfg.data.corpus!r}"
        ds = PackedLMDataset.from_texts(self.tokenizer, texts, self.cfg.data.seq_len, what)
        return ds, sum(len(t) + 1 for t in texts)

    def model_config(self, cfg: TrainConfig):
        require_task_arch(cfg)
        return cfg.model.replace(
            vocab_size=self.tokenizer.vocab_size, max_seq_len=max(cfg.model.max_seq_len, cfg.data.seq_len)
        )

    def train_loader(self, cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> BatchStream:
        """Rank `rank` of `world_size` takes every world_size-th batch of the one shared batch list."""
        loader = make_loader(
            self.train_ds,
            cfg.batch_size,
            shuffle=True,
            seed=cfg.seed,
            collate_fn=collate_lm,
            drop_last=True,
            rank=rank,
            world_size=world_size,
        )
        return BatchStream(loader)

    def loss(self, model: nn.Module, batch: LMBatch) -> tuple[Tensor, int]:
        return lm_loss_sum(model, batch, self.cfg.label_smoothing, fuses_loss(self.cfg))

    def count_targets(self, batch: LMBatch) -> int:
        return target_count(batch.targets)

    def count_inputs(self, batch: LMBatch) -> int:
        return batch.ids.numel()

    def evaluate(self, model: nn.Module, max_batches: int, split: str = "val") -> dict[str, float]:
        check_eval_args(max_batches, split)
        ds, chars = (self.val_ds, self.val_chars) if split == "val" else self.split_dataset(split)
        return evaluate_lm(
            model, ds, chars, self.cfg.batch_size, max_batches, self.device, fuses_loss(self.cfg)
        )

    def tokenizer_json(self) -> str:
        return self.tokenizer.to_json_str()

    def describe_result(self, report: dict) -> str:
        if "eval_loss" not in report:
            return "no evaluation recorded"
        split = "the validation works" if self.cfg.data.corpus == "shakespeare" else "the validation split"
        # what the reported evaluation scored (a resumed run's settings may differ from the ones it ran under)
        windows = report.get("windows", len(self.val_ds))
        scored = report.get("windows_scored", min(windows, self.cfg.eval_batches * self.cfg.batch_size))
        if scored < windows:
            more = f"tformer eval --run {self.run_dir} --split val"
            split += f": {scored} of its {windows} windows (eval_batches); more: {more}"
        return (
            f"validation loss {report['eval_loss']:.4f} nats/token | perplexity {report['perplexity']:.2f} | "
            f"{report['bits_per_char']:.3f} bits per character ({split})"
        )

    def sample_prompt(self) -> str:
        """ROMEO.\n on Shakespeare; elsewhere the first words of the validation split's first text."""
        if self.cfg.data.corpus == "shakespeare":
            return SAMPLE_PROMPT
        first = next((t for t in self.corpus.texts("val") if t.strip()), "")
        return " ".join(first.split()[:4]) or SAMPLE_PROMPT

    def show_sample(self, model: nn.Module, prompt: str | None = None, max_new_tokens: int = 160) -> str:
        prompt = self.sample_prompt() if prompt is None else prompt
        sampling = SamplingConfig(temperature=0.8, top_k=50, max_new_tokens=max_new_tokens, seed=0)
        budget = model.cfg.max_seq_len - 1
        ids = self.tokenizer.encode(prompt)[-budget:]
        sampling = sampling.replace(max_new_tokens=min(max_new_tokens, model.cfg.max_seq_len - len(ids)))
        out = generate(model, [ids], sampling, eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id)[0]
        return f"--- sample (temperature 0.8, top-k 50) ---\n{prompt}{self.tokenizer.decode(out)}\n---"


@torch.no_grad()
def evaluate_lm(
    model: nn.Module,
    ds: PackedLMDataset,
    chars: int,
    batch_size: int,
    max_batches: int | None,
    device: torch.device,
    fused: bool = False,
) -> dict[str, float]:
    """Loss over up to max_batches * batch_size windows spread evenly over the split (all when it fits);
    `windows` / `windows_scored` and `predictions` say how much of it was scored (max_batches None: all).
    `fused`: the model's fused head and loss (a run with fused_loss), which never makes the logits."""
    check_eval_args(max_batches)
    n = len(ds)
    take = n if max_batches is None else min(n, max_batches * batch_size)
    index = torch.linspace(0, n - 1, take).round().long().unique().tolist()
    total, count = 0.0, 0
    for i in range(0, len(index), batch_size):
        batch = collate_lm([ds[j] for j in index[i : i + batch_size]]).to(device)
        loss, targets = lm_loss_sum(model, batch, fused=fused)
        total, count = total + float(loss), count + targets
    loss = total / max(1, count)
    tokens_per_char = ds.n_tokens / max(1, chars)
    return {
        "eval_loss": loss,
        "perplexity": perplexity(loss),
        "bits_per_token": loss / math.log(2),
        "bits_per_char": loss * tokens_per_char / math.log(2),
        "windows": n,
        "windows_scored": len(index),
        "predictions": count,
    }
