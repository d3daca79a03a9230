"""The decoding fast paths (row-blocked linear products, RMSNorm as LayerNorm) against their slow twins."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tformer import MoEConfig, build_model
from tformer.generate.engine import generate
from tformer.generate.sampling import SamplingConfig
from tformer.model import decode_step as decode_step_module
from tformer.model import grouped_linear as kernels
from tformer.model import linear as linear_module
from tformer.model.linear import DECODE_MAX_ROWS, row_blocked_linear, row_blocked_linears, stacked_linear
from tformer.model.norms import rms_norms_as_layer_norm
from tformer.model.transformer import DecoderLM
from tformer.presets import llama_like


@pytest.fixture(autouse=True)
def block_every_layer(monkeypatch) -> None:
    """The test models are tiny; block their layers too (DECODE_MIN_WEIGHT is read at call time)."""
    monkeypatch.setattr(linear_module, "DECODE_MIN_WEIGHT", 0)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    cfg = llama_like(97, 32, 2, 4, 2, 64, 64).replace(bias=True, tie_embeddings=True)
    return build_model(cfg).eval()


def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


@pytest.mark.parametrize("shape", [(1, 1), (3,), (2, 5), (4, 16)])
@pytest.mark.parametrize("n_blocks", [1, 2, 4, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_row_blocked_linear_equals_f_linear(shape, n_blocks: int, bias: bool) -> None:
    torch.manual_seed(0)
    x, weight = torch.randn(*shape, 24), torch.randn(40, 24)
    b = torch.randn(40) if bias else None
    out = row_blocked_linear(x, weight, b, n_blocks)
    assert out.shape == (*shape, 40)
    torch.testing.assert_close(out, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_row_blocked_linear_writes_into_out(rows: int, bias: bool, count_calls) -> None:
    """out=: the result lands in the given rows (a slice of a bigger buffer, as the MoE loop kernel
    passes); one row without bias is written by the product itself, with no copy."""
    torch.manual_seed(0)
    x, weight = torch.randn(rows, 24), torch.randn(40, 24)
    b = torch.randn(40) if bias else None
    buffer = torch.full((rows + 2, 40), float("nan"))
    copies = count_calls(torch.Tensor, "copy_")
    got = row_blocked_linear(x, weight, b, 4, out=buffer[1 : 1 + rows])
    assert got.data_ptr() == buffer[1].data_ptr() and len(copies) == (0 if rows == 1 and not bias else 1)
    torch.testing.assert_close(buffer[1 : 1 + rows], F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    assert buffer[0].isnan().all() and buffer[-1].isnan().all()


def test_row_blocked_linear_has_gradients() -> None:
    torch.manual_seed(0)
    x, weight, bias = (
        torch.randn(2, 3, 8, requires_grad=True),
        torch.randn(12, 8, requires_grad=True),
        torch.randn(12, requires_grad=True),
    )
    row_blocked_linear(x, weight, bias, 4).square().sum().backward()
    grads = [t.grad.clone() for t in (x, weight, bias)]
    for t in (x, weight, bias):
        t.grad = None
    F.linear(x, weight, bias).square().sum().backward()
    for got, t in zip(grads, (x, weight, bias)):
        torch.testing.assert_close(got, t.grad, atol=1e-5, rtol=1e-5)


def test_few_rows_take_the_blocked_path_many_rows_f_linear(model) -> None:
    few, many = torch.randint(0, 97, (2, 3)), torch.randint(0, 97, (2, DECODE_MAX_ROWS))
    with torch.no_grad():
        ref_few, ref_many = model(few), model(many)
        with row_blocked_linears(model):
            patched = [m for m in linears(model) if "forward" in m.__dict__]
            assert patched == linears(model)[:-1]  # all but the head: 97 outputs, a prime
            assert model.lm_head is linears(model)[-1]
            fast_few, fast_many = model(few), model(many)
    torch.testing.assert_close(fast_few, ref_few, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast_many, ref_many)  # 2 x 64 rows: the F.linear path, bit for bit
    assert not any("forward" in m.__dict__ for m in linears(model))  # restored on exit


def test_layers_reading_one_input_share_one_stacked_product_per_context(model) -> None:
    attn, ffn = model.blocks[0].attn, model.blocks[0].ffn
    groups = [(attn.q_proj, attn.k_proj, attn.v_proj), (ffn.gate_proj, ffn.up_proj)]
    inputs = [torch.randn(2, 1, 32), torch.randn(2, DECODE_MAX_ROWS // 2, 32)]  # one step; 64 rows
    with torch.no_grad():
        slow = [[tuple(layer(x) for layer in group) for group in groups] for x in inputs]
        with row_blocked_linears(model):
            state = linear_module._DECODING.get()
            fast = [[stacked_linear(x, group) for group in groups] for x in inputs]
            keys = [tuple(id(layer) for layer in group) for group in groups]
            assert set(state.stacks) == set(keys)  # one stack per group ...
            built = [state.stacks[k][0] for k in keys]
            stacked_linear(inputs[0], groups[0])
            assert all(state.stacks[k][0] is w for k, w in zip(keys, built))  # ... built once
            weight, bias, blocks = state.stacks[keys[0]][:3]
            assert weight.shape == (32 + 16 + 16, 32) and bias.shape == (64,) and blocks == 4
            attn.k_proj.weight.add_(1.0)  # a weight changed in place: the stack is rebuilt
            changed = stacked_linear(inputs[0], groups[0])[1]
            torch.testing.assert_close(changed, attn.k_proj(inputs[0]), atol=1e-5, rtol=1e-5)
            attn.k_proj.weight.sub_(1.0)
            other = nn.Linear(32, 32), nn.Linear(32, 32)  # not this context's layers: the separate path
            assert stacked_linear(inputs[0], other)[0].shape == (2, 1, 32) and len(state.stacks) == 2
        assert linear_module._DECODING.get() is None and not state.stacks  # the copies go with the context
    for got_x, want_x in zip(fast, slow):
        for got, want in zip(got_x, want_x):
            assert [t.shape for t in got] == [t.shape for t in want]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    with row_blocked_linears(model):  # under autograd: the separate layers, gradients reach them
        stacked_linear(inputs[0], groups[0])[1].sum().backward()
        assert not linear_module._DECODING.get().stacks and attn.k_proj.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_stacked_product_without_biases() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(16, 8, bias=False), nn.Linear(16, 4, bias=False)
    x = torch.randn(3, 16)
    with torch.no_grad(), row_blocked_linears(nn.Sequential(a, b), n_blocks=4):
        got = stacked_linear(x, (a, b))
        assert linear_module._DECODING.get().stacks[(id(a), id(b))][1] is None
    torch.testing.assert_close(got[0], a(x).detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], b(x).detach(), atol=1e-5, rtol=1e-5)


def test_block_count_divides_the_width_and_errors_restore() -> None:
    prime, six, twelve = nn.Linear(8, 7), nn.Linear(8, 6), nn.Linear(8, 12)
    wrapper = nn.Sequential(prime, six, twelve)
    with pytest.raises(RuntimeError, match="inside"), row_blocked_linears(wrapper, n_blocks=4):
        assert "forward" not in prime.__dict__
        assert six.forward.args[-1] == 3 and twelve.forward.args[-1] == 4
        x = torch.randn(1, 8)
        torch.testing.assert_close(six(x), F.linear(x, six.weight, six.bias), atol=1e-6, rtol=1e-6)
        raise RuntimeError("inside")
    assert not any("forward" in m.__dict__ for m in wrapper)


def test_small_layers_keep_f_linear_by_default(monkeypatch) -> None:
    monkeypatch.undo()  # the module default
    small, large = nn.Linear(64, 64), nn.Linear(256, 256)  # 4,096 and 65,536 weights
    with row_blocked_linears(nn.Sequential(small, large)):
        assert "forward" not in small.__dict__ and "forward" in large.__dict__
    with row_blocked_linears(nn.Sequential(small, large), min_weight=0):
        assert "forward" in small.__dict__


@pytest.mark.parametrize("n_prompts", [1, 2])
def test_generate_fast_equals_slow_twin(model, n_prompts: int, count_calls) -> None:
    calls = count_calls(linear_module, "row_blocked_linear")
    step_calls = count_calls(decode_step_module, "row_blocked_linear")
    forwards = count_calls(DecoderLM, "forward")
    prompts = [[5, 6, 7, 8], [9, 10]][:n_prompts]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=24)
    slow = generate(model, prompts, cfg, fast_decode=False)
    assert (
        not calls and not step_calls and len(forwards) == 24
    )  # the prompt, then a step per token but the last
    fast = generate(model, prompts, cfg)
    assert len(forwards) == 25  # the fast run's prompt; its steps ran in the flat decoding step
    assert fast == slow and all(len(row) == 24 for row in fast)
    # the prompt and each of 23 steps, each of 2 layers: q/k/v (stacked), o, gate/up (stacked), down;
    # the steps call the stacked products themselves and o / down through the layers' patched forwards
    assert len(calls) + len(step_calls) == 24 * 2 * 4 and len(step_calls) == 23 * 2 * 2


def test_generate_without_row_blocks_where_they_do_not_pay(model, monkeypatch, count_calls) -> None:
    """DECODE_ROW_BLOCKED False (what the measurement gives on a CPU whose F.linear of one row uses every
    core): the flat step with the layers' own products, the same tokens as the slow twin."""
    monkeypatch.setattr(linear_module, "DECODE_ROW_BLOCKED", False)
    calls = count_calls(linear_module, "row_blocked_linear")
    step_calls = count_calls(decode_step_module, "row_blocked_linear")
    forwards = count_calls(DecoderLM, "forward")
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=16)
    slow = generate(model, [[5, 6, 7, 8], [9, 10]], cfg, fast_decode=False)
    fast = generate(model, [[5, 6, 7, 8], [9, 10]], cfg)
    assert fast == slow and not calls and not step_calls
    assert len(forwards) == 17  # the slow twin: prompt + 15 steps; the fast run: its prompt (steps: flat)


def test_row_blocking_pays_is_measured_once_per_layer_set(model, monkeypatch, count_calls) -> None:
    monkeypatch.setattr(linear_module, "DECODE_ROW_BLOCKED", None)
    monkeypatch.delenv(linear_module.ENV_ROW_BLOCKED, raising=False)
    monkeypatch.setattr(linear_module, "_PAYS", {})
    calls = count_calls(linear_module, "row_blocked_linear")
    rng = torch.get_rng_state()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # measured in fp32 all the same
        first = linear_module.row_blocking_pays(model)
    assert isinstance(first, bool) and calls  # timed: row-blocked passes over the model's layers
    assert torch.equal(torch.get_rng_state(), rng)  # no random numbers drawn: an exact resume stays exact
    n = len(calls)
    assert linear_module.row_blocking_pays(model) is first and len(calls) == n  # cached
    (key,) = linear_module._PAYS
    assert key[0] == torch.get_num_threads() and len(key[1]) > 0
    linear_module._PAYS[key] = not first
    assert linear_module.row_blocking_pays(model) is (not first)
    other = DecoderLM(llama_like(97, 48, 1, 4, 2, 96, 64)).eval()  # other layer shapes: measured again
    linear_module.row_blocking_pays(other)
    assert len(linear_module._PAYS) == 2 and len(calls) > n
    for forced in (True, False):
        monkeypatch.setattr(linear_module, "DECODE_ROW_BLOCKED", forced)
        assert linear_module.row_blocking_pays(model) is forced
    monkeypatch.setattr(linear_module, "DECODE_ROW_BLOCKED", None)
    for value, pinned in (("1", True), ("0", False), ("off", False)):
        monkeypatch.setenv(linear_module.ENV_ROW_BLOCKED, value)
        assert linear_module.row_blocking_pays(model) is pinned
    monkeypatch.setenv(linear_module.ENV_ROW_BLOCKED, "sometimes")
    with pytest.raises(ValueError, match="TFORMER_DECODE_ROW_BLOCKED='sometimes': use 1"):
        linear_module.row_blocking_pays(model)
    monkeypatch.delenv(linear_module.ENV_ROW_BLOCKED)
    monkeypatch.setattr(linear_module, "DECODE_MIN_WEIGHT", 10**9)  # no layer the layout would block
    monkeypatch.setattr(linear_module, "_PAYS", {})
    assert linear_module.row_blocking_pays(model) is False and linear_module._PAYS == {}


def test_generate_fast_equals_slow_twin_with_moe(count_calls) -> None:
    """The MoE experts' loop kernel takes the row-blocked path only inside the decoding context."""
    torch.manual_seed(0)
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=16, n_shared=1, dispatch="grouped")
    model = build_model(llama_like(97, 32, 2, 4, 2, 64, 64).replace(moe=moe)).eval()
    calls = count_calls(kernels, "row_blocked_linear")
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=12)
    slow = generate(model, [[5, 6, 7, 8]], cfg, fast_decode=False)
    assert not calls
    fast = generate(model, [[5, 6, 7, 8]], cfg)
    assert fast == slow and calls


def test_half_precision_weights_keep_f_linear() -> None:
    layers = [nn.Linear(16, 32).to(dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)]
    with row_blocked_linears(nn.Sequential(*layers)):
        assert ["forward" in m.__dict__ for m in layers] == [False, False, True]


def test_autocast_keeps_f_linear() -> None:
    layer = nn.Linear(16, 32)
    x = torch.randn(1, 16)
    with torch.no_grad(), row_blocked_linears(nn.Sequential(layer)):
        assert "forward" in layer.__dict__
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = F.linear(x, layer.weight, layer.bias)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)


def test_row_blocked_linear_on_strided_and_offset_input() -> None:
    torch.manual_seed(0)
    weight, base = torch.randn(12, 8), torch.randn(3, 10, 8)
    for x in (base[:, 3:5], base.transpose(0, 1)[2:4], base[1, 4:6]):  # offset, non-contiguous, both
        torch.testing.assert_close(
            row_blocked_linear(x, weight, None, 4), F.linear(x, weight), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_rms_norm_as_layer_norm_equals_rms_norm(scale: float) -> None:
    torch.manual_seed(0)
    norm = nn.RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    wrapper = nn.Sequential(norm)
    x = torch.randn(3, 5, 48) * scale
    with torch.no_grad():
        ref = norm(x)
    with torch.no_grad(), rms_norms_as_layer_norm(wrapper):
        assert "forward" in norm.__dict__
        fast = norm(x)
    torch.testing.assert_close(fast, ref, atol=1e-6 * max(1.0, float(ref.abs().max())), rtol=1e-5)
    assert "forward" not in norm.__dict__
