"""Several linear layers applied to the same input, as one GEMM when that pays.

Shapes: x (..., D_in) -> one (..., D_out_i) per layer. q/k/v of self-attention and gate/up of SwiGLU
read the same x; one GEMM over the stacked weights [W_1; W_2; ...] is 15-20% faster than separate
ones at training sizes on CPU (wider output, one pass over x; docs/performance.md), but stacking
copies the weights at every call, which costs more than it saves when there are few rows (decoding
reads each weight once per token). So the stacked GEMM runs from `FUSE_MIN_ROWS` rows on, the
separate layers (the slow twin, same result up to summation order) below. Parameters and checkpoint
keys stay those of the separate `nn.Linear` layers.

Decoding (one or two rows) is different again: `transposed_linears` makes, for the duration of a
`generate` call, transposed copies of the widening layers and of each stacked group, which BLAS
streams faster for a single row; `stacked_linear` uses a group's copy while it exists.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FUSE_MIN_ROWS = 1024  # rows (B * T) from which one stacked GEMM beats separate ones (CPU, fp32)


def stacked_linear(
    x: Tensor, linears: Sequence[nn.Linear], min_rows: int | None = None
) -> tuple[Tensor, ...]:
    """(linear(x) for linear in linears); one GEMM over the stacked weights when x has >= min_rows rows
    (default FUSE_MIN_ROWS, read at call time), or over the decoding layout's stacked copy while
    `transposed_linears` holds one for these layers and x has few rows."""
    stack = linears[0].__dict__.get(_STACK_ATTR)
    if stack is not None and x.numel() <= stack.max_rows * x.shape[-1] and stack.serves(linears):
        y = x @ stack.weight_t
        return (y if stack.bias is None else y + stack.bias).split(stack.sizes, dim=-1)
    if x.numel() < (FUSE_MIN_ROWS if min_rows is None else min_rows) * x.shape[-1]:
        return tuple(linear(x) for linear in linears)
    weight = torch.cat([linear.weight for linear in linears])  # (sum D_out_i, D_in)
    bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
    return F.linear(x, weight, bias).split([linear.out_features for linear in linears], dim=-1)


# ----------------------------------------------------------------------------- decoding layout
DECODE_MAX_ROWS = 2  # rows up to which x @ (in, out) beats F.linear's (out, in) on CPU (docs/performance.md)


def _decode_linear(linear: nn.Linear, weight_t: Tensor, max_rows: int, x: Tensor) -> Tensor:
    if x.numel() > max_rows * x.shape[-1]:
        return F.linear(x, linear.weight, linear.bias)  # the slow twin, and the path for many rows
    y = x @ weight_t
    return y if linear.bias is None else y + linear.bias


_STACK_ATTR = "_decode_stack"


@dataclass(frozen=True)
class _Stack:
    """A decoding-layout copy of several layers that read the same input: [W_1; W_2; ...]^T, (in, sum out)."""

    members: tuple[int, ...]  # id() of the layers, in order
    weight_t: Tensor
    bias: Tensor | None
    sizes: tuple[int, ...]
    max_rows: int

    def serves(self, linears: Sequence[nn.Linear]) -> bool:
        return len(linears) == len(self.members) and all(id(m) == i for m, i in zip(linears, self.members))


def _stack_groups(model: nn.Module) -> list[tuple[nn.Linear, ...]]:
    """The layer groups that modules declare they feed through `stacked_linear` (`stacked_projections`)."""
    groups = []
    for m in model.modules():
        names = getattr(type(m), "stacked_projections", ())
        group = tuple(getattr(m, name) for name in names)
        if not group or not all(type(lin) is nn.Linear and lin.weight.device.type == "cpu" for lin in group):
            continue
        if sum(lin.out_features for lin in group) > group[0].in_features:  # widening, as for single layers
            groups.append(group)
    return groups


@contextmanager
def transposed_linears(model: nn.Module, max_rows: int = DECODE_MAX_ROWS) -> Iterator[None]:
    """While active, every widening `nn.Linear` (out_features > in_features) of `model` that lives on
    the CPU multiplies inputs of at most `max_rows` rows by a contiguous (in, out) copy of its weight,
    made once on entry, dropped on exit.

    Why: one decoding step of one sequence is a matrix-vector product per layer, bound by reading the
    weights. For a widening layer CPU BLAS streams the (in, out) layout for one row faster than the
    (out, in) layout `F.linear` passes it; measured with cold weights, 2 threads, on this project's
    2-core machine: 512 -> 1376 10.4 vs 6.1 GB/s, 512 -> 8192 (an output head) 14.4 vs 7.3 GB/s, while
    512 -> 512 is equal and 1376 -> 512 is *slower* transposed (6.8 vs 10.4), so only widening layers
    get a copy. At 4+ rows the layouts are equal; inputs with more rows (the prompt) keep `F.linear`.
    Layers that a module feeds through `stacked_linear` together (q/k/v of self-attention, gate/up of
    SwiGLU: the module's `stacked_projections`) get one transposed copy of their stacked weights
    instead, which is widening even where each layer alone is square (512 -> 3 x 512): three 1 MB
    products run at ~5 GB/s, one 3 MB product at ~9 GB/s here, and the gate/up pair is read in one pass.
    The price is a second copy of those weights while active (tied weights share one copy). Inference
    only: the copies do not follow later changes of the weights and carry no gradient.
    """
    patched: list[nn.Linear] = []
    stacked: list[nn.Linear] = []
    copies: dict[int, Tensor] = {}
    try:
        in_groups = set()
        for group in _stack_groups(model):
            in_groups.update(map(id, group))
            if _STACK_ATTR in group[0].__dict__:  # an enclosing layout made it already
                continue
            bias = None if group[0].bias is None else torch.cat([lin.bias.detach() for lin in group])
            weight_t = torch.cat([lin.weight.detach() for lin in group]).t().contiguous()
            sizes = tuple(lin.out_features for lin in group)
            group[0].__dict__[_STACK_ATTR] = _Stack(tuple(map(id, group)), weight_t, bias, sizes, max_rows)
            stacked.append(group[0])
        for m in model.modules():
            if type(m) is not nn.Linear or m.weight.device.type != "cpu" or "forward" in m.__dict__:
                continue
            if m.out_features <= m.in_features or id(m) in in_groups:
                continue
            w = m.weight
            if id(w) not in copies:
                copies[id(w)] = w.detach().t().contiguous()
            m.forward = partial(_decode_linear, m, copies[id(w)], max_rows)
            patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward
        for m in stacked:
            del m.__dict__[_STACK_ATTR]
