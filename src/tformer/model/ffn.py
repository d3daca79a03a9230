"""Position-wise feed-forward networks: the FFN slot of every block.

Shapes: x (B, T, D) -> (B, T, D). Hidden width F = d_ff (or an expert's d_expert).
- ReluFFN:  down(relu(up(x)))                  (Vaswani et al., 2017)
- GeluFFN:  down(gelu(up(x)))                  (BERT / GPT-2)
- SwiGLU:   down(silu(gate(x)) * up(x))        (Shazeer, 2020; Llama)
`make_ffn(cfg, layer_idx)` decides per layer whether the slot holds a dense FFN or an MoE layer.
SwiGLU computes gate and up with `stacked_linear` (one GEMM over [W_gate; W_up] for many rows without a graph).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from tformer.config import ModelConfig
from tformer.model.linear import apply_linear, stacked_linear


class ReluFFN(nn.Module):
    """down(relu(up(x)))."""

    activation = staticmethod(F.relu)

    def __init__(self, d_model: int, d_ff: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor, tokens: Tensor | None = None) -> Tensor:  # position-wise: tokens unused
        return apply_linear(self.down_proj, self.activation(apply_linear(self.up_proj, x)))


class GeluFFN(ReluFFN):
    """down(gelu(up(x)))."""

    activation = staticmethod(F.gelu)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, d_ff: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor, tokens: Tensor | None = None) -> Tensor:  # position-wise: tokens unused
        gate, up = stacked_linear(x, (self.gate_proj, self.up_proj))  # 2 x (..., F)
        return apply_linear(self.down_proj, F.silu(gate) * up)


FFNS: dict[str, type[nn.Module]] = {"relu": ReluFFN, "gelu": GeluFFN, "swiglu": SwiGLU}


def make_dense_ffn(kind: str, d_model: int, d_ff: int, bias: bool) -> nn.Module:
    return FFNS[kind](d_model, d_ff, bias)


def make_ffn(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    """The module in block `layer_idx`'s FFN slot: dense, or MoE where `cfg.moe` says so."""
    if cfg.moe is not None and cfg.moe.is_moe_layer(layer_idx):
        from tformer.model.moe import MoE

        return MoE(cfg, layer_idx)
    return make_dense_ffn(cfg.ffn, cfg.d_model, cfg.d_ff, cfg.bias)
