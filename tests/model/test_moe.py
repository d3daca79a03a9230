"""MoE layer: dense equivalence, grouped == loop parity and the grouped kernels, shared experts, sizes,
MoE inside every architecture, and parity with Hugging Face's MoE blocks (RELIABILITY section E).
Routing, balance losses, the auxiliary-loss-free bias, capacity and statistics: test_moe_routing.py."""

from __future__ import annotations

import contextlib
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer import ConfigError, ModelConfig, MoEConfig
from tformer.model import moe as moe_module
from tformer.model.ffn import make_dense_ffn
from tformer.model.linear import row_blocked_linears
from tformer.model.moe import (
    MoE,
    loop_grouped_linear,
    moe_aux_loss,
    moe_routing_stats,
    split_grouped_linear,
    torch_grouped_linear,
    update_expert_biases,
)
from tformer.model.stats import count_params, fine_grained, flops_per_token
from tformer.presets import tiny

from .helpers import make, moe_cfg, rand_tokens


def twins(cfg: ModelConfig) -> tuple[MoE, MoE]:
    """The same weights behind the grouped fast path and the loop reference."""
    fast = MoE(cfg.replace(moe=cfg.moe.replace(dispatch="grouped")), 0)
    slow = MoE(cfg.replace(moe=cfg.moe.replace(dispatch="loop")), 0)
    slow.load_state_dict(fast.state_dict())
    return fast, slow


# ----------------------------------------------------------------------------- equivalences
@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("ffn", ["relu", "gelu", "swiglu"])
def test_one_expert_top1_equals_dense_ffn(ffn: str, bias: bool, dispatch: str) -> None:
    moe = MoE(moe_cfg(ffn, bias, n_experts=1, top_k=1, dispatch=dispatch), 0)
    dense = make_dense_ffn(ffn, 16, 24, bias)
    with torch.no_grad():
        for name in moe.experts.projections:
            getattr(moe.experts, name)[0].copy_(getattr(dense, name).weight)
            if bias:
                getattr(moe.experts, f"{name}_bias")[0].copy_(getattr(dense, name).bias)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(moe(x), dense(x))


PARITY = {
    "swiglu-shared-top2": dict(n_experts=6, top_k=2, n_shared=2, d_shared=8, z_loss_coef=0.1),
    "relu-bias-capacity": dict(n_experts=5, top_k=2, capacity_factor=0.5, seq_aux_loss_coef=0.1),
    "gelu-sigmoid-groups": dict(
        n_experts=8,
        top_k=3,
        score_func="sigmoid",
        n_group=4,
        topk_group=2,
        group_score="top2",
        routed_scaling=2.5,
        device_loss_coef=0.1,
        n_devices=2,
    ),
    "swiglu-top1-idle-expert": dict(n_experts=4, top_k=1, jitter=0.1),
}


@pytest.mark.parametrize("case", sorted(PARITY))
def test_grouped_dispatch_equals_loop_reference(case: str) -> None:
    ffn = case.split("-")[0]
    fast, slow = twins(moe_cfg(ffn, bias="bias" in case, **PARITY[case]))
    if "idle" in case:
        for m in (fast, slow):
            m.router.expert_bias[-1] = -100.0  # expert 3 gets no token
    x = torch.randn(3, 7, 16)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    grad = torch.randn(3, 7, 16)
    outs = []
    for m, x in zip((fast, slow), xs):
        torch.manual_seed(1)  # same jitter noise
        y = m.train()(x)
        ((y * grad).sum() + m.last_aux).backward()
        outs.append(y)
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(xs[0].grad, xs[1].grad)
    assert fast.last_stats["dropped"] == slow.last_stats["dropped"]
    for (name, p), q in zip(fast.named_parameters(), slow.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert fast.router.weight.grad.abs().sum() > 0
    if "idle" in case:  # no NaN, an exact zero gradient for the expert without tokens
        assert all(torch.isfinite(p.grad).all() for p in fast.parameters())
        assert fast.experts.gate_proj.grad[-1].abs().sum() == 0


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("row_blocked", [False, True], ids=["gemm", "row-blocked"])
def test_grouped_matmul_kernels_agree(bias: bool, row_blocked: bool, count_calls) -> None:
    """row-blocked: the loop kernel's few-row (decoding) path, taken by every expert inside the decoding
    context (counted), never outside it."""
    calls = count_calls(moe_module, "row_blocked_linear")
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
    q = moe_module.ROW_QUANTUM
    pieces = moe_module.row_pieces
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

    q = moe_module.ROW_QUANTUM
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
    applied = count_calls(moe_module.LoopGroupedLinear, "apply")
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
    pick = moe_module.pick_grouped_kernel
    assert moe_module.CPU_DECODE_KERNEL == "grouped_mm" and moe_module.CPU_KERNEL == "loop"
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
    kernel = moe_module.GROUPED_LINEAR_KERNELS["grouped_mm"]
    monkeypatch.setitem(
        moe_module.GROUPED_LINEAR_KERNELS, "grouped_mm", lambda *a: calls.append(1) or kernel(*a)
    )
    torch.manual_seed(0)
    moe = MoE(moe_cfg(n_experts=4, top_k=2, n_shared=1, d_shared=16), 0).eval()
    x = torch.randn(1, 8, moe.router.weight.shape[1])
    with torch.no_grad():
        fast = moe(x)
        assert len(calls) == 3  # gate, up and down products
        default, moe_module.CPU_DECODE_KERNEL = moe_module.CPU_DECODE_KERNEL, "loop"
        try:
            slow = moe(x)
        finally:
            moe_module.CPU_DECODE_KERNEL = default
    assert len(calls) == 3
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)


def test_shared_experts_reach_every_token_independent_of_routing() -> None:
    moe = MoE(moe_cfg(n_experts=4, top_k=2, n_shared=2, d_shared=8), 0).train()
    assert moe.shared.up_proj.out_features == 16  # 2 shared experts fused into one FFN
    with torch.no_grad():
        moe.experts.down_proj.zero_()
    x = torch.randn(2, 6, 16)
    y = moe(x)
    torch.testing.assert_close(y, moe.shared(x))
    assert (y.abs().sum(-1) > 0).all()
    with torch.no_grad():
        moe.router.weight.normal_()
    torch.testing.assert_close(moe(x), y)
    moe(x).sum().backward()
    assert all(p.grad.abs().sum() > 0 for p in moe.shared.parameters())


def test_fused_shared_ffn_is_the_sum_of_its_experts() -> None:
    fused = make_dense_ffn("swiglu", 16, 2 * 8, bias=False)
    x = torch.randn(5, 16)
    parts = []
    for i in range(2):
        rows = slice(8 * i, 8 * (i + 1))
        h = F.silu(x @ fused.gate_proj.weight[rows].T) * (x @ fused.up_proj.weight[rows].T)
        parts.append(h @ fused.down_proj.weight[:, rows].T)
    torch.testing.assert_close(fused(x), parts[0] + parts[1])


# ----------------------------------------------------------------------------- sizes
def test_total_and_active_params() -> None:
    cfg = tiny().replace(moe=MoEConfig(n_experts=8, top_k=2, first_dense=1))
    experts = 8 * 3 * 64 * 128  # one MoE layer of 8 SwiGLU experts, width d_ff = 128
    counts = count_params(cfg)
    assert counts["total"] - counts["active"] == experts * 6 // 8
    assert counts["total"] == count_params(tiny())["total"] + experts - 3 * 64 * 128 + 8 * 64
    assert count_params(make(cfg)) == counts


def test_active_params_round_the_routed_share_exactly() -> None:
    """5 SwiGLU experts of width 8, top-4: the inactive part is exactly 1/5 of 5 * 3 * 64 * 8 = 7680, which
    floating point puts at 1535.9999999999995."""
    cfg = tiny().replace(moe=MoEConfig(n_experts=5, top_k=4, d_expert=8, first_dense=1))
    experts = 5 * 3 * 64 * 8  # one MoE layer
    counts = count_params(cfg)
    assert counts["total"] - counts["active"] == experts * (5 - 4) // 5


def test_total_params_count_tied_weights_once() -> None:
    """tiny(): a 128 x 64 embedding tied to the head, 2 layers of q, k, v, o (64 x 64), SwiGLU (3 x 64 x 128)
    and two RMSNorm weights, a final RMSNorm."""
    by_hand = 128 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert count_params(tiny())["total"] == by_hand
    moe = tiny().replace(moe=MoEConfig(n_experts=4, top_k=2, first_dense=1))
    assert count_params(moe)["total"] == by_hand - 3 * 64 * 128 + 4 * 3 * 64 * 128 + 4 * 64  # + router


def test_flops_per_token_by_hand() -> None:
    per_layer = 4 * 64 * 64 + 3 * 64 * 128  # q, k, v, o + SwiGLU
    matmul = 2 * per_layer + 128 * 64  # + lm_head
    assert flops_per_token(tiny(), 64) == 2 * matmul + 2 * 64 * 2 * 64 * 2
    assert flops_per_token(tiny(), 64, causal=True) == 2 * matmul + 64 * 2 * 64 * 2
    assert flops_per_token(make(tiny()), 64) == flops_per_token(tiny(), 64)
    # grouped-query attention: k/v projections shrink to n_kv_heads x head_dim, the score and value
    # products still run for every query head (d_model 64, 4 heads of 16, 1 kv head)
    gqa = tiny().replace(n_kv_heads=1)
    per_layer = 2 * 64 * 64 + 2 * 64 * 16 + 3 * 64 * 128  # q, o; k, v; SwiGLU
    matmul = 2 * per_layer + 128 * 64
    assert flops_per_token(gqa, 64) == 2 * matmul + 2 * 64 * 2 * 64 * 2
    # an encoder-decoder: only the decoder's self-attention is causal (the encoder's and the
    # cross-attention had been halved too)
    ed = tiny("encoder_decoder")
    attention = 2 * 64 * 2 * 64  # one attention layer, full
    assert flops_per_token(ed, 64) - flops_per_token(ed, 64, causal=True) == 0.5 * attention * ed.n_layers
    # biases are not products: one expert, top-1, equals the dense FFN whether or not layers have biases
    for bias in (False, True):
        dense = tiny().replace(bias=bias)
        one = dense.replace(moe=MoEConfig(n_experts=1, top_k=1, aux_loss_coef=0.0))
        router = 64 * 1 * dense.n_layers  # the router's d_model x n_experts product per layer
        assert flops_per_token(one, 64) - flops_per_token(dense, 64) == 2 * router, bias


@pytest.mark.parametrize("base", ["dense", "gshard"])
def test_fine_grained_keeps_active_params_and_flops(base: str) -> None:
    cfg = tiny() if base == "dense" else tiny().replace(moe=MoEConfig(n_experts=8, top_k=2))
    fg = fine_grained(cfg, m=4, n_shared=2)
    n, k = (1, 1) if base == "dense" else (8, 2)
    assert (fg.moe.n_experts, fg.moe.top_k, fg.moe.d_expert, fg.moe.n_shared) == (4 * n - 2, 4 * k - 2, 32, 2)
    router_growth = 2 * 64 * (fg.moe.n_experts - (0 if base == "dense" else n))  # 2 MoE layers
    a, b = count_params(cfg), count_params(fg)
    assert b["active"] - a["active"] == router_growth and b["total"] - a["total"] == router_growth
    assert flops_per_token(fg, 64) - flops_per_token(cfg, 64) == 2 * router_growth
    with pytest.raises(ConfigError, match="divide"):
        fine_grained(cfg, m=5, n_shared=1)


def test_fine_grained_refuses_what_it_cannot_segment() -> None:
    gshard = tiny().replace(moe=MoEConfig(n_experts=8, top_k=2))
    with pytest.raises(ConfigError, match=r"n_shared=8 must be in \[0, m \* top_k = 8\)"):
        fine_grained(gshard, m=4, n_shared=8)  # would leave top_k = 0
    with pytest.raises(ConfigError, match="already has shared experts"):
        fine_grained(gshard.replace(moe=gshard.moe.replace(n_shared=1)), m=2, n_shared=1)
    with pytest.raises(ConfigError, match="m=0 must be >= 1"):
        fine_grained(gshard, m=0, n_shared=0)


def test_config_checks_group_score() -> None:
    with pytest.raises(ConfigError, match="group_score"):
        MoEConfig(n_experts=4, n_group=4, topk_group=2, group_score="top2")


@pytest.mark.parametrize("name", ["capacity_factor", "eval_capacity_factor"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_config_checks_capacity_factors(name: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"MoEConfig.{name} must be a finite number"):
        MoEConfig(**{name: value})


# ----------------------------------------------------------------------------- inside the models
MODEL_MOE = MoEConfig(
    n_experts=4,
    top_k=2,
    d_expert=32,
    n_shared=1,
    first_dense=1,
    z_loss_coef=1e-3,
    seq_aux_loss_coef=1e-3,
    bias_update_rate=1e-3,
)


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
def test_moe_trains_inside_every_architecture(arch: str) -> None:
    cfg = tiny(arch).replace(moe=MODEL_MOE, **({"n_classes": 3} if arch == "encoder" else {}))
    model = make(cfg).train()
    tokens = rand_tokens(cfg, t=10)
    out = model(tokens, tokens.flip(1)) if arch == "encoder_decoder" else model(tokens)
    aux = moe_aux_loss(model)
    (out.float().square().mean() + aux).backward()
    assert aux.requires_grad and torch.isfinite(aux)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    stats = moe_routing_stats(model)
    expected = {
        "encoder_decoder": ["decoder.blocks.1.ffn", "encoder.blocks.1.ffn"],
        "encoder": ["encoder.blocks.1.ffn"],
        "decoder": ["blocks.1.ffn"],
    }[arch]
    assert sorted(stats) == expected
    update_expert_biases(model)
    assert all(name + ".router.expert_bias" in model.state_dict() for name in stats)


@pytest.mark.parametrize("capacity", [None, 0.5], ids=["dropless", "capacity-in-training"])
def test_kv_cache_decoding_equals_full_forward_with_moe_decoder(capacity: float | None) -> None:
    """With capacity_factor the limit applies to training forwards only: the full forward (many tokens)
    and the one-token decoding steps see the same dropless routing."""
    cfg = tiny().replace(moe=MODEL_MOE.replace(capacity_factor=capacity))
    model = make(cfg)
    tokens = rand_tokens(cfg, t=14)
    full = model(tokens)
    cache = model.new_cache(16)
    steps = [model(tokens[:, :6], cache=cache)] + [
        model(tokens[:, i : i + 1], cache=cache) for i in range(6, 14)
    ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_kv_cache_decoding_equals_full_forward_with_moe_encoder_decoder() -> None:
    cfg = tiny("encoder_decoder").replace(moe=MODEL_MOE.replace(dispatch="loop"))
    model = make(cfg)
    src, tgt = rand_tokens(cfg, t=9), rand_tokens(cfg, t=7)
    full = model(src, tgt)
    memory, cache = model.encode(src), model.new_cache(8)
    steps = [model.decode(tgt[:, :2], memory, cache=cache)]
    steps += [model.decode(tgt[:, i : i + 1], memory, cache=cache) for i in range(2, 7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- against Hugging Face
def copy_from_hf(ours: MoE, hf: nn.Module) -> None:
    """HF stores each expert's gate and up rows concatenated: gate_up_proj (E, 2F, D)."""
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        gate, up = hf.experts.gate_up_proj.chunk(2, dim=1)
        ours.experts.gate_proj.copy_(gate)
        ours.experts.up_proj.copy_(up)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        for name in ("gate_proj", "up_proj", "down_proj"):
            if hasattr(hf, "shared_experts"):
                getattr(ours.shared, name).weight.copy_(getattr(hf.shared_experts, name).weight)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("peer", ["mixtral", "deepseek_v3"])
def test_equals_hugging_face_moe_blocks(peer: str, impl: str) -> None:
    import transformers  # dev extra: a missing install fails here, never skips

    if peer == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        hf_cfg = transformers.MixtralConfig(
            hidden_size=16, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2
        )
        moe = MoEConfig(n_experts=6, top_k=2)
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block

        hf_cfg = transformers.DeepseekV3Config(
            hidden_size=16,
            moe_intermediate_size=24,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        )
        moe = MoEConfig(
            n_experts=8,
            top_k=3,
            n_shared=2,
            score_func="sigmoid",
            n_group=4,
            topk_group=2,
            group_score="top2",
            routed_scaling=2.5,
        )
    hf_cfg._experts_implementation = impl
    hf = Block(hf_cfg).eval()
    for p in hf.parameters():
        nn.init.normal_(p, std=0.3)
    ours = MoE(moe_cfg(d_ff=24, **{**moe.to_dict(), "aux_loss_coef": 0.0}), 0).eval()
    copy_from_hf(ours, hf)
    x = torch.randn(2, 9, 16)
    torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["encoder", "encoder_decoder"])
def test_padding_is_left_out_of_moe_routing(arch: str) -> None:
    """Padding had been routed like real tokens: it filled capacity slots ahead of later rows' real
    tokens, counted in the loads that drive the bias update, and entered the balance losses. With the
    same real tokens and 0, 8 or 24 padding positions after them, a training forward now gives the same
    outputs, counts, drops and balance losses (capacity factor 1; the Switch, sequence-wise and z terms on)."""
    moe = MoEConfig(n_experts=8, top_k=2, capacity_factor=1.0, aux_loss_coef=0.01, seq_aux_loss_coef=0.01,
                    z_loss_coef=0.001, bias_update_rate=1e-3)  # fmt: skip
    kind = {"encoder": ("encoder", dict(n_classes=2)), "encoder_decoder": ("encoder_decoder", {})}[arch]
    cfg = tiny(kind[0]).replace(moe=moe, dropout=0.0, max_seq_len=64, **kind[1])
    torch.manual_seed(0)
    model = make(cfg).train()
    real = torch.randint(4, cfg.vocab_size, (2, 8))
    results = []
    for n_pad in (0, 8, 24):
        ids = F.pad(real, (0, n_pad), value=0)
        mask = ids != 0
        for layer in model.modules():
            if hasattr(layer, "tokens_per_expert"):
                layer.tokens_per_expert.zero_()
        # encoder: (B, classes), mean pooling over the real tokens; encoder-decoder: the real target positions
        out = model(ids, mask) if arch == "encoder" else model(ids, ids, mask, mask)[:, :8]
        layers = [m for m in model.modules() if hasattr(m, "last_stats") and m.last_stats]
        results.append((out, [(m.last_stats["counts"].clone(), m.last_stats["dropped"].clone(), m.last_aux)
                              for m in layers]))  # fmt: skip
    (want, stats), others = results[0], results[1:]
    assert stats and any(int(d) > 0 for _, d, _ in stats)  # capacity 1 drops some real assignments
    for got, got_stats in others:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for (c, d, a), (c0, d0, a0) in zip(got_stats, stats):
            assert torch.equal(c, c0) and torch.equal(d, d0)
            torch.testing.assert_close(a, a0)


def test_a_forward_of_padding_alone_runs_the_moe_layer_on_no_token() -> None:
    """Every token padding: the layer still runs (on 0 tokens: an expert-parallel dispatch's collectives
    must run on every rank), outputs 0, and its balance loss and statistics are this forward's (0, no
    counts) instead of the last forward's, whose graph was gone."""
    cfg = tiny().replace(moe=MoEConfig(n_experts=4, top_k=2, aux_loss_coef=0.01, seq_aux_loss_coef=0.01))
    layer = MoE(cfg, 0).train()
    x = torch.randn(2, 5, cfg.d_model, requires_grad=True)
    layer(x).sum().backward()  # a forward with tokens: its aux loss's graph is freed by this backward
    out = layer(x, torch.zeros(2, 5, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))
    assert float(layer.last_aux) == 0.0 and int(layer.last_stats["counts"].sum()) == 0
    (out.sum() + layer.last_aux).backward()  # no stale graph
    layer(x, torch.zeros(2, 5, dtype=torch.bool))
    assert layer.last_aux.requires_grad  # in the router's graph, as the losses it stands for
    layer.last_aux.backward()  # so a backward of the balance loss alone runs on such a batch too


def test_a_model_that_has_trained_can_be_copied() -> None:
    """copy.deepcopy (and AveragedModel, which makes one) of an MoE model after a training forward had
    failed on the layers' last balance loss, a tensor inside the step's graph: the copy holds it detached,
    computes what the model computes, and the model keeps its own."""
    import copy

    from torch.optim.swa_utils import AveragedModel

    from tformer import build_model

    torch.manual_seed(0)
    model = build_model(tiny().replace(moe=MoEConfig(n_experts=4, top_k=2, aux_loss_coef=0.01)))
    x = torch.randint(0, 128, (2, 8))
    model(x).sum().backward()
    copied = copy.deepcopy(model)
    AveragedModel(model)
    layer, its_copy = model.blocks[1].ffn, copied.blocks[1].ffn
    assert layer.last_aux.grad_fn is not None and its_copy.last_aux.grad_fn is None
    assert torch.equal(layer.last_aux.detach(), its_copy.last_aux)
    assert its_copy.last_stats.keys() == layer.last_stats.keys()
    model.eval(), copied.eval()
    with torch.no_grad():
        assert torch.equal(model(x), copied(x))
