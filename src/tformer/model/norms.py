"""Normalisation layers. Shapes: (..., D) -> (..., D).

"layernorm" (Ba et al., 2016, with bias), "layernorm_nobias", "rmsnorm" (Zhang & Sennrich, 2019).

`RMSNorm` is `nn.RMSNorm` (same parameters, same function) with a training fast path on the CPU, where
torch's RMSNorm backward is a chain of ~10 elementwise ops: `RMSNormFunction` computes the forward in 3
passes and the backward in 6 from the saved 1 / rms (see there). `nn.RMSNorm` is its slow twin.
`rms_norms_as_layer_norm(model)` is a decoding-time fast path for RMSNorm on the CPU (see there);
`nn.RMSNorm` is its slow twin too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from tformer.config import ModelConfig
from tformer.model.linear import records_graph


class RMSNormFunction(torch.autograd.Function):
    """y = x / rms(x) * w, rms(x) = sqrt(mean(x^2) + eps) over the last dimension, with the backward

        dw = sum over rows of dy * x / rms      dx = dy w / rms - x * rowsum(dy x w) / (D rms^3)

    written out over the saved x and 1 / rms (one value per row): the forward takes rms from
    `vector_norm` (one fused reduction, where a dot of x with itself is a product and a sum), the
    backward's two row and column reductions of dy * x are matrix-vector products, and dx is three
    passes. 6 passes backward where torch's composite runs ~10 ops. Measured on the bf16 LM training step
    (benchmarks/bench_lm.py shapes, 17 norms of 2,048 x 512, 8 interleaved rounds, Intel Xeon, 2026-12-02):
    0.529 vs 0.547 s a step, 1.234x vs 1.194x HF paired, with a first version of 4 + 9 passes; this one
    takes 0.43 + 0.96 ms a norm where that took 0.60 + 1.54 (forward + backward, the same day), and moved
    the step from 1.248x to 1.277x HF (10 rounds) in bf16, 1.024x to 1.048x with RoPE's in fp32."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # noqa: D102
        d = x.shape[-1]
        inv_rms = torch.linalg.vector_norm(x, dim=-1).square_().div_(d).add_(eps).rsqrt_().unsqueeze(-1)
        ctx.save_for_backward(x, weight, inv_rms)  # inv_rms: (..., 1)
        return torch.mul(x, inv_rms).mul_(weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # noqa: D102
        x, weight, inv_rms = ctx.saved_tensors
        d = x.shape[-1]
        dy = dy.to(x.dtype)
        dyx = (dy * x).reshape(-1, d)
        inv = inv_rms.reshape(-1)
        dw = torch.mv(dyx.t(), inv) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, dw, None
        coef = inv.pow(3).mul_(torch.mv(dyx, weight)).div_(-d).view(inv_rms.shape)  # (..., 1)
        return torch.mul(dy, weight).mul_(inv_rms).addcmul_(x, coef), dw, None


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm that trains through `RMSNormFunction` where it applies: fp32 CPU input recording a
    graph, a 1-D normalized shape with a plain weight, outside torch.compile (which fuses its own)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.fused_applies(x):
            eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
            return RMSNormFunction.apply(x, self.weight, eps)
        return super().forward(x)

    def fused_applies(self, x: Tensor) -> bool:
        w = self.weight
        return (
            FUSED_RMS_NORM
            and type(x) is Tensor
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and type(w) is nn.Parameter
            and w.dtype == torch.float32
            and len(self.normalized_shape) == 1
            and records_graph(x, w)
            and not torch.compiler.is_compiling()
        )


FUSED_RMS_NORM = True  # False: RMSNorm trains through nn.RMSNorm's forward (the slow twin)
RMS_NORMS = (nn.RMSNorm, RMSNorm)  # the module types that compute nn.RMSNorm's function


def is_rms_norm(module: nn.Module) -> bool:
    """An RMSNorm of exactly torch's function (not a subclass that changes it)."""
    return type(module) in RMS_NORMS


NORMS = {
    "layernorm": partial(nn.LayerNorm, bias=True),
    "layernorm_nobias": partial(nn.LayerNorm, bias=False),
    "rmsnorm": RMSNorm,
}


def make_norm(cfg: ModelConfig) -> nn.Module:
    return NORMS[cfg.norm](cfg.d_model, eps=cfg.norm_eps)


def rms_norm_as_layer_norm(x: Tensor, weight2: Tensor, eps: float) -> Tensor:
    """RMSNorm(x) * w computed as LayerNorm([x, -x]) * [w, w], first half.

    [x, -x] has mean 0 and mean square mean(x^2), so LayerNorm of it is x / sqrt(mean(x^2) + eps) on
    the first half: the same function, in 3 ops (neg, cat, layer_norm) where `torch.rms_norm` runs ~9
    on the CPU (pow, mean, add, rsqrt, mul, mul, dtype copies).
    """
    d = x.shape[-1]
    return F.layer_norm(torch.cat((x, x.neg()), dim=-1), (2 * d,), weight2, None, eps)[..., :d]


@contextmanager
def rms_norms_as_layer_norm(model: nn.Module) -> Iterator[None]:
    """While active, every CPU `nn.RMSNorm` over the last dimension of `model` computes with
    `rms_norm_as_layer_norm`. For decoding, where a step is many small ops (17 norms per step in an
    8-layer model): measured 0.4-1 ms less per step here. Inference only (the doubled weight is a copy)."""
    patched: list[nn.RMSNorm] = []
    try:
        for m in model.modules():
            if not is_rms_norm(m) or len(m.normalized_shape) != 1 or "forward" in m.__dict__:
                continue
            if m.weight is None or m.weight.device.type != "cpu" or type(m.weight) is not nn.Parameter:
                continue  # (not a plain parameter: a sequence-parallel norm's replicated DTensor)
            if m.eps is None:  # torch's default eps depends on the input's dtype: the module knows it
                continue
            eps = m.eps
            weight2 = torch.cat((m.weight.detach(), m.weight.detach()))
            m.forward = partial(rms_norm_as_layer_norm, weight2=weight2, eps=eps)
            patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward
