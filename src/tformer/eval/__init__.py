"""Evaluation metrics: BLEU / chrF for translation (sacrebleu), accuracy / macro-F1 / confusion matrix."""

from tformer.eval.bleu import TranslationScores, bleu_tokenizer, copy_baseline, score_translations
from tformer.eval.classification import ClassificationScores, plot_confusion, score_classification

__all__ = [
    "ClassificationScores",
    "TranslationScores",
    "bleu_tokenizer",
    "copy_baseline",
    "plot_confusion",
    "score_classification",
    "score_translations",
]
