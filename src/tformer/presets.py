"""Named model presets: plain functions returning a `ModelConfig` (override with `.replace(...)`)."""

from __future__ import annotations

from collections.abc import Callable

from tformer.config import ConfigError, ModelConfig, MoEConfig, RopeConfig


def paper_base() -> ModelConfig:
    """The base Transformer of Vaswani et al. (2017): 6+6 layers, d_model 512, 8 heads, FFN 2048, ReLU,
    Post-Norm LayerNorm, sinusoidal positions, dropout 0.1, one shared 37k BPE vocabulary with the
    embeddings tied to the output projection and scaled by sqrt(d_model)."""
    return ModelConfig(
        arch="encoder_decoder",
        vocab_size=37000,
        d_model=512,
        n_layers=6,
        n_heads=8,
        d_ff=2048,
        max_seq_len=512,
        dropout=0.1,
        norm="layernorm",
        norm_placement="post",
        positions="sinusoidal",
        ffn="relu",
        bias=True,
        embed_scale=True,
        share_embeddings=True,
        tie_embeddings=True,
        init="xavier",
    )


def tiny(arch: str = "decoder") -> ModelConfig:
    """A tiny model for tests and smoke runs (d_model 64, 2 layers, vocab 128)."""
    return ModelConfig(
        arch=arch,
        vocab_size=128,
        d_model=64,
        n_layers=2,
        n_heads=4,
        d_ff=128,
        max_seq_len=64,
        dropout=0.0,
        norm_placement="pre",
        positions="rope",
        ffn="swiglu",
        norm="rmsnorm",
        bias=False,
        embed_scale=False,
        init="normal",
    )


def llama_like(
    vocab_size: int = 32000,
    d_model: int = 512,
    n_layers: int = 8,
    n_heads: int = 8,
    n_kv_heads: int | None = None,
    d_ff: int = 1376,
    max_seq_len: int = 2048,
) -> ModelConfig:
    """A Llama-style decoder: Pre-Norm RMSNorm, RoPE (half layout), SwiGLU, no biases, untied head."""
    return ModelConfig(
        arch="decoder",
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_ff=d_ff,
        max_seq_len=max_seq_len,
        dropout=0.0,
        norm="rmsnorm",
        norm_eps=1e-6,
        norm_placement="pre",
        positions="rope",
        rope=RopeConfig(theta=10000.0),
        ffn="swiglu",
        bias=False,
        embed_scale=False,
        tie_embeddings=False,
        init="scaled",
    )


def deepseek_moe_small(
    vocab_size: int = 8192, d_model: int = 256, n_layers: int = 4, max_seq_len: int = 256
) -> ModelConfig:
    """A small DeepSeekMoE decoder: Pre-Norm + RoPE, first layer dense, then 16 fine-grained SwiGLU
    experts (width d_ff/4), top-4, plus 1 shared expert."""
    d_ff = 4 * d_model
    return llama_like(vocab_size, d_model, n_layers, max(1, d_model // 64), None, d_ff, max_seq_len).replace(
        moe=MoEConfig(n_experts=16, top_k=4, d_expert=d_ff // 4, n_shared=1, first_dense=1),
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "paper-base": paper_base,
    "tiny": tiny,
    "llama-like": llama_like,
    "deepseek-moe-small": deepseek_moe_small,
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
    return PRESETS[name]()
