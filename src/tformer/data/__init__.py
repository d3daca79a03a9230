"""Data for tformer: the installed real corpora, the byte-level BPE tokenizer, datasets and resumable loaders."""

from typing import TYPE_CHECKING

from tformer._lazy import lazy_exports
from tformer.data.corpora import (
    CORPORA,
    SPLITS,
    Corpus,
    Document,
    MissingDataError,
    Pair,
    corpus_task,
    iter_texts,
    load_corpus,
)

if TYPE_CHECKING:  # what static tools see; at run time each name is imported on first use
    from tformer.data.bpe_dropout import BPEDropout
    from tformer.data.datasets import (
        IGNORE_INDEX,
        ClassificationBatch,
        ClassificationCollator,
        ClassificationDataset,
        LMBatch,
        PackedLMDataset,
        Seq2SeqBatch,
        Seq2SeqCollator,
        Seq2SeqDataset,
        collate_lm,
        pad_sequences,
    )
    from tformer.data.loader import (
        BucketBatchSampler,
        RandomBatchSampler,
        ResumableLoader,
        batches,
        make_bucket_loader,
        make_loader,
    )
    from tformer.data.tokenizer import (
        SPECIAL_TOKENS,
        Tokenizer,
    )

__getattr__, __dir__ = lazy_exports(globals())

__all__ = [
    "CORPORA",
    "SPLITS",
    "Corpus",
    "Document",
    "MissingDataError",
    "Pair",
    "corpus_task",
    "iter_texts",
    "load_corpus",
    "BPEDropout",
    "IGNORE_INDEX",
    "ClassificationBatch",
    "ClassificationCollator",
    "ClassificationDataset",
    "LMBatch",
    "PackedLMDataset",
    "Seq2SeqBatch",
    "Seq2SeqCollator",
    "Seq2SeqDataset",
    "collate_lm",
    "pad_sequences",
    "BucketBatchSampler",
    "RandomBatchSampler",
    "ResumableLoader",
    "batches",
    "make_bucket_loader",
    "make_loader",
    "SPECIAL_TOKENS",
    "Tokenizer",
]
