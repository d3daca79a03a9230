"""MoE routing and balancing: top-k routing by hand, balance losses and their channel to the trainer,
the auxiliary-loss-free bias, capacity and routing statistics (RELIABILITY section E)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer import MoEConfig
from tformer.model.ffn import make_dense_ffn
from tformer.model.moe import Capacity, MoE, moe_aux_loss, moe_routing_stats, update_expert_biases
from tformer.model.router import (
    Segments,
    TopKRouter,
    device_balance_loss,
    load_balance_loss,
    router_z_loss,
    seq_balance_loss,
)

from .helpers import NO_LOSS, moe_cfg


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


def test_jitter_is_drawn_in_fp32_for_bf16_inputs() -> None:
    """U(1 - eps, 1 + eps) around 1 for a bf16 model too: drawn in bf16 the factor had come out of four
    values, never above 1 (a one-sided, biased noise)."""
    router = MoE(moe_cfg(n_experts=4, top_k=2, jitter=0.01), 0).router.train()
    router.weight.data = torch.eye(4, 16)
    x = torch.ones(50_000, 16, dtype=torch.bfloat16)
    factor = router(x).logits[:, 0]  # x * U, one draw per element
    assert factor.dtype == torch.float32 and factor.unique().numel() > 1000
    assert factor.max() > 1.005 and factor.min() < 0.995 and abs(factor.mean().item() - 1) < 5e-4


def test_sigmoid_scores_that_underflow_give_finite_balance_loss_and_entropy() -> None:
    moe = MoE(moe_cfg(n_experts=4, top_k=2, score_func="sigmoid", aux_loss_coef=0.01), 0).train()
    moe.router.weight.data = torch.full((4, 16), -10.0)  # logits -160: sigmoid underflows to 0 in fp32
    x = torch.ones(1, 6, 16)
    assert moe.router(x[0]).scores.max() == 0
    moe(x)
    assert torch.isfinite(moe.last_aux) and moe.last_stats["entropy"] == 0


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
    torch.testing.assert_close(seq_balance_loss(probs, idx, groups=2), torch.tensor((seq0 + seq1) / 2))
    # sequences of other lengths (padding left out): given as segment ids, the same formula per sequence
    same = seq_balance_loss(probs, idx, Segments(torch.tensor([0, 0, 1, 1]), 2))
    torch.testing.assert_close(same, torch.tensor((seq0 + seq1) / 2))
    short = 3 * (1.0 * 0.7)  # token 0 alone
    rest = 3 * (1 / 3 * 0.3 + 1 / 3 * (1.3 / 3) + 1 / 3 * (0.8 / 3))  # tokens 1-3: experts 0, 1, 2
    uneven = seq_balance_loss(probs, idx, Segments(torch.tensor([0, 2, 2, 2]), 3))  # sequence 1 empty
    torch.testing.assert_close(uneven, torch.tensor((short + rest) / 2))
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


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("term", ["aux_loss_coef", "seq_aux_loss_coef", "device_loss_coef"])
def test_a_layers_balance_loss_is_its_term_on_normalised_scores_per_sequence(
    score_func: str, term: str
) -> None:
    """The layer feeds each balance term the router's scores normalised to sum 1 (sigmoid scores do not),
    and the sequence-wise term the layer's B sequences (not the batch as one sequence)."""
    torch.manual_seed(0)
    coefs = {"aux_loss_coef": 0.0} | {term: 0.3}
    cfg = moe_cfg(n_experts=4, top_k=2, score_func=score_func, n_devices=2, **coefs)
    moe = MoE(cfg, 0).train()
    x = torch.randn(2, 6, 16)
    moe(x)
    route = moe.router(x.view(-1, 16))
    probs = route.scores / route.scores.sum(-1, keepdim=True)  # (N, E)
    formulas = {
        "aux_loss_coef": lambda p: load_balance_loss(p, route.idx),
        "seq_aux_loss_coef": lambda p: seq_balance_loss(p, route.idx, 2),
        "device_loss_coef": lambda p: device_balance_loss(p, route.idx, 2),
    }
    torch.testing.assert_close(moe.last_aux, 0.3 * formulas[term](probs))
    if score_func == "sigmoid":  # unnormalised scores would give another value
        assert not torch.isclose(formulas[term](probs), formulas[term](route.scores))
    if term == "seq_aux_loss_coef":  # the two sequences route differently: one sequence of 12 differs
        assert not torch.isclose(formulas[term](probs), seq_balance_loss(probs, route.idx, 1))


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
    first = moe.router(x.view(512, 8)).idx[:, 0]
    assert max(int((first == 0).sum()), int((first == 1).sum())) <= 320
    shared = moe.shared(x.view(512, 8))
    kept = ~torch.isclose(y, shared).all(dim=1)  # a token some expert served
    assert kept.all()  # first choices before second ones: every token keeps its first choice


@pytest.mark.parametrize("n_shared", [1, 0])
@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
def test_a_token_every_expert_dropped_passes_on_the_shared_experts_output_alone(
    dispatch: str, n_shared: int
) -> None:
    """RELIABILITY E5: a token whose every assignment overflowed gets no routed output: the shared experts'
    output alone (0 without shared experts, so the block's residual carries it on unchanged)."""
    moe = MoE(
        moe_cfg(d_model=8, n_experts=4, top_k=2, capacity_factor=0.25, n_shared=n_shared, dispatch=dispatch),
        0,
    )
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))  # every token onto experts 0, 1
    x = torch.randn(1, 64, 8)
    y = moe.train()(x).view(64, 8)
    cap = moe.dispatch.capacity.limit(64)  # ceil(0.25 * 64 * 2 / 4) = 8 slots per expert
    base = moe.shared(x.view(64, 8)) if n_shared else torch.zeros(64, 8)
    served = ~torch.isclose(y, base, rtol=0, atol=1e-7).all(dim=1)
    assert cap == 8 and int(served.sum()) == 2 * cap  # 16 tokens kept their first choice, 48 lost both
    assert torch.equal(y[~served], base[~served])
    assert moe_routing_stats(moe)[""]["dropped"] == 128 - 2 * cap


@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
def test_capacity_keeps_first_choices_before_second_ones(dispatch: str) -> None:
    """GShard's priority: expert 0 is token 0's second choice and tokens 1-3's first; with 2 slots it
    keeps tokens 1 and 2 (first choices, token order), not token 0's second choice."""
    cap = Capacity(MoEConfig(n_experts=4, top_k=2, capacity_factor=1.0)).train()
    idx = torch.tensor([[1, 0], [0, 2], [0, 3], [0, 1]])  # (N=4, K=2), best first
    flat = idx.flatten()
    order = cap.sort(idx)
    assert [(int(a) // 2, int(a) % 2) for a in order if flat[a] == 0] == [(1, 0), (2, 0), (3, 0), (0, 1)]
    kept, counts, dropped = cap.trim(order, flat[order], torch.bincount(flat, minlength=4), 4)
    assert cap.limit(4) == 2 and int(dropped) == 2 and counts.tolist() == [2, 2, 1, 1]
    assert [(int(a) // 2, int(a) % 2) for a in kept if flat[a] == 0] == [(1, 0), (2, 0)]
    # the whole layer, both dispatches: token 0 loses its second choice (expert 0), token 3 its first
    # (expert 0's third first choice) and keeps its second (expert 1)
    values = [[0.0, 2.0, -9.0, -9.0], [2.0, -9.0, 1.0, -9.0], [2.0, -9.0, -9.0, 1.0], [2.0, 1.0, -9.0, -9.0]]
    moe = MoE(moe_cfg(d_model=4, n_experts=4, top_k=2, capacity_factor=1.0, dispatch=dispatch), 0).train()
    with torch.no_grad():
        moe.router.weight.copy_(torch.eye(4))
    x = torch.tensor(values)[None]  # logits = x (identity centroids)
    route = moe.router(x[0])
    assert route.idx.tolist() == idx.tolist()
    out, n_dropped = moe.dispatch(moe.experts, x[0], route)
    assert int(n_dropped) == 2
    for t, served in enumerate([[1], [0, 2], [0, 3], [1]]):
        expected = sum(
            moe.experts(x[0, t : t + 1], proj) * route.weights[t, list(route.idx[t]).index(e)]
            for e, proj in enumerate(moe.experts.per_expert())
            if e in served
        )
        torch.testing.assert_close(out[t : t + 1], expected)


def test_capacity_is_clamped_to_the_token_count_and_dropless_drops_nothing() -> None:
    """RELIABILITY E5 (clamp) and E6."""
    big = MoE(moe_cfg(n_experts=2, top_k=2, capacity_factor=10.0), 0)
    assert big.dispatch.capacity.limit(4) == 4
    moe = MoE(moe_cfg(n_experts=4, top_k=2), 0).train()
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    moe(torch.randn(2, 64, 16))
    assert moe_routing_stats(moe)[""]["dropped"] == 0


@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
def test_capacity_limits_training_forwards_and_eval_capacity_factor_eval_ones(dispatch: str) -> None:
    """capacity_factor 0.5 (48 tokens, top-2 of 4: 12 per expert) drops in training; an eval forward is
    dropless by default, so a sequence's output is the same alone or after two batchmates; with
    eval_capacity_factor it is limited too, and the last sequence loses to the earlier ones."""
    cfg = moe_cfg(d_model=8, n_experts=4, top_k=2, capacity_factor=0.5, dispatch=dispatch)
    moe = MoE(cfg, 0)
    x = torch.randn(3, 16, 8)
    moe.train()(x)
    assert moe.dispatch.capacity.limit(48) == 12 and moe_routing_stats(moe)[""]["dropped"] >= 48
    with torch.no_grad():
        moe.eval()
        assert moe.dispatch.capacity.limit(48) == 48
        torch.testing.assert_close(moe(x)[2:], moe(x[2:]))
        limited = MoE(cfg.replace(moe=cfg.moe.replace(eval_capacity_factor=0.5)), 0).eval()
        limited.load_state_dict(moe.state_dict())
        assert limited.dispatch.capacity.limit(48) == 12
        assert not torch.allclose(limited(x)[2:], limited(x[2:]))
        assert not torch.allclose(limited(x), moe(x))
    eval_only = MoE(moe_cfg(d_model=8, n_experts=4, top_k=2, eval_capacity_factor=0.5), 0)
    assert eval_only.train().dispatch.capacity.limit(48) == 48
    assert eval_only.eval().dispatch.capacity.limit(48) == 12


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


# ----------------------------------------------------------------------------- found by a mutation audit
def test_jitter_multiplies_the_router_input_by_uniform_noise() -> None:
    """Switch's jitter in training: x * U(1 - eps, 1 + eps), element by element. With identity centroids
    the logits are the jittered input, so logits / x lies in [1 - eps, 1 + eps] whatever x's size."""
    torch.manual_seed(0)
    router, _ = hand_router([0.0] * 4, top_k=2, jitter=0.2)
    x = torch.tensor([[0.01, -0.02, 5.0, -40.0]]).repeat(256, 1)
    ratio = router.train()(x).logits / x
    assert (ratio >= 0.8 - 1e-6).all() and (ratio <= 1.2 + 1e-6).all()
    assert ratio.min() < 0.85 and ratio.max() > 1.15  # the noise spans its range


@pytest.mark.parametrize(
    ("score_func", "probs"), [("softmax", [0.1, 0.2, 0.3, 0.4]), ("sigmoid", [0.5, 0.75, 0.25, 0.9])]
)
def test_top1_weight_is_the_chosen_score_times_the_scaling_even_with_norm_topk(score_func, probs) -> None:
    """norm_topk is for top_k > 1: at top-1 renormalising would make every weight 1 (p / p)."""
    logits = [math.log(p) if score_func == "softmax" else math.log(p / (1 - p)) for p in probs]
    router, x = hand_router(logits, top_k=1, score_func=score_func, norm_topk=True, routed_scaling=2.0)
    route = router(x)
    assert route.idx.tolist() == [[3]]
    torch.testing.assert_close(route.weights, torch.tensor([[2.0 * probs[3]]]))


def test_renormalised_weights_of_underflowing_sigmoid_scores_are_zero_not_nan() -> None:
    router, x = hand_router([-200.0, -300.0, -250.0, -400.0], top_k=2, score_func="sigmoid", norm_topk=True)
    route = router(x)
    assert route.scores.max() == 0  # every fp32 sigmoid score underflows
    assert torch.equal(route.weights, torch.zeros(1, 2))  # 0 / 0 taken as 0


def test_bias_update_follows_the_loads_summed_over_processes() -> None:
    """expert_bias_i += u * sign(mean load - load_i) over the loads of every process (all_reduce sums)."""
    moe = MoE(moe_cfg(n_experts=4, top_k=1, bias_update_rate=0.1, **NO_LOSS), 0)
    moe.router.tokens_per_expert.copy_(torch.tensor([5, 0, 0, 0]))  # this process: expert 0 the busiest
    other = torch.tensor([0.0, 0.0, 0.0, 20.0])  # another process: expert 3 far busier

    def all_reduce(t: torch.Tensor) -> None:
        t += other

    update_expert_biases(moe, all_reduce=all_reduce)
    total = torch.tensor([5.0, 0.0, 0.0, 20.0])
    torch.testing.assert_close(moe.router.expert_bias, 0.1 * torch.sign(total.mean() - total))
    assert moe.router.tokens_per_expert.sum() == 0


def test_routing_stats_window_is_summed_over_processes() -> None:
    moe = MoE(moe_cfg(n_experts=4, top_k=2), 0).train()
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))  # this process: experts 0, 1
    moe(torch.randn(1, 6, 16))
    other = torch.tensor([0, 0, 3, 0])  # another process sent 3 assignments to expert 2

    def all_reduce(t: torch.Tensor) -> None:
        t += other

    stats = moe_routing_stats(moe, all_reduce=all_reduce)[""]
    assert stats["dead_experts"] == [3] and stats["window_tokens"] == 6 * 2 + 3


def test_routing_stats_without_reset_keep_counting_the_window() -> None:
    moe = MoE(moe_cfg(n_experts=4, top_k=2), 0).train()
    x = torch.randn(1, 6, 16)
    moe(x)
    assert moe_routing_stats(moe, reset_window=False)[""]["window_tokens"] == 12
    assert moe.router.window_tokens.sum() == 12  # kept
    moe(x)
    assert moe_routing_stats(moe)[""]["window_tokens"] == 24  # both forwards
    assert moe.router.window_tokens.sum() == 0


def test_routing_entropy_is_that_of_the_normalised_sigmoid_scores() -> None:
    torch.manual_seed(0)
    moe = MoE(moe_cfg(n_experts=4, top_k=2, score_func="sigmoid"), 0).train()
    x = torch.randn(2, 6, 16)
    moe(x)
    scores = torch.sigmoid(x.view(-1, 16) @ moe.router.weight.detach().T)  # (N, E)
    p = scores / scores.sum(-1, keepdim=True)
    expected = -(p * p.log()).sum(-1).mean()
    assert math.isclose(moe_routing_stats(moe)[""]["entropy"], float(expected), rel_tol=1e-5)


def test_routing_entropy_counts_a_zero_probability_as_zero() -> None:
    """-sum p log p with 0 log 0 = 0: one expert takes all the probability (the others underflow to 0)."""
    moe = MoE(moe_cfg(n_experts=4, top_k=2), 0).train()
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 20.0  # logits 320, 0, 0, 0 for x of ones: softmax (1, 0, 0, 0) in fp32
    moe(torch.ones(1, 3, 16))
    assert moe_routing_stats(moe)[""]["entropy"] == 0.0


@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
def test_capacity_is_rounded_up(dispatch: str) -> None:
    """ceil(cf * N * K / E): cf 1.25, 10 tokens, top-2 of 4 -> ceil(6.25) = 7 per expert. Collapsed onto
    experts 0 and 1 (10 assignments each), 2 * (10 - 7) = 6 assignments are dropped."""
    moe = MoE(moe_cfg(d_model=8, n_experts=4, top_k=2, capacity_factor=1.25, dispatch=dispatch), 0)
    with torch.no_grad():
        moe.router.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    cap = math.ceil(1.25 * 10 * 2 / 4)
    assert moe.dispatch.capacity.limit(10) == cap
    moe.train()(torch.randn(1, 10, 8))
    assert moe_routing_stats(moe)[""]["dropped"] == 2 * (10 - cap)


@pytest.mark.parametrize(
    ("factor", "n", "k", "e", "cap"), [(1.1, 100, 1, 11, 10), (1.1, 45, 6, 11, 27), (2.2, 25, 2, 11, 10)]
)
def test_capacity_of_a_whole_number_of_slots_is_not_rounded_up_by_float_error(factor, n, k, e, cap) -> None:
    """cf * N * K / E in floats is 10.000000000000002 for 1.1 x 100 / 11 (ceil: 11); the factor is the
    decimal written, so the limit is 10; likewise 1.1 x 45 x 6 / 11 = 27 and 2.2 x 25 x 2 / 11 = 10."""
    assert math.ceil(factor * n * k / e) == cap + 1  # the float arithmetic these cases catch
    for training in (True, False):
        cfg = moe_cfg(n_experts=e, top_k=k, capacity_factor=factor, eval_capacity_factor=factor)
        assert MoE(cfg, 0).train(training).dispatch.capacity.limit(n) == cap


def test_the_sequence_wise_loss_of_padded_rows_is_taken_row_by_row() -> None:
    """Rows with 5 and 1 real tokens: the loss is the mean of each row's Switch loss (not that of the 6
    real tokens cut into two halves of 3)."""
    torch.manual_seed(0)
    moe = MoE(moe_cfg(n_experts=4, top_k=2, aux_loss_coef=0.0, seq_aux_loss_coef=1.0), 0).train()
    x = torch.randn(2, 6, 16)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    moe(x, mask)
    route = moe.router(x[mask])  # the real tokens, row-major: 5 of row 0, then 1 of row 1
    probs = (route.scores / route.scores.sum(-1, keepdim=True)).detach()
    rows = [slice(0, 5), slice(5, 6)]
    expected = sum(load_balance_loss(probs[r], route.idx[r]) for r in rows) / 2
    torch.testing.assert_close(moe.last_aux, expected)


@pytest.mark.parametrize("chunk", [4, 7, 2**24], ids=["one-row-per-pass", "uneven-passes", "one-pass"])
def test_counting_by_comparison_equals_bincount(chunk: int) -> None:
    """The count CUDA takes (no value read on the host) equals torch.bincount on the CPU, whatever its
    passes, for an index with idle experts and for an empty one."""
    from tformer.model.router import count_by_comparison

    torch.manual_seed(0)
    idx = torch.randint(0, 5, (23, 3))  # experts 5..7 idle
    for flat in (idx.flatten(), idx.flatten()[:0]):
        got = count_by_comparison(flat, 8, chunk=chunk)
        assert got.dtype == torch.long and torch.equal(got, torch.bincount(flat, minlength=8))
