"""The decoding layout (transposed weight copies for one or two rows) against plain F.linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tformer import build_model
from tformer.generate.engine import generate
from tformer.generate.sampling import SamplingConfig
from tformer.model.linear import transposed_linears
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


def test_one_row_matches_f_linear_and_many_rows_use_it(model) -> None:
    one, many = torch.randint(0, 97, (1, 1)), torch.randint(0, 97, (3, 5))
    with torch.no_grad():
        ref_one, ref_many = model(one), model(many)
        with transposed_linears(model):
            patched = [m for m in linears(model) if "forward" in m.__dict__]
            assert patched == widening(model) and len(patched) >= 3  # up, gate, the head; not q/k/v/o, down
            fast_one, fast_many = model(one), model(many)
    torch.testing.assert_close(fast_one, ref_one, atol=1e-5, rtol=1e-5)
    assert torch.equal(fast_many, ref_many)  # 15 rows: the F.linear path, bit for bit
    assert not any("forward" in m.__dict__ for m in linears(model))  # restored on exit


def test_tied_weights_share_one_copy_and_errors_restore(model) -> None:
    seen = {}
    with pytest.raises(RuntimeError, match="inside"), transposed_linears(model):
        for m in widening(model):
            seen.setdefault(id(m.weight), set()).add(id(m.forward.args[1]))
        raise RuntimeError("inside")
    assert all(len(copies) == 1 for copies in seen.values())
    assert model.lm_head.weight is model.tok_embed.weight and id(model.lm_head.weight) in seen
    assert not any("forward" in m.__dict__ for m in linears(model))


@pytest.mark.parametrize("n_prompts", [1, 2])
def test_generate_fast_equals_slow_twin(model, n_prompts: int) -> None:
    prompts = [[5, 6, 7, 8], [9, 10]][:n_prompts]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=24)
    fast = generate(model, prompts, cfg)
    slow = generate(model, prompts, cfg, fast_decode=False)
    assert fast == slow and all(len(row) == 24 for row in fast)
