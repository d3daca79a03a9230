"""AdamW parameter groups and the learning-rate schedules."""

from __future__ import annotations

import math

import pytest

from tformer import ModelConfig, MoEConfig, build_model
from tformer.train.config import OptimConfig
from tformer.train.optim import lr_factor, make_optimizer, param_groups


def test_biases_norms_and_embeddings_do_not_decay_even_stacked_expert_biases():
    cfg = ModelConfig(
        vocab_size=64, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=8, bias=True,
        moe=MoEConfig(n_experts=4, top_k=2, first_dense=1),
    )  # fmt: skip
    model = build_model(cfg)
    decay, no_decay = (set(map(id, g["params"])) for g in param_groups(model, 0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = sorted(names[i] for i in decay)
    assert "blocks.1.ffn.experts.up_proj_bias" in {names[i] for i in no_decay}  # (E, out): 2-D, still a bias
    assert all(not (n.endswith("bias") or "norm" in n or "embed" in n) for n in decayed), decayed
    assert "blocks.1.ffn.experts.up_proj" in decayed and "blocks.0.ffn.up_proj.weight" in decayed
    assert len(decay) + len(no_decay) == len(list(model.parameters()))


def test_the_optimizer_decays_the_matrices_alone_at_the_configured_rate():
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=8, bias=True)
    model = build_model(cfg)
    opt = make_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.25))
    names = {id(p): n for n, p in model.named_parameters()}
    by_decay = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in opt.param_groups}
    assert sorted(by_decay) == [0.0, 0.25] and by_decay[0.25] and by_decay[0.0]
    assert by_decay[0.25] == {n for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n}
    assert "tok_embed.weight" in by_decay[0.0] and "blocks.0.attn.q_proj.bias" in by_decay[0.0]
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_schedules_reach_the_floor_exactly_at_the_last_step(schedule, warmup):
    cfg = OptimConfig(schedule=schedule, warmup_steps=warmup, min_lr_ratio=0.1, decay_frac=0.25)
    total = 12
    f = [lr_factor(i, total, cfg) for i in range(total)]
    assert f[-1] == pytest.approx(0.1) and min(f) == pytest.approx(0.1)
    if warmup:
        assert f[:warmup] == pytest.approx([(i + 1) / warmup for i in range(warmup)])
        assert f[warmup - 1] == 1.0 and f[warmup] <= 1.0
    else:
        assert f[0] == 1.0
    peak = f.index(1.0)
    assert all(a >= b for a, b in zip(f[peak:], f[peak + 1 :]))  # never rises after the peak
    if schedule == "wsd":  # a stable stretch, then decay_frac of the run decays, every step of it lower
        decay = f[int(total * 0.75) :]
        assert len(decay) == 3 and all(a > b for a, b in zip(decay, decay[1:])) and decay[0] < 1.0
        assert all(x == 1.0 for x in f[warmup : int(total * 0.75)])


def test_constant_schedule_and_cosine_midpoint():
    assert [lr_factor(i, 5, OptimConfig(schedule="constant", warmup_steps=2)) for i in range(5)] == [
        0.5, 1.0, 1.0, 1.0, 1.0,
    ]  # fmt: skip
    cfg = OptimConfig(schedule="cosine", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_factor(5, 11, cfg) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    # the cosine's shape, not only its midpoint (a linear decay also passes 0.5 there): a quarter and
    # three quarters of the way, with a floor of 0.1, after 3 warm-up steps
    cfg = OptimConfig(schedule="cosine", warmup_steps=3, min_lr_ratio=0.1)
    total = 3 + 8  # the decay spans steps 3..10: progress (step - 2) / 8
    for step, progress in ((4, 0.25), (8, 0.75), (3, 1 / 8)):
        want = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        assert lr_factor(step, total, cfg) == pytest.approx(want, rel=1e-12), step
    assert lr_factor(3, total, cfg) < 1.0  # the first step after warm-up already decays


def test_a_skipped_step_leaves_no_expert_counts_for_the_next_bias_update():
    import torch

    from tformer.model.moe import moe_layers
    from tformer.train.optim import make_optimizer, make_scheduler
    from tformer.train.step import train_step

    cfg = ModelConfig(
        vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=8,
        moe=MoEConfig(n_experts=4, top_k=2, bias_update_rate=0.01),
    )  # fmt: skip
    model = build_model(cfg)
    opt = make_optimizer(model, OptimConfig(fused=False))
    sched = make_scheduler(opt, 10, OptimConfig())
    ids = torch.randint(0, 64, (2, 8))

    def loss(m, batch, scale):
        return m(batch).float().logsumexp(-1).sum() * scale, batch.numel()

    router = moe_layers(model)[0][1].router
    result = train_step(model, lambda m, b: loss(m, b, math.nan), [ids], lambda b: b.numel(), opt, sched, 1.0,
                        torch.autocast("cpu", enabled=False))  # fmt: skip
    assert result.skipped and int(router.tokens_per_expert.sum()) == 0 and not router.expert_bias.any()
    result = train_step(model, lambda m, b: loss(m, b, 1.0), [ids], lambda b: b.numel(), opt, sched, 1.0,
                        torch.autocast("cpu", enabled=False))  # fmt: skip
    assert not result.skipped and router.expert_bias.abs().sum() > 0  # a good step updates the bias
