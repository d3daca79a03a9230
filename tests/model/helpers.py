"""Small builders shared by the model tests."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tformer import ModelConfig, build_model


def make(cfg: ModelConfig, **changes) -> nn.Module:
    model = build_model(cfg.replace(**changes))
    return model.eval()


def run(model: nn.Module, tokens: Tensor, **kwargs) -> Tensor:
    """Logits of any architecture on `tokens` (the encoder-decoder decodes the reversed source)."""
    if model.cfg.arch == "encoder_decoder":
        return model(tokens, tokens.flip(1), **kwargs)
    return model(tokens, **kwargs)


def rand_tokens(cfg: ModelConfig, b: int = 2, t: int = 12, lo: int = 0) -> Tensor:
    return torch.randint(lo, cfg.vocab_size, (b, t))
