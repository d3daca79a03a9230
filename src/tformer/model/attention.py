"""Multi-head attention (Vaswani et al., 2017) with grouped K/V heads (GQA / MQA).

Shapes: x (B, T, D); q (B, H, T, E); k, v (B, Hkv, S, E) with H = n_heads, Hkv = n_kv_heads,
E = head_dim; memory (B, S, D). Kernels take (q, k, v, mask) with Hkv K/V heads, each serving
n_rep = H / Hkv query heads: `EagerAttention` is the readable softmax(q k^T / sqrt(E)) v reference
(it expands K/V with `repeat_kv`); `SdpaAttention` is PyTorch's fused `scaled_dot_product_attention`
after `repeat_kv`, and `GqaSdpaAttention` lets SDPA broadcast the K/V heads itself (`enable_gqa`,
torch >= 2.5), which saves copying K/V (and the whole KV cache at every decoding step). The registry
picks the GQA kernel where torch has it. All honour the same `Mask` and attention dropout.

Self-attention computes q, k, v with `stacked_linear`: one GEMM over the stacked weights when the
batch has enough rows to pay for stacking them and no graph is recorded (prefill, evaluation), three
GEMMs otherwise (training, decoding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.config import ModelConfig
from tformer.model.cache import NoCache
from tformer.model.linear import apply_linear, stacked_linear
from tformer.model.masks import Mask
from tformer.model.score_attention import applies as score_attention_applies
from tformer.model.score_attention import score_attention

SDPA_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


class EagerAttention(nn.Module):
    """softmax(q k^T / sqrt(E) + mask) v, written out (the slow twin of SdpaAttention)."""

    def __init__(self, dropout: float, n_rep: int = 1) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.n_rep = n_rep

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
        probs = attention_weights(q, repeat_kv(k, self.n_rep), mask).to(q.dtype)  # (B, H, Tq, Tk)
        return self.dropout(probs) @ repeat_kv(v, self.n_rep)  # (B, H, Tq, E)


def attention_weights(q: Tensor, k: Tensor, mask: Mask) -> Tensor:
    """softmax(q k^T / sqrt(E) + mask) in fp32: q (B, H, Tq, E), k (B, H, Tk, E) -> (B, H, Tq, Tk)."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask.allowed, float("-inf")).float(), dim=-1)


class SdpaAttention(nn.Module):
    """torch's fused attention on K/V expanded by repeat_kv. Without a mask where every query sees every
    key (`mask.is_full`, e.g. one new token over the cache), with its causal path where the mask is the
    square causal one, with the boolean mask otherwise. bf16 CPU training at up to 512 keys (a recorded
    graph, no attention dropout) goes to `score_attention` instead, 2-5x faster forward + backward."""

    def __init__(self, dropout: float, n_rep: int = 1) -> None:
        super().__init__()
        self.p = dropout
        self.n_rep = n_rep

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
        return self.sdpa(q, repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep), mask)

    def sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask, **gqa: bool) -> Tensor:
        p = self.p if self.training else 0.0
        if score_attention_applies(q, k, p):  # CPU training: written-out scores (score_attention.py)
            n_rep = q.shape[1] // k.shape[1]
            return score_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)
        if mask.is_full:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, **gqa)
        if mask.is_causal:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, **gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.allowed, dropout_p=p, **gqa)


class GqaSdpaAttention(SdpaAttention):
    """SdpaAttention with SDPA broadcasting each K/V head over its n_rep query heads (no repeat_kv copy)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
        return self.sdpa(q, k, v, mask, enable_gqa=True)


ATTENTION_KERNELS: dict[str, type[nn.Module]] = {
    "eager": EagerAttention,
    "sdpa": GqaSdpaAttention if SDPA_HAS_GQA else SdpaAttention,
}


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, Hkv, S, E) -> (B, Hkv * n_rep, S, E): each K/V head serves n_rep query heads."""
    if n_rep == 1:
        return x
    b, h, s, e = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, e).reshape(b, h * n_rep, s, e)


@dataclass(frozen=True)
class Memory:
    """Encoder output seen by cross-attention: states (B, S, D), positions (S,), key mask over S."""

    states: Tensor
    positions: Tensor
    mask: Mask


class Attention(nn.Module):
    """Projections and head bookkeeping shared by self- and cross-attention."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: nn.Module) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.resolved_n_kv_heads
        self.head_dim = cfg.resolved_head_dim
        d, e = cfg.d_model, self.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * e, bias=cfg.bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * e, bias=cfg.bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * e, bias=cfg.bias)
        self.o_proj = nn.Linear(self.n_heads * e, d, bias=cfg.bias)
        self.rotary = rotary
        self.kernel = ATTENTION_KERNELS[cfg.attn_kernel](cfg.attn_dropout, self.n_heads // self.n_kv_heads)

    def split_heads(self, x: Tensor, n: int) -> Tensor:
        """(B, T, n*E) -> (B, n, T, E); n is read from the width, so a tensor-parallel rank holding
        n / T of the heads (its column slice of the projection) splits its own share."""
        b, t, _ = x.shape
        return x.view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, n, T, E)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
        y = self.kernel(q, k, v, mask)  # (B, H, T, E)
        b, h, t, e = y.shape
        return apply_linear(self.o_proj, y.transpose(1, 2).reshape(b, t, h * e))  # (B, T, D)


class SelfAttention(Attention):
    """Attention of x over itself (and over the cached past when decoding)."""

    def forward(self, x: Tensor, positions: Tensor, mask: Mask, cache: NoCache) -> Tensor:
        q, k, v = stacked_linear(x, (self.q_proj, self.k_proj, self.v_proj))  # (B, T, H*E), 2 x (B, T, Hkv*E)
        q, k = self.rotary.pair(
            self.split_heads(q, self.n_heads), self.split_heads(k, self.n_kv_heads), positions
        )
        v = self.split_heads(v, self.n_kv_heads)
        k, v = cache.update(self.layer_idx, k, v)
        return self.attend(q, k, v, mask)


class CrossAttention(Attention):
    """Attention of the decoder states x over the encoder memory; memory K/V computed once per source."""

    def memory_kv(self, memory: Memory) -> tuple[Tensor, Tensor]:
        k = self.rotary(
            self.split_heads(apply_linear(self.k_proj, memory.states), self.n_kv_heads), memory.positions
        )
        return k, self.split_heads(apply_linear(self.v_proj, memory.states), self.n_kv_heads)

    def forward(self, x: Tensor, positions: Tensor, memory: Memory, cache: NoCache) -> Tensor:
        q = self.rotary(self.split_heads(apply_linear(self.q_proj, x), self.n_heads), positions)
        k, v = cache.cross(self.layer_idx, lambda: self.memory_kv(memory))
        return self.attend(q, k, v, memory.mask)
