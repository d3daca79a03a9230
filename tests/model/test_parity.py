"""Parity against references others wrote: torch.nn.Transformer (Post- and Pre-Norm) and Hugging Face
LlamaForCausalLM, weights copied across; the sinusoidal table against the paper's formula."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from torch import nn

from tformer import ModelConfig, build_model
from tformer.model import NO_CACHE
from tformer.model.positions import sinusoidal_table

from .helpers import distinct_norms, tiny_llama_pair


def test_sinusoidal_table_is_the_papers_formula() -> None:
    d, table = 10, sinusoidal_table(50, 10)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def _copy_mha(ours, mha: nn.MultiheadAttention) -> None:
    wq, wk, wv = mha.in_proj_weight.chunk(3)
    bq, bk, bv = mha.in_proj_bias.chunk(3)
    for proj, w, b in ((ours.q_proj, wq, bq), (ours.k_proj, wk, bk), (ours.v_proj, wv, bv)):
        proj.weight.copy_(w)
        proj.bias.copy_(b)
    ours.o_proj.weight.copy_(mha.out_proj.weight)
    ours.o_proj.bias.copy_(mha.out_proj.bias)


def _copy_ffn_norms(block, layer, norms: tuple[str, ...]) -> None:
    block.ffn.up_proj.load_state_dict(layer.linear1.state_dict())
    block.ffn.down_proj.load_state_dict(layer.linear2.state_dict())
    for ours, theirs in zip(norms, ("norm1", "norm2", "norm3")):
        getattr(block, ours).load_state_dict(getattr(layer, theirs).state_dict())


@pytest.mark.parametrize("trained_norms", [False, True])
@pytest.mark.parametrize("norm_first", [False, True])
@torch.no_grad()
def test_encoder_decoder_matches_torch_nn_transformer(norm_first: bool, trained_norms: bool) -> None:
    """trained_norms: every LayerNorm with a random weight and bias (see `distinct_norms`), so that a norm
    in the wrong slot or an extra final norm shows."""
    d, h, ff, n_enc, n_dec = 32, 4, 64, 2, 3
    ref = nn.Transformer(d, h, n_enc, n_dec, ff, dropout=0.0, batch_first=True, norm_first=norm_first).eval()
    if not norm_first:  # the paper's Post-Norm stack ends in its last block's norm; nn.Transformer adds one
        ref.encoder.norm, ref.decoder.norm = nn.Identity(), nn.Identity()
    if trained_norms:
        distinct_norms(ref)
    cfg = ModelConfig(
        arch="encoder_decoder",
        vocab_size=50,
        d_model=d,
        n_heads=h,
        d_ff=ff,
        n_layers=n_dec,
        n_encoder_layers=n_enc,
        dropout=0.0,
        norm_placement="pre" if norm_first else "post",
        positions="none",
        embed_scale=False,
    )
    ours = build_model(cfg).eval()
    for block, layer in zip(ours.encoder.blocks, ref.encoder.layers):
        _copy_mha(block.attn, layer.self_attn)
        _copy_ffn_norms(block, layer, ("attn_norm", "ffn_norm"))
    for block, layer in zip(ours.decoder.blocks, ref.decoder.layers):
        _copy_mha(block.attn, layer.self_attn)
        _copy_mha(block.cross_attn, layer.multihead_attn)
        _copy_ffn_norms(block, layer, ("attn_norm", "cross_norm", "ffn_norm"))
    if norm_first:
        ours.encoder.final_norm.load_state_dict(ref.encoder.norm.state_dict())
        ours.decoder.final_norm.load_state_dict(ref.decoder.norm.state_dict())

    src, tgt = torch.randint(0, 50, (3, 11)), torch.randint(0, 50, (3, 7))
    src_pad = torch.ones(3, 11, dtype=torch.bool)
    src_pad[1, 6:] = False
    src_emb, tgt_emb = ours.src_embed(src), ours.tok_embed(tgt)
    expected = ref(
        src_emb,
        tgt_emb,
        tgt_mask=ref.generate_square_subsequent_mask(7),
        tgt_is_causal=True,
        src_key_padding_mask=~src_pad,
        memory_key_padding_mask=~src_pad,
    )
    memory = ours.encode(src, src_pad)
    hidden = ours.decoder(tgt, torch.arange(7), None, NO_CACHE, memory)
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    print(
        f"max |diff| vs torch.nn.Transformer (norm_first={norm_first}):",
        (hidden - expected).abs().max().item(),
    )


@torch.no_grad()
def test_decoder_matches_hf_llama() -> None:
    ours, hf = tiny_llama_pair(rope_theta=10000.0, attention_bias=False, mlp_bias=False)
    tokens = torch.randint(0, 96, (2, 17))
    torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)
    # Max absolute logit difference measured when this test was written: printed for the record.
    print("max |logit diff| vs HF Llama:", (ours(tokens) - hf(tokens).logits).abs().max().item())


@torch.no_grad()
def test_decoder_matches_x_transformers() -> None:
    """tformer's Llama-style decoder against x-transformers' Decoder (Pre-Norm RMSNorm, rotary, SwiGLU)
    with the same weights: logits equal to 1e-5. x-transformers is the third library users train such
    decoders with (benchmarks/bench_lm.py measures it beside HF)."""
    from benchmarks.peers import tformer_state_for_x_transformers, x_transformers_decoder
    from tformer.presets import llama_like

    torch.manual_seed(0)
    # x-transformers' RMSNorm is sqrt(d) * x / max(|x|, 1e-12): tformer's with an epsilon that small
    ours = build_model(llama_like(96, 64, 2, 4, None, 112, 64).replace(norm_eps=1e-12)).eval()
    for p in ours.parameters():  # norm gains away from 1 and a head of ordinary scale
        p.add_(torch.randn_like(p) * 0.02)
    xt = x_transformers_decoder(96, 64, 2, 4, 112, 64).eval()
    mapped = tformer_state_for_x_transformers(ours)
    assert mapped.keys() == dict(xt.named_parameters()).keys()  # every parameter (the rest: rotary buffers)
    xt.load_state_dict({**xt.state_dict(), **mapped}, strict=True)
    tokens = torch.randint(0, 96, (2, 17))
    torch.testing.assert_close(ours(tokens), xt(tokens), rtol=1e-5, atol=1e-5)
    print("max |logit diff| vs x-transformers:", (ours(tokens) - xt(tokens)).abs().max().item())


@pytest.mark.parametrize(
    ("hidden", "heads", "factor", "original", "theta"),
    [
        (4096, 32, 4.0, 4096, 10000.0),
        (64, 4, 4.0, 16, 10000.0),
        (512, 8, 8.0, 256, 500000.0),
        (96, 3, 2.0, 64, 10000.0),
    ],
)
def test_yarn_dims_ramp_equals_hugging_faces_frequencies(hidden, heads, factor, original, theta) -> None:
    """yarn_ramp="dims" is the YaRN authors' code as Hugging Face runs it (YaRN weights trained there keep
    their frequencies); the default "rotations" ramp is the paper's formula and differs in between."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tformer import RopeConfig
    from tformer.model.positions import rope_inv_freq

    hf_cfg = transformers.LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        max_position_embeddings=int(original * factor),
        rope_theta=theta,  # where transformers 4.x reads it (5.x: in rope_scaling)
        rope_scaling={"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
                      "rope_theta": theta},
    )  # fmt: skip
    theirs, their_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    rope = RopeConfig(
        theta=theta, scaling="yarn", factor=factor, original_max_seq_len=original, yarn_ramp="dims"
    )
    ours, scale = rope_inv_freq(hidden // heads, rope, int(original * factor))
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(their_scale, rel=1e-12)
    paper, _ = rope_inv_freq(hidden // heads, rope.replace(yarn_ramp="rotations"), int(original * factor))
    assert not torch.allclose(paper.float(), theirs.float(), rtol=1e-3)
