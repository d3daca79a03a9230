"""MoE layer: dense equivalence, grouped == loop parity, shared experts, sizes,
MoE inside every architecture, and parity with Hugging Face's MoE blocks (RELIABILITY section E).
Routing, balance losses, the auxiliary-loss-free bias, capacity and statistics: test_moe_routing.py;
the grouped-matmul kernels: test_moe_kernels.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer import ConfigError, ModelConfig, MoEConfig
from tformer.model.ffn import make_dense_ffn
from tformer.model.moe import (
    MoE,
    moe_aux_loss,
    moe_routing_stats,
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


def test_a_model_with_every_balance_loss_pickles_and_saves_whole() -> None:
    """torch.save / pickle of the module itself (not its state_dict) had failed on the balance losses'
    lambdas (the default aux_loss_coef 0.01 has one): the loaded model computes what the model computes,
    balance loss included."""
    import io
    import pickle

    from tformer import build_model

    torch.manual_seed(0)
    moe = MoEConfig(n_experts=4, top_k=2, aux_loss_coef=0.01, device_loss_coef=0.01, n_devices=2,
                    seq_aux_loss_coef=0.01, z_loss_coef=0.001)  # fmt: skip
    model = build_model(tiny().replace(moe=moe))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randint(0, 128, (2, 8))
    for other in (loaded, pickle.loads(pickle.dumps(model))):
        assert torch.equal(model(x), other(x))
        assert torch.equal(model.blocks[1].ffn.last_aux, other.blocks[1].ffn.last_aux)
    assert model.training and model.blocks[1].ffn.last_aux > 0
