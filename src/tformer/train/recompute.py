"""Activation checkpointing (`activation_checkpointing: true` in a run's config): every Transformer
block keeps only its input for the backward and runs its forward again there, so a step holds one
block's activations at a time instead of every layer's, for about one more forward of compute.

The block's forward becomes `torch.utils.checkpoint.checkpoint(forward, ...)` (non-reentrant, the RNG
state kept, so dropout draws the same masks in the recomputation and losses and gradients stay
bit-identical to a run without it, in eager mode). Parameter names do not change, so checkpoints,
optimizer state and DCP shards are the same with and without it, and a resumed run may switch it. It is
applied before data parallelism (FSDP2 shards the checkpointed blocks, as torchtitan orders them). MoE
layers skip their counters and statistics in the recomputation (`tformer.model.moe.recomputing`).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from tformer.model.blocks import Block


def checkpoint_blocks(model: nn.Module) -> int:
    """Make every block of `model` recompute its activations in the backward; return how many blocks.
    The slow twin is the model as built (tests compare the two)."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        if "forward" in block.__dict__:
            raise ValueError(f"block {type(block).__name__} already has a forward of its own on the instance")
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return len(blocks)
