"""torch.compile sees each dense model's forward as one graph: no host reads (the id and position range
checks are skipped while compiling) and no ContextVar reads (the decoding context is never active there).
Traced with dynamo's eager backend: seconds, nothing is code-generated."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

import tformer.model.norms as norms_module
import tformer.model.positions as positions_module
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


@pytest.mark.parametrize("name", ["pre-norm rope swiglu gqa", "encoder-decoder"])
def test_bf16_training_attention_traces_in_the_graph(name: str, monkeypatch, trace_graph) -> None:
    """Under bf16 autocast the training attention is `score_attention` (an autograd.Function with
    causal blocks): every layer's call traces into the one graph (no SDPA left in it), with the loss and
    gradients of eager mode, bit for bit (eager here with torch's RMSNorm and the rotary reference's ops,
    which compiled graphs use)."""
    monkeypatch.setattr(norms_module, "FUSED_RMS_NORM", False)
    monkeypatch.setattr(positions_module, "FUSED_ROTARY", False)
    cfg = CONFIGS[name]
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    args = (tokens, tokens) if cfg.arch == "encoder_decoder" else (tokens,)
    model = build_model(cfg).train()
    twin = copy.deepcopy(model)
    compiled, graphs = trace_graph(twin)
    grads = []
    for run, params in ((model, model), (compiled, twin)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = run(*args).float().square().mean()
        loss.backward()
        grads.append([loss] + [p.grad for p in params.parameters()])
    (graph,) = graphs
    layers = cfg.n_layers * (3 if cfg.arch == "encoder_decoder" else 1)  # self (+ cross, + encoder)
    assert graph.count("= torch.ops.higher_order.autograd_function_apply(") == layers
    assert "scaled_dot_product_attention" not in graph
    for eager, traced in zip(*grads):
        torch.testing.assert_close(traced, eager, rtol=0, atol=0)


def test_eager_calls_still_check_ids() -> None:
    model = build_model(tiny())
    with pytest.raises(ValueError, match="contains id 128"):
        model(torch.tensor([[1, 128]]))
