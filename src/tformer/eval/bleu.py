"""Corpus BLEU and chrF with sacrebleu's reference implementation, plus the copy-the-source baseline.

Scores are on detokenized text, as sacrebleu intends: BLEU with its default 13a tokenizer (its "zh"
tokenizer for Chinese references, which have no spaces between words), mixed case, exponential
smoothing; chrF with character 6-grams (chrF2). The signature strings say exactly which settings
produced a number, so scores from different runs can be compared (or not).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tformer.data.corpus_base import MissingDataError

SACREBLEU_INSTALL = "pip install sacrebleu==2.6.0"


@dataclass(frozen=True)
class TranslationScores:
    bleu: float  # 0..100
    chrf: float  # 0..100
    n: int  # sentences scored
    bleu_signature: str
    chrf_signature: str
    # BLEU's parts: = brevity_penalty x geometric mean of the n-gram precisions (1- to 4-grams, 0..100,
    # smoothed where a count is 0); brevity_penalty = exp(1 - ref_len / hyp_len) when the output is shorter
    # than the references (length_ratio = hyp_len / ref_len < 1), else 1; lengths in BLEU's tokens
    bleu_precisions: tuple[float, ...]
    brevity_penalty: float
    length_ratio: float
    hyp_len: int
    ref_len: int

    def to_dict(self) -> dict:
        return asdict(self)


def bleu_parts(precisions: Sequence[float], brevity_penalty: float, length_ratio: float) -> str:
    """BLEU's parts in words, as sacrebleu prints them: "42.0/11.0/3.7/1.0, BP 0.847, length ratio 0.858"."""
    return f"{'/'.join(f'{p:.1f}' for p in precisions)}, BP {brevity_penalty:.3f}, length ratio {length_ratio:.3f}"


def bleu_tokenizer(direction: str) -> str:
    """sacrebleu's tokenizer for the target language of a direction such as "en-zh": "zh" for Chinese,
    else "13a"."""
    if not isinstance(direction, str):
        raise TypeError(f"direction must be a str such as 'de-en', got {type(direction).__name__}")
    return "zh" if direction.rpartition("-")[2] == "zh" else "13a"


CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff]")  # kana and Han: scripts without spaces


def warn_if_cjk_without_its_tokenizer(references: Sequence[str], tokenize: str) -> None:
    """Most references written in Chinese or Japanese script but scored with 13a, which splits on
    spaces those scripts do not have: BLEU then counts whole clauses as words (a `pairs:` corpus whose
    data.direction still reads the default 'de-en'). Said, with the setting that picks sacrebleu's zh."""
    if tokenize != "13a":
        return
    sample = references[:: max(1, len(references) // 200)]
    if sum(bool(CJK.search(r)) for r in sample) > len(sample) / 2:
        warnings.warn(
            "most references are Chinese or Japanese text, but BLEU tokenizes them with 13a (the "
            "target language of data.direction is not 'zh'), which splits words at spaces only: for Chinese "
            "set data.direction to '<source>-zh' to score with sacrebleu's zh tokenizer",
            UserWarning,
            stacklevel=3,
        )


def _metrics(tokenize: str):
    try:
        from sacrebleu.metrics import BLEU, CHRF
    except ImportError:
        raise MissingDataError(
            "sacrebleu (BLEU and chrF)", "python package 'sacrebleu'", SACREBLEU_INSTALL
        ) from None
    try:
        return BLEU(tokenize=tokenize), CHRF()
    except KeyError:  # sacrebleu's own error is the bare name
        import sacrebleu.metrics.bleu as bleu_module

        known = ", ".join(getattr(bleu_module, "_TOKENIZERS", ())) or "13a, zh, intl, char, none, ..."
        raise ValueError(f"unknown BLEU tokenize {tokenize!r}; sacrebleu has {known}") from None


def score_translations(
    hypotheses: Sequence[str], references: Sequence[str], tokenize: str = "13a", warn: bool = True
) -> TranslationScores:
    """Corpus-level BLEU (with sacrebleu's `tokenize`, see `bleu_tokenizer`) and chrF of `hypotheses`
    against one reference each."""
    for name, texts in (("hypotheses", hypotheses), ("references", references)):
        if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):  # a str would score by letter
            raise TypeError(f"{name} must be a list of sentences (one str each), got {type(texts).__name__}")
        if (bad := next((t for t in texts if not isinstance(t, str)), None)) is not None:
            raise TypeError(f"{name} must hold one str per sentence, got {type(bad).__name__}")
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not references:
        raise ValueError("nothing to score: no references")
    if warn:  # (the copy baseline scores the same references: said once)
        warn_if_cjk_without_its_tokenizer(references, tokenize)
    bleu, chrf = _metrics(tokenize)
    hyps, refs = list(hypotheses), [list(references)]
    score = bleu.corpus_score(hyps, refs)
    return TranslationScores(
        bleu=score.score,
        chrf=chrf.corpus_score(hyps, refs).score,
        n=len(hyps),
        bleu_signature=str(bleu.get_signature()),
        chrf_signature=str(chrf.get_signature()),
        bleu_precisions=tuple(float(p) for p in score.precisions),
        brevity_penalty=float(score.bp),
        length_ratio=float(score.ratio),
        hyp_len=int(score.sys_len),
        ref_len=int(score.ref_len),
    )


def copy_baseline(
    sources: Sequence[str], references: Sequence[str], tokenize: str = "13a"
) -> TranslationScores:
    """The scores of a "translation" that copies the source unchanged: names, numbers and cognates
    already overlap, so this is the floor a trained model has to clear."""
    return score_translations(sources, references, tokenize, warn=False)
