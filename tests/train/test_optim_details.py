"""AdamW's settings and the schedules' edges (tformer/train/optim.py)."""

from __future__ import annotations

import pytest
import torch

from tformer import ModelConfig, build_model
from tformer.train.config import OptimConfig
from tformer.train.optim import lr_factor, make_optimizer, make_scheduler, param_groups


def tiny_model():
    return build_model(ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=8))


def test_frozen_parameters_are_left_out_of_the_groups() -> None:
    model = tiny_model()
    frozen = {name for name, p in model.named_parameters() if "blocks.0.attn" in name}
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    names = {id(p): n for n, p in model.named_parameters()}
    grouped = [names[id(p)] for g in param_groups(model, 0.1) for p in g["params"]]
    assert frozen and sorted(grouped) == sorted(n for n in names.values() if n not in frozen)


def test_the_optimizer_takes_the_configured_betas_and_eps() -> None:
    cfg = OptimConfig(lr=3e-4, beta1=0.8, beta2=0.95, eps=1e-6, fused=False)
    opt = make_optimizer(tiny_model(), cfg)
    for group in opt.param_groups:
        assert tuple(group["betas"]) == (0.8, 0.95) and group["eps"] == 1e-6 and group["lr"] == 3e-4


def test_fused_adamw_is_taken_where_this_torch_has_it() -> None:
    model = tiny_model()
    try:
        torch.optim.AdamW(model.parameters(), fused=True)
    except (RuntimeError, TypeError):
        pytest.skip("no fused AdamW for CPU parameters in this torch")
    assert make_optimizer(model, OptimConfig(fused=True)).defaults["fused"]
    assert not make_optimizer(model, OptimConfig(fused=False)).defaults["fused"]


def adamw_written_out(params, grads_per_step, groups, lr, betas, eps):
    """AdamW (Loshchilov & Hutter) step by step in plain tensor arithmetic: decoupled decay, bias-corrected
    moments. The slow twin of torch's fused and foreach kernels."""
    b1, b2 = betas
    p = {n: t.detach().clone().double() for n, t in params.items()}
    m = {n: torch.zeros_like(t) for n, t in p.items()}
    v = {n: torch.zeros_like(t) for n, t in p.items()}
    for step, grads in enumerate(grads_per_step, start=1):
        for n in p:
            g = grads[n].double()
            p[n] *= 1 - lr * groups[n]
            m[n] = b1 * m[n] + (1 - b1) * g
            v[n] = b2 * v[n] + (1 - b2) * g * g
            m_hat, v_hat = m[n] / (1 - b1**step), v[n] / (1 - b2**step)
            p[n] -= lr * m_hat / (v_hat.sqrt() + eps)
    return p


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_kernels_equal_the_update_written_out(fused: bool) -> None:
    """The default fused kernel (and the foreach fallback) take the documented AdamW step over both
    parameter groups: 4 steps of the same gradients against the update in float64 arithmetic."""
    if fused:
        try:
            torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
        except (RuntimeError, TypeError):
            pytest.fail("this torch has no fused AdamW for CPU parameters (torch >= 2.4 has one)")
    torch.manual_seed(0)
    model = tiny_model()
    cfg = OptimConfig(lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, fused=fused)
    opt = make_optimizer(model, cfg)
    assert bool(opt.defaults["fused"]) is fused and bool(opt.defaults["foreach"]) is not fused
    params = dict(model.named_parameters())
    start = {n: t.detach().clone() for n, t in params.items()}
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    grads_per_step = [{n: torch.randn_like(t) for n, t in params.items()} for _ in range(4)]
    for grads in grads_per_step:
        for n, t in params.items():
            t.grad = grads[n].clone()
        opt.step()
    expected = adamw_written_out(start, grads_per_step, {n: decay[id(t)] for n, t in params.items()},
                                 cfg.lr, (cfg.beta1, cfg.beta2), cfg.eps)  # fmt: skip
    assert {0.0, 0.1} == set(decay.values())
    for n, t in params.items():
        torch.testing.assert_close(t.detach().double(), expected[n], rtol=1e-5, atol=1e-6, msg=n)
        assert not torch.equal(t.detach(), start[n]), n


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
@pytest.mark.parametrize("warmup", [0, 2])
def test_past_the_last_step_the_rate_stays_at_the_floor(schedule: str, warmup: int) -> None:
    cfg = OptimConfig(schedule=schedule, warmup_steps=warmup, min_lr_ratio=0.1, decay_frac=0.5)
    total = 10
    assert lr_factor(total - 1, total, cfg) == pytest.approx(0.1)
    for step in range(total, total + 5):  # the scheduler is stepped once more after the last step
        assert lr_factor(step, total, cfg) == pytest.approx(0.1), step


def test_a_wsd_warm_up_longer_than_the_stable_stretch_decays_linearly_after_it() -> None:
    """decay_frac asks the decay to start at step 6 of 12, inside the 10 warm-up steps: the decay then
    starts after the warm-up, in equal steps from the peak to the floor at the last step."""
    cfg = OptimConfig(schedule="wsd", warmup_steps=10, min_lr_ratio=0.1, decay_frac=0.5)
    total = 12
    f = [lr_factor(i, total, cfg) for i in range(total)]
    assert f[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    drop = (1.0 - 0.1) / (total - 10)  # 1.0 at step 9, the floor at step 11
    assert f[10:] == pytest.approx([1.0 - drop, 1.0 - 2 * drop])


def test_a_wsd_decay_goes_down_in_equal_steps_from_the_peak() -> None:
    cfg = OptimConfig(schedule="wsd", warmup_steps=0, min_lr_ratio=0.2, decay_frac=0.4)
    total = 10  # the decay covers steps 6..9, the last at the floor
    f = [lr_factor(i, total, cfg) for i in range(total)]
    drop = (1.0 - 0.2) / 4
    assert f == pytest.approx([1.0] * 6 + [1.0 - k * drop for k in range(1, 5)])


@pytest.mark.parametrize(
    ("total", "frac", "decaying"), [(10, 0.8, 8), (10, 0.9, 9), (100, 0.56, 56), (7, 0.3, 3)]
)
def test_a_wsd_decay_takes_the_fraction_of_steps_its_decimal_names(
    total: int, frac: float, decaying: int
) -> None:
    """floor(total * (1 - decay_frac)) with the fraction as written: 1 - 0.8 in float is just below 0.2,
    which had added a step to the decay (and with 0.9 of 10 steps, step 0 had never run at the peak)."""
    cfg = OptimConfig(schedule="wsd", warmup_steps=0, min_lr_ratio=0.0, decay_frac=frac)
    f = [lr_factor(i, total, cfg) for i in range(total)]
    assert sum(x < 1.0 for x in f) == decaying and f[0] == 1.0 and f[-1] == 0.0


def test_a_fused_adamw_that_cannot_run_falls_back_to_foreach_with_a_warning(monkeypatch) -> None:
    real = torch.optim.AdamW

    def no_fused(params, fused=None, **kw):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be on a supported device")
        return real(params, **kw)

    monkeypatch.setattr(torch.optim, "AdamW", no_fused)
    with pytest.warns(UserWarning, match=r"fused AdamW is not available .*supported device.*foreach"):
        opt = make_optimizer(tiny_model(), OptimConfig(fused=True))
    assert opt.defaults["foreach"] is True


def test_the_scheduler_sets_each_steps_rate_from_lr_factor() -> None:
    cfg = OptimConfig(lr=0.5, schedule="cosine", warmup_steps=3, min_lr_ratio=0.1, fused=False)
    total = 9
    model = tiny_model()
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, total, cfg)
    for step in range(total):
        assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * lr_factor(step, total, cfg)), step
        opt.step()
        sched.step()
