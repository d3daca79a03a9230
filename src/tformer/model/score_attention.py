"""Attention for CPU training as batched products over the score matrix (a fast twin of SDPA there).

torch's CPU flash-attention kernel is quick forward, but its backward is not: at the benchmark LM's
8 x 8 heads x 256 (bf16, causal) it takes ~14 ms a layer where its forward takes ~2, and at 16 x 8 heads
x 128 (the encoder-decoder benchmark) forward and backward together take ~21 ms in bf16 and ~11 ms in
fp32. Short sequences fit their whole score matrix in the cache, so this kernel writes it out:

    forward   s = q k^T / sqrt(E) + bias     p = softmax(s)          out = p v
    backward  dv = p^T dout   ds = p * (dout v^T - rowsum(...))    dq = ds k / sqrt(E)   dk = ds^T q / sqrt(E)

as batched GEMMs and torch's fused softmax and softmax backward, keeping p (in the input's dtype, as
an eager bf16 attention does) for the backward. A causal mask splits the queries into row blocks, each
multiplying only the keys up to its last row (4 blocks: 5/8 of the full products), so the masked half
is never computed. Measured forward + backward (2 threads, Intel Xeon with AMX, 2026-12-02): bf16
8 x 8 x 256 causal 7.9 vs 15.5 ms, 16 x 8 x 128 4.3-4.6 vs 21.3-21.8 ms (causal and full), 4 x 8 x 512
12.5 vs 20.7 ms; at 1024 keys it lost (28 vs 25 ms). In fp32 the kernel alone was faster too (16 x 8
x 128: 8.0-9.6 vs 11.1-11.4 ms) but whole training steps were not (dense LM 0.978x vs 1.008x HF with
and without it, encoder-decoder 1.082x vs 1.093x torch), so fp32 stays with SDPA.

`applies(...)` says where it is used: CPU tensors that record a graph, no attention dropout, bf16, at
most MAX_KEYS keys and MAX_PROBS_BYTES of probabilities kept per call (B*H*Tq*Tk elements, up
to 3/8 fewer with causal blocks), plain tensors. torch.compile traces it too (inductor keeps SDPA's
flash backward otherwise): the bf16 LM step compiled with it 0.506 s, with SDPA 0.552 s (6 rounds).
Everything else, inference included (SDPA's forward alone is fast), stays with SDPA. `EagerAttention` is the readable reference; tests compare both with it and with SDPA.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from tformer.model.linear import records_graph
from tformer.model.masks import Mask

ENABLED = True  # False: training attention on the CPU goes through SDPA as well (the slow twin)
MAX_KEYS = 512  # above this, p per layer gets large and the flash kernel catches up (lost at 1024)
MAX_PROBS_BYTES = 256 * 2**20  # and at most this much kept for backward per call (B * H * Tq * Tk elements)
CAUSAL_BLOCKS = 4  # query-row blocks of a causal mask from CAUSAL_SPLIT_FROM queries on
CAUSAL_SPLIT_FROM = 256  # (128 queries: one block measured faster, 4.3 vs 4.9 ms with two)
DTYPES = (torch.bfloat16,)  # fp32 measured no faster in whole training steps (module docstring)


def applies(q: Tensor, k: Tensor, dropout_p: float) -> bool:
    """Whether `score_attention` computes this call (see the module docstring)."""
    return (
        ENABLED
        and dropout_p == 0.0
        and q.device.type == "cpu"
        and q.dtype in DTYPES
        and k.dtype == q.dtype
        and k.shape[-2] <= MAX_KEYS
        and q.shape[0] * q.shape[1] * q.shape[2] * k.shape[-2] * q.element_size() <= MAX_PROBS_BYTES
        and records_graph(q, k)
        and type(q) is Tensor
        and type(k) is Tensor
    )


def score_attention(q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> Tensor:
    """softmax(q k^T / sqrt(E) masked) v: q (B, H, Tq, E), k and v (B, H, Tk, E) -> (B, H, Tq, E)."""
    b, h, t_q, e = q.shape
    t_k = k.shape[-2]
    if mask.is_causal:
        n = CAUSAL_BLOCKS if t_q >= CAUSAL_SPLIT_FROM else 1
        bounds = tuple(round(t_q * i / n) for i in range(n + 1))
        bias = None
    else:
        bounds = (0, t_q)
        bias = None if mask.is_full else key_bias(mask.allowed, b, h, t_q, t_k, q.dtype)
    return ScoreAttention.apply(q, k, v, bounds, mask.is_causal, bias)


def key_bias(allowed: Tensor, b: int, h: int, t_q: int, t_k: int, dtype: torch.dtype) -> Tensor:
    """0 where allowed, -inf elsewhere, (B * H, Tq, Tk) for the batched products (one copy per call)."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )
    return bias.expand(b, h, t_q, t_k).reshape(b * h, t_q, t_k)


def causal_bias(start: int, end: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(end - start, end): 0 where query start + i may see key j (j <= start + i), -inf after; made once
    per shape in eager mode, traced as ops (a constant to inductor) under torch.compile."""
    if torch.compiler.is_compiling():
        return make_causal_bias(start, end, dtype, device)
    return cached_causal_bias(start, end, dtype, device)


def make_causal_bias(start: int, end: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    rows = torch.arange(start, end, device=device)[:, None]
    above = torch.arange(end, device=device)[None, :] > rows
    return torch.zeros(above.shape, dtype=dtype, device=device).masked_fill_(above, float("-inf"))


cached_causal_bias = lru_cache(maxsize=64)(make_causal_bias)


class ScoreAttention(torch.autograd.Function):
    """The kernel; `bounds` are the query-row blocks, each attending keys [0, its end) when causal."""

    @staticmethod
    def forward(ctx, q, k, v, bounds, causal, bias):  # noqa: ANN001 (autograd.Function signature)
        b, h, t_q, e = q.shape
        t_k = k.shape[-2]
        scale = 1.0 / math.sqrt(e)
        q3, k3, v3 = q.reshape(b * h, t_q, e), k.reshape(b * h, t_k, e), v.reshape(b * h, t_k, e)
        out = torch.empty_like(q3)
        probs = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            keys = end if causal else t_k
            kt = k3[:, :keys].transpose(1, 2)
            if causal:
                scores = torch.baddbmm(
                    causal_bias(start, end, q.dtype, q.device), q3[:, start:end], kt, alpha=scale
                )
            elif bias is not None:
                scores = torch.baddbmm(bias, q3, kt, alpha=scale)
            else:
                scores = torch.bmm(q3, kt).mul_(scale)
            p = torch.softmax(scores, dim=-1)
            torch.bmm(p, v3[:, :keys], out=out[:, start:end])
            probs.append(p)
        ctx.save_for_backward(q3, k3, v3, *probs)
        ctx.bounds, ctx.causal, ctx.shape = bounds, causal, (b, h, t_q, t_k, e)
        return out.view(b, h, t_q, e)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):  # noqa: ANN001
        q3, k3, v3, *probs = ctx.saved_tensors
        b, h, t_q, t_k, e = ctx.shape
        scale = 1.0 / math.sqrt(e)
        d_out = d_out.reshape(b * h, t_q, e)
        dq, dk, dv = torch.empty_like(q3), torch.zeros_like(k3), torch.zeros_like(v3)
        for (start, end), p in zip(zip(ctx.bounds[:-1], ctx.bounds[1:]), probs):
            keys = end if ctx.causal else t_k
            do = d_out[:, start:end]
            dv[:, :keys].baddbmm_(p.transpose(1, 2), do)
            dp = torch.bmm(do, v3[:, :keys].transpose(1, 2))
            ds = torch._softmax_backward_data(dp, p, -1, p.dtype)
            torch.bmm(ds, k3[:, :keys], out=dq[:, start:end])
            dk[:, :keys].baddbmm_(ds.transpose(1, 2), q3[:, start:end])
        dq.mul_(scale)
        dk.mul_(scale)
        shape_q, shape_k = (b, h, t_q, e), (b, h, t_k, e)
        return dq.view(shape_q), dk.view(shape_k), dv.view(shape_k), None, None, None
