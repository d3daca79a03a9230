"""Generation: next-token sampling (more to come: engine with KV cache, beam search)."""

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
