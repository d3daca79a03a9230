"""Small builders shared by the model tests."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tformer import ModelConfig, MoEConfig, build_model


def make(cfg: ModelConfig, **changes) -> nn.Module:
    model = build_model(cfg.replace(**changes))
    return model.eval()


def run(model: nn.Module, tokens: Tensor, **kwargs) -> Tensor:
    """Logits of any architecture on `tokens` (the encoder-decoder decodes the reversed source)."""
    if model.cfg.arch == "encoder_decoder":
        return model(tokens, tokens.flip(1), **kwargs)
    return model(tokens, **kwargs)


def rand_tokens(cfg: ModelConfig, b: int = 2, t: int = 12, lo: int = 0) -> Tensor:
    return torch.randint(lo, cfg.vocab_size, (b, t))


HF_LLAMA_TO_TFORMER = {
    "model.embed_tokens": "tok_embed",
    "model.norm": "final_norm",
    "model.layers": "blocks",
    "self_attn": "attn",
    "mlp": "ffn",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def hf_llama_state_for_tformer(hf: nn.Module) -> dict[str, Tensor]:
    """A Hugging Face `LlamaForCausalLM` state dict under tformer's DecoderLM parameter names."""
    state = {}
    for name, tensor in hf.state_dict().items():
        for a, b in HF_LLAMA_TO_TFORMER.items():
            name = name.replace(a, b)
        state[name] = tensor
    return state


def tiny_llama_pair(n_kv_heads: int = 2, context: int = 64, **hf_options) -> tuple[nn.Module, nn.Module]:
    """(tformer DecoderLM, Hugging Face LlamaForCausalLM) of one tiny random config (vocabulary 96, d_model
    64, 2 layers, 4 heads over `n_kv_heads` K/V heads, FFN 112, `context` positions), HF's weights copied
    into tformer's."""
    import transformers

    from tformer.presets import llama_like

    hf_cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=context,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **hf_options,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    cfg = llama_like(
        vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, d_ff=112, max_seq_len=context
    )
    ours = build_model(cfg).eval()
    missing, unexpected = ours.load_state_dict(hf_llama_state_for_tformer(hf), strict=True)
    assert not missing and not unexpected
    return ours, hf


NO_LOSS = {"aux_loss_coef": 0.0}  # MoE settings without balance losses


def moe_cfg(ffn: str = "swiglu", bias: bool = False, d_model: int = 16, d_ff: int = 24, **moe) -> ModelConfig:
    """A small model config whose FFN slot is an MoE layer with settings `moe`."""
    return ModelConfig(d_model=d_model, d_ff=d_ff, n_heads=4, ffn=ffn, bias=bias, moe=MoEConfig(**moe))


@torch.no_grad()
def distinct_norms(model: nn.Module) -> nn.Module:
    """Every LayerNorm / RMSNorm of `model` given a random weight (and bias): at their initial (1, 0) all
    norms of a block are one function, and a LayerNorm applied twice equals one, so a norm in another's
    slot, or an extra or missing one, is invisible to a parity test."""
    for m in model.modules():
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            m.weight.copy_(1 + 0.5 * torch.randn_like(m.weight))
            if getattr(m, "bias", None) is not None:
                m.bias.copy_(0.5 * torch.randn_like(m.bias))
    return model
