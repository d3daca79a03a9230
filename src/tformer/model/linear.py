"""Linear layers for the shapes where `F.linear` is not the fastest way to the same product.

Shapes: x (..., D_in) -> (..., D_out).

Many rows: q/k/v of self-attention and gate/up of SwiGLU read the same x; one GEMM over the stacked
weights [W_1; W_2; ...] was 15-20% faster than separate ones at training sizes on an AVX2 CPU (wider
output, one pass over x; docs/performance.md), but stacking copies the weights at every call, which
costs more than it saves when there are few rows. So `stacked_linear` runs the stacked GEMM from
`FUSE_MIN_ROWS` rows on, the separate layers (the slow twin, same result up to summation order)
below; and, since an AVX512 CPU measured the training step faster without it (the backward's extra
copies), only where no graph is recorded unless `FUSE_UNDER_AUTOGRAD`. Parameters and checkpoint
keys stay those of the separate `nn.Linear` layers.

Decoding (a few rows per step), where `row_blocking_pays` measures it faster on the machine:
`row_blocked_linears` makes every CPU `nn.Linear` (and the MoE
experts' kernel, through `decoding_row_blocks`) compute x W^T as a batch of products of W's row blocks
with x^T (`row_blocked_linear`), which CPU BLAS spreads over the cores and streams at about twice the
rate of `F.linear` for one row. Layers that read the same input (q/k/v, gate/up) go through
`stacked_linear`, which then runs one such product over their weights stacked once per context (a
copy of those weights for the length of the context; 32 products per step instead of 56 in the blocks
of an 8-layer SwiGLU model).

Training in fp32 on the CPU (`apply_linear`, how the blocks call their linear layers): where
`onednn_linear_pays` says so, the forward and input-gradient products go through oneDNN (`OneDnnLinear`)
instead of `F.linear`'s MKL GEMM, which on some CPUs runs the same shapes 5-25% slower (an AMD EPYC with
AVX512-BF16, measured); the weight gradient stays an MKL product. `F.linear` is the slow twin.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache, partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FUSE_MIN_ROWS = 1024  # rows (B * T) from which one stacked GEMM beats separate ones (CPU, fp32)
# Whether a training step (a graph recorded) stacks too. Its backward pays a concatenation of the output
# gradients and a copy of the weights per call: on an AMD EPYC (AVX2) the stacked step still won
# (1.05-1.23x per layer pair), on an Intel Xeon (AVX512/AMX) the whole LM training step ran 6.7% faster
# with separate layers in fp32 and the same in bf16 (2026-11-30), where the benchmarks now run.
FUSE_UNDER_AUTOGRAD = False


def records_graph(*tensors: Tensor | None) -> bool:
    """Whether an op on these tensors would be recorded for backward (grad mode on and one of them
    requires grad); None entries (absent biases) are skipped."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _records_graph(x: Tensor, linears: Sequence[nn.Linear]) -> bool:
    return records_graph(x, *(lin.weight for lin in linears))


def autocast_input(x: Tensor) -> Tensor:
    """x cast to the autocast dtype where autocast would cast it (fp32 under an enabled autocast), else x.

    Layers that read the same x under autocast then share one cast instead of casting x once each: one
    copy of x forward and one of its gradient backward instead of one per layer (the layers' input
    gradients are summed in the autocast dtype before their one cast back). Measured on the bf16 LM
    training step: see docs/performance.md."""
    kind = x.device.type
    if x.dtype != torch.float32 or not autocast_enabled(kind):
        return x
    return x.to(torch.get_autocast_dtype(kind))


def autocast_enabled(kind: str) -> bool:
    """torch.is_autocast_enabled(kind), False for device types autocast does not know (meta)."""
    available = getattr(torch.amp, "is_autocast_available", lambda k: k in ("cpu", "cuda", "xpu", "mps"))
    return available(kind) and torch.is_autocast_enabled(kind)


def stacked_linear(
    x: Tensor, linears: Sequence[nn.Linear], min_rows: int | None = None
) -> tuple[Tensor, ...]:
    """(linear(x) for linear in linears); one GEMM over the stacked weights when x has >= min_rows rows
    (default FUSE_MIN_ROWS, read at call time) and no graph is recorded (or FUSE_UNDER_AUTOGRAD). While
    `row_blocked_linears` is active, inputs of at most its max_rows rows use one row-blocked product over
    weights stacked once for the context (without gradients: under autograd they take the separate
    layers). The separate layers read x cast once under autocast (`autocast_input`)."""
    plain = all(type(linear.weight) is nn.Parameter for linear in linears)  # not tensor-parallel shards
    sizes = [linear.out_features for linear in linears]
    few = x.numel() < (FUSE_MIN_ROWS if min_rows is None else min_rows) * x.shape[-1]
    if few or not plain or (not FUSE_UNDER_AUTOGRAD and _records_graph(x, linears)):
        decoding = active_decoding()
        if (
            plain
            and decoding is not None
            and x.numel() <= decoding.max_rows * x.shape[-1]
            and not torch.is_grad_enabled()  # the stack is a copy: gradients would not reach the layers
            and not torch.is_autocast_enabled("cpu")
        ):
            stacked = decoding.stacked(linears)
            if stacked is not None:
                return row_blocked_linear(x, *stacked).split(sizes, dim=-1)
        x = autocast_input(x) if len(linears) > 1 else x  # cast once, not once per layer
        return tuple(apply_linear(linear, x) for linear in linears)  # the separate layers
    weight = torch.cat([linear.weight for linear in linears])  # (sum D_out_i, D_in)
    bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
    return F.linear(x, weight, bias).split(sizes, dim=-1)


# ----------------------------------------------------------------------------- decoding
DECODE_MAX_ROWS = 64  # rows up to which the row-blocked product beats F.linear by >= 1.3x here
DECODE_BLOCKS = 4  # row blocks per weight: 2 to 16 measure the same on 2 cores (more cores may want more)
DECODE_MIN_WEIGHT = 65_536  # elements (256 KB fp32) below which bmm's ~15 us fixed cost outweighs its gain


def row_blocked_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, n_blocks: int = DECODE_BLOCKS, out: Tensor | None = None
) -> Tensor:
    """F.linear(x, weight, bias) as one batched product of n_blocks row blocks of weight with x^T.

    x (..., D_in), weight (D_out, D_in) with D_out divisible by n_blocks -> (..., D_out). The blocks are
    views of weight, x^T is broadcast over them: (n, D_out/n, D_in) @ (n, D_in, R) -> (n, D_out/n, R).
    Same sums as F.linear, possibly in another order (floating point differs by rounding only).
    out: write the result there (one contiguous row without bias: the product writes it directly).
    """
    d_in, d_out = x.shape[-1], weight.shape[0]
    x = x.contiguous()
    rows = x.numel() // d_in
    xt = x.as_strided((n_blocks, d_in, rows), (0, 1, d_in))  # x^T, broadcast over the blocks
    blocks = weight.view(n_blocks, d_out // n_blocks, d_in)
    if out is not None and rows == 1 and bias is None and out.is_contiguous():
        torch.bmm(blocks, xt, out=out.view(n_blocks, d_out // n_blocks, 1))  # (n, D_out/n, 1) is the row
        return out
    y = torch.bmm(blocks, xt)  # (n, D_out/n, R)
    out_shape = (*x.shape[:-1], d_out)
    y = y.view(out_shape) if rows == 1 else y.permute(2, 0, 1).reshape(out_shape)
    y = y if bias is None else y + bias
    return y if out is None else out.copy_(y)


def row_blocks(weight: Tensor, n_blocks: int = DECODE_BLOCKS, min_weight: int | None = None) -> int | None:
    """How many row blocks `row_blocked_linear` should cut `weight` (out, in) into: the most up to
    n_blocks that divide out (at least 2); None where F.linear is the better choice: no such divisor,
    fewer than min_weight weights (default DECODE_MIN_WEIGHT, read at call time), not on the CPU, not
    fp32 (bf16 / fp16 weights: F.linear's oneDNN path is ~1.1x faster than bmm here, cold weights; in
    fp32 the row-blocked product is ~2x faster)."""
    floor = DECODE_MIN_WEIGHT if min_weight is None else min_weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if weight.numel() == 0 or weight.numel() < floor:
        return None
    return next((n for n in range(n_blocks, 1, -1) if weight.shape[0] % n == 0), None)


# Whether the decoding callers (`generate`, the encoder-decoder `search`) enter `row_blocked_linears`:
# None measures it (`row_blocking_pays`) unless the environment variable TFORMER_DECODE_ROW_BLOCKED says
# 1 / 0 (auto: measure); True / False here: always / never.
DECODE_ROW_BLOCKED: bool | None = None
ENV_ROW_BLOCKED = "TFORMER_DECODE_ROW_BLOCKED"
DECODE_PROBE_BYTES = 256 * 2**20  # the measurement reads at most this much of a model's weights (>= 1 layer)
_PAYS: dict[tuple, bool] = {}  # (thread count, the probed layers' shapes and block counts) -> the answer
_PAYS_LOCK = threading.Lock()


def row_blocking_pays(model: nn.Module, margin: float = 1.1) -> bool:
    """Whether one-row products with `model`'s linear layers run at least `margin` times faster as
    row-blocked products than through `F.linear` on this CPU: DECODE_ROW_BLOCKED or the environment
    variable TFORMER_DECODE_ROW_BLOCKED where set (to pin the layout, and with it the summation order,
    across runs), else timed over the layers `row_blocks` accepts (up to DECODE_PROBE_BYTES of them,
    each read once per pass: 2 warm-up and 3 timed passes of each, interleaved; ~60 ms for a 118 MB
    model) once per process, thread count and set of layer shapes, then cached. A model with no such
    layer gets False.

    Why measured: the layout exists because MKL computes `F.linear` of one row on one core on some CPUs
    (an AMD EPYC with AVX2: ~5 GB/s, row blocks on both cores ~11-13 GB/s, 2.0x faster decoding), while
    on others it uses every core (an Intel Xeon with AVX512/AMX: `generate` 0.83x as fast with the row
    blocks as without them, 2026-11-30)."""
    forced = DECODE_ROW_BLOCKED if DECODE_ROW_BLOCKED is not None else _env_row_blocked()
    if forced is not None:
        return forced
    probe, size = [], 0
    for m in model.modules():
        if type(m) is nn.Linear:
            blocks = row_blocks(m.weight)
            nbytes = m.weight.numel() * m.weight.element_size()
            if blocks is not None and (not probe or size + nbytes <= DECODE_PROBE_BYTES):
                probe.append((m.weight.detach(), blocks))
                size += nbytes
    if not probe:
        return False
    key = (torch.get_num_threads(), tuple((tuple(w.shape), n) for w, n in probe))
    with _PAYS_LOCK:  # one measurement at a time (another thread's decoding would skew it)
        if key not in _PAYS:
            _PAYS[key] = _measure_row_blocking(probe) >= margin
        return _PAYS[key]


def _env_row_blocked() -> bool | None:
    value = os.environ.get(ENV_ROW_BLOCKED, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV_ROW_BLOCKED}={value!r}: use 1 (row blocks), 0 (F.linear) or auto (measure)")


def _measure_row_blocking(probe: list[tuple[Tensor, int]]) -> float:
    """Median over 3 interleaved passes of (F.linear time / row-blocked time) over the probe's weights,
    after 2 warm-up passes of each; fp32 rows of ones (no random numbers: the RNG streams stay as they
    are), outside autocast and autograd."""
    rows = {w.shape[1]: torch.ones(1, w.shape[1], dtype=w.dtype) for w, _ in probe}

    def timed(product: Callable[[Tensor, Tensor, int], Tensor]) -> float:
        t = time.perf_counter()
        for w, n in probe:
            product(rows[w.shape[1]], w, n)
        return time.perf_counter() - t

    def linear(x: Tensor, w: Tensor, n: int) -> Tensor:
        return F.linear(x, w)

    def blocked(x: Tensor, w: Tensor, n: int) -> Tensor:
        return row_blocked_linear(x, w, None, n)

    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        for _ in range(2):
            timed(linear), timed(blocked)
        ratios = []
        for linear_first in (True, False, True):  # alternate which goes first
            if linear_first:
                t_linear, t_blocked = timed(linear), timed(blocked)
            else:
                t_blocked, t_linear = timed(blocked), timed(linear)
            ratios.append(t_linear / t_blocked)
    return sorted(ratios)[1]


def decoding_layout(model: nn.Module):
    """`row_blocked_linears(model)` where `row_blocking_pays(model)`, else a context that does nothing."""
    return row_blocked_linears(model) if row_blocking_pays(model) else nullcontext()


@dataclass(frozen=True)
class _Decoding:
    max_rows: int
    n_blocks: int
    min_weight: int | None
    patched: dict = field(default_factory=dict, compare=False)  # id -> the nn.Linear this context patched
    stacks: dict = field(
        default_factory=dict, compare=False
    )  # ids -> (weight, bias, blocks, params, versions)

    def stacked(self, linears: Sequence[nn.Linear]) -> tuple[Tensor, Tensor | None, int] | None:
        """[W_1; W_2; ...] (and biases) of layers that read the same input, with its row-block count,
        copied once per context and again only if a weight changes in place; None unless this context
        patched every layer (so each is a CPU fp32 layer `row_blocks` accepts, its forward not someone
        else's) and a block count divides the stacked width. Called per group and decoding step: a hit
        reads only the stored parameters' versions (a module attribute lookup costs ~1 us each)."""
        key = tuple(map(id, linears))
        entry = self.stacks.get(key)
        if entry is not None and entry[4] == _versions(entry[3]):
            return entry[:3]
        if not all(self.patched.get(id(linear)) is linear for linear in linears):
            return None
        rows = sum(linear.out_features for linear in linears)
        blocks = next((n for n in range(self.n_blocks, 1, -1) if rows % n == 0), None)
        if blocks is None:
            return None
        params = tuple(p for linear in linears for p in (linear.weight, linear.bias) if p is not None)
        with torch.no_grad():
            weight = torch.cat([linear.weight for linear in linears])  # (sum D_out_i, D_in)
            bias = None if linears[0].bias is None else torch.cat([linear.bias for linear in linears])
        self.stacks[key] = (weight, bias, blocks, params, _versions(params))
        return weight, bias, blocks


def _versions(params: Sequence[Tensor]) -> tuple[tuple[int, int], ...]:
    """Where each tensor's data is and how often it was changed in place."""
    return tuple((p.data_ptr(), p._version) for p in params)


_DECODING: ContextVar[_Decoding | None] = ContextVar("tformer_row_blocked_decoding", default=None)


def active_decoding() -> _Decoding | None:
    """The active `row_blocked_linears` context, if any. None inside torch.compile, which cannot trace a
    ContextVar (every read split the graph) and which decoding does not use."""
    return None if torch.compiler.is_compiling() else _DECODING.get()


def decoding_row_blocks(weight: Tensor, rows: int) -> int | None:
    """For kernels that multiply by weights outside `nn.Linear` (the MoE experts): the block count to use
    for a product of `rows` rows with `weight` while `row_blocked_linears` is active, else None."""
    d = active_decoding()
    if d is None or rows > d.max_rows:
        return None
    return row_blocks(weight, d.n_blocks, d.min_weight)


def decoding_max_rows() -> int:
    """Rows up to which the active `row_blocked_linears` context takes row-blocked products (0: none
    active)."""
    d = active_decoding()
    return 0 if d is None else d.max_rows


def _decode_forward(linear: nn.Linear, max_rows: int, n_blocks: int, x: Tensor) -> Tensor:
    if x.numel() > max_rows * x.shape[-1] or torch.is_autocast_enabled("cpu"):
        return F.linear(x, linear.weight, linear.bias)  # the slow twin: many rows, or autocast's casts
    return row_blocked_linear(x, linear.weight, linear.bias, n_blocks)


@contextmanager
def row_blocked_linears(
    model: nn.Module,
    max_rows: int = DECODE_MAX_ROWS,
    n_blocks: int = DECODE_BLOCKS,
    min_weight: int | None = None,
) -> Iterator[None]:
    """While active, every `nn.Linear` of `model` on the CPU computes inputs of at most `max_rows` rows
    with `row_blocked_linear`, in the most blocks up to `n_blocks` that divide its out_features (at
    least 2), and the MoE experts' loop kernel does the same for experts with that few rows
    (`decoding_row_blocks`). `F.linear` stays for larger inputs (a long prompt), under CPU autocast,
    for weights that are not fp32, for widths with no such divisor, and for layers with fewer than
    `min_weight` weights (default `DECODE_MIN_WEIGHT`, read at call time): there, and wherever the
    weights sit in the cache anyway, bmm's fixed cost of ~15 us a call outweighs the faster streaming
    (a d_model 64 model decoded 0.83x as fast with every layer blocked). The layers' own weights are
    not copied; without autograd, `stacked_linear` copies the weights of each group of patched layers
    it is called with (q/k/v, gate/up) into one stacked tensor, once per context (again if a weight
    changes in place), and frees them when the context ends: for a dense SwiGLU model that is about
    60% of its matrix weights held twice for the length of the context.

    Why: one decoding step is a matrix-vector product per layer (a matrix-matrix product with a few
    rows at batch > 1), bound by reading the weights. For such shapes MKL runs `F.linear`'s
    x @ W^T on one core at ~5 GB/s here, and the batch of row-block products on both cores at ~11 GB/s
    (every layer shape of an 8-layer d_model 512 model, cold weights, 2 threads, this project's 2-core
    machine): the matrix products of one step of one sequence take 10 ms instead of 18; at 2 to 64 rows
    the gain is 1.3-2.2x (docs/performance.md). Autograd works through the per-layer products (the
    stacked ones are used only without it), but the context is meant for inference.

    The layers are patched in place (an instance `forward`), so use one such context per model at a time
    and from one thread; a layer whose `forward` is already patched is left alone.
    """
    patched: list[tuple[nn.Linear, partial]] = []
    decoding = _Decoding(max_rows, n_blocks, min_weight)
    token = _DECODING.set(decoding)
    try:
        for m in model.modules():
            if type(m) is not nn.Linear or "forward" in m.__dict__:
                continue
            blocks = row_blocks(m.weight, n_blocks, min_weight)
            if blocks is None:
                continue
            m.forward = partial(_decode_forward, m, max_rows, blocks)
            patched.append((m, m.forward))
            decoding.patched[id(m)] = m
        yield
    finally:
        _DECODING.reset(token)
        decoding.patched.clear()
        decoding.stacks.clear()  # the copies go with the context (even where a task still holds it)
        for m, ours in patched:
            if m.__dict__.get("forward") is ours:  # only what this context set
                del m.forward


# ----------------------------------------------------------------------------- training products
ONEDNN_MIN_ROWS = 256  # rows (B * T) from which a training product may take oneDNN (measured from 2,048)
# Whether fp32 training products on the CPU take oneDNN: None decides by the CPU (`onednn_linear_pays`)
# unless the environment variable TFORMER_ONEDNN_LINEAR says 1 / 0 (auto: by the CPU); True / False here.
ONEDNN_LINEAR: bool | None = None
ENV_ONEDNN_LINEAR = "TFORMER_ONEDNN_LINEAR"


def _onednn_op() -> Callable | None:
    op = (
        getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    )
    return op if op is not None and torch.backends.mkldnn.enabled else None


def onednn_linear_pays() -> bool:
    """Whether fp32 training products on the CPU go through oneDNN (`OneDnnLinear`): ONEDNN_LINEAR or the
    environment variable TFORMER_ONEDNN_LINEAR where set, else on CPUs whose torch kernels use AVX512
    (`torch.backends.cpu.get_cpu_capability()`), and only where torch has oneDNN enabled.

    Why by the CPU and not timed as `row_blocking_pays` times the decoding layout: the choice sets the
    summation order of every training product, so a run resumed in another process must make the same
    choice to continue bit for bit, which a timing on a noisy machine would not guarantee. Measured
    (docs/performance.md): on an AMD EPYC with AVX512-BF16, MKL's fp32 GEMMs of the benchmark models'
    forward and input-gradient shapes ran at 157-198 GFLOP/s and oneDNN's at 204-215 (its weight
    gradients ran slower there, so those stay MKL products); the encoder-decoder's fp32 training step
    1.17x faster. On an AVX2-only AMD EPYC oneDNN was not consistently faster, so it stays off there.
    """
    if _onednn_op() is None:
        return False
    if ONEDNN_LINEAR is not None:
        return ONEDNN_LINEAR
    value = os.environ.get(ENV_ONEDNN_LINEAR, "auto").strip().lower()
    if value in ("1", "0"):
        return value == "1"
    if value != "auto":
        raise ValueError(f"{ENV_ONEDNN_LINEAR}={value!r}: use 1 (oneDNN), 0 (F.linear) or auto (by the CPU)")
    return _avx512_kernels()


@cache
def _avx512_kernels() -> bool:
    """Whether torch's CPU kernels use AVX512 here (read once: `onednn_linear_pays` asks at every product)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


class OneDnnLinear(torch.autograd.Function):
    """F.linear(x, weight, bias) with the forward and x's gradient as oneDNN products
    (`torch.ops.mkldnn._linear_pointwise`, the kernel torch's own compiler emits for CPU linear layers)
    and the weight's gradient as an MKL product (dY^T x), for fp32 CPU tensors. x (..., D_in), weight
    (D_out, D_in), bias (D_out) or None. Same sums as F.linear up to their order (rounding only);
    saves x and weight for backward, as F.linear's graph does."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        op = _onednn_op()
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = op(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), bias, "none", [], "")
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _onednn_op()(dy2, weight.t(), None, "none", [], "").view(x.shape)
        if ctx.needs_input_grad[1]:
            dw = dy2.t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def takes_onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether `apply_linear` computes this product with `OneDnnLinear`: a graph is recorded, every tensor is a
    plain fp32 CPU tensor (no DTensor shard, no autocast, not under torch.compile, whose own CPU
    lowering picks kernels), x has at least ONEDNN_MIN_ROWS rows, and `onednn_linear_pays()`."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if x.dim() < 2 or x.numel() < ONEDNN_MIN_ROWS * x.shape[-1] or not records_graph(x, weight, bias):
        return False
    if any(t is not None and type(t) not in (Tensor, nn.Parameter) for t in (x, weight, bias)):
        return False
    if autocast_enabled("cpu") or torch.compiler.is_compiling():
        return False
    return onednn_linear_pays()


def _plain_call(layer: nn.Module) -> bool:
    """Whether calling `layer` runs nn.Linear.forward and nothing else: an `nn.Linear` (not a subclass,
    such as a quantized layer), no forward set on the instance (the decoding contexts patch one), no
    hooks of its own or global ones."""
    if type(layer) is not nn.Linear or "forward" in layer.__dict__:
        return False
    if layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks or layer._backward_pre_hooks:
        return False
    hooks = torch.nn.modules.module
    return not (
        hooks._global_forward_hooks
        or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks
    )


def apply_linear(layer: nn.Module, x: Tensor) -> Tensor:
    """layer(x); for a plain `nn.Linear` whose product `takes_onednn`, that product through `OneDnnLinear`
    (the layers stay `nn.Linear` modules: quantization, tensor parallelism, hooks and the decoding
    contexts see them as before and take the module call)."""
    if _plain_call(layer) and takes_onednn(x, layer.weight, layer.bias):
        return OneDnnLinear.apply(x, layer.weight, layer.bias)
    return layer(x)
