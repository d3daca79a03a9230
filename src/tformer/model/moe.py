"""Mixture-of-Experts FFN slot: y = sum_{e in topK(x)} g_e(x) FFN_e(x) + Shared(x).

Shapes: x (B, T, D) -> (B, T, D); inside, N = B * T tokens, E = n_experts, K = top_k, F = d_expert,
S <= N * K token-expert assignments kept after the capacity limit. Expert weights are stacked like E
linear layers, W (E, out, in): `experts.gate_proj` (E, F, D), `experts.up_proj` (E, F, D),
`experts.down_proj` (E, D, F), biases `*_bias` (E, out) when cfg.bias.

Dispatch is chosen at build time: `LoopDispatch` is the readable reference (one expert at a time);
`GroupedDispatch` sorts the assignments by expert, gathers once, runs contiguous per-expert matmuls
(`grouped_linear`) and scatter-adds once. The trainer's one channel is `moe_aux_loss`,
`moe_routing_stats` and `update_expert_biases` at the bottom of this file.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.config import ModelConfig, MoEConfig
from tformer.model.ffn import make_dense_ffn
from tformer.model.linear import (
    DECODE_MAX_ROWS,
    autocast_enabled,
    decoding_max_rows,
    decoding_row_blocks,
    records_graph,
    row_blocked_linear,
)
from tformer.model.router import BalanceLoss, Routing, Segments, TopKRouter, count_per_expert, probabilities

# ----------------------------------------------------------------------------- grouped matmul kernels
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


# ----------------------------------------------------------------------------- experts
def _same(t: Tensor | None) -> Tensor | None:
    return t


class Experts(nn.Module):
    """E FFNs of one kind; `forward(x, p)` is the FFN written once over projections `p`, which
    `grouped(counts)` binds to all experts' rows at once and `per_expert()` to each expert alone.
    `local` maps a stacked weight to what the kernels multiply by: the weight itself, or (set by a
    tensor-parallel plan, tformer.distributed.expert_width) this rank's slice of it."""

    projections: tuple[str, ...] = ("up_proj", "down_proj")
    local = staticmethod(_same)

    def __init__(self, n_experts: int, d_model: int, d_expert: int, bias: bool) -> None:
        super().__init__()
        self.n_experts = n_experts
        for name in self.projections:
            d_out, d_in = (d_model, d_expert) if name == "down_proj" else (d_expert, d_model)
            bound = d_in**-0.5  # nn.Linear's default init, expert by expert
            w = nn.Parameter(torch.empty(n_experts, d_out, d_in).uniform_(-bound, bound))
            self.register_parameter(name, w)
            b = nn.Parameter(torch.empty(n_experts, d_out).uniform_(-bound, bound)) if bias else None
            self.register_parameter(f"{name}_bias", b)

    def grouped(self, counts: list[int] | DeviceCounts) -> SimpleNamespace:
        """Projections over rows sorted by expert, counts[e] rows for expert e (`grouped_linear`)."""
        return SimpleNamespace(
            **{
                n: partial(
                    grouped_linear,
                    w=self.local(getattr(self, n)),
                    b=self.local(getattr(self, f"{n}_bias")),
                    counts=counts,
                )  # fmt: skip
                for n in self.projections
            }
        )

    def per_expert(self) -> list[SimpleNamespace]:
        """Each expert's projections, as views from one `unbind` per stacked tensor."""
        views = {n: self._unbind(self.local(getattr(self, n))) for n in self.projections}
        biases = {n: self._unbind(self.local(getattr(self, f"{n}_bias"))) for n in self.projections}
        return [
            SimpleNamespace(**{n: partial(F.linear, weight=views[n][e], bias=biases[n][e]) for n in views})
            for e in range(self.n_experts)
        ]

    def _unbind(self, t: Tensor | None) -> tuple:
        return (None,) * self.n_experts if t is None else t.unbind(0)


class ReluExperts(Experts):
    """down(relu(up(x))) per expert."""

    activation = staticmethod(F.relu)

    def forward(self, x: Tensor, p: SimpleNamespace) -> Tensor:
        return p.down_proj(self.activation(p.up_proj(x)))


class GeluExperts(ReluExperts):
    """down(gelu(up(x))) per expert."""

    activation = staticmethod(F.gelu)


class SwiGLUExperts(Experts):
    """down(silu(gate(x)) * up(x)) per expert."""

    projections = ("gate_proj", "up_proj", "down_proj")

    def forward(self, x: Tensor, p: SimpleNamespace) -> Tensor:
        return p.down_proj(F.silu(p.gate_proj(x)) * p.up_proj(x))


EXPERTS: dict[str, type[Experts]] = {"relu": ReluExperts, "gelu": GeluExperts, "swiglu": SwiGLUExperts}


class NoShared(nn.Module):
    """No shared experts: contributes nothing."""

    def forward(self, x: Tensor) -> Tensor:
        return x.new_zeros(())


# ----------------------------------------------------------------------------- capacity
class Dropless(nn.Module):
    """Every assignment is kept."""

    def limit(self, n_tokens: int) -> int:
        return n_tokens

    def sort(self, idx: Tensor) -> Tensor:
        """The N*K assignments (indices into idx (N, K) flattened) by expert, token order within."""
        return idx.flatten().argsort(stable=True)

    def trim(self, order: Tensor, expert: Tensor, counts: Tensor, n_tokens: int):
        return order, counts, counts.new_zeros(())


class Capacity(nn.Module):
    """Each expert keeps ceil(cf * N * K / E) assignments (<= N): every token's first choice before any
    token's second, and so on, in token order within a choice (GShard's priority: a token's second choice
    never pushes out another token's first). The rest are dropped: those tokens get nothing from that
    expert (the residual and shared experts remain).
    cf is capacity_factor in training mode and eval_capacity_factor in eval mode; None: no limit
    (an expert holds each token at most once, so a limit of N drops nothing)."""

    def __init__(self, moe: MoEConfig) -> None:
        super().__init__()
        # each factor as the fraction its decimal names (1.1 is 11/10, not 1.1000000000000000888...) and the
        # limit in integers, so a whole number of slots is not rounded up to one more (1.1 x 100 / 11 is 10)
        self.factor, self.eval_factor = (None if f is None else Fraction(repr(f)).as_integer_ratio() for f in
                                         (moe.capacity_factor, moe.eval_capacity_factor))  # fmt: skip
        self.top_k, self.n_experts = moe.top_k, moe.n_experts

    def limit(self, n_tokens: int) -> int:
        factor = self.factor if self.training else self.eval_factor
        if factor is None:
            return n_tokens
        num, den = factor
        return min(-(-num * n_tokens * self.top_k // (den * self.n_experts)), n_tokens)  # ceil, exact

    def sort(self, idx: Tensor) -> Tensor:
        """The N*K assignments (indices into idx (N, K) flattened) by expert, then by choice rank, then
        token: the order in which an expert's slots are filled. One sort of a unique key."""
        n, k = idx.shape
        a = torch.arange(n * k, device=idx.device)  # token-major: a = token * K + rank
        return (idx.flatten() * (n * k) + (a % k) * n + a // k).argsort()

    def trim(self, order: Tensor, expert: Tensor, counts: Tensor, n_tokens: int):
        """order (S,) assignments in `sort`'s order; expert (S,) their experts; counts (E,)."""
        cap = self.limit(n_tokens)
        if cap >= n_tokens:  # no expert holds a token twice: nothing to drop (and no data-dependent shape)
            return order, counts, counts.new_zeros(())
        starts = counts.cumsum(0) - counts  # (E,) first sorted slot of each expert
        keep = torch.arange(order.numel(), device=order.device) - starts[expert] < cap  # (S,)
        return order[keep], counts.clamp(max=cap), (~keep).sum()


# ----------------------------------------------------------------------------- dispatch
class Dispatch(nn.Module):
    """(experts, x (N, D), routing) -> (sum of weighted expert outputs (N, D) in >= fp32, dropped count)."""

    def __init__(self, capacity: nn.Module) -> None:
        super().__init__()
        self.capacity = capacity

    def kept(self, idx: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor]:
        """(the kept assignments (S,) as indices into idx (N, K) flattened, by expert; rows per expert (E,);
        the dropped count) under the capacity's order and limit."""
        flat = idx.flatten()  # (N*K,) expert of each assignment
        order = self.capacity.sort(idx)  # (N*K,)
        counts = count_per_expert(flat, n_experts)  # (E,)
        return self.capacity.trim(order, flat[order], counts, idx.shape[0])


class LoopDispatch(Dispatch):
    """Reference: for each expert, gather its tokens, run it, add its weighted output back."""

    def forward(self, experts: Experts, x: Tensor, route: Routing) -> tuple[Tensor, Tensor]:
        n, d = x.shape
        cap, dropped = self.capacity.limit(n), 0
        out = torch.zeros(n, d, device=x.device, dtype=torch.promote_types(x.dtype, torch.float32))
        for e, proj in enumerate(experts.per_expert()):
            slot, token = torch.where(e == route.idx.T)  # first choices first, token order within
            dropped += max(token.numel() - cap, 0)
            token, slot = token[:cap], slot[:cap]
            y = experts(x[token], proj)  # (n_e, D)
            out = out.index_add(0, token, y * route.weights[token, slot].unsqueeze(1))
        return out, torch.tensor(dropped, device=x.device)


# Whether the rows per expert stay a tensor on the GPU for the grouped_mm kernel. Read as a list, they cost
# one wait for the GPU per MoE layer (`tolist`) and one more per projection (`torch.tensor(counts,
# device=...)` copies from the host and waits for the stream), where the CPU could have queued the
# layer's remaining kernels; made into offsets on the device, they cost none (torch's grouped_mm still
# reads them on the host where it has no grouped GEMM for the dtype and loops over the experts).
DEVICE_COUNTS = True


def host_or_device(counts: Tensor) -> list[int] | DeviceCounts:
    """counts (E,) as `Experts.grouped` should get them: `DeviceCounts` on CUDA (`DEVICE_COUNTS`), a list
    elsewhere."""
    return DeviceCounts(counts) if counts.is_cuda and DEVICE_COUNTS else counts.tolist()


class GroupedDispatch(Dispatch):
    """Fast path: sort the N*K assignments by expert, one gather, grouped matmuls, one scatter-add."""

    def forward(self, experts: Experts, x: Tensor, route: Routing) -> tuple[Tensor, Tensor]:
        n, d = x.shape
        k = route.idx.shape[1]
        order, counts, dropped = self.kept(route.idx, experts.n_experts)  # (S,), (E,)
        token = order // k  # (S,)
        y = experts(x.index_select(0, token), experts.grouped(host_or_device(counts)))  # (S, D)
        weighted = y * route.weights.flatten().index_select(0, order).unsqueeze(1)  # (S, D), >= fp32
        return torch.zeros(n, d, device=x.device, dtype=weighted.dtype).index_add(0, token, weighted), dropped


DISPATCH: dict[str, type[Dispatch]] = {"loop": LoopDispatch, "grouped": GroupedDispatch}


# ----------------------------------------------------------------------------- the layer
class MoE(nn.Module):
    """y = sum_{e in topK} g_e(x) Expert_e(x) + Shared(x), token by token (Shazeer et al., 2017;
    GShard; Switch; DeepSeekMoE). Slots: router, experts, shared. In a training forward with grad
    enabled it also keeps `last_aux` (this layer's weighted balance losses) and `last_stats`."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        moe = cfg.moe
        self.layer_idx = layer_idx
        d_expert, d_shared = moe.expert_width(cfg.d_ff), moe.shared_width(cfg.d_ff)
        self.router = TopKRouter(cfg.d_model, moe)
        self.experts = EXPERTS[cfg.ffn](moe.n_experts, cfg.d_model, d_expert, cfg.bias)
        shared_width = moe.n_shared * d_shared  # n_shared experts fused into one FFN: the sum of them
        self.shared = (
            make_dense_ffn(cfg.ffn, cfg.d_model, shared_width, cfg.bias) if moe.n_shared else NoShared()
        )
        limited = moe.capacity_factor is not None or moe.eval_capacity_factor is not None
        self.dispatch = DISPATCH[moe.dispatch](Capacity(moe) if limited else Dropless())
        self.balance = BalanceLoss(moe)
        self.last_aux: Tensor = torch.zeros(())
        self.last_stats: dict[str, Tensor] = {}

    def __getstate__(self) -> dict:
        """The module's state with the last training forward's loss and statistics detached: a copy
        (copy.deepcopy, torch.optim.swa_utils.AveragedModel) of a model that has trained had failed on
        that loss, a tensor inside the step's graph."""
        state = dict(self.__dict__)
        state["last_aux"] = self.last_aux.detach()
        state["last_stats"] = {k: v.detach() for k, v in self.last_stats.items()}
        return state

    def forward(self, x: Tensor, tokens: Tensor | None = None) -> Tensor:
        """x (B, T, D); tokens (B, T) bool, True for real tokens (None: all are). Padding is left out of
        the layer: no expert, capacity slot, load count, balance loss or statistic sees it, and its
        output there is 0 (padding is masked out of attention, pooling and the loss)."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)  # (N, D)
        if tokens is None:
            return self.mix(flat, b).view(b, t, d)
        keep = tokens.reshape(-1).nonzero().squeeze(1)  # (N',) the real tokens, row-major
        # (none at all still runs the layer, on 0 tokens: an expert-parallel dispatch's collectives must run
        # on every rank, and the layer's balance loss and statistics must be this forward's)
        out = self.mix(flat.index_select(0, keep), Segments(keep // t, b))
        return torch.zeros_like(flat).index_copy(0, keep, out).view(b, t, d)

    def mix(self, flat: Tensor, groups: int | Segments) -> Tensor:
        """Routed experts + shared experts of N tokens (N, D); groups: the sequences they come from (an
        int B: N / B tokens each, in order)."""
        route = self.router(flat)
        routed, dropped = self.dispatch(self.experts, flat, route)  # (N, D) fp32
        if self.training and torch.is_grad_enabled():
            self.observe(route, dropped, groups)
        return routed.to(flat.dtype) + self.shared(flat)

    def observe(self, route: Routing, dropped: Tensor, groups: int | Segments) -> None:
        """Training-forward bookkeeping: counters, this layer's balance losses, statistics. Activation
        checkpointing's recomputation computes the losses again (it must save the tensors the forward
        saved) but keeps the forward's counters, losses and statistics: the forward counted these tokens,
        and a loss kept from the recomputation would hold its graph (the block's activations) after the
        backward."""
        again = recomputing()
        counts = self.router.count(route.idx, add=not again)
        none = route.idx.shape[0] == 0  # no token (a forward of padding alone): nothing to balance
        # 0 without tokens, in the graph like the losses it stands for
        aux = route.logits.sum() * 0.0 if none else self.balance(route, groups)
        if again:
            return
        self.last_aux = aux
        with torch.no_grad():
            if none:
                entropy = torch.zeros((), device=route.logits.device)
            else:
                p = probabilities(route.scores)
                entropy = -(p * p.clamp_min(1e-20).log()).sum(-1).mean()
        self.last_stats = {"counts": counts, "dropped": dropped, "entropy": entropy}


def recomputing() -> bool:
    """Whether this forward runs inside a backward: activation checkpointing's recomputation of a block
    (tformer.model.recompute), whose tokens the forward before it already counted. torch's FSDP2 tells
    its backward hooks from its forward ones the same way. A forward between two backward calls (each
    micro-batch of gradient accumulation) is not inside one; tformer runs no forward from a backward hook."""
    return torch._C._current_graph_task_id() != -1


# ----------------------------------------------------------------------------- the trainer's channel
def _no_reduce(t: Tensor) -> None:
    """Single process: nothing to all-reduce."""


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> Tensor:
    """The weighted balance + z losses of each MoE layer's last training forward, averaged over the MoE
    layers (each layer's loss is computed from its own f and P). Add it to the task loss. A constant 0
    without graph when every coefficient is 0 or the model has no MoE layer."""
    layers = moe_layers(model)
    device = next(model.parameters()).device
    if not layers:
        return torch.zeros((), device=device)
    return torch.stack([m.last_aux.to(device) for _, m in layers]).mean()


@torch.no_grad()
def moe_routing_stats(
    model: nn.Module, reset_window: bool = True, all_reduce: Callable[[Tensor], object] = _no_reduce
) -> dict[str, dict]:
    """Per MoE layer (by module name), from its last training forward: `load` (share of assignments per
    expert), `max_vio` (max load / mean load - 1), `dropped` and `assignments` counts, router
    `entropy` (nats, mean over tokens), `aux_loss`; over the window since the last call with
    reset_window: `dead_experts` (ids that got no token) and `window_tokens`. Plain JSON-ready values.
    `all_reduce` (e.g. torch.distributed.all_reduce) sums the window counts over processes."""
    out = {}
    for name, layer in moe_layers(model):
        if not layer.last_stats:
            continue  # no training forward yet
        s, window = layer.last_stats, layer.router.window_tokens.clone()
        all_reduce(window)
        counts = s["counts"].double()
        total = counts.sum().clamp_min(1.0)
        out[name] = {
            "load": (counts / total).tolist(),
            "max_vio": float(counts.max() / (total / counts.numel()) - 1.0),
            "dropped": int(s["dropped"]),
            "assignments": int(counts.sum()),
            "entropy": float(s["entropy"]),
            "aux_loss": float(layer.last_aux),
            "dead_experts": (window == 0).nonzero().flatten().tolist(),
            "window_tokens": int(window.sum()),
        }
        if reset_window:
            layer.router.window_tokens.zero_()
    return out


def update_expert_biases(model: nn.Module, all_reduce: Callable[[Tensor], object] = _no_reduce) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): call after each optimizer step. Each MoE layer's
    expert_bias_i += bias_update_rate * sign(mean load - load_i), from the assignments its training
    forwards made since the last call (summed over processes by `all_reduce`); then the count restarts."""
    for _, layer in moe_layers(model):
        layer.router.update_bias(all_reduce)


def discard_expert_counts(model: nn.Module) -> None:
    """Forget the assignments counted since the last bias update: a skipped (non-finite) step's routing
    must not steer the next update."""
    for _, layer in moe_layers(model):
        layer.router.tokens_per_expert.zero_()
