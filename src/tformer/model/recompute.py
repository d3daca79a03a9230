"""Activation checkpointing (`activation_checkpointing` in a run's config): each Transformer block keeps
less of its forward for the backward and computes the rest again there.

- "full": a block keeps only its input and runs its whole forward again in the backward, so a step holds
  one block's activations at a time instead of every layer's, for about one more forward of compute.
- "selective": a block keeps the outputs of its linear layers' products (`mm`, `addmm`, `_grouped_mm`,
  the MoE loop kernel's `tformer::expert_products`) and of SDPA's fused kernels without dropout, and
  recomputes the rest in the backward: norms, RoPE, activations, dropout, residual adds, casts, the
  MoE routing, and attention computed as batched products (`score_attention` in bf16 on the CPU, SDPA's
  math path). Those ops are cheap to run again and their outputs are a large share of the activations
  (benchmarks/bench_recompute.py measures the trade against "full" and the model as built).
  This is PyTorch's selective activation checkpointing (`create_selective_checkpoint_contexts`) with a
  policy by op, as torchtitan's "op" mode saves products and attention.

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
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tformer.model import grouped_linear  # noqa: F401  (registers torch.ops.tformer.expert_products)
from tformer.model.blocks import Block
from tformer.model.cache import NO_CACHE

MODES = ("full", "selective")  # what checkpoint_blocks takes; a run's config adds "none"

_aten = torch.ops.aten
# the ops whose outputs "selective" keeps: the products of the linear layers (oneDNN's too, which fp32
# training takes on AVX512 CPUs: tformer.model.linear.OneDnnLinear), the fused attention kernels
# and the MoE loop kernel's products. Not bmm / baddbmm (the attention of `score_attention` and SDPA's
# math path, recomputed whole: keeping their score matrices would cost as much memory as not
# checkpointing them), not out= overloads (a kept output would not be written into the caller's buffer)
SAVED_OPS = frozenset(
    getattr(_aten, name).default for name in ("mm", "addmm", "_grouped_mm") if hasattr(_aten, name)
) | {torch.ops.tformer.expert_products.default}
if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
    SAVED_OPS |= {torch.ops.mkldnn._linear_pointwise.default}
ATTENTION_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
)


def _dropout_p(op, args, kwargs) -> float:
    """The dropout probability an attention op is called with (by its schema: the position differs)."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name == "dropout_p":
            return args[i] if i < len(args) else kwargs.get("dropout_p", arg.default_value or 0.0)
    return 0.0


def _keep_products_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep the products and the attention kernels' outputs, recompute every other op. An attention
    kernel that draws dropout is recomputed too: kept, it would not draw its random numbers again in the
    recomputation, and every later random op of the block (the residual dropout) would draw other masks."""
    if op in SAVED_OPS or (op in ATTENTION_OPS and _dropout_p(op, args, kwargs) == 0.0):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_SELECTIVE = functools.partial(create_selective_checkpoint_contexts, _keep_products_and_attention)


def recomputed_forward(
    forward: Callable[..., Tensor], x: Tensor, positions, mask, cache, *memory, selective: bool = False
) -> Tensor:
    """`forward` (a block's own, bound) recomputed in the backward, all of it or (`selective`) all but its
    products and attention, when it records a training graph without a KV cache; called as it is
    otherwise."""
    if cache is NO_CACHE and torch.is_grad_enabled() and forward.__self__.training:
        policy = {"context_fn": _SELECTIVE} if selective else {}
        return checkpoint(forward, x, positions, mask, cache, *memory, use_reentrant=False, **policy)
    return forward(x, positions, mask, cache, *memory)


def recompute_mode(module: nn.Module) -> str:
    """ "full" or "selective" where `module`'s instance-level forward is what `checkpoint_blocks` set on it,
    over its own forward (a shallow copy of a block would hold the original's); "none" otherwise."""
    forward = module.__dict__.get("forward")
    if getattr(forward, "func", None) is not recomputed_forward or forward.args[0].__self__ is not module:
        return "none"
    return "selective" if forward.keywords.get("selective") else "full"


def is_recomputed(module: nn.Module) -> bool:
    """Whether `checkpoint_blocks` made `module` recompute activations (either mode)."""
    return recompute_mode(module) != "none"


def checkpoint_blocks(model: nn.Module, mode: str = "full") -> int:
    """Make every block of `model` recompute its activations in the backward, all of them ("full") or all
    but its products' and attention's ("selective"); return how many blocks. (A partial over the bound
    forward: a deep copy or pickle of the model rebinds it to the copy.)"""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {', '.join(MODES)}, got {mode!r}")
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        if "forward" in block.__dict__:
            raise ValueError(f"block {type(block).__name__} already has a forward of its own on the instance")
        block.forward = functools.partial(recomputed_forward, block.forward, selective=mode == "selective")
    return len(blocks)


def plain_blocks(model: nn.Module) -> None:
    """Undo `checkpoint_blocks`: every block runs its forward as built again."""
    for block in model.modules():
        if isinstance(block, Block) and is_recomputed(block):
            del block.forward
