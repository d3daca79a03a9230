"""Named training runs: plain functions returning a `TrainConfig`."""

from __future__ import annotations

from collections.abc import Callable

from tformer.config import ModelConfig, MoEConfig, RopeConfig
from tformer.schema import ConfigError
from tformer.train.config import DataConfig, OptimConfig, TrainConfig


def shakespeare_model(moe: MoEConfig | None) -> ModelConfig:
    """Pre-Norm RMSNorm + RoPE + SwiGLU decoder sized for 2 CPU cores (vocab set from the tokenizer)."""
    return ModelConfig(
        arch="decoder",
        vocab_size=2048,
        d_model=256,
        n_layers=4,
        n_heads=4,
        d_ff=688,
        max_seq_len=256,
        dropout=0.1,
        norm="rmsnorm",
        norm_eps=1e-6,
        norm_placement="pre",
        positions="rope",
        rope=RopeConfig(theta=10000.0),
        ffn="swiglu",
        bias=False,
        embed_scale=False,
        tie_embeddings=True,
        init="scaled",
        moe=moe,
    )


def shakespeare() -> TrainConfig:
    """The main job: a Pre-Norm + RoPE + DeepSeekMoE decoder on Shakespeare, about 10 minutes on 2 cores.

    DeepSeekMoE layers after one dense layer: 8 fine-grained experts of width 172 (a quarter of the
    dense 688), top-2, plus 1 shared expert of width 172: 3 x 172 = 516 active hidden units per token.
    """
    moe = MoEConfig(n_experts=8, top_k=2, d_expert=172, n_shared=1, first_dense=1, aux_loss_coef=0.01)
    return TrainConfig(
        task="lm",
        model=shakespeare_model(moe),
        data=DataConfig(corpus="shakespeare", vocab_size=2048, seq_len=256),
        optim=OptimConfig(lr=3e-3, warmup_steps=50, schedule="cosine", min_lr_ratio=0.1, weight_decay=0.1),
        steps=600,
        batch_size=16,
        eval_every=150,
        eval_batches=40,
        save_every=150,
        dtype="bfloat16",
        sample_every=0,
    )


def shakespeare_dense() -> TrainConfig:
    """The same run with a dense SwiGLU FFN in every layer."""
    return shakespeare().replace(model=shakespeare_model(None))


def tiny_lm() -> TrainConfig:
    """Seconds-long smoke run on Python's documentation text (no data package needed)."""
    model = ModelConfig(
        arch="decoder",
        vocab_size=512,
        d_model=64,
        n_layers=2,
        n_heads=4,
        d_ff=128,
        max_seq_len=64,
        dropout=0.0,
        norm="rmsnorm",
        norm_placement="pre",
        positions="rope",
        ffn="swiglu",
        bias=False,
        embed_scale=False,
        init="scaled",
    )
    return TrainConfig(
        task="lm",
        model=model,
        data=DataConfig(corpus="pydoc", vocab_size=512, seq_len=64, max_train_docs=200),
        optim=OptimConfig(lr=3e-3, warmup_steps=5),
        steps=30,
        batch_size=8,
        eval_every=15,
        eval_batches=4,
        save_every=15,
        log_every=5,
    )


TRAIN_PRESETS: dict[str, Callable[[], TrainConfig]] = {
    "shakespeare": shakespeare,
    "shakespeare-dense": shakespeare_dense,
    "tiny-lm": tiny_lm,
}


def get_train_preset(name: str) -> TrainConfig:
    if name not in TRAIN_PRESETS:
        raise ConfigError(f"unknown training preset {name!r}; available: {', '.join(TRAIN_PRESETS)}")
    return TRAIN_PRESETS[name]()
