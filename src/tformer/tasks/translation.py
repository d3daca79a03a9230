"""Machine translation: sentence pairs, joint or separate byte-level BPE, length-bucketed batches,
label-smoothed cross-entropy, and BLEU / chrF (sacrebleu) of decoded held-out sentences.

Run directory, besides what the trainer writes: tokenizer.json (the joint vocabulary, or the target
one), src_tokenizer.json (separate vocabularies only) and data.json (the corpus manifest: source, split
rule, counts and split hashes, plus how many training pairs were too long).

Evaluation during training: loss per target token on the validation split (no smoothing) and greedy
BLEU / chrF on its sentences. `evaluate_run` (for `tformer eval`) scores a split with beam search and
reports the copy-the-source baseline beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tformer.data.bpe_dropout import BPEDropout
from tformer.data.corpus_base import Corpus, Pair
from tformer.data.datasets import Seq2SeqBatch, Seq2SeqCollator, Seq2SeqDataset, pad_sequences
from tformer.data.tokenizer import Tokenizer
from tformer.eval.attention import AttentionMap, cross_attention_map
from tformer.eval.bleu import bleu_tokenizer, score_translations
from tformer.generate.beam import Hypothesis, SearchConfig, check_n_best, search_nbest
from tformer.generate.engine import as_token_lists
from tformer.model.ensemble import Ensemble
from tformer.runs import LoadedRun, check_texts, require_task, warn_truncated
from tformer.schema import ConfigError
from tformer.tasks.corpus import (
    check_data_unchanged,
    load_task_corpus,
    train_tokenizer,
    write_manifest,
)
from tformer.tasks.losses import cross_entropy_sum, fuses_loss, loss_unit, perplexity, target_count
from tformer.tasks.stream import BatchStream, bucketed_train_stream, check_eval_args, spread
from tformer.train.config import DataConfig, TrainConfig, require_task_arch

SRC_TOKENIZER = "src_tokenizer.json"
EVAL_SEARCH = SearchConfig(method="greedy", batch_size=64)
TEST_SEARCH = SearchConfig(method="beam", beam_size=4, length_penalty=0.6)
# every character str.splitlines splits at, and tab (a column separator): a space in a translation
ONE_LINE = str.maketrans(dict.fromkeys("\n\r\t\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029", " "))


def load_translation_corpus(data: DataConfig) -> Corpus:
    extra = dict(terms=data.dictionary_terms) if data.dictionary_terms else {}
    if data.adds_alternatives:
        extra["alternatives"] = True
    return load_task_corpus(data, "translation", direction=data.direction, **extra)


def run_dir_of(checkpoint: Path) -> Path:
    """The run directory of a checkpoint (run/checkpoints/step_N -> run)."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint


def truncate(ids: list[int], max_len: int, eos_id: int) -> tuple[list[int], bool]:
    """Cut a source (ending in EOS) to max_len tokens, keeping the EOS; True when it was cut."""
    if len(ids) <= max_len:
        return ids, False
    return ids[: max_len - 1] + [eos_id], True


class Translator:
    """A trained encoder-decoder with its tokenizers: text in, text out (batched, length-sorted)."""

    def __init__(self, model: nn.Module, src_tok: Tokenizer, tgt_tok: Tokenizer, max_src_len: int) -> None:
        self.model, self.src_tok, self.tgt_tok = model, src_tok, tgt_tok
        self.max_src_len = min(max_src_len, model.cfg.max_seq_len)
        self.special = "EOS"  # max_src_len counts each source's EOS

    def encode(self, texts: Sequence[str]) -> tuple[list[list[int]], list[int]]:
        """Source ids (with EOS) per text, and the indices of the texts that were truncated."""
        texts = check_texts(texts)
        out, cut = [], []
        for i, ids in enumerate(self.src_tok.encode_batch(list(texts), add_eos=True)):
            ids, was_cut = truncate(ids, self.max_src_len, self.src_tok.eos_id)
            out.append(ids)
            if was_cut:
                cut.append(i)
        return out, cut

    def hypotheses(
        self, sources: Sequence[list[int]], cfg: SearchConfig, generator: torch.Generator | None = None
    ) -> list[Hypothesis]:
        """The best hypothesis per source, searched in length-sorted batches. generator: for sampling, the
        stream to draw from (one that goes on across calls: a caller that splits one input into several
        calls passes one); None: a new one seeded with cfg.seed."""
        return [hyps[0] for hyps in self.nbest(sources, cfg, 1, generator)]

    def nbest(
        self,
        sources: Sequence[list[int]],
        cfg: SearchConfig,
        n_best: int,
        generator: torch.Generator | None = None,
    ) -> list[list[Hypothesis]]:
        """The n_best best hypotheses per source, best first (`tformer.generate.beam.search_nbest`: beam
        search, n_best at most its beam size), as `hypotheses` searches them."""
        _check_search(cfg, n_best)  # (also for no sources: not only at the first batch)
        sources = as_token_lists(sources, self.model.cfg.resolved_src_vocab_size, "source")
        device = next(self.model.parameters()).device
        order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
        out: list[list[Hypothesis]] = [[] for _ in sources]
        was_training = self.model.training
        self.model.eval()
        try:
            # one stream over every batch: a batch that reseeded would repeat the draws of the one before
            if generator is None and cfg.method == "sample":
                generator = torch.Generator(device=device).manual_seed(cfg.seed)
            for start in range(0, len(order), cfg.batch_size):
                chunk = order[start : start + cfg.batch_size]
                src, mask = pad_sequences([torch.tensor(sources[i]) for i in chunk], self.src_tok.pad_id)
                found = search_nbest(
                    self.model,
                    src.to(device),
                    mask.to(device),
                    cfg,
                    n_best=n_best,
                    bos_id=self.tgt_tok.bos_id,
                    eos_id=self.tgt_tok.eos_id,
                    banned=(self.tgt_tok.pad_id, self.tgt_tok.bos_id),
                    generator=generator,
                )
                for i, hyps in zip(chunk, found):
                    out[i] = hyps
        finally:  # also when a batch raises: the caller's model keeps its mode
            self.model.train(was_training)
        return out

    def translate(self, texts: Sequence[str], cfg: SearchConfig, warn: bool = True) -> list[str]:
        """One translation per text; texts longer than max_src_len tokens are cut (`warn`: with a warning)."""
        sources, cut = self.encode(texts)
        if warn:
            warn_truncated(cut, self.max_src_len, self.special)
        return [self.text(h) for h in self.hypotheses(sources, cfg)]

    def translate_nbest(
        self, texts: Sequence[str], cfg: SearchConfig, n_best: int, warn: bool = True
    ) -> list[list[tuple[str, float]]]:
        """The n_best best translations per text, best first, each with its score (`nbest`); texts cut as
        `translate` cuts them."""
        _check_search(cfg, n_best)  # before the texts are cut and warned of
        sources, cut = self.encode(texts)
        if warn:
            warn_truncated(cut, self.max_src_len, self.special)
        return [[(self.text(h), h.score) for h in hyps] for hyps in self.nbest(sources, cfg, n_best)]

    def attention(self, text: str, cfg: SearchConfig) -> AttentionMap:
        """The cross-attention of `text`'s translation (searched with `cfg`; a text longer than max_src_len
        tokens cut, with a warning), per decoder layer and head (`tformer.eval.attention`)."""
        if not isinstance(text, str):
            raise TypeError(
                f"text must be one str (attention maps one translation), got {type(text).__name__}"
            )
        _check_search(cfg, 1)
        sources, cut = self.encode([text])
        warn_truncated(cut, self.max_src_len, self.special)
        hypothesis = self.hypotheses(sources, cfg)[0]
        return cross_attention_map(self.model, sources[0], hypothesis, self.src_tok, self.tgt_tok)

    def text(self, hypothesis: Hypothesis) -> str:
        """A hypothesis as one line of text: the byte-level vocabulary can spell line breaks and tabs,
        which become spaces, so a translation file keeps one output line per input line."""
        return self.tgt_tok.decode(hypothesis.tokens).translate(ONE_LINE)


def _check_search(cfg: SearchConfig, n_best: int) -> None:
    if not isinstance(cfg, SearchConfig):
        raise TypeError(
            f"cfg must be a SearchConfig (e.g. SearchConfig(beam_size=4)), got {type(cfg).__name__}"
        )
    check_n_best(n_best, cfg.method, cfg.beam_size)


def seq2seq_loss_sum(
    model: nn.Module, batch: Seq2SeqBatch, label_smoothing: float = 0.0, fused: bool = False
) -> tuple[Tensor, int]:
    """(summed target-token loss, target count); `fused`: the model's fused head and loss, else its logits."""
    # The target padding mask keeps the padding out of MoE routing (capacity, balance losses, statistics);
    # the collator pads on the right, so attention keeps SDPA's causal path (masks.causal_mask).
    if fused:
        loss = model(
            batch.src,
            batch.tgt_in,
            batch.src_mask,
            batch.tgt_mask,
            targets=batch.tgt_out,
            label_smoothing=label_smoothing,
            tgt_right_padded=True,
        )
        return loss, target_count(batch.tgt_out)
    logits = model(
        batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask, tgt_right_padded=True
    )  # (B, T, V)
    return cross_entropy_sum(logits, batch.tgt_out, label_smoothing, "target tokens")


class TranslationTask:
    """The task protocol of `tformer.tasks` for sentence-pair translation."""

    @property
    def loss_unit(self) -> str:
        """loss.png's axis (the evaluation's loss is plain cross-entropy; training's may be smoothed)."""
        return loss_unit("nats / target token", self)

    def setup(self, cfg: TrainConfig, run_dir: Path, device: torch.device, resume: bool = False) -> None:
        self.cfg, self.device, self.run_dir = cfg, device, run_dir
        self.corpus = load_translation_corpus(cfg.data)
        if resume:
            check_data_unchanged(run_dir, self.corpus, cfg.data)
        self.train_pairs = train = list(self.corpus["train"])[: cfg.data.max_train_docs]
        self.src_tok, self.tgt_tok = self._tokenizers(train)
        self.collate = Seq2SeqCollator(self.tgt_tok.pad_id, self.tgt_tok.bos_id, self.tgt_tok.eos_id)
        self.train_ds = self.dataset(train)
        self.val_ds = self.dataset(self.corpus["val"])
        for name, ds in (("train", self.train_ds), ("val", self.val_ds)):
            check_scoreable(ds, f"the {name} split", cfg.data.seq_len)
        if not resume:
            write_manifest(
                run_dir,
                self.corpus,
                train_pairs_used=len(train),
                train_pairs_too_long=self.train_ds.n_filtered,
            )
            if self.train_ds.n_filtered > 0.01 * len(train):  # (recorded in data.json alone, it went unseen)
                warnings.warn(
                    f"{self.train_ds.n_filtered:,} of the {len(train):,} training pairs are longer than "
                    f"data.seq_len={cfg.data.seq_len} tokens (with BOS / EOS) and are left out of training",
                    UserWarning,
                    stacklevel=2,
                )
        self.resumed, self._samples = resume, None

    def training_set(self) -> Seq2SeqDataset:
        """The items training reads: the training pairs as encoded, or with data.bpe_dropout their sampled
        segmentations (`sampled_dataset`, made on first use: by `train_loader`, after the set-up that the
        ranks of a distributed run take in turn, so that they sample at once)."""
        if not self.cfg.data.bpe_dropout:
            return self.train_ds
        if self._samples is None:
            self._samples = self.sampled_dataset()
        return self._samples

    def sampled_dataset(self) -> Seq2SeqDataset:
        """data.bpe_dropout: each training pair that fits data.seq_len, in data.bpe_dropout_copies
        segmentations sampled with BPE-dropout from seeds of the run's seed (a resume, and every rank,
        sample the same ones). A sample longer than data.seq_len is left out, as a pair is."""
        data, seed = self.cfg.data, self.cfg.seed
        fits = [self.train_pairs[i] for i in self.train_ds.kept]
        copies = data.bpe_dropout_copies
        if not dist.is_initialized() or dist.get_rank() == 0:
            with contextlib.suppress(OSError):  # a lost stderr stops nothing here (the trainer sees it after)
                print(
                    f"BPE-dropout: sampling {copies} segmentations of each of {len(fits):,} training pairs",
                    file=sys.stderr,
                    flush=True,
                )
        src = BPEDropout(self.src_tok, data.bpe_dropout)
        tgt = src if self.tgt_tok is self.src_tok else BPEDropout(self.tgt_tok, data.bpe_dropout)
        pairs: list[tuple[list[int], list[int]]] = []
        for copy in range(copies):
            pairs += zip(
                src.encode_batch([p.src for p in fits], f"bpe-dropout:{seed}:{copy}:src", add_eos=True),
                tgt.encode_batch([p.tgt for p in fits], f"bpe-dropout:{seed}:{copy}:tgt"),
            )
        samples = Seq2SeqDataset(pairs, data.seq_len, data.seq_len)
        check_scoreable(
            samples, "the BPE-dropout samples of the train split", data.seq_len, "or lower data.bpe_dropout"
        )
        if samples.n_filtered > 0.01 * len(pairs) and not self.resumed:
            warnings.warn(
                f"{samples.n_filtered:,} of the {len(pairs):,} BPE-dropout samples of the training pairs are "
                f"longer than data.seq_len={data.seq_len} tokens and are left out of training (the longest "
                "pairs train less often): raise data.seq_len or lower data.bpe_dropout",
                UserWarning,
                stacklevel=2,
            )
        return samples

    def _tokenizers(self, train: Sequence[Pair]) -> tuple[Tokenizer, Tokenizer]:
        data, tgt_path, src_path = (
            self.cfg.data,
            self.run_dir / "tokenizer.json",
            self.run_dir / SRC_TOKENIZER,
        )
        if tgt_path.exists():  # resuming: the run's own vocabularies
            tgt = Tokenizer.load(tgt_path)
            src = (
                _source_tokenizer(src_path, " to resume, or start a new run")
                if data.tokenizer == "separate"
                else tgt
            )
            return src, tgt
        if data.tokenizer == "joint":
            tgt = train_tokenizer([t for p in train for t in (p.src, p.tgt)], data.vocab_size)
            src = tgt
        else:
            tgt = train_tokenizer([p.tgt for p in train], data.vocab_size)
            src = train_tokenizer(
                [p.src for p in train],
                data.src_vocab_size or data.vocab_size,
                "data.src_vocab_size" if data.src_vocab_size else "data.vocab_size",
            )
            src.save(src_path)
        tgt.save(tgt_path)
        return src, tgt

    def dataset(self, pairs: Sequence[Pair]) -> Seq2SeqDataset:
        n = self.cfg.data.seq_len
        return Seq2SeqDataset.from_texts(pairs, self.src_tok, n, n, tgt_tokenizer=self.tgt_tok)

    def model_config(self, cfg: TrainConfig):
        require_task_arch(cfg)
        separate = cfg.data.tokenizer == "separate"
        return cfg.model.replace(
            vocab_size=self.tgt_tok.vocab_size,
            src_vocab_size=self.src_tok.vocab_size if separate else None,
            share_embeddings=cfg.model.share_embeddings and not separate,
            max_seq_len=max(cfg.model.max_seq_len, cfg.data.seq_len),
        )

    def train_loader(self, cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> BatchStream:
        return bucketed_train_stream(self.training_set(), self.collate, cfg, rank, world_size)

    def loss(self, model: nn.Module, batch: Seq2SeqBatch) -> tuple[Tensor, int]:
        return seq2seq_loss_sum(model, batch, self.cfg.label_smoothing, fuses_loss(self.cfg))

    def count_targets(self, batch: Seq2SeqBatch) -> int:
        return target_count(batch.tgt_out)

    def count_inputs(self, batch: Seq2SeqBatch) -> int:
        return int(batch.tgt_mask.sum())  # target tokens: what tokens/s means for seq2seq here

    def translator(self, model: nn.Module) -> Translator:
        return Translator(model, self.src_tok, self.tgt_tok, self.cfg.data.seq_len)

    def evaluate(self, model: nn.Module, max_batches: int, split: str = "val") -> dict[str, float]:
        check_eval_args(max_batches, split)
        ds = self.val_ds if split == "val" else self.dataset(self.corpus[split])
        fused = fuses_loss(self.cfg)
        result = evaluate_loss(model, ds, self.collate, self.cfg.batch_size, max_batches, self.device, fused)
        take = None if max_batches is None else max_batches * self.cfg.batch_size
        pairs = spread(list(self.corpus[split]), take)
        hyps = self.translator(model).translate([p.src for p in pairs], EVAL_SEARCH, warn=False)
        scores = score_translations(hyps, [p.tgt for p in pairs], bleu_tokenizer(self.cfg.data.direction))
        # the sentences BLEU scored: all of the split's, or a spread sample with eval_batches
        return {**result, "bleu": scores.bleu, "chrf": scores.chrf, "bleu_sentences": len(pairs)}

    def tokenizer_json(self) -> str:
        return self.tgt_tok.to_json_str()

    def src_tokenizer_json(self) -> str | None:
        """The separate source vocabulary (None when joint), kept in each checkpoint like the target one."""
        return self.src_tok.to_json_str() if self.cfg.data.tokenizer == "separate" else None

    def describe_result(self, report: dict) -> str:
        if "eval_loss" not in report:
            return "no evaluation recorded"
        return (
            f"validation loss {report['eval_loss']:.4f} nats/token | perplexity {report['perplexity']:.2f} | "
            f"greedy BLEU {report['bleu']:.2f} | chrF {report['chrf']:.2f}{_scored_words(report)}\n"
            f"test BLEU with beam search: tformer eval --run {self.run_dir}"
        )

    def show_sample(self, model: nn.Module, n: int = 5) -> str:
        pairs = list(self.corpus["test"])[:n]
        outs = self.translator(model).translate([p.src for p in pairs], TEST_SEARCH, warn=False)
        lines = ["--- test sentences (beam 4) ---"]
        for p, out in zip(pairs, outs):
            lines += [f"source:    {p.src}", f"reference: {p.tgt}", f"output:    {out}", ""]
        return "\n".join(lines[:-1]) + "\n---"


def check_scoreable(ds: Seq2SeqDataset, what: str, seq_len: int, other_cure: str = "") -> None:
    """ConfigError when no pair of `ds` fits data.seq_len (its loss would be 0 over 0 tokens)."""
    if len(ds) == 0:
        raise ConfigError(
            f"no pair of {what} fits data.seq_len={seq_len} (the source with EOS, and the target with "
            f"BOS or EOS, must each be at most {seq_len} tokens): all {ds.n_filtered} are longer; "
            f"raise data.seq_len{' ' + other_cure if other_cure else ''}"
        )


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    ds: Seq2SeqDataset,
    collate: Callable,
    batch_size: int,
    max_batches: int,
    device,
    fused: bool = False,
) -> dict[str, float]:
    """Loss per target token (no smoothing) over up to max_batches * batch_size pairs spread evenly over
    the split, batched in length order; `fused`: the model's fused head and loss (a run with fused_loss)."""
    lengths = ds.lengths()
    take = None if max_batches is None else max_batches * batch_size  # None: the whole split
    order = sorted(spread(range(len(ds)), take), key=lambda i: lengths[i])
    total, count = 0.0, 0
    for start in range(0, len(order), batch_size):
        batch = collate([ds[i] for i in order[start : start + batch_size]]).to(device)
        loss, n = seq2seq_loss_sum(model, batch, fused=fused)
        total, count = total + float(loss), count + n
    loss = total / max(1, count)
    return {"eval_loss": loss, "perplexity": perplexity(loss)}


# ----------------------------------------------------------------------------- trained runs


def _source_tokenizer(path: Path, what_then: str = "") -> Tokenizer:
    """A separate-vocabulary run's src_tokenizer.json, for a checkpoint that keeps no copy of it (those of
    older versions): an error saying so where the file is missing."""
    if not path.exists():
        raise FileNotFoundError(
            f"separate vocabularies: the source tokenizer {path} is missing, and this run's checkpoint keeps "
            f"no copy of it (checkpoints of older versions did not): put the file back{what_then}"
        )
    return Tokenizer.load(path)


def load_translator(run: LoadedRun | str | Path) -> Translator:
    """The Translator of a run (loaded with `tformer.runs.load_run`, or its path)."""
    run = require_task(run, "translation", "translation")
    cfg = run.train_config
    src_tok = run.tokenizer
    if cfg.data.tokenizer == "separate" and run.src_tokenizer is not None:
        src_tok = run.src_tokenizer  # the checkpoint's own
    elif cfg.data.tokenizer == "separate":  # a checkpoint that did not keep it: the run directory's file
        src_tok = _source_tokenizer(run_dir_of(run.checkpoint) / SRC_TOKENIZER)
    return Translator(run.model, src_tok, run.tokenizer, cfg.data.seq_len)


def ensemble_of(run: LoadedRun | str | Path, others: Sequence[LoadedRun | str | Path]) -> LoadedRun:
    """`run` with its model and those of `others` as one `Ensemble` (next-token probabilities averaged):
    translation runs of the same source and target vocabularies, e.g. the same data settings with other
    seeds, models or regularisers. The result's `ensemble` names the other runs' checkpoints."""
    if isinstance(others, (str, Path)) or not isinstance(others, Sequence):
        raise TypeError(f"others must be a list of runs, got {type(others).__name__}")
    if not others:
        raise ValueError("an ensemble needs at least one other run")
    runs = [require_task(r, "translation", "translation") for r in (run, *others)]
    if nested := next((r for r in runs if isinstance(r.model, Ensemble)), None):
        raise ValueError(f"{nested.checkpoint} is already an ensemble: give all the runs in one call")
    first = load_translator(runs[0])
    for r in runs[1:]:
        for field in ("corpus", "direction"):  # a de-en and an en-de run can share a joint vocabulary
            mine, theirs = getattr(runs[0].train_config.data, field), getattr(r.train_config.data, field)
            if mine != theirs:
                raise ValueError(
                    f"{r.checkpoint} has data.{field} {theirs!r}, {runs[0].checkpoint} {mine!r}: the runs of an "
                    "ensemble translate the same corpus's direction"
                )
        other = load_translator(r)
        if other.tgt_tok != first.tgt_tok or other.src_tok != first.src_tok:
            raise ValueError(
                f"{r.checkpoint} has other vocabularies than {runs[0].checkpoint}: the runs of an ensemble share "
                "their tokenizers (runs trained on the same data with the same data settings do)"
            )
    model = Ensemble([r.model for r in runs])
    return dataclasses.replace(runs[0], model=model, ensemble=tuple(str(r.checkpoint) for r in runs[1:]))


def _scored_words(report: dict) -> str:
    n = report.get("bleu_sentences")
    return "" if n is None else f" (on {n} validation sentences)"


_SCORING = ("evaluate_pairs", "evaluate_run", "format_result", "unfinished_note")


def __getattr__(name: str):
    """Scoring a trained run (tformer.tasks.translation_eval, which builds on this module) is offered here
    too, looked up on first use so that either module can be imported first."""
    if name in _SCORING:
        from tformer.tasks import translation_eval

        return getattr(translation_eval, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
