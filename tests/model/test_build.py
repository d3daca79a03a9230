"""What the configuration builds, checked on the built model: the initialisation schemes' statistics, tied
embeddings, norms without bias, and attention dropout reaching both attention kernels."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tformer import ModelConfig, build_model
from tformer.model import NO_CACHE
from tformer.model.attention import EagerAttention, Mask
from tformer.model.masks import causal_mask
from tformer.presets import tiny

from .helpers import distinct_norms


def big(**changes) -> ModelConfig:
    """Wide enough for standard deviations to be read to a few percent (256 x 1024 weights)."""
    base = dict(vocab_size=512, d_model=256, n_layers=4, n_heads=4, d_ff=1024, max_seq_len=16, bias=True)
    return ModelConfig(**(base | changes))


@pytest.mark.parametrize("scheme", ["xavier", "normal", "scaled"])
def test_init_schemes_by_their_statistics(scheme: str) -> None:
    torch.manual_seed(0)
    cfg = big(init=scheme, init_std=0.02, tie_embeddings=False)
    params = {n: p.detach() for n, p in build_model(cfg).named_parameters()}
    q, down = params["blocks.1.attn.q_proj.weight"], params["blocks.1.ffn.down_proj.weight"]
    embed, head = params["tok_embed.weight"], params["lm_head.weight"]
    if scheme == "xavier":  # Glorot uniform: U(-a, a), a = sqrt(6 / (fan_in + fan_out)), std a / sqrt(3)
        assert float(q.std()) == pytest.approx(math.sqrt(2 / (256 + 256)), rel=0.03)
        assert float(down.std()) == pytest.approx(math.sqrt(2 / (1024 + 256)), rel=0.03)
        assert float(q.abs().max()) <= math.sqrt(6 / 512)
        assert float(embed.std()) == pytest.approx(256**-0.5, rel=0.03)  # N(0, d^-1/2)
    else:
        out = 0.02 / math.sqrt(2 * 4) if scheme == "scaled" else 0.02  # residual outputs, by depth
        assert float(q.std()) == pytest.approx(0.02, rel=0.03)
        assert float(head.std()) == pytest.approx(0.02, rel=0.03)
        assert float(down.std()) == pytest.approx(out, rel=0.03)
        assert float(params["blocks.1.attn.o_proj.weight"].std()) == pytest.approx(out, rel=0.03)
        assert float(embed.std()) == pytest.approx(0.02, rel=0.03)
    assert all(float(p.abs().max()) == 0 for n, p in params.items() if n.endswith("bias"))
    assert all(bool((p == 1).all()) for n, p in params.items() if n.endswith("norm.weight"))


def test_tied_embeddings_share_one_tensor() -> None:
    tied, untied = build_model(big(tie_embeddings=True)), build_model(big(tie_embeddings=False))
    assert tied.lm_head.weight is tied.tok_embed.weight
    assert untied.lm_head.weight is not untied.tok_embed.weight
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(untied) - count(tied) == 512 * 256
    assert "lm_head.weight" not in dict(tied.named_parameters())  # one parameter, saved once


def test_layernorm_without_bias_has_no_bias() -> None:
    state = build_model(big(norm="layernorm_nobias")).state_dict()
    norms = [k for k in state if "norm" in k]
    assert norms and all(k.endswith(".weight") for k in norms), norms
    assert any(k.endswith("norm.bias") for k in build_model(big(norm="layernorm")).state_dict())


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_attention_dropout_reaches_the_kernel(kernel: str) -> None:
    """attn_dropout alone (dropout 0): training forwards differ by seed; evaluation equals attn_dropout 0."""
    cfg = big(d_model=32, d_ff=64, n_layers=2, attn_kernel=kernel, dropout=0.0, attn_dropout=0.3)
    torch.manual_seed(0)
    model = build_model(cfg)
    torch.manual_seed(0)
    plain = build_model(cfg.replace(attn_dropout=0.0)).eval()
    tokens = torch.randint(0, 512, (2, 9))
    torch.manual_seed(1)
    a = model.train()(tokens)
    torch.manual_seed(2)
    assert not torch.allclose(a, model(tokens))
    torch.testing.assert_close(model.eval()(tokens), plain(tokens))


def test_eager_attention_dropout_drops_weights_and_rescales() -> None:
    """The eager kernel's dropout is on the attention weights, kept ones divided by 1 - p."""
    kernel = EagerAttention(0.5).train()
    q, k, v = torch.randn(3, 1, 2, 4, 8).unbind(0)
    allowed = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), -1)
    torch.manual_seed(5)
    out = kernel(q, k, v, Mask(allowed))
    torch.manual_seed(5)
    keep = torch.nn.functional.dropout(torch.ones_like(probs), 0.5)  # the same draw: 0 or 2
    torch.testing.assert_close(out, (probs * keep) @ v)
    assert bool((keep == 0).any())


# ----------------------------------------------------------------------------- found by a mutation audit
@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_residual_dropout_drops_only_the_sublayer_outputs(arch: str, placement: str) -> None:
    """Dropout (training, p 0.5) applies to each sublayer's output before the residual sum, never to the
    residual stream: with every sublayer's output projection zeroed, a Pre-Norm block passes x through
    unchanged and a Post-Norm block returns its norms of x, whatever dropout draws."""
    cfg = tiny(arch).replace(norm="layernorm", bias=True, norm_placement=placement, dropout=0.5)
    model = build_model(cfg).train()
    stack = model if arch == "decoder" else model.decoder
    block = stack.blocks[0]
    with torch.no_grad():
        for lin in (block.attn.o_proj, block.ffn.down_proj) + (
            (block.cross_attn.o_proj,) if arch != "decoder" else ()
        ):
            lin.weight.zero_()
            lin.bias.zero_()
    distinct_norms(block)
    x = torch.randn(2, 5, cfg.d_model)
    positions = torch.arange(5)
    mask = causal_mask(0, 5, None, x.device)
    args = (x, positions, mask, NO_CACHE)
    if arch != "decoder":
        args += (model.encode(torch.randint(0, cfg.vocab_size, (2, 4))),)
    out = block(*args)

    def ln(y, norm):
        return F.layer_norm(y, (cfg.d_model,), norm.weight, norm.bias, norm.eps)

    if placement == "pre":
        expected = x
    else:
        expected = ln(x, block.attn_norm)
        if arch != "decoder":
            expected = ln(expected, block.cross_norm)
        expected = ln(expected, block.ffn_norm)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@torch.no_grad()
def test_embed_scale_with_tied_embeddings_scales_the_input_by_sqrt_d(arch: str) -> None:
    """embed_scale multiplies the token embedding by sqrt(d_model) also when the head shares its weight."""
    cfg = tiny(arch).replace(positions="none", embed_scale=True, tie_embeddings=True)
    model = build_model(cfg).eval()
    stack = model if arch == "decoder" else model.decoder
    seen = []
    stack.blocks[0].register_forward_hook(lambda m, args, out: seen.append(args[0]))
    tokens = torch.randint(0, cfg.vocab_size, (2, 5))
    if arch == "decoder":
        model(tokens)
    else:
        model(tokens, tokens)
    torch.testing.assert_close(seen[0], model.tok_embed.weight[tokens] * cfg.d_model**0.5)
    assert model.lm_head.weight is model.tok_embed.weight


def test_activation_bytes_counts_each_saved_storage_once_without_the_weights() -> None:
    """y = x W^T saves x (and W, a parameter: left out); y * y saves y, twice, counted once."""
    import torch
    from torch import nn

    from tformer.model.stats import activation_bytes

    layer = nn.Linear(4, 3, bias=False)
    x = torch.randn(5, 4, requires_grad=True)

    def loss() -> torch.Tensor:
        y = layer(x)
        return (y * y).sum()

    assert activation_bytes(layer, loss) == x.nbytes + 5 * 3 * 4
    assert layer.weight.grad is not None  # the backward ran
    kept = []  # a storage the forward made and holds without autograd saving it (as selective checkpointing
    # keeps its outputs) counts; the returned loss and what the forward freed do not

    def holding() -> torch.Tensor:
        kept.append(torch.ones(7, 2) * 2)
        return (layer(x) * 3).sum()

    assert activation_bytes(layer, holding) == x.nbytes + 7 * 2 * 4
    outside, counter = torch.randn(100), torch.zeros(1)

    def touching() -> torch.Tensor:  # views and in-place results of tensors made before: not activations
        kept.append(outside[10:20])
        counter.add_(1)
        return (layer(x) * 3).sum()

    assert activation_bytes(layer, touching) == x.nbytes
