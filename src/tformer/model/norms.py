"""Normalisation layers. Shapes: (..., D) -> (..., D).

"layernorm" (Ba et al., 2016, with bias), "layernorm_nobias", "rmsnorm" (Zhang & Sennrich, 2019).
"""

from __future__ import annotations

from functools import partial

from torch import nn

from tformer.config import ModelConfig

NORMS = {
    "layernorm": partial(nn.LayerNorm, bias=True),
    "layernorm_nobias": partial(nn.LayerNorm, bias=False),
    "rmsnorm": nn.RMSNorm,
}


def make_norm(cfg: ModelConfig) -> nn.Module:
    return NORMS[cfg.norm](cfg.d_model, eps=cfg.norm_eps)
