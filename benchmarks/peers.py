"""The Hugging Face Llama peer of tformer's dense benchmark model, built once for every script.

`s` is a script's shape dict (vocab, d_model, layers, heads, d_ff). The HF model's weights map onto
tformer's `llama_like` model by renaming (the mapping the parity tests use, tests/model/helpers.py).
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
