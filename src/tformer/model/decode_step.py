"""One cached decoding step of a `DecoderLM`, read from the model once: the fast twin of
`model(tokens[:, None], positions, key_padding_mask, cache)[:, -1]` for one new token per row.

Shapes: tokens (B,); positions (B, 1) or None (then every row is at the cache's next slot); key_padding
(B, S) bool over every key slot (cache included) or None; logits (B, V). Hidden states stay (B, D).

Why: a decoding step is a handful of matrix-vector products and ~60 small ops per layer. On a CPU the
ops' Python and dispatch cost (module calls, argument checks, mask objects, a RoPE table lookup per
layer, head reshapes) adds ~5 ms to each step of an 8-layer model: a third of a 15 ms step of
`benchmarks/bench_generate.py`'s d_model 512 model. `DecodeStep.build` decides everything once per
`generate` call (build time decides, run time computes): each block's norms as plain functions, q/k/v
and gate/up as one product each (the stacked, row-blocked products of `row_blocked_linears` when that
context is active), the RoPE table, the cache slot to write; the step then runs only the ops of the
paper's block. Slots it does not know (an MoE FFN, a norm of another kind) are called as the modules
they are. The step reads weights where the model calls modules, so it takes only the classes it
knows, as they are: models with other classes (blocks, attention or its kernel, a subclass of
`nn.Linear`, interleaved or partial RoPE), forward hooks, a forward replaced on an instance (other than
by the two decoding contexts), sharded weights, training mode, autograd or autocast get no step
(`unsupported` says why) and decode through `model(...)`, the slow twin. The step runs the model's
ops in the model's order on the same tensors (down to which products are row-blocked and which
tensors are contiguous), so tests/generate/test_decode_step.py holds logits and caches bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks

from tformer.model import linear as linear_module
from tformer.model.attention import CrossAttention, GqaSdpaAttention, Memory, SdpaAttention, SelfAttention
from tformer.model.blocks import PostNormBlock, PostNormCrossBlock, PreNormBlock, PreNormCrossBlock
from tformer.model.cache import KVCache
from tformer.model.ffn import GeluFFN, ReluFFN, SwiGLU
from tformer.model.linear import _DECODING, row_blocked_linear
from tformer.model.norms import is_rms_norm, rms_norm_as_layer_norm
from tformer.model.positions import HalfRotaryEmbedding, NoPositions, NoRotary, rotate_whole_half_layout
from tformer.model.recompute import is_recomputed
from tformer.model.transformer import DecoderLM, EncoderDecoder

Fn = Callable[[Tensor], Tensor]


def _layer(linear: nn.Linear) -> Fn:
    """The layer's own product without the module call: the forward the decoding context set on it
    (row-blocked, `row_blocked_linears`), else F.linear."""
    if "forward" in linear.__dict__:  # `unsupported` admits only the context's own
        return linear.forward
    return partial(F.linear, weight=linear.weight, bias=linear.bias)


def _product(linears: Sequence[nn.Linear], rows: int) -> Fn:
    """x (R, D_in) -> [linear(x) for linear in linears] joined on the last dim, computed as the model
    computes it at R rows (`stacked_linear`): one GEMM over stacked weights from FUSE_MIN_ROWS rows,
    else one row-blocked product over the decoding context's stacked copy where it has one, else each
    layer's own product."""
    if len(linears) == 1:
        return _layer(linears[0])
    if rows >= linear_module.FUSE_MIN_ROWS:
        weight = torch.cat([linear.weight for linear in linears])
        bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
        return partial(F.linear, weight=weight, bias=bias)
    decoding = _DECODING.get()
    if decoding is not None and rows <= decoding.max_rows:
        stacked = decoding.stacked(linears)
        if stacked is not None:
            weight, bias, blocks = stacked
            return partial(row_blocked_linear, weight=weight, bias=bias, n_blocks=blocks)
    layers = [_layer(linear) for linear in linears]
    return lambda x: torch.cat([layer(x) for layer in layers], dim=-1)


def _norm(norm: nn.Module) -> Fn | None:
    """The norm as a plain function (no module call): the decoding context's patched forward (RMSNorm
    as LayerNorm), F.layer_norm / F.rms_norm with the module's parameters, None for the identity, the
    module itself for any other norm."""
    if type(norm) is nn.Identity:
        return None
    if "forward" in norm.__dict__:  # patched by rms_norms_as_layer_norm
        return norm.forward
    if type(norm) is nn.LayerNorm:
        return partial(F.layer_norm, normalized_shape=norm.normalized_shape, weight=norm.weight,
                       bias=norm.bias, eps=norm.eps)  # fmt: skip
    if is_rms_norm(norm):
        return partial(F.rms_norm, normalized_shape=norm.normalized_shape, weight=norm.weight, eps=norm.eps)
    return norm


def _ffn(ffn: nn.Module, rows: int) -> Fn:
    """The FFN slot on (B, D): the dense FFNs as their products and activation, any other (MoE) as the
    module on (B, 1, D)."""
    if type(ffn) is SwiGLU:
        gate_up, down = _product((ffn.gate_proj, ffn.up_proj), rows), _product((ffn.down_proj,), rows)
        width = ffn.up_proj.out_features

        def swiglu(x: Tensor) -> Tensor:
            gate, up = gate_up(x).split(width, dim=-1)
            return down(F.silu(gate) * up)

        return swiglu
    if type(ffn) in (ReluFFN, GeluFFN):
        up, down, act = _product((ffn.up_proj,), rows), _product((ffn.down_proj,), rows), ffn.activation
        return lambda x: down(act(up(x)))
    return lambda x: ffn(x[:, None]).squeeze(1)


class _Attention:
    """Self-attention of one new token per row over the cache: q/k/v as one product, q and k rotated
    together, k and v written into the cache's slot, SDPA over the filled slots, the output product."""

    def __init__(self, attn: nn.Module, rows: int) -> None:
        self.qkv = _product((attn.q_proj, attn.k_proj, attn.v_proj), rows)
        self.o = _product((attn.o_proj,), rows)
        self.layer = attn.layer_idx
        self.h, self.hkv, self.e = attn.n_heads, attn.n_kv_heads, attn.head_dim
        # SDPA called as the model's kernel calls it (the GQA kernel passes enable_gqa at any head count)
        self.gqa = {"enable_gqa": True} if type(attn.kernel) is GqaSdpaAttention else {}

    def __call__(
        self, x: Tensor, rotate: Fn | None, cache: KVCache, slot: int, mask: Tensor | None
    ) -> Tensor:
        b, h, hkv = x.shape[0], self.h, self.hkv
        qkv = self.qkv(x).view(b, h + 2 * hkv, self.e)  # (B, H + 2 Hkv, E): q, k, v heads
        qk = qkv[:, : h + hkv]
        if rotate is not None:  # q and k rotated as one contiguous tensor, as the model's joint rotation
            qk = rotate(qk.contiguous())
        k_buf, v_buf = cache.k[self.layer], cache.v[self.layer]  # (B, Hkv, capacity, E)
        k_buf[:, :, slot] = qk[:, h:]
        v_buf[:, :, slot] = qkv[:, h + hkv :]
        q = qk[:, :h, None]  # (B, H, 1, E)
        y = F.scaled_dot_product_attention(
            q, k_buf[:, :, : slot + 1], v_buf[:, :, : slot + 1], attn_mask=mask, **self.gqa
        )  # (B, H, 1, E)
        return self.o(y.view(b, h * self.e))


class _Block:
    """One block's slots as functions; `pre` says where the norms sit (decided at build)."""

    def __init__(self, block: nn.Module, rows: int) -> None:
        self.pre = type(block) is PreNormBlock
        self.attn_norm, self.ffn_norm = _norm(block.attn_norm), _norm(block.ffn_norm)
        self.attn = _Attention(block.attn, rows)
        self.ffn = _ffn(block.ffn, rows)

    def __call__(
        self, x: Tensor, rotate: Fn | None, cache: KVCache, slot: int, mask: Tensor | None
    ) -> Tensor:
        if self.pre:  # x = x + Attn(norm(x)); x = x + FFN(norm(x))
            x = x + self.attn(self.attn_norm(x), rotate, cache, slot, mask)
            return x + self.ffn(self.ffn_norm(x))
        x = self.attn_norm(x + self.attn(x, rotate, cache, slot, mask))  # x = norm(x + Attn(x)) ...
        return self.ffn_norm(x + self.ffn(x))


class _CrossAttention:
    """Attention of one new token per row over the encoder memory: the q product (rotated where the
    model rotates cross-attention queries), the memory's K/V from the cache (projected once per source,
    by the layer's own `memory_kv`), SDPA under the memory's mask, the output product."""

    def __init__(self, attn: nn.Module, rows: int) -> None:
        self.attn = attn
        self.q, self.o = _product((attn.q_proj,), rows), _product((attn.o_proj,), rows)
        self.layer, self.h, self.e = attn.layer_idx, attn.n_heads, attn.head_dim
        self.rotates = type(attn.rotary) is HalfRotaryEmbedding
        self.gqa = {"enable_gqa": True} if type(attn.kernel) is GqaSdpaAttention else {}

    def __call__(self, x: Tensor, rotate: Fn | None, cache: KVCache, memory: Memory) -> Tensor:
        b = x.shape[0]
        q = self.q(x).view(b, self.h, 1, self.e)  # (B, H, 1, E)
        if self.rotates:
            q = rotate(q)
        k, v = cache.cross(self.layer, lambda: self.attn.memory_kv(memory))  # (B, Hkv, S, E)
        mask = None if memory.mask.is_full else memory.mask.allowed  # (B|1, 1, 1, S)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.gqa)  # (B, H, 1, E)
        return self.o(y.view(b, self.h * self.e))


class _CrossBlock(_Block):
    """A decoder block of the encoder-decoder: self-attention, cross-attention, FFN."""

    def __init__(self, block: nn.Module, rows: int) -> None:
        super().__init__(block, rows)
        self.pre = type(block) is PreNormCrossBlock
        self.cross_norm, self.cross = _norm(block.cross_norm), _CrossAttention(block.cross_attn, rows)

    def __call__(self, x: Tensor, rotate: Fn | None, cache: KVCache, slot: int, memory: Memory) -> Tensor:
        if self.pre:  # x += Attn(norm(x)); x += CrossAttn(norm(x), memory); x += FFN(norm(x))
            x = x + self.attn(self.attn_norm(x), rotate, cache, slot, None)
            x = x + self.cross(self.cross_norm(x), rotate, cache, memory)
            return x + self.ffn(self.ffn_norm(x))
        x = self.attn_norm(x + self.attn(x, rotate, cache, slot, None))  # x = norm(x + Attn(x)) ...
        x = self.cross_norm(x + self.cross(x, rotate, cache, memory))
        return self.ffn_norm(x + self.ffn(x))


def _own_forward(module: nn.Module) -> bool:
    """Whether `module` computes what its class says: no forward set on the instance except by the
    decoding contexts (`row_blocked_linears`, `rms_norms_as_layer_norm`) and activation checkpointing
    (`checkpoint_blocks`), no forward hooks."""
    if module._forward_hooks or module._forward_pre_hooks:
        return False
    forward = module.__dict__.get("forward")
    if forward is None:
        return True
    if is_recomputed(module):  # activation checkpointing: the block's own forward outside training
        return True
    decoding = _DECODING.get()
    if type(module) is nn.Linear:
        return decoding is not None and decoding.patched.get(id(module)) is module
    return is_rms_norm(module) and getattr(forward, "func", None) is rms_norm_as_layer_norm


def unsupported(model: nn.Module) -> str | None:
    """Why `DecodeStep.build` / `Seq2SeqDecodeStep.build` give no step for `model` (None: they give
    one). The steps read weights and call functions where the model calls modules, so they take only
    the classes they know, unchanged."""
    if type(model) not in (DecoderLM, EncoderDecoder):
        return f"{type(model).__name__} is neither a DecoderLM nor an EncoderDecoder"
    if any(m.training for m in model.modules()):
        return "the model or one of its modules is in training mode (dropout)"
    if torch.is_grad_enabled():
        return "gradients are enabled (the step is for inference: no_grad or inference_mode)"
    if torch.is_autocast_enabled(next((p.device for p in model.parameters()), torch.device("cpu")).type):
        return "autocast is on"
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
        return "global module forward hooks"
    for name, module in model.named_modules():
        if not _own_forward(module):
            return f"module {name or 'model'} has forward hooks or a replaced forward"
    if any(type(p) is not nn.Parameter for p in model.parameters()):
        return "sharded or wrapped parameters"
    if type(model.tok_embed) is not nn.Embedding or model.tok_embed.max_norm is not None:
        return f"token embedding {type(model.tok_embed).__name__}"
    lm = type(model) is DecoderLM
    stack = model if lm else model.decoder
    block_types = (PreNormBlock, PostNormBlock) if lm else (PreNormCrossBlock, PostNormCrossBlock)
    linears = [model.lm_head]
    for block in stack.blocks:
        if type(block) not in block_types:
            return f"block {type(block).__name__}"
        attentions = [(block.attn, SelfAttention)] + ([] if lm else [(block.cross_attn, CrossAttention)])
        for attn, kind in attentions:
            if type(attn) is not kind:
                return f"attention {type(attn).__name__}"
            if type(attn.rotary) not in (HalfRotaryEmbedding, NoRotary):
                return (
                    f"rotary embedding {type(attn.rotary).__name__} (only the half layout over whole heads)"
                )
            if type(attn.kernel) not in (GqaSdpaAttention, SdpaAttention):
                return f"attention kernel {type(attn.kernel).__name__}"
            if attn.n_heads != attn.n_kv_heads and type(attn.kernel) is not GqaSdpaAttention:
                return "grouped K/V heads without SDPA's enable_gqa (the kernel repeats K/V)"
            linears += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        if type(block.ffn) in (SwiGLU, ReluFFN, GeluFFN):  # read as products; others run as modules
            linears += list(block.ffn.children())
    for linear in linears:
        if type(linear) is not nn.Linear:
            return f"linear layer {type(linear).__name__}"
    return None


class _Step:
    """What both steps share: the new tokens' embedding, the RoPE rotation at their positions, and the
    end of a step (the cache's length, the final norm, the head). `stack` is the decoder stack (the
    `DecoderLM` itself, or the `EncoderDecoder`'s decoder)."""

    def __init__(self, stack: nn.Module) -> None:
        self.stack = stack
        self.embed_weight = stack.tok_embed.weight
        self.plain_embed = type(stack.input_positions) is NoPositions and stack.embed_scale == 1.0
        table = stack.rotary.cos_sin if type(stack.rotary) is HalfRotaryEmbedding else None  # (2, P, E)
        self.table = None if table is None else table.to(self.embed_weight.dtype)

    def start(
        self, tokens: Tensor, positions: Tensor | None, cache: KVCache
    ) -> tuple[Tensor, int, Fn | None]:
        """(x (B, D), the cache slot of the new tokens, the rotation of their q/k heads or None)."""
        slot = cache.seq_len
        if slot >= cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} positions; cannot add 1 after {slot}")
        if self.plain_embed:
            x = F.embedding(tokens, self.embed_weight)  # (B, D)
        else:
            pos = torch.arange(slot, slot + 1, device=tokens.device) if positions is None else positions
            x = self.stack.embed(tokens[:, None], pos).squeeze(1)
        if self.table is None:
            return x, slot, None
        if positions is None:
            cos, sin = self.table[:, slot]  # (E,) each: one position for every row
        else:
            cos, sin = self.table.index_select(1, positions.view(-1))[:, :, None]  # (B, 1, E) each
        return x, slot, partial(rotate_whole_half_layout, cos=cos, sin=sin)

    @staticmethod
    def finish(x: Tensor, cache: KVCache, slot: int, final_norm: Fn | None, head: Fn) -> Tensor:
        cache.lengths = [slot + 1] * len(cache.lengths)
        return head(x if final_norm is None else final_norm(x))


class DecodeStep(_Step):
    """`step(tokens, positions, key_padding, cache)` -> logits (B, V) of one new token per row, writing
    its keys/values into `cache` (a `KVCache` the model's prefill filled) like `model(...)` does."""

    def __init__(self, model: DecoderLM, rows: int) -> None:
        super().__init__(model)
        self.rows = rows
        self.blocks = [_Block(block, rows) for block in model.blocks]
        self.final_norm = _norm(model.final_norm)
        self.head = _product((model.lm_head,), rows)

    @classmethod
    def build(cls, model: nn.Module, rows: int) -> DecodeStep | None:
        """The step for `model` decoding `rows` rows (read once: call it inside the decoding contexts
        `generate` opens, after the model's last weight change), or None where `unsupported(model)`."""
        return None if type(model) is not DecoderLM or unsupported(model) else cls(model, rows)

    def __call__(
        self, tokens: Tensor, positions: Tensor | None, key_padding: Tensor | None, cache: KVCache
    ) -> Tensor:
        if tokens.shape[0] != self.rows:
            raise ValueError(f"this decoding step was built for {self.rows} rows, got {tokens.shape[0]}")
        x, slot, rotate = self.start(tokens, positions, cache)
        mask = None if key_padding is None else key_padding[:, None, None, :]  # (B, 1, 1, S)
        for block in self.blocks:
            x = block(x, rotate, cache, slot, mask)
        return self.finish(x, cache, slot, self.final_norm, self.head)


class Seq2SeqDecodeStep(_Step):
    """`step(tokens, memory, cache)` -> logits (R, V) of one new target token per row of an
    `EncoderDecoder`, over `memory` (the rows' encoder `Memory`) and `cache` (a `KVCache` that holds at
    least one step: the first step, which allocates its buffers, runs through `model.decode`). Rows may
    change between steps (beam search drops and reorders them); the products are chosen per row count,
    once each."""

    def __init__(self, model: EncoderDecoder) -> None:
        super().__init__(model.decoder)
        self.model = model
        self.rows, self.program = 0, None  # the program for the last row count (rows only shrink)

    @classmethod
    def build(cls, model: nn.Module) -> Seq2SeqDecodeStep | None:
        """The step for `model` (call it inside the decoding context the search opens), or None where
        `unsupported(model)`."""
        return None if type(model) is not EncoderDecoder or unsupported(model) else cls(model)

    def _program(self, rows: int) -> tuple[list[_CrossBlock], Fn | None, Fn]:
        """The blocks, final norm and head for `rows` rows, rebuilt when the row count changes (cheap:
        partials over the weights; from FUSE_MIN_ROWS rows a stacked copy, as `model.decode` makes per
        call; only the latest is kept)."""
        if rows != self.rows:
            blocks = [_CrossBlock(block, rows) for block in self.stack.blocks]
            final_norm, head = _norm(self.stack.final_norm), _product((self.model.lm_head,), rows)
            self.rows, self.program = rows, (blocks, final_norm, head)
        return self.program

    def __call__(self, tokens: Tensor, memory: Memory, cache: KVCache) -> Tensor:
        if cache.seq_len == 0 or cache.k[0] is None:
            raise ValueError("the first decoding step runs through model.decode (it allocates the cache)")
        cache.use_source(memory.states)
        blocks, final_norm, head = self._program(tokens.shape[0])
        x, slot, rotate = self.start(tokens, None, cache)
        for block in blocks:
            x = block(x, rotate, cache, slot, memory)
        return self.finish(x, cache, slot, final_norm, head)
