"""Initialisation schemes (chosen by `ModelConfig.init`).

- "xavier": Glorot-uniform linear weights (as torch.nn.Transformer), embeddings N(0, d_model^-1/2)
  so that embeddings scaled by sqrt(d_model) have unit variance (Vaswani et al., 2017; fairseq).
- "normal": every linear and embedding weight N(0, init_std) (GPT-2, init_std = 0.02).
- "scaled": "normal", with the residual output projections (o_proj, down_proj, experts included)
  divided by sqrt(2 * n_layers), so the residual stream's variance does not grow with depth
  (GPT-2; Megatron-LM).
Biases start at zero and norm weights at one in every scheme. Stacked (E, out, in) expert weights are
initialised expert by expert, like E separate linear layers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from tformer.config import ModelConfig

RESIDUAL_OUTPUTS = ("o_proj", "down_proj")


def _init_matrix(w: Tensor, scheme: str, std: float) -> None:
    if scheme == "xavier":
        nn.init.xavier_uniform_(w)
    else:
        nn.init.normal_(w, 0.0, std)


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    depth = cfg.n_layers + (cfg.resolved_n_encoder_layers if cfg.arch == "encoder_decoder" else 0)
    out_scale = 1.0 / math.sqrt(2 * depth) if cfg.init == "scaled" else 1.0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if parts[-1].endswith("bias"):  # biases, stacked (E, out) expert biases included
            nn.init.zeros_(p)
        elif p.dim() == 1:
            nn.init.ones_(p)
        elif "embed" in parts[-2]:
            std = cfg.d_model**-0.5 if cfg.init == "xavier" else cfg.init_std
            nn.init.normal_(p, 0.0, std)
        else:
            scale = out_scale if any(o in parts for o in RESIDUAL_OUTPUTS) else 1.0
            for w in p if p.dim() == 3 else (p,):
                _init_matrix(w, cfg.init, cfg.init_std * scale)
