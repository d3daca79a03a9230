"""What the distributed test workers share: the MoE model config they train and gathering a tensor whole."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tformer.config import MoEConfig
from tformer.presets import tiny


def moe_model_cfg(**moe):
    moe = {"n_experts": 4, "top_k": 2, "aux_loss_coef": 0.0, "bias_update_rate": 0.01, **moe}
    return tiny().replace(d_model=32, d_ff=32, n_heads=2, vocab_size=64, moe=MoEConfig(**moe))


def full(t: torch.Tensor, sliced: bool) -> torch.Tensor:
    """The whole tensor on every rank: DTensors gathered, expert-parallel slices concatenated."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    if sliced:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)
    return t
