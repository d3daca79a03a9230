"""Scoring a trained translation run: beam-search BLEU / chrF, BLEU's parts, the copy-the-source baseline
and the loss, on a split of its corpus (`evaluate_run`) or on pairs of the user's own (`evaluate_pairs`:
`tformer eval --pairs-file`), and the result as a line of text (`format_result`)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from tformer.data.corpus_base import Pair
from tformer.data.datasets import Seq2SeqCollator, Seq2SeqDataset
from tformer.eval.bleu import bleu_parts, bleu_tokenizer, copy_baseline, score_translations
from tformer.generate.beam import SearchConfig
from tformer.model.ensemble import Ensemble
from tformer.runs import LoadedRun, require_task, truncated_note, weights_words
from tformer.tasks.corpus import warn_if_split_changed
from tformer.tasks.stream import check_eval_args, check_own_items, spread
from tformer.tasks.translation import (
    TEST_SEARCH,
    evaluate_loss,
    load_translation_corpus,
    load_translator,
    run_dir_of,
)


def evaluate_run(
    run: LoadedRun | str | Path,
    split: str = "test",
    search_cfg: SearchConfig = TEST_SEARCH,
    max_batches: int | None = None,
) -> dict:
    """Beam-search BLEU / chrF of a run (or its path) on a split of its corpus, with the copy-the-source
    baseline and the loss; the translations go to <run>/translations_<split>.txt (where max_batches took a
    sample of the split: translations_<split>_sample.txt; a file that cannot be written is warned about)."""
    check_eval_args(max_batches, split)
    run = require_task(run, "translation", "translation")
    cfg = run.train_config
    corpus = load_translation_corpus(cfg.data)
    warn_if_split_changed(run_dir_of(run.checkpoint), corpus, split)
    limit = cfg.data.max_train_docs if split == "train" else None  # the train split as the run trained on it
    whole = list(corpus[split])[:limit]
    data = f"{cfg.data.corpus} {cfg.data.direction} {split} split"
    return _evaluate(run, whole, data, f"translations_{split}", search_cfg, max_batches, "split")


def evaluate_pairs(
    run: LoadedRun | str | Path,
    pairs: Sequence[tuple[str, str]],
    name: str | None = None,
    search_cfg: SearchConfig = TEST_SEARCH,
    max_batches: int | None = None,
) -> dict:
    """`evaluate_run` on pairs of the caller's own, (source, reference) each, every one scored (repeats
    too, as in a test set); the result's "data" is `name` (or "pairs") and the translations go to
    <run>/translations_pairs_<name>.txt (translations_pairs.txt without a name)."""
    check_eval_args(max_batches)
    run = require_task(run, "translation", "translation")
    check_own_items(pairs, "pairs", ("source", "reference"), name)
    whole = [
        Pair(f"{name or 'pairs'}:{i + 1}", src.strip(), ref.strip()) for i, (src, ref) in enumerate(pairs)
    ]
    out_stem = "translations_pairs" + (f"_{name}" if name else "")
    return _evaluate(run, whole, name or "pairs", out_stem, search_cfg, max_batches, "pairs")


def _evaluate(
    run: LoadedRun,
    whole: list[Pair],
    data: str,
    out_stem: str,
    search_cfg: SearchConfig,
    max_batches: int | None,
    kind: str,
) -> dict:
    """Translate, score and write the translations of `whole` (a sample of it with max_batches), a split
    or the caller's pairs (`kind`)."""
    cfg = run.train_config
    translator = load_translator(run)
    pairs = whole
    if max_batches is not None:  # a sample of the whole split, as the LM and classification evaluations take
        pairs = spread(pairs, max_batches * search_cfg.batch_size)
    sources, cut = translator.encode([p.src for p in pairs])
    t0 = time.perf_counter()
    found = translator.hypotheses(sources, search_cfg)
    seconds = time.perf_counter() - t0
    hyps = [translator.text(h) for h in found]
    refs = [p.tgt for p in pairs]
    tokenize = bleu_tokenizer(cfg.data.direction)
    scores = score_translations(hyps, refs, tokenize)
    copy = copy_baseline([p.src for p in pairs], refs, tokenize)
    seq_len = min(cfg.data.seq_len, run.model.cfg.max_seq_len)  # (an ensemble's: what every member reads)
    ds = Seq2SeqDataset.from_texts(pairs, translator.src_tok, seq_len, seq_len, translator.tgt_tok)
    collate = Seq2SeqCollator(translator.tgt_tok.pad_id, translator.tgt_tok.bos_id, translator.tgt_tok.eos_id)
    loss = {"eval_loss": None, "perplexity": None}  # no pair fits data.seq_len: no loss (BLEU stands)
    if len(ds):
        device = next(run.model.parameters()).device
        fused = cfg.fused_loss and not isinstance(run.model, Ensemble)  # (scored from its log-probabilities)
        loss = evaluate_loss(run.model, ds, collate, 64, 10**9, device, fused)
    name = f"{out_stem}{'' if len(pairs) == len(whole) else '_sample'}{run.file_suffix()}.txt"
    out = run_dir_of(run.checkpoint) / name
    try:
        out.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    except OSError as err:
        warnings.warn(f"the translations were not written to {out}: {err.strerror or err}", stacklevel=3)
        out = None
    return {
        "data": data,
        "checkpoint_step": run.step,
        "averaged_steps": list(run.averaged_steps),
        "ensemble": list(run.ensemble),  # the other runs' checkpoints, where the model is an ensemble
        "sentences": len(pairs),
        "split_sentences": len(whole),  # more than "sentences": --max-batches took a sample
        "scored": kind,  # "split" or "pairs" (the caller's own)
        "sources_truncated": len(cut),
        "outputs_unfinished": sum(not h.finished for h in found),  # stopped at the length limit, no EOS
        "loss_pairs": len(ds),  # the pairs that fit data.seq_len, on which the loss is measured
        "seq_len": seq_len,
        "search": search_cfg.to_dict(),
        "bleu": scores.bleu,
        "bleu_precisions": list(scores.bleu_precisions),
        "brevity_penalty": scores.brevity_penalty,
        "length_ratio": scores.length_ratio,
        "hyp_len": scores.hyp_len,
        "ref_len": scores.ref_len,
        "chrf": scores.chrf,
        "copy_bleu": copy.bleu,
        "copy_chrf": copy.chrf,
        **loss,
        "sentences_per_s": len(pairs) / max(seconds, 1e-9),
        "bleu_signature": scores.bleu_signature,
        "chrf_signature": scores.chrf_signature,
        "translations": str(out) if out else None,
    }


def _loss_words(result: dict) -> str:
    if result["eval_loss"] is None:
        return "loss: no pair fits data.seq_len"
    left_out = result["sentences"] - result["loss_pairs"]
    others = (
        f" (the other {left_out} are longer than {result.get('seq_len', 'data.seq_len')} tokens)"
        if left_out
        else ""
    )
    return f"loss {result['eval_loss']:.4f} nats/token on {result['loss_pairs']} pairs{others}"


def _sentences_words(result: dict) -> str:
    whole = result.get("split_sentences", result["sentences"])
    if result["sentences"] < whole:
        whose = "the pairs'" if result.get("scored") == "pairs" else "the split's"
        return f"{result['sentences']} of {whose} {whole} sentences, --max-batches"
    return f"{result['sentences']} sentences"


def unfinished_note(n: int) -> str:
    """The note a score's text line gets when n translations stopped at the length limit before an end."""
    return f" | {n} output{'s' if n != 1 else ''} cut at the length limit before an end token" if n else ""


def _bleu_parts_words(result: dict) -> str:
    if "bleu_precisions" not in result:  # (a result written before the parts were recorded)
        return ""
    return f" ({bleu_parts(result['bleu_precisions'], result['brevity_penalty'], result['length_ratio'])})"


def format_result(result: dict) -> str:
    s = result["search"]
    how = (
        f"beam {s['beam_size']}, length penalty {s['length_penalty']}"
        if s["method"] == "beam"
        else s["method"]
    )
    return (
        f"{result['data']} ({weights_words(result['checkpoint_step'], result.get('averaged_steps', ()), result.get('ensemble', ()))}, "
        f"{_sentences_words(result)}, {how}): "
        f"BLEU {result['bleu']:.2f}{_bleu_parts_words(result)} | chrF {result['chrf']:.2f} | copy-the-source baseline BLEU "
        f"{result['copy_bleu']:.2f}, chrF {result['copy_chrf']:.2f} | {_loss_words(result)} "
        f"| {result['sentences_per_s']:.1f} sentences/s{truncated_note(result['sources_truncated'], 'source')}"
        f"{unfinished_note(result.get('outputs_unfinished', 0))}\n"
        f"sacrebleu signature: {result['bleu_signature']}"
        + (f"\ntranslations: {result['translations']}" if result.get("translations") else "")
    )
