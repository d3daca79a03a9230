"""The MoE layer's grouped-matmul kernels: the loop, split and grouped_mm kernels against a row-by-row
reference, the loop kernel's reduced-precision windows and pieces, its autocast and no-graph paths, and the
CPU decoding kernel. The layer itself: test_moe.py."""

from __future__ import annotations

import contextlib
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer.model import grouped_linear as kernels
from tformer.model import moe as moe_module
from tformer.model.grouped_linear import loop_grouped_linear, split_grouped_linear, torch_grouped_linear
from tformer.model.linear import row_blocked_linears
from tformer.model.moe import MoE

from .helpers import moe_cfg


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("row_blocked", [False, True], ids=["gemm", "row-blocked"])
def test_grouped_matmul_kernels_agree(bias: bool, row_blocked: bool, count_calls) -> None:
    """row-blocked: the loop kernel's few-row (decoding) path, taken by every expert inside the decoding
    context (counted), never outside it."""
    calls = count_calls(kernels, "row_blocked_linear")
    decoding = (
        partial(row_blocked_linears, nn.Sequential(), min_weight=0) if row_blocked else contextlib.nullcontext
    )
    counts = [3, 0, 5, 1, 0]
    w = torch.randn(5, 8, 12, requires_grad=True)
    b = torch.randn(5, 8, requires_grad=True) if bias else None
    x = torch.randn(sum(counts), 12, requires_grad=True)
    g = torch.randn(sum(counts), 8)
    rows = torch.repeat_interleave(torch.arange(5), torch.tensor(counts))
    results = []
    for kernel in (loop_grouped_linear, split_grouped_linear, torch_grouped_linear, None):
        leaves = [t for t in (x, w, b) if t is not None]
        for t in leaves:
            t.grad = None
        if kernel is None:  # reference: row by row
            y = torch.stack([F.linear(x[i], w[e], None if b is None else b[e]) for i, e in enumerate(rows)])
        else:
            with decoding():
                y = kernel(x, w, b, counts)
        (y * g).sum().backward()
        results.append([y.detach()] + [t.grad.clone() for t in leaves])
    assert len(calls) == (3 if row_blocked else 0)  # the loop kernel's 3 experts with rows
    for got in results[:3]:
        for a, ref in zip(got, results[3]):
            torch.testing.assert_close(a, ref)


def test_row_pieces_bound_the_shapes_that_reduced_precision_products_ask_for() -> None:
    """fp32 rows run whole; bf16 / fp16 rows on the CPU in a multiple of ROW_QUANTUM and the rest, so every
    row count up to 2,048 needs at most 2,048 / Q + Q - 1 product shapes (oneDNN compiles one per shape)."""
    q = kernels.ROW_QUANTUM
    pieces = kernels.row_pieces
    assert pieces(2 * q + 5, torch.empty(0)) == (slice(0, 2 * q + 5),)
    bf16 = torch.empty(0, dtype=torch.bfloat16)
    assert pieces(2 * q + 5, bf16) == (slice(0, 2 * q), slice(2 * q, 2 * q + 5))
    assert pieces(2 * q, bf16) == (slice(0, 2 * q),) and pieces(q - 1, bf16) == (slice(0, q - 1),)
    assert pieces(q + 1, torch.empty(0, dtype=torch.float16)) == (slice(0, q), slice(q, q + 1))
    lengths = set()
    for n in range(1, 2049):
        got = pieces(n, bf16)
        assert (
            got[0].start == 0 and got[-1].stop == n and all(a.stop == b.start for a, b in zip(got, got[1:]))
        )
        lengths.update(s.stop - s.start for s in got)
    assert len(lengths) <= 2048 // q + q - 1


@pytest.mark.parametrize("bias", [False, True])
def test_loop_kernel_in_bf16_multiplies_in_windows_and_pieces_and_equals_the_products_in_float64(
    bias: bool,
) -> None:
    """Under bf16 the loop kernel's forward and input-gradient products take each expert's rows as one
    window of a multiple of ROW_QUANTUM rows running into the next experts' rows (pieces for the last
    expert, whose window would pass the end), its weight-gradient products the expert's own rows in pieces
    (shapes recorded); output and gradients equal float64 products of the same bf16 values to bf16
    rounding, so no window's spill is left in another expert's rows (the weight gradient adds its pieces'
    products in bf16)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    q = kernels.ROW_QUANTUM
    counts = [2 * q + 7, 0, q, 5, q + 1]
    torch.manual_seed(0)
    w = torch.randn(5, 24, 40).bfloat16().requires_grad_()
    b = torch.randn(5, 24).bfloat16().requires_grad_() if bias else None
    x = torch.randn(sum(counts), 40).bfloat16().requires_grad_()
    g = torch.randn(sum(counts), 24).bfloat16()

    class Sizes(TorchDispatchMode):
        """The sizes of every product's first operand: rows (forward, input gradient) or reduction
        length (weight gradient), beside the widths 24 and 40."""

        seen: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
                self.seen.update(args[0 if func.overloadpacket is torch.ops.aten.mm else 1].shape)
            return func(*args, **(kwargs or {}))

    # rows start at 0, 2q + 7, 3q + 7, 3q + 12 of 4q + 13: windows of 3q, q, q, and the last expert's q + 1
    # rows in pieces of q and 1; the weight gradients' pieces of the experts' own rows 2q + 7, q, 5, q + 1
    windows, pieces = {3 * q, q, 1}, {2 * q, 7, q, 5, 1}
    with torch.no_grad(), Sizes():  # without a graph the forward's products run here, not in a custom op
        loop_grouped_linear(x, w, b, counts)
    assert Sizes.seen - {24, 40} == windows
    Sizes.seen = set()
    y = loop_grouped_linear(x, w, b, counts)
    with Sizes():  # the backward's input- and weight-gradient products
        y.backward(g)
    assert Sizes.seen - {24, 40} == windows | pieces
    rows = torch.repeat_interleave(torch.arange(5), torch.tensor(counts))
    x64, w64, g64 = x.detach().double(), w.detach().double(), g.double()
    ref = torch.einsum("nd,nod->no", x64, w64[rows]) + (0 if b is None else b.detach().double()[rows])
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-1)
    torch.testing.assert_close(
        x.grad.double(), torch.einsum("no,nod->nd", g64, w64[rows]), rtol=1e-2, atol=1e-1
    )
    dw = torch.zeros_like(w64).index_add_(0, rows, g64[:, :, None] * x64[:, None, :])
    torch.testing.assert_close(w.grad.double(), dw, rtol=1e-2, atol=2e-1)
    if b is not None:
        torch.testing.assert_close(b.grad.double(), torch.zeros(5, 24, dtype=torch.float64).index_add_(0, rows, g64),
                                   rtol=1e-2, atol=1e-1)  # fmt: skip


def test_grouped_linear_under_autocast_casts_except_few_rows_without_a_graph() -> None:
    """Under bf16 autocast the experts' products run in bf16 (as F.linear would), except for at most
    DECODE_MAX_ROWS rows without a graph (decoding), which multiply in the weights' fp32 without casting
    every expert's weights: equal to the fp32 products. Without autocast, bf16 rows cast the weights."""
    from tformer.model.linear import DECODE_MAX_ROWS
    from tformer.model.moe import grouped_linear

    torch.manual_seed(0)
    w, b = torch.randn(4, 8, 16, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    counts = [3, 0, 2, 3]
    x = torch.randn(sum(counts), 16)
    fp32 = loop_grouped_linear(x, w, b, counts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            few = grouped_linear(x, w, b, counts)
            many_counts = [DECODE_MAX_ROWS, 0, 1, 0]
            many = grouped_linear(torch.randn(DECODE_MAX_ROWS + 1, 16), w, b, many_counts)
        trained = grouped_linear(x, w, b, counts)
    assert few.dtype == torch.float32
    torch.testing.assert_close(few, fp32.detach(), rtol=1e-6, atol=1e-6)
    assert many.dtype == torch.bfloat16 and trained.dtype == torch.bfloat16
    with torch.no_grad():
        assert grouped_linear(x.bfloat16(), w, b, counts).dtype == torch.bfloat16  # no autocast: x's dtype
    torch.testing.assert_close(trained.float(), fp32, rtol=2e-2, atol=1e-1)


@pytest.mark.parametrize("bias", [False, True])
def test_loop_kernel_without_autograd_skips_the_function_and_equals_its_autograd_twin(
    bias: bool, count_calls
) -> None:
    """Inference (no_grad / inference_mode) runs the loop kernel's products without the autograd
    Function (its per-call cost shows in decoding): same values, no graph."""
    applied = count_calls(kernels.LoopGroupedLinear, "apply")
    torch.manual_seed(0)
    counts = [0, 2, 0, 0, 1, 0, 3]
    w = torch.randn(7, 8, 12, requires_grad=True)
    b = torch.randn(7, 8, requires_grad=True) if bias else None
    x = torch.randn(sum(counts), 12)
    with_graph = loop_grouped_linear(x, w, b, counts)
    assert with_graph.grad_fn is not None
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            without = loop_grouped_linear(x, w, b, counts)
        assert without.grad_fn is None and torch.equal(without, with_graph.detach())
    assert len(applied) == 1  # the call with gradients only


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without F.grouped_mm keeps the loop")
def test_cpu_decode_kernel_for_a_few_rows_without_a_graph_or_row_blocks() -> None:
    """torch's grouped_mm for <= DECODE_MAX_ROWS rows without a graph, outside the row-blocked decoding
    products and with rows of a multiple of 16 bytes; the loop kernel for everything else."""
    w = torch.randn(4, 8, 12)
    few, many = torch.randn(64, 12), torch.randn(65, 12)
    pick = kernels.pick_grouped_kernel
    assert kernels.CPU_DECODE_KERNEL == "grouped_mm" and kernels.CPU_KERNEL == "loop"
    assert pick(few, w) == "grouped_mm"
    assert pick(many, w) == "loop"
    assert pick(few.requires_grad_(), w) == "loop"  # training: the loop kernel's Function
    with torch.no_grad():
        assert pick(few, w) == "grouped_mm"
        assert pick(torch.randn(3, 7), torch.randn(4, 8, 7)) == "loop"  # 28-byte rows: grouped_mm refuses
        assert pick(torch.randn(3, 12, dtype=torch.bfloat16), w.bfloat16()) == "loop"  # 24-byte rows
        assert pick(torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(4, 8, 8).bfloat16()) == "grouped_mm"
        with row_blocked_linears(nn.Sequential(), min_weight=0):
            assert pick(few, w) == "loop"  # the loop kernel's row-blocked products


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without F.grouped_mm keeps the loop")
def test_a_decoding_sized_moe_forward_through_grouped_mm_equals_the_loop(monkeypatch) -> None:
    """An MoE layer on 8 tokens without gradients runs its expert products through grouped_mm (counted),
    with the output of the loop kernel."""
    calls = []
    kernel = kernels.GROUPED_LINEAR_KERNELS["grouped_mm"]
    monkeypatch.setitem(
        kernels.GROUPED_LINEAR_KERNELS, "grouped_mm", lambda *a: calls.append(1) or kernel(*a)
    )
    torch.manual_seed(0)
    moe = MoE(moe_cfg(n_experts=4, top_k=2, n_shared=1, d_shared=16), 0).eval()
    x = torch.randn(1, 8, moe.router.weight.shape[1])
    with torch.no_grad():
        fast = moe(x)
        assert len(calls) == 3  # gate, up and down products
        default, kernels.CPU_DECODE_KERNEL = kernels.CPU_DECODE_KERNEL, "loop"
        try:
            slow = moe(x)
        finally:
            kernels.CPU_DECODE_KERNEL = default
    assert len(calls) == 3
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)


def test_a_float64_moe_model_takes_the_loop_kernel_and_decodes() -> None:
    """grouped_mm takes bf16, fp16 and fp32 only: float64 rows take the loop kernel (few decoding rows
    on the CPU had been sent to grouped_mm, which raised), and a float64 MoE model's greedy tokens equal
    its full forward's argmax."""
    from tformer import build_model
    from tformer.generate.engine import generate
    from tformer.generate.sampling import SamplingConfig
    from tformer.presets import tiny

    x, w = torch.randn(4, 16, dtype=torch.float64), torch.randn(3, 8, 16, dtype=torch.float64)
    assert kernels.pick_grouped_kernel(x, w) == kernels.CPU_KERNEL
    assert kernels.pick_grouped_kernel(x.float(), w.float()) == kernels.CPU_DECODE_KERNEL
    torch.manual_seed(0)
    model = build_model(tiny().replace(moe=moe_module.MoEConfig(n_experts=4, top_k=2))).double().eval()
    new = generate(model, [[5, 17, 33]], SamplingConfig(temperature=0.0, max_new_tokens=6))[0]
    seq = [5, 17, 33]
    with torch.no_grad():
        for token in new:
            assert int(model(torch.tensor([seq]))[0, -1].argmax()) == token
            seq.append(token)


@pytest.mark.parametrize("bias", [False, True])
def test_rows_per_expert_as_a_device_tensor_give_the_products_of_the_list(bias: bool) -> None:
    """The GPU dispatch keeps the rows per expert as a tensor (`DEVICE_COUNTS`): grouped_mm makes its
    offsets from it, `grouped_linear` reads `DeviceCounts`' list, once, for the other kernels (the loop
    kernel here); outputs and gradients equal those of the list. On the CPU the dispatch hands the kernels
    a list."""
    counts = [3, 0, 5, 1, 0, 7]
    torch.manual_seed(0)
    w = torch.randn(6, 8, 16, requires_grad=True)
    b = torch.randn(6, 8, requires_grad=True) if bias else None
    x = torch.randn(sum(counts), 16, requires_grad=True)
    g = torch.randn(sum(counts), 8)
    leaves = [t for t in (x, w, b) if t is not None]
    results = []
    tensor_kernels = [(torch_grouped_linear, torch.tensor)] if hasattr(F, "grouped_mm") else []
    held = kernels.DeviceCounts(torch.tensor(counts))
    for kernel, on_device in [*tensor_kernels, (kernels.grouped_linear, lambda _: held)]:
        for given in (counts, on_device(counts)):
            for t in leaves:
                t.grad = None
            y = kernel(x, w, b, given)
            (y * g).sum().backward()
            results.append([y.detach()] + [t.grad.clone() for t in leaves])
    for got in results[1:]:
        for a, ref in zip(got, results[0]):
            torch.testing.assert_close(a, ref)
    assert held.as_list() == counts and held.as_list() is held.as_list()  # read from the tensor once
    assert moe_module.host_or_device(torch.tensor(counts)) == counts  # a CPU tensor: a list
