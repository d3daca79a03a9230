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

    def to_dict(self) -> dict:
        return asdict(self)


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
    return TranslationScores(
        bleu=bleu.corpus_score(hyps, refs).score,
        chrf=chrf.corpus_score(hyps, refs).score,
        n=len(hyps),
        bleu_signature=str(bleu.get_signature()),
        chrf_signature=str(chrf.get_signature()),
    )


def copy_baseline(
    sources: Sequence[str], references: Sequence[str], tokenize: str = "13a"
) -> TranslationScores:
    """The scores of a "translation" that copies the source unchanged: names, numbers and cognates
    already overlap, so this is the floor a trained model has to clear."""
    return score_translations(sources, references, tokenize, warn=False)
