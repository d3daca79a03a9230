"""AdamW with decay / no-decay parameter groups, and the learning-rate schedules."""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import torch
from torch import nn

from tformer.train.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (linear and expert weights) decay; biases, norm weights and embeddings do not. Biases are
    told by name, since stacked expert biases (E, out) are matrices by shape."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")
        is_embedding = len(parts) > 1 and "embed" in parts[-2]
        is_bias = parts[-1] == "bias" or parts[-1].endswith("_bias")
        (decay if p.dim() >= 2 and not (is_embedding or is_bias) else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; the fused kernel where this torch build has it for the parameters' device."""
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if cfg.fused:
        try:
            return torch.optim.AdamW(groups, fused=True, **kwargs)
        except (RuntimeError, TypeError) as e:
            warnings.warn(
                f"fused AdamW is not available for these parameters ({(str(e).splitlines() or [type(e).__name__])[0]}): "
                "using the foreach kernel (the same update; set optim.fused=false to choose it quietly)",
                stacklevel=2,
            )
    return torch.optim.AdamW(groups, foreach=True, **kwargs)


def lr_factor(step: int, total: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based) of `total`: warm-up rises linearly to 1.0
    at step warmup_steps - 1; the decay then starts below the peak and reaches min_lr_ratio exactly at
    the last step, total - 1 (without warm-up, cosine's step 0 runs at the peak; WSD's decay starts at
    step total * (1 - decay_frac), already below it)."""
    w = cfg.warmup_steps
    if w and step < w:
        return (step + 1) / w
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        done, span = (step - w + 1, total - w) if w else (step, total - 1)
        progress = min(1.0, done / max(1, span))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd: stable, then a linear decay from step floor(total * (1 - decay_frac)), the fraction as its decimal
    # reads (0.8 is 4/5: in float, 1 - 0.8 is 0.19999999999999996, which had started the decay a step early)
    decay_start = max(w, math.floor(total * (1 - Fraction(repr(cfg.decay_frac)))))
    if step < decay_start:
        return 1.0
    progress = (step - decay_start + 1) / max(1, total - decay_start)
    return 1.0 - (1 - cfg.min_lr_ratio) * min(1.0, progress)


def make_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, cfg: OptimConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total_steps, cfg))
