"""The peers of tformer's dense benchmark model, built once for every script: Hugging Face Llama and
x-transformers' Decoder.

`s` is a script's shape dict (vocab, d_model, layers, heads, d_ff). The HF model's weights map onto
tformer's `llama_like` model by renaming (the mapping the parity tests use, tests/model/helpers.py);
tformer's map onto x-transformers' with `tformer_state_for_x_transformers`, which
tests/model/test_parity.py checks (logits equal to 1e-5).
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from tformer import build_model
from tformer.presets import llama_like

HF_TO_TFORMER = {
    "model.embed_tokens": "tok_embed",
    "model.norm": "final_norm",
    "model.layers": "blocks",
    "self_attn": "attn",
    "mlp": "ffn",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def tformer_llama(s: dict, max_seq_len: int) -> nn.Module:
    return build_model(
        llama_like(s["vocab"], s["d_model"], s["layers"], s["heads"], None, s["d_ff"], max_seq_len)
    )


def hf_llama(s: dict, max_seq_len: int, **config) -> nn.Module:
    """HF `LlamaForCausalLM` (sdpa) of the same shape; `config`: extra LlamaConfig fields."""
    cfg = transformers.LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["d_model"],
        intermediate_size=s["d_ff"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["heads"],
        max_position_embeddings=max_seq_len,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        **config,
    )
    return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")


def hf_llama_state_for_tformer(hf: nn.Module) -> dict[str, torch.Tensor]:
    """HF Llama state dict under tformer's names."""
    out = {}
    for name, tensor in hf.state_dict().items():
        for a, b in HF_TO_TFORMER.items():
            name = name.replace(a, b)
        out[name] = tensor
    return out


def x_transformers_decoder(vocab: int, d_model: int, n_layers: int, n_heads: int, d_ff: int, context: int):
    """x-transformers' `TransformerWrapper(Decoder(...))` set up as a Llama-style decoder: Pre-Norm RMSNorm,
    rotary positions on the whole head (x-transformers rotates only part of it unless told), SwiGLU of
    width d_ff, no absolute positions, an untied head, PyTorch's SDPA attention; everything else as
    x-transformers sets it."""
    from x_transformers import Decoder, TransformerWrapper

    head = d_model // n_heads
    return TransformerWrapper(
        num_tokens=vocab,
        max_seq_len=context,
        use_abs_pos_emb=False,
        tie_embedding=False,
        attn_layers=Decoder(
            dim=d_model,
            depth=n_layers,
            heads=n_heads,
            attn_dim_head=head,
            rotary_pos_emb=True,
            rotary_emb_dim=head,
            use_rmsnorm=True,
            norm_add_unit_offset=False,  # its gains as they are (the default stores gain - 1): the same ops
            ff_glu=True,
            ff_swish=True,
            ff_mult=d_ff / d_model,
            ff_no_bias=True,
            attn_flash=True,
        ),
    )


def tformer_state_for_x_transformers(model: nn.Module) -> dict[str, torch.Tensor]:
    """A tformer `llama_like` DecoderLM state dict under x-transformers' names. x-transformers rotates
    interleaved pairs (2i, 2i+1) where tformer (and HF) rotate halves (i, i + d/2): each head's q and k
    rows are reordered to match (a reordering of both leaves q.k, and so the model, unchanged). Its
    RMSNorm gain `g` multiplies sqrt(d) * x / |x| (tformer's x / rms(x): the same up to the epsilon), and
    its SwiGLU is one product [up; gate] with a bias (set to zero here)."""
    cfg, state = model.cfg, model.state_dict()
    head = cfg.d_model // cfg.n_heads
    interleave = torch.stack([torch.arange(head // 2), torch.arange(head // 2) + head // 2], 1).flatten()
    rows = (torch.arange(cfg.n_heads)[:, None] * head + interleave).flatten()
    out = {
        "token_emb.emb.weight": state["tok_embed.weight"],
        "attn_layers.final_norm.g": state["final_norm.weight"],
        "to_logits.weight": state["lm_head.weight"],
    }
    for i in range(cfg.n_layers):
        b, attn, ffn = f"blocks.{i}.", f"attn_layers.layers.{2 * i}.", f"attn_layers.layers.{2 * i + 1}."
        out[attn + "0.0.g"] = state[b + "attn_norm.weight"]
        out[attn + "1.to_q.weight"] = state[b + "attn.q_proj.weight"][rows]
        out[attn + "1.to_k.weight"] = state[b + "attn.k_proj.weight"][rows]
        out[attn + "1.to_v.weight"] = state[b + "attn.v_proj.weight"]
        out[attn + "1.to_out.weight"] = state[b + "attn.o_proj.weight"]
        out[ffn + "0.0.g"] = state[b + "ffn_norm.weight"]
        up = torch.cat([state[b + "ffn.up_proj.weight"], state[b + "ffn.gate_proj.weight"]])
        out[ffn + "1.ff.0.proj.weight"] = up
        out[ffn + "1.ff.0.proj.bias"] = torch.zeros(up.shape[0])
        out[ffn + "1.ff.2.weight"] = state[b + "ffn.down_proj.weight"]
    return out
