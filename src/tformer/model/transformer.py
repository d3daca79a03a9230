"""The three spines: decoder-only LM, encoder (+ classification head), encoder-decoder.

Shapes: tokens (B, T) int; key_padding_mask (B, T) bool, True for real tokens (for cached decoding it
covers every key slot, cached ones included); positions (T,) or (B, T); hidden (B, T, D); logits
(B, T, V) or (B, n_classes). Each constructor reads the config once; each forward validates its
inputs on the host, builds the mask as data, then runs the blocks. Given `targets` (B, T), the decoder
LM's and the encoder-decoder's forward return the summed cross-entropy instead of the logits, from the
fused head (tformer.model.loss), which never makes the (B, T, V) logits.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import replace

import torch
from torch import Tensor, nn

from tformer.config import ModelConfig
from tformer.model.attention import Memory
from tformer.model.blocks import BLOCKS, CROSS_BLOCKS, make_dropout
from tformer.model.buffers import compute_tables_after_load
from tformer.model.cache import NO_CACHE, KVCache, NoCache, as_cache
from tformer.model.checks import (
    check_key_padding,
    check_positions,
    check_source_padding,
    check_targets,
    check_tokens,
    is_dtensor,
)
from tformer.model.init import init_weights
from tformer.model.linear import apply_linear, autocast_input
from tformer.model.loss import IGNORE_INDEX, linear_cross_entropy
from tformer.model.masks import causal_mask, padding_mask
from tformer.model.norms import make_norm
from tformer.model.positions import NoRotary, make_positions


def new_kv_cache(cfg, capacity: int | None) -> KVCache:
    """A KV cache of `capacity` positions (default: the model's context), at most max_seq_len: positions
    past it are refused by the model anyway, and a cache's buffers take its whole capacity."""
    cache = KVCache(cfg.n_layers, cfg.max_seq_len if capacity is None else capacity)  # (checks >= 1)
    if cache.capacity > cfg.max_seq_len:
        raise ValueError(
            f"a KV cache of {cache.capacity:,} positions is more than the model's context (max_seq_len "
            f"{cfg.max_seq_len:,}): its positions end there"
        )
    return cache


def check_loss_targets(
    targets: Tensor, head: nn.Linear, tokens: Tensor, cache: NoCache, label_smoothing: float
) -> None:
    """targets= of a training forward, checked before anything runs (a refused call leaves the cache and
    the MoE counters as they were): one class id per input token, on the model's device, no cache (a
    loss is for training; decoding takes the logits), label smoothing in [0, 1), and the whole head on
    this rank."""
    if isinstance(cache, KVCache):
        raise ValueError("targets= returns a training loss and takes no KV cache: decode without targets")
    check_targets(targets, head.out_features, "targets", IGNORE_INDEX, head.weight.device)
    if targets.shape != tokens.shape:
        raise ValueError(
            f"targets must have the shape of the input tokens {tuple(tokens.shape)} (one per position), "
            f"got {tuple(targets.shape)}"
        )
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"label_smoothing must be a number in [0, 1), got {label_smoothing!r}")
    if not 0 <= label_smoothing < 1:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    if is_dtensor(head.weight):
        raise ValueError(
            "targets= needs the whole output head on this rank, and tensor parallelism splits it by "
            "vocabulary: take the logits (model(...) without targets) and the vocabulary-parallel loss "
            "(tformer.tasks.losses.cross_entropy_sum)"
        )


def head_output(
    head: nn.Linear, h: Tensor, targets: Tensor | None = None, label_smoothing: float = 0.0
) -> Tensor:
    """The logits head(h) (B, T, V); given targets (B, T) (checked by check_loss_targets), the sum of
    their cross-entropy (fp32 scalar; IGNORE_INDEX positions add nothing) from the fused head and loss."""
    if targets is None:
        return apply_linear(head, h)
    return linear_cross_entropy(h, head.weight, targets, label_smoothing)


class Stack(nn.Module):
    """Token embedding (times sqrt(D) if cfg.embed_scale) + input positions + dropout, then blocks,
    then the final norm (Pre-Norm) or nothing (Post-Norm, whose blocks end in a norm)."""

    def __init__(self, cfg: ModelConfig, tok_embed: nn.Embedding) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embed = tok_embed
        self.input_positions, self.rotary = make_positions(cfg)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.embed_scale else 1.0
        self.embed_drop = make_dropout(cfg.dropout)
        self.final_norm = make_norm(cfg) if cfg.norm_placement == "pre" else nn.Identity()

    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        x = self.tok_embed(tokens) * self.embed_scale  # (B, T, D)
        return self.embed_drop(self.input_positions(x, positions))

    def resolve_positions(
        self, tokens: Tensor, positions: Tensor | None, start: int, what: str = "sequence"
    ) -> Tensor:
        b, t = tokens.shape
        if positions is None:
            positions = torch.arange(start, start + t, device=tokens.device)  # (T,)
        return check_positions(positions, b, t, self.cfg.max_seq_len, self.cfg.positions, what)


class Encoder(Stack):
    """Bidirectional stack: every token attends to every real token."""

    def __init__(self, cfg: ModelConfig, tok_embed: nn.Embedding, n_layers: int) -> None:
        super().__init__(cfg, tok_embed)
        block = BLOCKS[cfg.norm_placement]
        self.blocks = nn.ModuleList(block(cfg, i, self.rotary) for i in range(n_layers))

    def forward(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        check_tokens(tokens, self.tok_embed.num_embeddings, "source tokens", self.tok_embed.weight.device)
        b, t = tokens.shape
        key_padding_mask = check_key_padding(key_padding_mask, b, t, "source key_padding_mask")
        check_source_padding(key_padding_mask)
        positions = self.resolve_positions(tokens, None, 0, "source")
        mask = padding_mask(t, key_padding_mask, t, tokens.device)
        x = self.embed(tokens, positions)
        for block in self.blocks:
            x = block(x, positions, mask, NO_CACHE)
        return self.final_norm(x)  # (B, T, D)


class DecoderLM(Stack):
    """Causal language model: logits for the next token at every position."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, nn.Embedding(cfg.vocab_size, cfg.d_model))
        block = BLOCKS[cfg.norm_placement]
        self.blocks = nn.ModuleList(block(cfg, i, self.rotary) for i in range(cfg.n_layers))
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embed.weight

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        cache: NoCache = NO_CACHE,
        targets: Tensor | None = None,
        label_smoothing: float = 0.0,
    ) -> Tensor:
        check_tokens(tokens, self.cfg.vocab_size, device=self.tok_embed.weight.device)
        if targets is not None:
            check_loss_targets(targets, self.lm_head, tokens, cache, label_smoothing)
        cache = as_cache(cache, len(self.blocks))
        b, t = tokens.shape
        start = cache.seq_len
        key_padding_mask = check_key_padding(key_padding_mask, b, start + t, "key_padding_mask")
        positions = self.resolve_positions(tokens, positions, start)
        mask = causal_mask(start, t, key_padding_mask, tokens.device)
        x = self.embed(tokens, positions)
        for block in self.blocks:
            x = block(x, positions, mask, cache)
        return head_output(self.lm_head, self.final_norm(x), targets, label_smoothing)  # (B, T, V) or loss

    def new_cache(self, capacity: int | None = None) -> KVCache:
        return new_kv_cache(self.cfg, capacity)


class ClsPooling(nn.Module):
    """The first token's state (a <cls>/<bos> token the data pipeline puts first)."""

    def forward(self, h: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        return h[:, 0]  # (B, D)


class MeanPooling(nn.Module):
    """Mean of the real tokens' states."""

    def forward(self, h: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        if key_padding_mask is None:
            return h.mean(dim=1)
        w = key_padding_mask.to(h.dtype)[..., None]  # (B, T, 1)
        return (h * w).sum(dim=1) / w.sum(dim=1).clamp_min(1.0)  # (B, D)


POOLINGS: dict[str, type[nn.Module]] = {"cls": ClsPooling, "mean": MeanPooling}


class EncoderClassifier(nn.Module):
    """Encoder + pooling + linear head: class logits (B, n_classes)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg, nn.Embedding(cfg.vocab_size, cfg.d_model), cfg.n_layers)
        self.pool = POOLINGS[cfg.pooling]()
        self.head = nn.Linear(cfg.d_model, cfg.n_classes)
        init_weights(self, cfg)

    def forward(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        h = self.encoder(tokens, key_padding_mask)
        return self.head(self.pool(h, key_padding_mask))


class Decoder(Stack):
    """Causal stack with cross-attention over the encoder memory in every block."""

    def __init__(self, cfg: ModelConfig, tok_embed: nn.Embedding) -> None:
        super().__init__(cfg, tok_embed)
        cross_rotary = self.rotary if cfg.rope.cross_attention else NoRotary()
        block = CROSS_BLOCKS[cfg.norm_placement]
        self.blocks = nn.ModuleList(block(cfg, i, self.rotary, cross_rotary) for i in range(cfg.n_layers))

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        key_padding_mask: Tensor | None,
        cache: NoCache,
        memory: Memory,
        right_padded: bool = False,
    ) -> Tensor:
        mask = causal_mask(cache.seq_len, tokens.shape[1], key_padding_mask, tokens.device, right_padded)
        states = autocast_input(memory.states)  # under autocast: one cast for every block's K/V products
        memory = memory if states is memory.states else replace(memory, states=states)
        x = self.embed(tokens, positions)
        for block in self.blocks:
            x = block(x, positions, mask, cache, memory)
        return self.final_norm(x)  # (B, T, D)


class EncoderDecoder(nn.Module):
    """Sequence-to-sequence Transformer (Vaswani et al., 2017): encode the source once, decode causally."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        shared = cfg.share_embeddings
        self.src_embed = self.tok_embed if shared else nn.Embedding(cfg.resolved_src_vocab_size, cfg.d_model)
        self.encoder = Encoder(cfg, self.src_embed, cfg.resolved_n_encoder_layers)
        self.decoder = Decoder(cfg, self.tok_embed)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self, cfg)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embed.weight

    def encode(self, src: Tensor, src_key_padding_mask: Tensor | None = None) -> Memory:
        states = self.encoder(src, src_key_padding_mask)  # (B, S, D)
        b, s = src.shape
        positions = torch.arange(s, device=src.device)  # (S,)
        return Memory(states, positions, padding_mask(1, src_key_padding_mask, s, src.device))

    def decode(
        self,
        tgt: Tensor,
        memory: Memory | None,
        positions: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        cache: NoCache = NO_CACHE,
        targets: Tensor | None = None,
        label_smoothing: float = 0.0,
        right_padded: bool = False,
    ) -> Tensor:
        """right_padded: key_padding_mask's real tokens come first in every row (training targets), so
        attention keeps its causal path and the mask only keeps the padding out of MoE routing."""
        if not isinstance(memory, Memory):
            raise ValueError("the decoder needs the encoder memory: call decode(tgt, model.encode(src), ...)")
        check_tokens(tgt, self.cfg.vocab_size, "target tokens", self.lm_head.weight.device)
        b, t = tgt.shape
        if memory.states.shape[0] != b:
            raise ValueError(
                f"target batch size {b} does not match the encoder memory's {memory.states.shape[0]}"
            )
        if memory.states.dim() != 3 or memory.states.shape[-1] != self.cfg.d_model:
            raise ValueError(
                f"the encoder memory's states are {tuple(memory.states.shape)}, not (batch, source length, "
                f"d_model={self.cfg.d_model}): give decode this model's own encode(src)"
            )
        if targets is not None:
            check_loss_targets(targets, self.lm_head, tgt, cache, label_smoothing)
        cache = as_cache(cache, len(self.decoder.blocks))
        cache.use_source(memory.states)  # the caller's tensor: the decoder may cast a copy under autocast
        start = cache.seq_len
        key_padding_mask = check_key_padding(key_padding_mask, b, start + t, "target key_padding_mask")
        positions = self.decoder.resolve_positions(tgt, positions, start, "target")
        h = self.decoder(tgt, positions, key_padding_mask, cache, memory, right_padded)
        return head_output(self.lm_head, h, targets, label_smoothing)  # (B, T, V) or the summed loss

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        targets: Tensor | None = None,
        label_smoothing: float = 0.0,
        tgt_right_padded: bool = False,
    ) -> Tensor:
        check_tokens(src, self.cfg.resolved_src_vocab_size, "source tokens", self.lm_head.weight.device)
        check_tokens(tgt, self.cfg.vocab_size, "target tokens", self.lm_head.weight.device)
        if src.shape[0] != tgt.shape[0]:
            raise ValueError(
                f"source batch size {src.shape[0]} does not match target batch size {tgt.shape[0]}"
            )
        if targets is not None:  # before the encoder runs (decode checks them again)
            check_loss_targets(targets, self.lm_head, tgt, NO_CACHE, label_smoothing)
        memory = self.encode(src, src_key_padding_mask)
        return self.decode(
            tgt,
            memory,
            key_padding_mask=tgt_key_padding_mask,
            targets=targets,
            label_smoothing=label_smoothing,
            right_padded=tgt_right_padded,
        )

    def new_cache(self, capacity: int | None = None) -> KVCache:
        return new_kv_cache(self.cfg, capacity)


ARCHITECTURES: dict[str, type[nn.Module]] = {
    "decoder": DecoderLM,
    "encoder": EncoderClassifier,
    "encoder_decoder": EncoderDecoder,
}


def weight_count_bound(cfg: ModelConfig) -> int:
    """An upper bound on the model's parameter count from its sizes alone (no module is built): each
    layer with its biases and norms, the larger of its dense and MoE FFNs, cross-attention in a decoder
    over an encoder; embeddings (the head's and a source vocabulary's where not shared), a learned
    position table and the classifier head counted whether or not the architecture has them."""
    d, hd, kv = (
        cfg.d_model,
        cfg.n_heads * cfg.resolved_head_dim,
        cfg.resolved_n_kv_heads * cfg.resolved_head_dim,
    )
    attn = 2 * d * hd + 2 * d * kv + 2 * hd + 2 * kv + d  # q, o; k, v; their biases
    gated = 3 if cfg.ffn == "swiglu" else 2
    ffn = gated * d * cfg.d_ff + 2 * cfg.d_ff + d
    if cfg.moe is not None:  # routed and shared experts (and their biases), the router's centroids
        moe = cfg.moe
        hidden = moe.n_experts * moe.expert_width(cfg.d_ff) + moe.n_shared * moe.shared_width(cfg.d_ff)
        ffn = max(ffn, (gated * d + 2) * hidden + moe.n_experts * (d + 3) + 2 * d)
    layer = attn + ffn + 4 * d
    layers = cfg.n_layers
    if cfg.arch == "encoder_decoder":
        layers += cfg.resolved_n_encoder_layers
        layer += attn + 2 * d  # the decoder's cross-attention, counted for every layer
    vocab = cfg.vocab_size * (1 if cfg.tie_embeddings else 2)
    if cfg.arch == "encoder_decoder" and not cfg.share_embeddings:
        vocab += cfg.src_vocab_size or cfg.vocab_size
    return layers * layer + vocab * d + 2 * cfg.max_seq_len * d + (cfg.n_classes + 4) * (d + 1)


def check_fits(cfg: ModelConfig) -> None:
    """ValueError, before anything is allocated, when the fp32 weights alone would need more than this
    machine's memory (a layer count or width typed with extra digits would otherwise allocate until the
    machine runs out, or build modules for hours)."""
    if torch.empty(0).device.type == "meta":  # built for its shapes only (count_params): no memory
        return
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: the allocator will say
        return
    need = 4 * weight_count_bound(cfg)
    if need > memory:
        raise ValueError(
            f"the model does not fit in memory: its float32 weights alone take about {need / 2**30:,.1f} GiB, "
            f"and this machine has {memory / 2**30:,.1f} GiB: check its sizes: vocab_size={cfg.vocab_size}, "
            f"d_model={cfg.d_model}, n_layers={cfg.n_layers}, d_ff={cfg.d_ff}, max_seq_len={cfg.max_seq_len} "
            "(position tables)"
            + (
                f", moe.n_experts={cfg.moe.n_experts}, moe.d_expert={cfg.moe.expert_width(cfg.d_ff)}, "
                f"moe.n_shared={cfg.moe.n_shared}, moe.d_shared={cfg.moe.shared_width(cfg.d_ff)}"
                if cfg.moe is not None
                else ""
            )
        )


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model `cfg` describes, initialised by `cfg.init`."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"build_model expects a ModelConfig, got {type(cfg).__name__}")
    check_fits(cfg)
    try:
        model = ARCHITECTURES[cfg.arch](cfg)
        model.register_load_state_dict_post_hook(compute_tables_after_load)  # (assign=True on meta)
        return model
    except (RuntimeError, MemoryError) as err:  # the allocator's message names bytes, not the setting
        if isinstance(err, RuntimeError) and "allocate" not in str(err):
            raise
        asked = re.search(r"allocate (\d+) bytes", str(err))
        what = f"one tensor needs {int(asked.group(1)) / 2**30:,.1f} GiB" if asked else "out of memory"
        raise ValueError(
            f"the model does not fit in memory ({what}): "
            f"check its sizes: vocab_size={cfg.vocab_size}, d_model={cfg.d_model}, n_layers={cfg.n_layers}, "
            f"d_ff={cfg.d_ff}, max_seq_len={cfg.max_seq_len} (position tables hold max_seq_len rows)"
        ) from None
