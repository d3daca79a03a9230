"""Several linear layers applied to the same input, as one GEMM when that pays.

Shapes: x (..., D_in) -> one (..., D_out_i) per layer. q/k/v of self-attention and gate/up of SwiGLU
read the same x; one GEMM over the stacked weights [W_1; W_2; ...] is 15-20% faster than separate
ones at training sizes on CPU (wider output, one pass over x; docs/performance.md), but stacking
copies the weights at every call, which costs more than it saves when there are few rows (decoding
reads each weight once per token). So the stacked GEMM runs from `FUSE_MIN_ROWS` rows on, the
separate layers (the slow twin, same result up to summation order) below. Parameters and checkpoint
keys stay those of the separate `nn.Linear` layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FUSE_MIN_ROWS = 1024  # rows (B * T) from which one stacked GEMM beats separate ones (CPU, fp32)


def stacked_linear(
    x: Tensor, linears: Sequence[nn.Linear], min_rows: int | None = None
) -> tuple[Tensor, ...]:
    """(linear(x) for linear in linears); one GEMM over the stacked weights when x has >= min_rows rows
    (default FUSE_MIN_ROWS, read at call time)."""
    if x.numel() < (FUSE_MIN_ROWS if min_rows is None else min_rows) * x.shape[-1]:
        return tuple(linear(x) for linear in linears)
    weight = torch.cat([linear.weight for linear in linears])  # (sum D_out_i, D_in)
    bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
    return F.linear(x, weight, bias).split([linear.out_features for linear in linears], dim=-1)
