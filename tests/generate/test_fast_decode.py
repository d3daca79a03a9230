"""The decoding layout (transposed and stacked weight copies for one or two rows) against plain F.linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tformer import build_model
from tformer.generate.engine import generate
from tformer.generate.sampling import SamplingConfig
from tformer.model.linear import _STACK_ATTR, stacked_linear, transposed_linears
from tformer.model.norms import rms_norms_as_layer_norm
from tformer.presets import llama_like


@pytest.fixture(scope="module")
def model() -> nn.Module:
    torch.manual_seed(0)
    cfg = llama_like(97, 32, 2, 4, 2, 64, 64).replace(bias=True, tie_embeddings=True)
    return build_model(cfg).eval()


def linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if type(m) is nn.Linear]


def widening(model: nn.Module) -> list[nn.Linear]:
    return [m for m in linears(model) if m.out_features > m.in_features]


def stacks(model: nn.Module) -> list[nn.Linear]:
    return [m for m in linears(model) if _STACK_ATTR in m.__dict__]


def test_one_row_matches_f_linear_and_many_rows_use_it(model) -> None:
    one, many = torch.randint(0, 97, (1, 1)), torch.randint(0, 97, (3, 5))
    blocks = list(model.blocks)
    with torch.no_grad():
        ref_one, ref_many = model(one), model(many)
        with transposed_linears(model):
            patched = [m for m in linears(model) if "forward" in m.__dict__]
            assert patched == [model.lm_head]  # the widening layer outside a stacked group
            firsts = [layer for b in blocks for layer in (b.attn.q_proj, b.ffn.gate_proj)]
            assert stacks(model) == firsts  # q/k/v (32 -> 3 x 32 with GQA: 32 -> 64) and gate/up copies
            stack = model.blocks[0].attn.q_proj.__dict__[_STACK_ATTR]
            assert stack.weight_t.shape == (32, 32 + 16 + 16) and stack.sizes == (32, 16, 16)
            fast_one, fast_many = model(one), model(many)
    torch.testing.assert_close(fast_one, ref_one, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast_many, ref_many)  # 15 rows: the F.linear path, bit for bit
    assert not any("forward" in m.__dict__ for m in linears(model))  # restored on exit
    assert not stacks(model)


def test_stacked_copy_serves_only_its_own_group(model) -> None:
    attn = model.blocks[0].attn
    x = torch.randn(1, 1, 32)
    with torch.no_grad(), transposed_linears(model):
        q, k, v = stacked_linear(x, (attn.q_proj, attn.k_proj, attn.v_proj))
        other = stacked_linear(x, (attn.q_proj, attn.v_proj))  # same first layer, another group
    torch.testing.assert_close(q, attn.q_proj(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k, attn.k_proj(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v, attn.v_proj(x), atol=1e-6, rtol=1e-6)
    assert torch.equal(other[1], attn.v_proj(x))


def test_tied_weights_share_one_copy_and_errors_restore(model) -> None:
    seen = {}
    with pytest.raises(RuntimeError, match="inside"), transposed_linears(model):
        for m in widening(model):
            if "forward" in m.__dict__:
                seen.setdefault(id(m.weight), set()).add(id(m.forward.args[1]))
        raise RuntimeError("inside")
    assert all(len(copies) == 1 for copies in seen.values())
    assert model.lm_head.weight is model.tok_embed.weight and id(model.lm_head.weight) in seen
    assert not any("forward" in m.__dict__ for m in linears(model)) and not stacks(model)


@pytest.mark.parametrize("n_prompts", [1, 2])
def test_generate_fast_equals_slow_twin(model, n_prompts: int) -> None:
    prompts = [[5, 6, 7, 8], [9, 10]][:n_prompts]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=24)
    fast = generate(model, prompts, cfg)
    slow = generate(model, prompts, cfg, fast_decode=False)
    assert fast == slow and all(len(row) == 24 for row in fast)


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
