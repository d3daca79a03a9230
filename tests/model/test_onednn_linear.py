"""fp32 training products through oneDNN (`OneDnnLinear`, entered by `apply_linear`) against their slow
twin `F.linear`: the product and its three gradients, when the path is taken and when it is not, and
whole training steps of a decoder LM and an encoder-decoder with the switch on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tformer.model.linear as linear_module
from tformer.model.linear import ONEDNN_MIN_ROWS, OneDnnLinear, apply_linear, onednn_linear_pays, takes_onednn
from tformer.presets import tiny

from .helpers import make, rand_tokens, run

pytestmark = pytest.mark.skipif(
    linear_module._onednn_op() is None, reason="this torch build has no oneDNN (mkldnn) CPU kernels"
)


@pytest.fixture
def switch(monkeypatch):
    """Sets `ONEDNN_LINEAR` for the test (restored after)."""

    def set_to(value: bool | None) -> None:
        monkeypatch.setattr(linear_module, "ONEDNN_LINEAR", value)

    return set_to


@pytest.fixture
def calls(monkeypatch) -> list[tuple]:
    """Records the shapes of every product that goes through `OneDnnLinear`."""
    seen: list[tuple] = []
    apply = OneDnnLinear.apply

    def counting(x, weight, bias):
        seen.append((tuple(x.shape), tuple(weight.shape)))
        return apply(x, weight, bias)

    monkeypatch.setattr(OneDnnLinear, "apply", counting)
    return seen


def grads_of(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dy: torch.Tensor):
    leaves = [
        t.detach().clone().requires_grad_() for t in (x, weight) + ((bias,) if bias is not None else ())
    ]
    y = fn(*leaves) if bias is not None else fn(*leaves, None)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(300, 48), (3, 100, 48), (2, 3, 50, 48)])
def test_onednn_linear_equals_f_linear(shape, bias) -> None:
    """Output, input gradient, weight gradient and bias gradient equal F.linear's to fp32 rounding, for
    2-D to 4-D inputs."""
    torch.manual_seed(0)
    x, weight = torch.randn(shape), torch.randn(80, 48) / 7
    b = torch.randn(80) if bias else None
    dy = torch.randn(*shape[:-1], 80)
    ours = grads_of(OneDnnLinear.apply, x, weight, b, dy)
    ref = grads_of(F.linear, x, weight, b, dy)
    assert len(ours) == len(ref) == (4 if bias else 3)
    for got, want, what in zip(ours, ref, ("y", "dx", "dw", "db")):
        assert got.shape == want.shape, what
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=what)


def test_onednn_linear_takes_non_contiguous_inputs_and_frozen_weights() -> None:
    """A transposed (non-contiguous) input gives F.linear's product and gradient; a weight that needs no
    gradient gets none, and x still gets its own."""
    torch.manual_seed(1)
    x = torch.randn(48, 4, 300).permute(1, 2, 0)  # (4, 300, 48), not contiguous
    weight = torch.randn(64, 48)
    xi, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    assert not xi.is_contiguous()
    y = OneDnnLinear.apply(xi, weight, None)
    torch.testing.assert_close(y, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    F.linear(xr, weight).sum().backward()
    torch.testing.assert_close(xi.grad, xr.grad, rtol=1e-5, atol=1e-5)
    assert weight.grad is None


def test_takes_onednn_only_for_fp32_cpu_training_products_with_enough_rows(switch) -> None:
    """Taken where a graph is recorded, every tensor fp32 on the CPU, at least ONEDNN_MIN_ROWS rows, no
    autocast, and the switch on; never with the switch off."""
    switch(True)
    w = torch.randn(16, 8, requires_grad=True)
    many = torch.randn(ONEDNN_MIN_ROWS, 8)
    assert takes_onednn(many, w, None)
    assert takes_onednn(many.view(2, -1, 8), w, None)
    assert not takes_onednn(torch.randn(ONEDNN_MIN_ROWS - 1, 8), w, None)  # few rows (decoding)
    assert not takes_onednn(many, w.detach(), None)  # no graph
    with torch.no_grad():
        assert not takes_onednn(many, w, None)
    assert not takes_onednn(many.bfloat16(), w.bfloat16(), None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not takes_onednn(many, w, None)  # F.linear casts under autocast
    switch(False)
    assert not takes_onednn(many, w, None)


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("0", False)])
def test_environment_variable_pins_the_choice(monkeypatch, switch, value, expected) -> None:
    switch(None)
    monkeypatch.setenv(linear_module.ENV_ONEDNN_LINEAR, value)
    assert onednn_linear_pays() is expected


def test_auto_follows_the_cpu_and_a_bad_value_names_the_variable(monkeypatch, switch) -> None:
    """auto (or unset): on where torch's CPU kernels use AVX512; an unknown value is an error naming the
    variable and the values allowed."""
    switch(None)
    monkeypatch.delenv(linear_module.ENV_ONEDNN_LINEAR, raising=False)
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert onednn_linear_pays() is avx512
    monkeypatch.setenv(linear_module.ENV_ONEDNN_LINEAR, "fast")
    with pytest.raises(ValueError, match=r"TFORMER_ONEDNN_LINEAR='fast': use 1 \(oneDNN\), 0 \(F.linear\)"):
        onednn_linear_pays()


def test_oneDNN_disabled_in_torch_is_respected(monkeypatch, switch) -> None:
    switch(True)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert not onednn_linear_pays()


def test_apply_linear_calls_the_module_where_it_computes_something_else(switch, calls) -> None:
    """A forward hook, a forward set on the instance and an nn.Linear subclass take the module call (the
    hook runs, the instance's forward computes); a plain layer takes oneDNN."""
    switch(True)
    x = torch.randn(ONEDNN_MIN_ROWS, 8, requires_grad=True)
    plain = nn.Linear(8, 4)
    apply_linear(plain, x)
    assert calls == [((ONEDNN_MIN_ROWS, 8), (4, 8))]
    hooked, ran = nn.Linear(8, 4), []
    hooked.register_forward_hook(lambda *args: ran.append(True))
    apply_linear(hooked, x)
    assert ran == [True]
    patched = nn.Linear(8, 4)
    patched.forward = lambda t: torch.zeros(1)
    assert torch.equal(apply_linear(patched, x), torch.zeros(1))

    class Scaled(nn.Linear):
        def forward(self, t):
            return 2 * super().forward(t)

    sub = Scaled(8, 4)
    torch.testing.assert_close(apply_linear(sub, x), 2 * F.linear(x, sub.weight, sub.bias))
    assert len(calls) == 1


CONFIGS = {
    "decoder": tiny("decoder"),
    "encoder_decoder": tiny("encoder_decoder").replace(
        norm_placement="post", norm="layernorm", positions="sinusoidal", ffn="relu", bias=True
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_step_with_onednn_equals_f_linear(name, switch, calls) -> None:
    """A decoder LM (q/k/v, o, gate/up, down, head) and an encoder-decoder (cross-attention's K/V from the
    memory too): the loss and every parameter's gradient with the switch on equal those with it off to
    fp32 rounding, and the products did go through oneDNN."""
    torch.manual_seed(0)
    model = make(CONFIGS[name]).train()
    tokens = rand_tokens(model.cfg, 8, 40)
    results = []
    for on in (True, False):
        switch(on)
        model.zero_grad(set_to_none=True)
        logits = run(model, tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        if on:
            assert len(calls) >= 5 * model.cfg.n_layers  # attention's 4 products and the FFN's, per layer
            calls.clear()
    assert calls == []  # the switch off: F.linear only
    (loss_on, grads_on), (loss_off, grads_off) = results
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-6, atol=1e-6)
    assert grads_on.keys() == grads_off.keys()
    for n in grads_on:
        torch.testing.assert_close(grads_on[n], grads_off[n], rtol=1e-4, atol=1e-6, msg=n)
