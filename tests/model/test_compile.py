"""torch.compile sees each dense model's forward as one graph: no host reads (the id and position range
checks are skipped while compiling) and no ContextVar reads (the decoding context is never active there).
Traced with dynamo's eager backend: seconds, nothing is code-generated."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from tformer import build_model
from tformer.presets import llama_like, tiny

CONFIGS = {
    "post-norm decoder": tiny(),
    "pre-norm rope swiglu gqa": llama_like(128, 64, 2, 4, 2, 128, 64),
    "encoder-decoder": tiny().replace(arch="encoder_decoder"),
    "encoder classifier": tiny().replace(arch="encoder", n_classes=3),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_dense_forward_and_backward_trace_as_one_graph(name: str) -> None:
    cfg = CONFIGS[name]
    model = build_model(cfg).train()
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    args = (tokens, tokens) if cfg.arch == "encoder_decoder" else (tokens,)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # a graph break is an error
    torch.manual_seed(0)
    out = compiled(*args)
    torch.manual_seed(0)
    assert torch.allclose(out, model(*args), atol=1e-6)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    torch._dynamo.reset()


def test_eager_calls_still_check_ids() -> None:
    model = build_model(tiny())
    with pytest.raises(ValueError, match="contains id 128"):
        model(torch.tensor([[1, 128]]))
