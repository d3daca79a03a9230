"""Activation checkpointing (`activation_checkpointing: true` in a run's config): every Transformer
block keeps only its input for the backward and runs its forward again there, so a step holds one
block's activations at a time instead of every layer's, for about one more forward of compute.

A block's forward becomes `recomputed_forward` over its own: a training forward that records a graph
(no KV cache) runs under `torch.utils.checkpoint.checkpoint` (non-reentrant, the RNG state kept, so
dropout draws the same masks in the recomputation, and losses and gradients stay bit-identical to the
model as built, its slow twin, in eager mode); any other call (evaluation, decoding with a cache) is
the plain forward, and the decoding steps still take the model. Parameter names do not change, so
checkpoints, optimizer state and DCP shards are the same with and without it, and a resumed run may
switch it. The trainer applies it before data parallelism (FSDP2 shards the checkpointed blocks, as
torchtitan orders them). MoE layers leave their counters, losses and statistics as the forward made
them when they are recomputed (`tformer.model.moe.recomputing`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tformer.model.blocks import Block
from tformer.model.cache import NO_CACHE


def recomputed_forward(forward: Callable[..., Tensor], x: Tensor, positions, mask, cache, *memory) -> Tensor:
    """`forward` (a block's own, bound) recomputed in the backward when it records a training graph
    without a KV cache; called as it is otherwise."""
    if cache is NO_CACHE and torch.is_grad_enabled() and forward.__self__.training:
        return checkpoint(forward, x, positions, mask, cache, *memory, use_reentrant=False)
    return forward(x, positions, mask, cache, *memory)


def is_recomputed(module: nn.Module) -> bool:
    """Whether `module`'s instance-level forward is what `checkpoint_blocks` set on it, over its own
    forward (a shallow copy of a block would hold the original's)."""
    forward = module.__dict__.get("forward")
    return getattr(forward, "func", None) is recomputed_forward and forward.args[0].__self__ is module


def checkpoint_blocks(model: nn.Module) -> int:
    """Make every block of `model` recompute its activations in the backward; return how many blocks.
    (A partial over the bound forward: a deep copy or pickle of the model rebinds it to the copy.)"""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        if "forward" in block.__dict__:
            raise ValueError(f"block {type(block).__name__} already has a forward of its own on the instance")
        block.forward = functools.partial(recomputed_forward, block.forward)
    return len(blocks)


def plain_blocks(model: nn.Module) -> None:
    """Undo `checkpoint_blocks`: every block runs its forward as built again."""
    for block in model.modules():
        if isinstance(block, Block) and is_recomputed(block):
            del block.forward
