"""A decoding step of a `DecoderLM` written for `torch.compile`: the opt-in `generate(..., compile=True)`
path.

Shapes: tokens (B,); positions (B,) int64; mask (B|1, S) bool over the cache slots filled after this
step (S = the new token's slot + 1; the prompt's padding False); caches k/v (B, Hkv, capacity, E);
logits (B, V). Hidden states stay (B, D).

Why: `DecodeStep` (model/decode_step.py) runs a step's ~270 small ops one by one; each costs a few
microseconds of dispatch, ~1.7 ms of a 5 ms step of the benchmark model, whose weights take ~2.5-5 ms
to read. Compiled, they fuse into 4 C++ kernels per layer between the products. `torch.compile`
specialises on Python values, so a step whose cache slot is a Python int compiled once per position
(measured: 175 s, then eager). Here nothing a step changes is a Python value: the positions are a
tensor, and the number of filled slots is the mask's length, marked dynamic (as the caches' capacity),
so one graph serves every step and every prompt length; the new keys/values are written as a slice
(an index would specialise on it). Attention is written as products and sums, which the compiler fuses
(a first version over a static capacity with every slot masked read the whole cache each step: at batch
8 no faster than the flat step). The weights are arguments, not constants: one graph serves every model
of the same shapes and sees weight updates; per call only the stacked q/k/v and gate/up weights are
copied (as the flat step does).

`step_program` is the same program uncompiled: tests/generate/test_compiled_step.py holds it to the
model's forward (1e-5) and the compiled one to it.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.model.blocks import PreNormBlock
from tformer.model.cache import KVCache
from tformer.model.decode_step import DecodeStep, unsupported
from tformer.model.ffn import GeluFFN, ReluFFN, SwiGLU
from tformer.model.linear import DECODE_MAX_ROWS, row_blocking_pays, row_blocks
from tformer.model.moe import Dropless, GeluExperts, MoE, NoShared, ReluExperts, SwiGLUExperts
from tformer.model.norms import is_rms_norm
from tformer.model.positions import HalfRotaryEmbedding, LearnedPositions, NoPositions, SinusoidalPositions
from tformer.model.router import SCORE_FUNCS, limit_groups, renormalize
from tformer.model.transformer import DecoderLM

FFN_KINDS = {SwiGLU: "swiglu", ReluFFN: "relu", GeluFFN: "gelu"}
EXPERT_KINDS = {SwiGLUExperts: "swiglu", ReluExperts: "relu", GeluExperts: "gelu"}


@dataclass(frozen=True)
class Norm:
    """A norm as its function's constants: kind "layer", "rms" or "none", and eps."""

    kind: str
    eps: float = 0.0


@dataclass(frozen=True)
class Dense:
    """A dense FFN: kind swiglu | relu | gelu, hidden width."""

    kind: str
    width: int


@dataclass(frozen=True)
class Routed:
    """An MoE FFN slot (model/moe.py `MoE`, dropless): the router's constants (model/router.py
    `TopKRouter`), the experts' kind and width, the shared experts as one dense FFN or None."""

    kind: str
    top_k: int
    score_func: str  # softmax | sigmoid
    norm_topk: bool
    routed_scaling: float
    groups: tuple[int, int, int] | None  # (n_group, topk_group, per_group_k) where routing is group-limited
    shared: Dense | None


@dataclass(frozen=True)
class Program:
    """What a step computes beyond its tensors: the Python constants `torch.compile` specialises on."""

    pre: bool
    heads: int
    kv_heads: int
    head_dim: int
    ffns: tuple[Dense | Routed, ...]  # each block's FFN slot
    attn_norm: Norm
    ffn_norm: Norm
    final_norm: Norm
    embed_scale: float
    rope: bool
    row_blocks: bool = False  # products as row-blocked batched products (`_linear`), where they pay here


def _norm_spec(norm: nn.Module) -> tuple[Norm, dict[str, Tensor | None]] | None:
    if type(norm) is nn.Identity:
        return Norm("none"), {}
    if type(norm) is nn.LayerNorm and len(norm.normalized_shape) == 1:
        return Norm("layer", norm.eps), {"weight": norm.weight, "bias": norm.bias}
    if is_rms_norm(norm) and len(norm.normalized_shape) == 1:
        eps = torch.finfo(norm.weight.dtype).eps if norm.eps is None else norm.eps
        return Norm("rms", eps), {"weight": norm.weight}
    return None


def _apply_norm(spec: Norm, w: dict[str, Tensor | None], x: Tensor) -> Tensor:
    if spec.kind == "layer":
        return F.layer_norm(x, x.shape[-1:], w["weight"], w["bias"], spec.eps)
    if spec.kind == "rms":
        return F.rms_norm(x, x.shape[-1:], w["weight"], spec.eps)
    return x


def why_not_compiled(model: nn.Module) -> str | None:
    """Why `CompiledDecodeStep.build` gives no step for `model` (None: it gives one). It takes what the
    flat step takes (`decode_step.unsupported`), dense or dropless MoE FFNs, one norm kind per slot."""
    if type(model) is not DecoderLM:
        return f"{type(model).__name__} is not a DecoderLM"
    reason = unsupported(model)
    if reason is not None:
        return reason
    for i, block in enumerate(model.blocks):
        if type(block.ffn) is MoE:
            moe = block.ffn
            if type(moe.dispatch.capacity) is not Dropless and moe.dispatch.capacity.eval_factor is not None:
                return (
                    f"block {i}'s MoE drops tokens over eval_capacity_factor (compiled decoding is dropless)"
                )
            if type(moe.experts) not in EXPERT_KINDS or type(moe.shared) not in (*FFN_KINDS, NoShared):
                return f"block {i}'s MoE experts {type(moe.experts).__name__} / {type(moe.shared).__name__}"
        elif type(block.ffn) not in FFN_KINDS:
            return f"block {i} has a {type(block.ffn).__name__} FFN"
    shapes = {(b.attn.n_heads, b.attn.n_kv_heads, b.attn.head_dim) for b in model.blocks}
    if len(shapes) != 1:
        return f"the blocks' attention heads differ ({sorted(shapes)} as (heads, K/V heads, head size))"
    for slot in ("attn_norm", "ffn_norm"):
        specs = [_norm_spec(getattr(block, slot)) for block in model.blocks]
        if None in specs or len({spec[0] for spec in specs}) != 1:
            return f"the blocks' {slot} are not all one LayerNorm, RMSNorm or identity"
    if _norm_spec(model.final_norm) is None:
        return f"final norm {type(model.final_norm).__name__}"
    if type(model.input_positions) not in (NoPositions, SinusoidalPositions, LearnedPositions):
        return f"input positions {type(model.input_positions).__name__}"
    return None


def _tables(model: DecoderLM) -> dict[str, Tensor | None]:
    positions, rotary = model.input_positions, model.rotary
    pos_table = None
    if type(positions) is SinusoidalPositions:
        pos_table = positions.table
    elif type(positions) is LearnedPositions:
        pos_table = positions.pos_embed.weight
    cos_sin = rotary.cos_sin if type(rotary) is HalfRotaryEmbedding else None  # (2, P, E)
    return {
        "embed": model.tok_embed.weight,
        "pos_table": pos_table,
        "cos": None if cos_sin is None else cos_sin[0],
        "sin": None if cos_sin is None else cos_sin[1],
        "final_norm": _norm_spec(model.final_norm)[1],
        "head": model.lm_head.weight,
        "head_bias": model.lm_head.bias,
    }


def _stack(*linears: nn.Linear) -> tuple[Tensor, Tensor | None]:
    """One weight (and bias) for products that read the same input, as the model's `stacked_linear`."""
    weight = torch.cat([linear.weight for linear in linears])
    bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
    return weight, bias


def _dense(ffn: nn.Module) -> tuple[Dense, dict[str, Tensor | None]]:
    up, up_b = _stack(ffn.gate_proj, ffn.up_proj) if type(ffn) is SwiGLU else _stack(ffn.up_proj)
    weights = {"up": up, "up_bias": up_b, "down": ffn.down_proj.weight, "down_bias": ffn.down_proj.bias}
    return Dense(FFN_KINDS[type(ffn)], ffn.down_proj.in_features), weights


def _routed(moe: MoE) -> tuple[Routed, dict[str, object]]:
    router, experts = moe.router, moe.experts
    shared = None if type(moe.shared) is NoShared else _dense(moe.shared)
    limit = router.limit_groups
    spec = Routed(
        kind=EXPERT_KINDS[type(experts)],
        top_k=router.top_k,
        score_func=router.score_func,
        norm_topk=router.normalize is renormalize,
        routed_scaling=float(router.routed_scaling),
        groups=None if type(limit) is nn.Identity else (limit.n_group, limit.topk_group, limit.per_group_k),
        shared=None if shared is None else shared[0],
    )
    weights = {"router": router.weight, "expert_bias": router.expert_bias, "shared": shared and shared[1]}
    for name in experts.projections:
        weights[name], weights[f"{name}_bias"] = getattr(experts, name), getattr(experts, f"{name}_bias")
    return spec, weights


def _layer(block: nn.Module) -> tuple[Dense | Routed, dict[str, object]]:
    attn = block.attn
    qkv, qkv_b = _stack(attn.q_proj, attn.k_proj, attn.v_proj)
    spec, ffn = _routed(block.ffn) if type(block.ffn) is MoE else _dense(block.ffn)
    return spec, {
        "attn_norm": _norm_spec(block.attn_norm)[1],
        "ffn_norm": _norm_spec(block.ffn_norm)[1],
        "qkv": qkv,
        "qkv_bias": qkv_b,
        "o": attn.o_proj.weight,
        "o_bias": attn.o_proj.bias,
        "ffn": ffn,
    }


def _attention(p: Program, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(E)) v of one query per row over the filled cache slots, masked ones
    (padding) excluded, written as products and sums (which the compiler fuses into one kernel); scores
    and weights in fp32. q (B, H, E), k/v (B, Hkv, S, E), mask (B|1, S) -> (B, H * E)."""
    b, c = q.shape[0], k.shape[2]
    q = q.view(b, p.kv_heads, p.heads // p.kv_heads, 1, p.head_dim)  # query heads grouped by K/V head
    scores = (q.float() * k[:, :, None].float()).sum(-1) * p.head_dim**-0.5  # (B, Hkv, G, S) in fp32
    scores = scores.masked_fill(~mask.view(-1, 1, 1, c), float("-inf"))
    weights = scores.softmax(-1)
    y = (weights[..., None] * v[:, :, None]).sum(-2)  # (B, Hkv, G, E), fp32
    return y.to(q.dtype).reshape(b, p.heads * p.head_dim)


def _self_attention(
    p: Program, w: dict, x: Tensor, *, rotation: tuple[Tensor, Tensor] | None, k_buf: Tensor,
    v_buf: Tensor, mask: Tensor,
) -> Tensor:  # fmt: skip
    """q/k/v as one product, q and k rotated together, k and v written into the cache slot, attention
    over the cache, the output product. x (B, D) -> (B, D)."""
    b, h, hkv, e = x.shape[0], p.heads, p.kv_heads, p.head_dim
    qkv = _linear(p, x, w["qkv"], w["qkv_bias"]).view(b, h + 2 * hkv, e)  # q, k, v heads
    qk = qkv[:, : h + hkv]
    if rotation is not None:  # half layout: x * [cos, cos] + [x2, x1] * [-sin, sin]
        qk = qk * rotation[0] + qk.roll(e // 2, -1) * rotation[1]
    n = mask.shape[1]  # slots filled after this step's: the new token is at n - 1
    k_buf[:, :, n - 1 : n] = qk[:, h:, None]  # a slice, not an index: n stays symbolic when compiled
    v_buf[:, :, n - 1 : n] = qkv[:, h + hkv :, None]
    return _linear(p, _attention(p, qk[:, :h], k_buf[:, :, :n], v_buf[:, :, :n], mask), w["o"], w["o_bias"])


def _linear(p: Program, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear(x, weight, bias) of x (B, in); with p.row_blocks, for weights `row_blocks` accepts, as
    the eager step computes it (`tformer.model.linear.row_blocked_linear`): one batched product of the
    weight's row blocks with x^T, which streams the weights on every core where F.linear of a few rows
    uses one (an AMD EPYC: the compiled step read its weights at half the eager step's speed without it).
    The block count is read from the weight's static shape: a constant of the compiled graph."""
    n = row_blocks(weight) if p.row_blocks else None
    if n is None:
        return F.linear(x, weight, bias)
    b, (d_out, d_in) = x.shape[0], weight.shape
    y = torch.bmm(weight.view(n, d_out // n, d_in), x.t().unsqueeze(0).expand(n, d_in, b))  # (n, out/n, B)
    y = y.permute(2, 0, 1).reshape(b, d_out)
    return y if bias is None else y + bias


def _activate(kind: str, up: Tensor, gate: Tensor | None) -> Tensor:
    if kind == "swiglu":
        return F.silu(gate) * up
    return F.relu(up) if kind == "relu" else F.gelu(up)


def _ffn(p: Program, spec: Dense | Routed, w: dict, x: Tensor) -> Tensor:
    """The FFN slot on x (B, D): dense, or routed."""
    if type(spec) is Routed:
        return _moe(p, spec, w, x)
    up = _linear(p, x, w["up"], w["up_bias"])  # down(act(up(x))), down(silu(gate(x)) * up(x))
    gate, up = up.split(spec.width, dim=-1) if spec.kind == "swiglu" else (None, up)
    return _linear(p, _activate(spec.kind, up, gate), w["down"], w["down_bias"])


def _moe(p: Program, spec: Routed, w: dict, x: Tensor) -> Tensor:
    """sum over the row's top-K experts of weight * expert(x), plus the shared experts, as `MoE` computes
    it in eval mode (router in fp32; the weighted sum in fp32, then x's dtype). Each row's chosen experts'
    weights are indexed, W[idx] (B, K, out, in), and applied as products and sums, which the compiler
    fuses with the indexing (no copy of the chosen weights)."""
    logits = F.linear(x.float(), w["router"].float())  # (B, E)
    scores = SCORE_FUNCS[spec.score_func](logits)
    choice = scores + w["expert_bias"].float()  # the bias steers the choice only
    if spec.groups is not None:
        choice = limit_groups(choice, *spec.groups)
    idx = choice.topk(spec.top_k, dim=-1).indices  # (B, K)
    weights = scores.gather(-1, idx)
    weights = (renormalize(weights) if spec.norm_topk else weights) * spec.routed_scaling  # (B, K)

    def product(name: str, h: Tensor) -> Tensor:  # h (B, K|1, in) -> (B, K, out), expert idx[b, k]'s
        y = (h[:, :, None, :] * w[name][idx]).sum(-1)
        bias = w[f"{name}_bias"]
        return y if bias is None else y + bias[idx]

    x_k = x[:, None]  # (B, 1, D): every chosen expert reads the row
    gate = product("gate_proj", x_k) if spec.kind == "swiglu" else None
    y = product("down_proj", _activate(spec.kind, product("up_proj", x_k), gate))  # (B, K, D)
    routed = (y * weights[..., None]).sum(1).to(x.dtype)  # (B, D)
    return routed if spec.shared is None else routed + _ffn(p, spec.shared, w["shared"], x)


def step_program(
    p: Program,
    tables: dict,
    layers: tuple[dict, ...],
    tokens: Tensor,
    positions: Tensor,
    mask: Tensor,
    ks: list[Tensor],
    vs: list[Tensor],
) -> Tensor:
    """Logits (B, V) of one new token per row; writes its keys/values into slot S - 1 of ks/vs (S: the
    mask's length)."""
    x = F.embedding(tokens, tables["embed"])  # (B, D)
    if p.embed_scale != 1.0:
        x = x * p.embed_scale
    if tables["pos_table"] is not None:
        x = x + tables["pos_table"][positions].to(x.dtype)
    rotation = None
    if p.rope:  # (B, 1, E) each: the tables' rows at each row's position
        rotation = tuple(tables[name][positions][:, None].to(x.dtype) for name in ("cos", "sin"))
    for ffn_spec, w, k_buf, v_buf in zip(p.ffns, layers, ks, vs):
        attn = partial(_self_attention, p, w, rotation=rotation, k_buf=k_buf, v_buf=v_buf, mask=mask)
        ffn = partial(_ffn, p, ffn_spec, w["ffn"])
        attn_norm = partial(_apply_norm, p.attn_norm, w["attn_norm"])
        ffn_norm = partial(_apply_norm, p.ffn_norm, w["ffn_norm"])
        if p.pre:  # x = x + Attn(norm(x)); x = x + FFN(norm(x))
            x = x + attn(attn_norm(x))
            x = x + ffn(ffn_norm(x))
        else:  # x = norm(x + Attn(x)); x = norm(x + FFN(x))
            x = attn_norm(x + attn(x))
            x = ffn_norm(x + ffn(x))
    x = _apply_norm(p.final_norm, tables["final_norm"], x)
    return _linear(p, x, tables["head"], tables["head_bias"])


_FAILED: dict[tuple, str] = {}  # CompiledDecodeStep.key -> why compiling it failed in this process


def warn_user(message: str) -> None:
    """A warning attributed to the first caller outside tformer and torch (the user's `generate`)."""
    inside = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


@functools.cache
def compiled_step_program() -> Callable:
    """`step_program` under `torch.compile`, one per process: its graphs serve every build."""
    # cpp_wrapper: the graph's ~75 kernel and product calls are made from C++, not Python (1.08x per
    # step, median of 6 interleaved A/B rounds on the benchmark model; compiling takes longer)
    return torch.compile(step_program, fullgraph=True, options={"cpp_wrapper": True})


class CompiledDecodeStep:
    """`step(tokens, positions, key_padding, cache)` -> logits (B, V), as `DecodeStep`, over a cache
    the model's prefill filled. compiled=False runs the same program eagerly (the twin the
    tests compare the compiled one with)."""

    def __init__(self, model: DecoderLM, rows: int, compiled: bool) -> None:
        block, layers = model.blocks[0], [_layer(block) for block in model.blocks]
        self.rows = rows
        self.program = Program(
            pre=type(block) is PreNormBlock,
            heads=block.attn.n_heads,
            kv_heads=block.attn.n_kv_heads,
            head_dim=block.attn.head_dim,
            ffns=tuple(spec for spec, _ in layers),
            attn_norm=_norm_spec(block.attn_norm)[0],
            ffn_norm=_norm_spec(block.ffn_norm)[0],
            final_norm=_norm_spec(model.final_norm)[0],
            embed_scale=float(model.embed_scale),
            rope=type(model.rotary) is HalfRotaryEmbedding,
            row_blocks=rows <= DECODE_MAX_ROWS and row_blocking_pays(model),  # as the eager step decides
        )
        self.tables, self.layers = _tables(model), tuple(weights for _, weights in layers)
        self.fn = compiled_step_program() if compiled else step_program
        self.model, self.first_call = model, compiled  # the first compiled call compiles
        self.fallback: Callable | None = None  # the flat step, where compiling failed
        device = model.tok_embed.weight.device
        self.slots = torch.arange(model.cfg.max_seq_len, device=device)  # positions of unpadded rows
        self.slots_filled = torch.ones(1, model.cfg.max_seq_len, dtype=torch.bool, device=device)

    @property
    def key(self) -> tuple:
        """What a compiled graph is specialised on beyond sizes: the program, dtype and device."""
        embed = self.tables["embed"]
        return self.program, embed.dtype, embed.device.type

    @classmethod
    def build(cls, model: nn.Module, rows: int, compiled: bool = True) -> CompiledDecodeStep | None:
        """The step for `model` decoding `rows` rows, or None (with a warning naming why) where
        `why_not_compiled(model)`, or where compiling this program failed earlier in the process."""
        reason = why_not_compiled(model)
        if reason is not None:
            warn_user(f"compiled decoding not used: {reason}; decoding without it")
            return None
        step = cls(model, rows, compiled)
        if compiled and step.key in _FAILED:
            warn_user(f"torch.compile failed for this model earlier in this process ({_FAILED[step.key]}); "
                      "decoding without it")  # fmt: skip
            return None
        return step

    def __call__(
        self, tokens: Tensor, positions: Tensor | None, key_padding: Tensor | None, cache: KVCache
    ) -> Tensor:
        if self.fallback is not None:
            return self.fallback(tokens, positions, key_padding, cache)
        if tokens.shape[0] != self.rows:
            raise ValueError(f"this decoding step was built for {self.rows} rows, got {tokens.shape[0]}")
        slot, capacity = cache.seq_len, cache.capacity
        if slot >= capacity:
            raise ValueError(f"KV cache holds {capacity} positions; cannot add 1 after {slot}")
        if cache.k[0] is None:
            raise ValueError("the compiled step decodes after a prefill (which allocates the cache)")
        pos = self.slots[slot : slot + 1].expand(self.rows) if positions is None else positions.view(-1)
        mask = self.slots_filled[:, : slot + 1] if key_padding is None else key_padding  # (B|1, slot + 1)
        # sizes that change between calls are symbolic in the compiled graph: one graph for every step
        for tensor, dim in ((mask, 1), *((buf, 2) for buf in (*cache.k, *cache.v))):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        args = (self.program, self.tables, self.layers, tokens, pos, mask, cache.k, cache.v)
        logits = self._first_call(args) if self.first_call else self.fn(*args)
        if logits is None:  # compiling failed
            return self.fallback(tokens, positions, key_padding, cache)
        cache.lengths = [slot + 1] * len(cache.lengths)
        return logits

    def _first_call(self, args: tuple) -> Tensor | None:
        """The first compiled call, which compiles. Where compiling fails (no C++ compiler, a torch
        without the backend) it says why, sets the flat step as the fallback and returns None (compiling
        fails before the step writes the cache)."""
        try:
            logits = self.fn(*args)
        except Exception as err:  # noqa: BLE001 (whatever the compiler raises; the step itself is tested)
            if "RecompileLimit" in type(err).__name__:
                limit = torch._dynamo.config.recompile_limit
                why = (f"recompile limit reached: this process has compiled the decoding step for {limit} "
                       "model shapes, batch sizes or dtypes (torch._dynamo.config.recompile_limit); raise it "
                       "to compile more")  # fmt: skip
            else:
                lines = str(err).strip().splitlines()
                why = f"{type(err).__name__}: {lines[0][:300] if lines else ''}"
            _FAILED[self.key] = why  # later builds of this program decode without it from the start
            warn_user(f"torch.compile failed ({why}); decoding without it")
            # the flat step, for this call (outside the decoding contexts generate entered for it only
            # where no compiled step was built: later calls get both, since the failure is remembered)
            self.fallback = DecodeStep.build(self.model, self.rows)
            return None
        self.first_call = False
        return logits
