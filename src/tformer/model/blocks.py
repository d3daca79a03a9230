"""Transformer blocks: the same slots, wired Post-Norm or Pre-Norm.

Shapes: x (B, T, D) -> (B, T, D). `positions` (B, T) or (T,), `mask` a `Mask`, `cache` a cache or
NO_CACHE, `memory` the encoder `Memory` for cross-attention blocks. The FFN also gets `mask.tokens`
(the real tokens, or None), which an MoE layer uses to leave padding out of its routing. Which block class is used is
decided once in the spine's constructor (`BLOCKS[cfg.norm_placement]`); forwards never branch.
"""

from __future__ import annotations

from torch import Tensor, nn

from tformer.config import ModelConfig
from tformer.model.attention import CrossAttention, Memory, SelfAttention
from tformer.model.cache import NoCache
from tformer.model.ffn import make_ffn
from tformer.model.masks import Mask
from tformer.model.norms import make_norm


def make_dropout(p: float) -> nn.Module:
    """Dropout, or the identity when p == 0 (no F.dropout call per use: it shows in decoding)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class Block(nn.Module):
    """Slots: attn_norm, attn, ffn_norm, ffn (dense FFN or MoE), and residual dropout."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: nn.Module) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = SelfAttention(cfg, layer_idx, rotary)
        self.ffn_norm = make_norm(cfg)
        self.ffn = make_ffn(cfg, layer_idx)
        self.drop = make_dropout(cfg.dropout)


class PreNormBlock(Block):
    """x = x + Attn(norm(x)); x = x + FFN(norm(x))   (Xiong et al., 2020)."""

    def forward(self, x: Tensor, positions: Tensor, mask: Mask, cache: NoCache) -> Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), positions, mask, cache))
        return x + self.drop(self.ffn(self.ffn_norm(x), mask.tokens))


class PostNormBlock(Block):
    """x = norm(x + Attn(x)); x = norm(x + FFN(x))   (Vaswani et al., 2017)."""

    def forward(self, x: Tensor, positions: Tensor, mask: Mask, cache: NoCache) -> Tensor:
        x = self.attn_norm(x + self.drop(self.attn(x, positions, mask, cache)))
        return self.ffn_norm(x + self.drop(self.ffn(x, mask.tokens)))


class CrossBlock(Block):
    """A decoder block of the encoder-decoder: adds cross_norm and cross_attn over the memory."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: nn.Module, cross_rotary: nn.Module) -> None:
        super().__init__(cfg, layer_idx, rotary)
        self.cross_norm = make_norm(cfg)
        self.cross_attn = CrossAttention(cfg, layer_idx, cross_rotary)


class PreNormCrossBlock(CrossBlock):
    """x += Attn(norm(x)); x += CrossAttn(norm(x), memory); x += FFN(norm(x))."""

    def forward(self, x: Tensor, positions: Tensor, mask: Mask, cache: NoCache, memory: Memory) -> Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), positions, mask, cache))
        x = x + self.drop(self.cross_attn(self.cross_norm(x), positions, memory, cache))
        return x + self.drop(self.ffn(self.ffn_norm(x), mask.tokens))


class PostNormCrossBlock(CrossBlock):
    """x = norm(x + Attn(x)); x = norm(x + CrossAttn(x, memory)); x = norm(x + FFN(x))."""

    def forward(self, x: Tensor, positions: Tensor, mask: Mask, cache: NoCache, memory: Memory) -> Tensor:
        x = self.attn_norm(x + self.drop(self.attn(x, positions, mask, cache)))
        x = self.cross_norm(x + self.drop(self.cross_attn(x, positions, memory, cache)))
        return self.ffn_norm(x + self.drop(self.ffn(x, mask.tokens)))


BLOCKS: dict[str, type[Block]] = {"pre": PreNormBlock, "post": PostNormBlock}
CROSS_BLOCKS: dict[str, type[CrossBlock]] = {"pre": PreNormCrossBlock, "post": PostNormCrossBlock}
