"""MoE layer: dense equivalence, grouped == loop parity, routing by hand, balance losses and their
channel to the trainer, auxiliary-loss-free bias, capacity, statistics, sizes, and MoE inside every
architecture (RELIABILITY section E)."""

from __future__ import annotations

import contextlib
import math
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
from tformer.model.router import (
    TopKRouter,
    device_balance_loss,
    load_balance_loss,
    router_z_loss,
    seq_balance_loss,
)
from tformer.model.stats import count_params, fine_grained, flops_per_token
from tformer.presets import tiny

from .helpers import make, rand_tokens

NO_LOSS = {"aux_loss_coef": 0.0}


def moe_cfg(ffn: str = "swiglu", bias: bool = False, d_model: int = 16, d_ff: int = 24, **moe) -> ModelConfig:
    return ModelConfig(d_model=d_model, d_ff=d_ff, n_heads=4, ffn=ffn, bias=bias, moe=MoEConfig(**moe))


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


# ----------------------------------------------------------------------------- routing by hand
def hand_router(values: list[float], **moe) -> tuple[TopKRouter, torch.Tensor]:
    """A router whose logits are `values` (identity centroids)."""
    e = len(values)
    router = TopKRouter(e, MoEConfig(n_experts=e, **moe))
    with torch.no_grad():
        router.weight.copy_(torch.eye(e))
    return router, torch.tensor([values])


@pytest.mark.parametrize(
    ("score_func", "probs", "norm", "scale", "idx", "weights"),
    [
        ("softmax", [0.1, 0.2, 0.3, 0.4], False, 1.0, [3, 2], [0.4, 0.3]),
        ("softmax", [0.1, 0.2, 0.3, 0.4], True, 1.0, [3, 2], [4 / 7, 3 / 7]),
        ("softmax", [0.1, 0.2, 0.3, 0.4], True, 2.5, [3, 2], [10 / 7, 7.5 / 7]),
        ("sigmoid", [0.5, 0.75, 0.25, 0.9], False, 1.0, [3, 1], [0.9, 0.75]),
        ("sigmoid", [0.5, 0.75, 0.25, 0.9], True, 2.5, [3, 1], [2.5 * 0.9 / 1.65, 2.5 * 0.75 / 1.65]),
    ],
)
def test_top_k_by_hand(score_func, probs, norm, scale, idx, weights) -> None:
    # softmax(log p) = p when sum(p) = 1; sigmoid(log(s / (1 - s))) = s
    logits = [math.log(p) if score_func == "softmax" else math.log(p / (1 - p)) for p in probs]
    router, x = hand_router(logits, top_k=2, score_func=score_func, norm_topk=norm, routed_scaling=scale)
    route = router(x)
    assert route.idx.tolist() == [idx]
    torch.testing.assert_close(route.weights, torch.tensor([weights]))


GROUP_PROBS = [0.30, 0.02, 0.20, 0.19, 0.22, 0.01, 0.04, 0.02]  # 4 groups of 2 experts


@pytest.mark.parametrize(
    ("groups", "idx"),
    [
        ({}, [0, 4, 2]),  # global top-3
        ({"group_score": "max"}, [0, 4, 1]),  # groups {0, 2} by best expert (DeepSeek-V2)
        ({"group_score": "top2"}, [0, 2, 3]),  # groups {1, 0} by best two summed (DeepSeek-V3)
    ],
)
def test_group_limited_routing_by_hand(groups: dict, idx: list[int]) -> None:
    limit = {"n_group": 4, "topk_group": 2, **groups} if groups else {}
    router, x = hand_router([math.log(p) for p in GROUP_PROBS], top_k=3, norm_topk=False, **limit)
    route = router(x)
    assert route.idx.tolist() == [idx]
    torch.testing.assert_close(route.weights, torch.tensor([[GROUP_PROBS[i] for i in idx]]))


def test_top1_keeps_the_router_gradient_and_centroids_are_the_weight() -> None:
    moe = MoE(moe_cfg(n_experts=4, top_k=1, norm_topk=True, **NO_LOSS), 0).train()
    assert moe.router.centroids is moe.router.weight and moe.router.centroids.shape == (4, 16)
    moe(torch.randn(2, 8, 16)).sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0  # top-1 weight is p, not p / p = 1


def test_router_is_fp32_under_bf16_autocast() -> None:
    moe = MoE(moe_cfg(n_experts=4, top_k=2, z_loss_coef=0.1), 0).train()
    x = torch.randn(2, 8, 16)
    ref = moe.router(x.view(-1, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        route = moe.router(x.view(-1, 16))
        y = moe(x)
        loss = y.float().sum() + moe.last_aux
    assert route.logits.dtype == route.weights.dtype == torch.float32
    torch.testing.assert_close(route.logits, ref.logits, rtol=0, atol=0)
    assert torch.equal(route.idx, ref.idx) and torch.isfinite(y).all()
    loss.backward()
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in moe.parameters())


def test_jitter_only_in_training() -> None:
    moe = MoE(moe_cfg(n_experts=4, top_k=2, jitter=0.5), 0)
    x = torch.randn(10, 16)
    assert not torch.equal(moe.train().router(x).logits, moe.router(x).logits)
    clean = F.linear(x, moe.router.weight)
    torch.testing.assert_close(moe.eval().router(x).logits, clean, rtol=0, atol=0)


# ----------------------------------------------------------------------------- balance losses
def test_balance_losses_equal_their_formulas() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]])
    idx = torch.tensor([[0], [0], [1], [2]])
    f, p = [2 / 4, 1 / 4, 1 / 4], [1.6 / 4, 1.5 / 4, 0.9 / 4]
    expected = 3 * sum(fi * pi for fi, pi in zip(f, p))
    torch.testing.assert_close(load_balance_loss(probs, idx), torch.tensor(expected))
    # per sequence (2 of 2 tokens): seq 0 is all on expert 0
    seq0 = 3 * (1.0 * 0.65)
    seq1 = 3 * (0.5 * 0.5 + 0.5 * 0.35)
    torch.testing.assert_close(seq_balance_loss(probs, idx, batch=2), torch.tensor((seq0 + seq1) / 2))
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    z = (math.log(math.exp(1) + math.exp(2) + math.exp(3)) ** 2 + math.log(3) ** 2) / 2
    torch.testing.assert_close(router_z_loss(logits), torch.tensor(z))
    probs4 = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]])
    idx4 = torch.tensor([[0, 1], [0, 2]])  # loads 2, 1, 1, 0 -> f_i = E * share = 2, 1, 1, 0
    f_dev, p_dev = [(2 + 1) / 2, (1 + 0) / 2], [0.5, 0.5]
    expected = sum(a * b for a, b in zip(f_dev, p_dev))
    torch.testing.assert_close(device_balance_loss(probs4, idx4, n_devices=2), torch.tensor(expected))


@pytest.mark.parametrize("k", [1, 2])
def test_balance_losses_are_one_at_uniform_routing_and_grow_with_collapse(k: int) -> None:
    """RELIABILITY E3: the Switch loss goes from ~1 (uniform) to E / k (collapsed on k experts)."""
    e, n = 4, 64
    base = torch.randn(n, e)
    values = []
    for sharpness in (0.0, 1.0, 3.0, 100.0):  # uniform ... collapsed onto experts 0..k-1
        logits = base * (sharpness > 0) + sharpness * torch.tensor([1.0] * k + [-1.0] * (e - k))
        probs = torch.softmax(logits, -1)
        idx = torch.arange(n * k).remainder(e).view(n, k) if sharpness == 0 else probs.topk(k, -1).indices
        losses = [
            load_balance_loss(probs, idx),
            seq_balance_loss(probs, idx, 4),
            device_balance_loss(probs, idx, 2),
        ]
        values.append(torch.stack(losses))
    torch.testing.assert_close(values[0], torch.ones(3))
    for a, b in zip(values, values[1:]):
        assert (b >= a - 1e-6).all()
    torch.testing.assert_close(values[-1][0], torch.tensor(e / k), atol=1e-3, rtol=0)


def test_aux_loss_is_averaged_over_layers_never_pooled() -> None:
    cfg = moe_cfg(n_experts=4, top_k=1, aux_loss_coef=0.5)
    layers = nn.ModuleList([MoE(cfg, 0), MoE(cfg, 1)]).train()
    with torch.no_grad():
        layers[1].router.weight[0] += 5.0 * torch.ones(16)  # layer 1 prefers expert 0
    x = torch.randn(2, 8, 16).abs()
    routes = []
    for layer in layers:
        layer(x)
        routes.append(layer.router(x.view(-1, 16)))
    per_layer = [load_balance_loss(r.scores, r.idx) for r in routes]
    pooled = load_balance_loss(torch.cat([r.scores for r in routes]), torch.cat([r.idx for r in routes]))
    torch.testing.assert_close(moe_aux_loss(layers), 0.5 * (per_layer[0] + per_layer[1]) / 2)
    assert not torch.allclose(moe_aux_loss(layers), 0.5 * pooled)


def test_z_loss_of_a_layer() -> None:
    moe = MoE(moe_cfg(n_experts=4, top_k=2, aux_loss_coef=0.0, z_loss_coef=0.3), 0).train()
    x = torch.randn(2, 5, 16)
    moe(x)
    torch.testing.assert_close(moe.last_aux, 0.3 * router_z_loss(moe.router(x.view(-1, 16)).logits))


def test_aux_loss_exactly_zero_without_coefficients_or_moe_layers() -> None:
    """RELIABILITY E9."""
    moe = MoE(moe_cfg(n_experts=4, top_k=2, **NO_LOSS), 0).train()
    moe(torch.randn(2, 5, 16))
    for model in (moe, make_dense_ffn("swiglu", 16, 24, False)):
        loss = moe_aux_loss(model)
        assert loss.item() == 0.0 and not loss.requires_grad and loss.grad_fn is None
    moe = MoE(moe_cfg(n_experts=4, top_k=2, z_loss_coef=1e-3, seq_aux_loss_coef=1e-3), 0).train()
    moe(torch.randn(2, 5, 16))
    loss = moe_aux_loss(moe)
    assert loss.requires_grad and torch.isfinite(loss) and loss > 0


# ----------------------------------------------------------------------------- aux-loss-free bias
def test_bias_update_moves_a_skewed_load_toward_uniform() -> None:
    moe = MoE(moe_cfg(n_experts=4, top_k=1, bias_update_rate=0.02, **NO_LOSS), 0).train()
    x = torch.randn(4, 32, 16)
    with torch.no_grad():
        moe.router.weight[0] = 0.5 * x.view(-1, 16).mean(0) / x.view(-1, 16).mean(0).norm() ** 2
        moe.router.weight[1:] *= 0.1
    moe(x)
    start = moe_routing_stats(moe)[""]["max_vio"]
    for _ in range(60):
        moe(x)
        update_expert_biases(moe)
    moe(x)
    assert start > 1.0 and moe_routing_stats(moe)[""]["max_vio"] < 0.5 * start
    assert moe.router.expert_bias[0] < 0 and moe.router.tokens_per_expert.sum() == 128


def test_bias_steers_selection_but_not_the_combination_weights() -> None:
    moe = MoE(moe_cfg(n_experts=4, top_k=2, norm_topk=False), 0)
    x = torch.randn(6, 16)
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 5.0]))
    route = moe.router(x)
    assert (route.idx.sort(-1).values == torch.tensor([2, 3])).all()
    torch.testing.assert_close(
        route.weights, torch.softmax(F.linear(x, moe.router.weight), -1).gather(-1, route.idx)
    )


def test_counters_change_only_in_training_forwards_and_live_in_the_checkpoint() -> None:
    moe = MoE(moe_cfg(n_experts=4, top_k=2, bias_update_rate=0.1), 0)
    x = torch.randn(2, 5, 16)
    moe.eval()(x)
    with torch.no_grad():
        moe.train()(x)
    assert moe.router.tokens_per_expert.sum() == 0 and moe.router.window_tokens.sum() == 0
    assert moe.last_stats == {} and moe_routing_stats(moe) == {}
    moe.train()(x)
    assert moe.router.tokens_per_expert.sum() == 2 * 5 * 2
    update_expert_biases(moe)
    assert moe.router.tokens_per_expert.sum() == 0 and moe.router.expert_bias.abs().sum() > 0
    state = moe.state_dict()
    assert {"router.expert_bias", "router.tokens_per_expert", "router.window_tokens"} <= set(state)
    other = MoE(moe_cfg(n_experts=4, top_k=2, bias_update_rate=0.1), 0)
    other.load_state_dict(state)
    assert torch.equal(other.router.expert_bias, moe.router.expert_bias)


# ----------------------------------------------------------------------------- capacity and statistics
@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
def test_capacity_overflow_drops_an_exact_count(dispatch: str) -> None:
    """RELIABILITY E5: 512 tokens, top-2 of 4 collapsed onto experts 0 and 1, cf 1.25 -> capacity
    ceil(1.25 * 512 * 2 / 4) = 320 per expert; 2 * (512 - 320) = 384 of 1024 assignments dropped."""
    moe = MoE(
        moe_cfg(d_model=8, n_experts=4, top_k=2, capacity_factor=1.25, n_shared=1, dispatch=dispatch), 0
    )
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))  # forced collapse
    x = torch.randn(2, 256, 8)
    y = moe.train()(x).view(512, 8)
    assert moe.dispatch.capacity.limit(512) == 320
    stats = moe_routing_stats(moe)[""]
    assert stats["dropped"] == 384 and stats["assignments"] == 1024
    assert (
        stats["load"] == [0.5, 0.5, 0.0, 0.0] and stats["max_vio"] == 1.0 and stats["dead_experts"] == [2, 3]
    )
    shared = moe.shared(x.view(512, 8))
    torch.testing.assert_close(y[320:], shared[320:])  # both experts full: residual + shared only
    assert not torch.allclose(y[:320], shared[:320])


def test_capacity_is_clamped_to_the_token_count_and_dropless_drops_nothing() -> None:
    """RELIABILITY E5 (clamp) and E6."""
    big = MoE(moe_cfg(n_experts=2, top_k=2, capacity_factor=10.0), 0)
    assert big.dispatch.capacity.limit(4) == 4
    moe = MoE(moe_cfg(n_experts=4, top_k=2), 0).train()
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    moe(torch.randn(2, 64, 16))
    assert moe_routing_stats(moe)[""]["dropped"] == 0


def test_routing_stats_entropy_and_window() -> None:
    moe = MoE(moe_cfg(n_experts=4, top_k=2), 0).train()
    with torch.no_grad():
        moe.router.weight.zero_()  # uniform probabilities: entropy log(4)
    moe(torch.randn(1, 6, 16))
    stats = moe_routing_stats(moe)
    assert math.isclose(stats[""]["entropy"], math.log(4), rel_tol=1e-6)
    assert stats[""]["window_tokens"] == 12 and moe.router.window_tokens.sum() == 0


def test_dead_experts_are_counted_over_the_whole_window() -> None:
    """RELIABILITY E4: an expert is dead only if it got no token in any step since the last report."""
    moe = MoE(moe_cfg(n_experts=4, top_k=2), 0).train()

    def step(bias: list[float]) -> None:
        with torch.no_grad():
            moe.router.expert_bias.copy_(torch.tensor(bias))
        moe(torch.randn(2, 8, 16))

    step([10.0, 10.0, 0.0, 0.0])  # experts 0, 1
    step([0.0, 0.0, 10.0, 10.0])  # experts 2, 3
    stats = moe_routing_stats(moe)[""]
    assert stats["dead_experts"] == [] and stats["window_tokens"] == 2 * 16 * 2
    step([10.0, 10.0, 0.0, 0.0])
    step([10.0, 0.0, 10.0, 0.0])
    stats = moe_routing_stats(moe)[""]
    assert stats["dead_experts"] == [3] and stats["window_tokens"] == 2 * 16 * 2


# ----------------------------------------------------------------------------- sizes
def test_total_and_active_params() -> None:
    cfg = tiny().replace(moe=MoEConfig(n_experts=8, top_k=2, first_dense=1))
    experts = 8 * 3 * 64 * 128  # one MoE layer of 8 SwiGLU experts, width d_ff = 128
    counts = count_params(cfg)
    assert counts["total"] - counts["active"] == experts * 6 // 8
    assert counts["total"] == count_params(tiny())["total"] + experts - 3 * 64 * 128 + 8 * 64
    assert count_params(make(cfg)) == counts


def test_flops_per_token_by_hand() -> None:
    per_layer = 4 * 64 * 64 + 3 * 64 * 128  # q, k, v, o + SwiGLU
    matmul = 2 * per_layer + 128 * 64  # + lm_head
    assert flops_per_token(tiny(), 64) == 2 * matmul + 2 * 64 * 2 * 64 * 2
    assert flops_per_token(tiny(), 64, causal=True) == 2 * matmul + 64 * 2 * 64 * 2
    assert flops_per_token(make(tiny()), 64) == flops_per_token(tiny(), 64)


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


def test_config_checks_group_score() -> None:
    with pytest.raises(ConfigError, match="group_score"):
        MoEConfig(n_experts=4, n_group=4, topk_group=2, group_score="top2")


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
    cfg = tiny(arch).replace(moe=MODEL_MOE, n_classes=3)
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


def test_kv_cache_decoding_equals_full_forward_with_moe_decoder() -> None:
    cfg = tiny().replace(moe=MODEL_MOE)
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
