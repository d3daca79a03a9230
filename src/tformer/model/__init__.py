"""tformer's models: single-device module code, no training or distributed logic."""

from tformer.model.attention import Memory
from tformer.model.cache import NO_CACHE, KVCache, NoCache
from tformer.model.transformer import (
    ARCHITECTURES,
    DecoderLM,
    Encoder,
    EncoderClassifier,
    EncoderDecoder,
    build_model,
)

__all__ = [
    "ARCHITECTURES",
    "NO_CACHE",
    "DecoderLM",
    "Encoder",
    "EncoderClassifier",
    "EncoderDecoder",
    "KVCache",
    "Memory",
    "NoCache",
    "build_model",
]
