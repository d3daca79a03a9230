"""The MoE experts' grouped products: y[rows of e] = x[rows of e] @ W[e]^T + b[e] for rows sorted by expert.

Shapes: x (S, in) with counts[e] rows for expert e, W (E, out, in), b (E, out) or None -> (S, out).
`grouped_linear` is what the experts call (tformer.model.moe); it honours autocast and picks one of the
kernels in GROUPED_LINEAR_KERNELS by device, dtype and row count (`pick_grouped_kernel`): the loop
kernel (`loop_grouped_linear`, per-expert products into one output with a hand-written backward, in
row windows where oneDNN compiles a kernel per shape), torch's grouped GEMM (`torch_grouped_linear`) and
the plain-autograd twin (`split_grouped_linear`). docs/moe.md says which runs where and why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tformer.model.linear import (
    DECODE_MAX_ROWS,
    autocast_enabled,
    decoding_max_rows,
    decoding_row_blocks,
    records_graph,
    row_blocked_linear,
)

# torch multiplies bf16 and fp16 on the CPU with oneDNN, which compiles a kernel for every distinct shape
# (~4 ms each on an Intel Xeon) and keeps the last 1,024 (ONEDNN_PRIMITIVE_CACHE_CAPACITY). An expert's
# row count changes at every step, so whole per-expert products asked for thousands of shapes, missed the
# cache and spent most of a step compiling: bench_lm.py's DeepSeekMoE LM under bf16 autocast took 6.3 s a
# step against HF's 2.5 s (2.4 s with a cache large enough to hold every shape). The loop therefore
# multiplies an expert's rows in at most two pieces, a multiple of ROW_QUANTUM rows and the rest: at most
# max_rows / ROW_QUANTUM + ROW_QUANTUM - 1 row counts per product. That model then compiles ~380 kernels in
# its first steps, none after the fourth, and steps in 1.85-1.95 s with a quantum of 32 or 64 (16: 2.04;
# 128: 2.46, the cache still overflows; 256: 5.25). fp32 products (MKL) compile nothing and run whole.
# The forward and input-gradient products, whose rows are their output rows, then took one window of a
# multiple of ROW_QUANTUM rows per expert instead of two pieces (`row_windows`): 1.32x faster on one
# projection's 64 experts, and the LM's bf16 step 1.755 -> 1.674 s (1.037x paired, 8 interleaved rounds).
ROW_QUANTUM = 32


def reduced_cpu(x: Tensor) -> bool:
    """Products of x go to oneDNN: the CPU in bf16 or fp16."""
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)


def row_pieces(n: int, x: Tensor) -> tuple[slice, ...]:
    """The row slices an expert's n rows of x are multiplied in: [0, n) whole, except on the CPU in a
    reduced precision (oneDNN), where n > ROW_QUANTUM not a multiple of it splits in two."""
    tail = n % ROW_QUANTUM
    if n <= ROW_QUANTUM or not tail or not reduced_cpu(x):
        return (slice(0, n),)
    return slice(0, n - tail), slice(n - tail, n)


def row_windows(start: int, n: int, x: Tensor) -> tuple[slice, ...]:
    """The rows of x (absolute) a product that writes an expert's rows [start, start + n) takes. In a
    reduced precision on the CPU: one window of n rounded up to a multiple of ROW_QUANTUM, which runs into
    the rows after the expert's (their outputs are wrong for them and written again by their own expert,
    whose product comes later: callers run the experts in row order), or, where the window would pass the
    last row, `row_pieces`. Elsewhere the expert's rows. For products whose rows are their output rows
    (the forward, the input gradient), not for a weight gradient, which sums over the expert's rows."""
    window = -(-n // ROW_QUANTUM) * ROW_QUANTUM
    if not reduced_cpu(x):
        return (slice(start, start + n),)
    if start + window <= x.shape[0]:
        return (slice(start, start + window),)
    return tuple(slice(start + r.start, start + r.stop) for r in row_pieces(n, x))


def loop_products(x: Tensor, w: Tensor, b: Tensor | None, counts: list[int], y: Tensor) -> Tensor:
    """y[rows of e] = x[rows of e] @ W[e]^T + b[e] for each expert e with rows (views of that expert
    only: with 64 experts and 6 of them chosen, splitting and unbinding all 64 cost more than the
    products of one decoding token), in row order (`row_windows`). While decoding
    (`row_blocked_linears`) an expert with at most its max_rows rows takes the row-blocked product, which
    streams the weights on every core."""
    blocks, max_rows = decoding_row_blocks(w[0], 1), decoding_max_rows()
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        we, be = w[e], None if b is None else b[e]
        if blocks and n <= max_rows:  # a few rows: a product bound by reading the weights
            row_blocked_linear(x[start : start + n], we, be, blocks, out=y[start : start + n])
        else:
            for rows in row_windows(start, n, x):
                if be is not None:
                    torch.addmm(be, x[rows], we.t(), out=y[rows])
                else:
                    torch.mm(x[rows], we.t(), out=y[rows])
        start += n
    return y


@torch.library.custom_op(  # the schema given, not inferred from this module's string annotations
    "tformer::expert_products",
    mutates_args=(),
    schema="(Tensor x, Tensor w, Tensor? b, SymInt[] counts) -> Tensor",
)
def expert_products(x: Tensor, w: Tensor, b: Tensor | None, counts: list[int]) -> Tensor:
    """`loop_products` into a new output, as one operator: selective activation checkpointing keeps or
    recomputes whole operators, and could not keep the loop's products, which each write into a share of
    one buffer (`out=`); as one operator it keeps their output (tformer.model.recompute)."""
    return loop_products(x, w, b, counts, x.new_empty(x.shape[0], w.shape[1]))


@expert_products.register_fake
def _(x: Tensor, w: Tensor, b: Tensor | None, counts: list[int]) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


class LoopGroupedLinear(torch.autograd.Function):
    """y[rows of e] = x[rows of e] @ W[e]^T + b[e], one matmul per expert that has rows, written into
    one preallocated output; backward writes each expert's weight gradient once into one (E, out, in)
    buffer. (Indexing W[e] under autograd instead would make backward allocate a full zero (E, out, in)
    gradient per expert.)"""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None, counts: list[int]) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.counts, ctx.has_bias = counts, b is not None
        return expert_products(x, w, b, counts)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        counts = ctx.counts
        dy = dy.contiguous()
        with torch.autocast(dy.device.type, enabled=False):
            dx, dw = torch.empty_like(x), torch.empty_like(w)
            db = w.new_zeros(w.shape[:2]) if ctx.has_bias else None  # (E, out)
            start = 0
            for e, (n, we, dwe) in enumerate(zip(counts, w.unbind(0), dw.unbind(0))):
                if not n:
                    dwe.zero_()
                    continue
                for rows in row_windows(start, n, x):  # in row order: a window's spill is written again
                    torch.mm(dy[rows], we, out=dx[rows])
                for i, piece in enumerate(row_pieces(n, x)):  # the expert's own rows only
                    rows = slice(start + piece.start, start + piece.stop)
                    if i == 0:
                        torch.mm(dy[rows].t(), x[rows], out=dwe)
                    else:  # the weight gradient sums over the rows: the next piece adds to it
                        dwe.addmm_(dy[rows].t(), x[rows])
                if db is not None:
                    torch.sum(dy[start : start + n], dim=0, out=db[e])
                start += n
        return dx, dw, db, None


def loop_grouped_linear(x: Tensor, w: Tensor, b: Tensor | None, counts: list[int]) -> Tensor:
    if records_graph(x, w, b):
        return LoopGroupedLinear.apply(x, w, b, counts)
    return loop_products(x, w, b, counts, x.new_empty(x.shape[0], w.shape[1]))  # no graph to record


def torch_grouped_linear(x: Tensor, w: Tensor, b: Tensor | None, counts: list[int] | Tensor) -> Tensor:
    """PyTorch's grouped GEMM (`torch.nn.functional.grouped_mm`); needs 16-byte aligned rows. counts: a
    list, or an (E,) integer tensor on x's device (no copy from the host: `DEVICE_COUNTS`)."""
    sizes = counts if isinstance(counts, Tensor) else torch.tensor(counts, device=x.device)  # (E,)
    y = F.grouped_mm(x, w.transpose(1, 2), offs=sizes.cumsum(0).to(torch.int32))  # (S, out)
    if b is None:
        return y
    return y + b.repeat_interleave(sizes, dim=0, output_size=x.shape[0])


def split_grouped_linear(x: Tensor, w: Tensor, b: Tensor | None, counts: list[int]) -> Tensor:
    """Plain autograd: F.linear on `torch.split` chunks against `unbind` views (whose backward stacks the
    expert gradients once), then one cat."""
    biases = b.unbind(0) if b is not None else (None,) * len(counts)
    return torch.cat([F.linear(xe, we, be) for xe, we, be in zip(x.split(counts), w.unbind(0), biases)])


GROUPED_LINEAR_KERNELS = {
    "loop": loop_grouped_linear,
    "split": split_grouped_linear,
    "grouped_mm": torch_grouped_linear,
}
# The CPU kernel. benchmarks/bench_moe.py times all three; on an Intel Xeon grouped_mm ran a block 2-22% faster
# but whole models within noise of the loop, which decoding needs for its row-blocked path (docs/moe.md).
CPU_KERNEL = "loop"
# The CPU kernel for a few rows (a decoding step) without a graph where the row-blocked products are not
# in use (machines where they do not pay, `row_blocking_pays`): the same per-expert products, but torch's
# grouped_mm loops over the experts in C++ where the loop kernel slices each expert's rows in Python.
# bench_moe.py's blocks decoding 8 tokens, Intel Xeon, 2026-12-02, 15 interleaved rounds of 50 calls:
# 1.033x (Mixtral-like) and 1.029x (DeepSeekMoE) the loop kernel's speed, paired median; HF's
# grouped_mm experts still 1.05-1.1x faster (its gate and up are one product per expert).
CPU_DECODE_KERNEL = "grouped_mm" if hasattr(F, "grouped_mm") else "loop"


GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what F.grouped_mm takes (not float64)


def pick_grouped_kernel(x: Tensor, w: Tensor) -> str:
    """grouped_mm on CUDA (SM80+, bf16 / fp16 / fp32 rows of a multiple of 16 bytes): a grouped GEMM where
    torch has one for the GPU and dtype (bf16 on Hopper and newer in torch 2.10-2.11), else torch's own
    loop over the experts in C++; on an H200 the Python loop kernel had made a DeepSeekMoE fp32 training
    step 0.68x HF's, whose experts call grouped_mm in fp32 too. On the CPU `CPU_DECODE_KERNEL` for at
    most DECODE_MAX_ROWS rows without a graph or row-blocked products, `CPU_KERNEL` otherwise. float64
    takes `CPU_KERNEL` everywhere."""
    if x.dtype not in GROUPED_MM_DTYPES:
        return CPU_KERNEL
    if x.device.type == "cpu":
        few = x.shape[0] <= DECODE_MAX_ROWS and (x.shape[1] * x.element_size()) % 16 == 0
        if few and not records_graph(x, w) and decoding_row_blocks(w[0], x.shape[0]) is None:
            return CPU_DECODE_KERNEL
        return CPU_KERNEL
    if not (x.is_cuda and hasattr(F, "grouped_mm")):
        return CPU_KERNEL
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():  # inductor lowers bf16 grouped_mm only
        return CPU_KERNEL
    aligned = (x.shape[1] * x.element_size()) % 16 == 0 and (w.shape[1] * w.element_size()) % 16 == 0
    return "grouped_mm" if aligned and torch.cuda.get_device_capability(x.device) >= (8, 0) else CPU_KERNEL


def grouped_dtype(x: Tensor) -> torch.dtype:
    """The dtype `grouped_linear` multiplies x in where the rows are not few (autocast's, else x's)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if autocast_enabled(kind) else x.dtype


def few_rows_in_weights_dtype(x: Tensor, w: Tensor, b: Tensor | None) -> bool:
    """Whether `grouped_linear` multiplies x in the weights' own dtype instead of autocast's: on the CPU
    under autocast, at most DECODE_MAX_ROWS rows without a graph (decoding). The result's dtype then
    depends on the row count: an expert-parallel dispatch casts it to `grouped_dtype` before sending it."""
    kind = x.device.type
    return (
        kind == "cpu"
        and autocast_enabled(kind)
        and x.shape[0] <= DECODE_MAX_ROWS
        and not records_graph(x, w, b)
    )


class DeviceCounts:
    """The rows per expert as an (E,) tensor on the GPU (`DEVICE_COUNTS`), read on the host at most once:
    grouped_mm takes the tensor; where a layer's products take another kernel (float64, widths not a
    multiple of 16 bytes, fp32 while compiling, GPUs before SM80) the first reads the list, the others
    reuse it."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor
        self._list: list[int] | None = None

    def as_list(self) -> list[int]:
        if self._list is None:
            self._list = self.tensor.tolist()
        return self._list


def grouped_linear(x: Tensor, w: Tensor, b: Tensor | None, counts: list[int] | DeviceCounts) -> Tensor:
    """x (S, in) rows sorted by expert, counts[e] of them for expert e (a list, or `DeviceCounts`, whose
    tensor grouped_mm takes and whose list the other kernels); W (E, out, in) -> (S, out).
    Honours autocast like F.linear: inputs are cast to the autocast dtype, the kernel runs without it;
    except on the CPU for at most DECODE_MAX_ROWS rows without a graph (decoding), which multiply in the
    weights' own dtype: casting all E experts' weights at every step cost more than the products of the
    few experts the rows use (bench_moe.py --bf16, DeepSeekMoE, 8 tokens: 14.6 ms against HF's 3.6, whose
    experts are not cast)."""
    dtype = w.dtype if few_rows_in_weights_dtype(x, w, b) else grouped_dtype(x)
    x, w, b = x.to(dtype), w.to(dtype), b if b is None else b.to(dtype)
    kernel = pick_grouped_kernel(x, w)
    if isinstance(counts, DeviceCounts):
        counts = counts.tensor if kernel == "grouped_mm" else counts.as_list()
    with torch.autocast(x.device.type, enabled=False):
        return GROUPED_LINEAR_KERNELS[kernel](x, w, b, counts)
