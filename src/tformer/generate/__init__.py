"""Generation: next-token sampling (here), the KV-cached engine for decoder LMs (`engine.generate`)
and beam / greedy / sampled search for encoder-decoders (`beam.search`)."""

from tformer.generate.sampling import (
    SamplingConfig,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    make_generator,
    sample_next,
    sample_with_config,
)

__all__ = [
    "SamplingConfig",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "make_generator",
    "sample_next",
    "sample_with_config",
]
