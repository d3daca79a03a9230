"""Sizes and costs of a model: total vs active parameters, forward FLOPs per token, and DeepSeekMoE's
fine-grained expert segmentation as a compute-matched config transform.

Counting rule (docs/performance.md, Method): matmul FLOPs only. Forward per token = 2 x active matmul
weights (every linear layer, the output head included, the input embedding excluded; for MoE the
router, the top_k selected experts and the shared experts) + attention 2 x T x (d_qk + d_v) per
attention layer (full T x T; with causal=True half of it for the self-attention of causal stacks: the
decoder LM's, the encoder-decoder's decoder's). Training = 3 x forward.
"""

from __future__ import annotations

import gc
import numbers

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tformer.config import ConfigError, ModelConfig, MoEConfig


def _as_model(model_or_cfg: nn.Module | ModelConfig) -> nn.Module:
    if isinstance(model_or_cfg, nn.Module):
        return model_or_cfg
    from tformer.model import build_model

    with torch.device("meta"):  # shapes only: no memory, no time
        return build_model(model_or_cfg)


def _routed_experts(model: nn.Module, weights_only: bool = False) -> list[tuple[int, float]]:
    """(routed expert parameters, share active per token) for every MoE layer; weights_only: the weight
    matrices alone (the products' FLOPs), not their biases."""
    from tformer.model.moe import moe_layers

    out = []
    for _, layer in moe_layers(model):
        params = layer.experts.named_parameters()
        numel = sum(p.numel() for name, p in params if not (weights_only and name.endswith("_bias")))
        out.append((numel, layer.router.top_k / layer.experts.n_experts))
    return out


def count_params(model_or_cfg: nn.Module | ModelConfig) -> dict[str, int]:
    """{"total", "active"}: all parameters (tied ones once) and those one token uses (routed experts
    counted top_k / n_experts of the way). A config is measured on a meta-device model."""
    model = _as_model(model_or_cfg)
    total = sum(p.numel() for p in model.parameters())
    inactive = sum(round(numel * (1.0 - share)) for numel, share in _routed_experts(model))
    return {"total": total, "active": total - inactive}


def flops_per_token(model_or_cfg: nn.Module | ModelConfig, seq_len: int, causal: bool = False) -> float:
    """Forward matmul FLOPs per token at sequence length `seq_len` (see the module docstring)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral):
        raise TypeError(f"seq_len must be an int, got {seq_len!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    from tformer.model.attention import CrossAttention, SelfAttention
    from tformer.model.moe import moe_layers
    from tformer.model.transformer import Decoder, DecoderLM

    model = _as_model(model_or_cfg)
    cfg = model.cfg
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    moe = sum(layer.router.weight.numel() for _, layer in moe_layers(model))
    experts = sum(numel * share for numel, share in _routed_experts(model, weights_only=True))
    n_attn = sum(isinstance(m, (SelfAttention, CrossAttention)) for m in model.modules())
    # causal: a causal stack's self-attention (an encoder's and cross-attention stay full)
    stacks = [m for m in model.modules() if isinstance(m, (DecoderLM, Decoder))] if causal else []
    n_causal = sum(isinstance(m, SelfAttention) for stack in stacks for m in stack.modules())
    d_attn = cfg.n_heads * cfg.resolved_head_dim  # d_qk = d_v
    attention = 2 * seq_len * 2 * d_attn * (n_attn - 0.5 * n_causal)
    return 2.0 * (linear + moe + experts) + attention


def fine_grained(cfg: ModelConfig, m: int, n_shared: int) -> ModelConfig:
    """DeepSeekMoE's fine-grained expert segmentation + shared expert isolation, compute-matched.

    From a dense FFN (one expert, top-1) or an MoE baseline (N experts of width w, top-K): split each
    expert into m of width w / m, activate m*K of them, and make n_shared of them shared, taken from
    both the routed and the activated ones: mN - n_shared routed experts, top_k = mK - n_shared,
    d_shared = d_expert = w / m. Active and total expert weight matrices and FLOPs stay equal (the router
    grows to mN - n_shared centroids; with cfg.bias each expert keeps its own output bias of d_model, so
    the bias parameters grow m-fold). Other MoE settings of the baseline are kept.
    """
    for name, value in (("m", m), ("n_shared", n_shared)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"fine_grained: {name} must be an int, got {value!r}")
    base = cfg.moe if cfg.moe is not None else MoEConfig(n_experts=1, top_k=1)
    width = base.expert_width(cfg.d_ff)
    if m < 1 or width % m:
        raise ConfigError(f"fine_grained: m={m} must be >= 1 and divide the expert width {width}")
    if base.n_shared:
        raise ConfigError("fine_grained: the baseline already has shared experts; start from dense or GShard")
    if not 0 <= n_shared < m * base.top_k:
        raise ConfigError(f"fine_grained: n_shared={n_shared} must be in [0, m * top_k = {m * base.top_k})")
    moe = base.replace(
        n_experts=m * base.n_experts - n_shared,
        top_k=m * base.top_k - n_shared,
        d_expert=width // m,
        n_shared=n_shared,
        d_shared=width // m,
    )
    return cfg.replace(moe=moe)


class _Created(TorchDispatchMode):
    """Every storage an op makes while the mode is on (not a view's, an in-place or out= op's: theirs
    existed before): weak references, the newest per address."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        for t in tree_leaves(out):
            if type(t) is torch.Tensor and t.layout == torch.strided and t.device.type != "meta":
                _remember(self.storages, t)
        return out


def _remember(storages: dict[int, tuple[StorageWeakRef, int]], t: torch.Tensor) -> None:
    storage = t.untyped_storage()
    known = storages.get(storage.data_ptr())
    if known is None or known[0].expired():  # a freed storage's address reused
        storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())


def activation_bytes(model: nn.Module, forward) -> int:
    """Bytes of the activations autograd keeps for the backward of `forward()` (which returns the loss
    tensor; its backward runs here, and the gradients are left on the parameters): every tensor saved for
    the backward and every storage the forward made, each still alive when the forward returns (what
    activation checkpointing holds, a recomputed block's input and selective checkpointing's kept
    outputs, lives outside autograd's saved tensors), each storage once (q, k and v share their input),
    the model's parameters and the returned loss left out."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[StorageWeakRef, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        _remember(seen, t)
        return t

    created = _Created()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), created:
        loss = forward()
    gc.collect()  # what only a reference cycle still holds is not kept for the backward
    returned = loss.untyped_storage().data_ptr()
    kept = {
        address: nbytes
        for storages in (seen, created.storages)
        for address, (ref, nbytes) in storages.items()
        if not ref.expired() and address not in weights and address != returned
    }
    loss.backward()
    return sum(kept.values())
