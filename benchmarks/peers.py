"""The peers of tformer's benchmark models, built once for every script: Hugging Face Llama and
x-transformers' Decoder for the decoder LM, Hugging Face Marian for the encoder-decoder's searches.

`s` is a script's shape dict (vocab, d_model, layers, heads, d_ff). The HF model's weights map onto
tformer's `llama_like` model by renaming (the mapping the parity tests use, tests/model/helpers.py);
tformer's map onto x-transformers' with `tformer_state_for_x_transformers`, which
tests/model/test_parity.py checks (logits equal to 1e-5). A Hugging Face `MarianMTModel` maps onto
tformer's Post-Norm encoder-decoder with `marian_state_for_tformer` and `tformer_marian_config`, which
tests/generate/test_hf_seq2seq_reference.py checks (logits, greedy and beam search).
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

from tformer import ModelConfig, build_model
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


# ----------------------------------------------------------------------------- Hugging Face Marian
MARIAN_BLOCK_NAMES = {  # tformer's name in a block -> Marian's
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.o_proj": "self_attn.out_proj",
    "cross_attn.q_proj": "encoder_attn.q_proj",
    "cross_attn.k_proj": "encoder_attn.k_proj",
    "cross_attn.v_proj": "encoder_attn.v_proj",
    "cross_attn.o_proj": "encoder_attn.out_proj",
    "attn_norm": "self_attn_layer_norm",
    "cross_norm": "encoder_attn_layer_norm",
    "ffn_norm": "final_layer_norm",
    "ffn.up_proj": "fc1",
    "ffn.down_proj": "fc2",
}


EMBEDDINGS = {  # tformer's embeddings and output layer -> Marian's
    "tok_embed.weight": "model.decoder.embed_tokens.weight",
    "decoder.tok_embed.weight": "model.decoder.embed_tokens.weight",
    "src_embed.weight": "model.encoder.embed_tokens.weight",
    "encoder.tok_embed.weight": "model.encoder.embed_tokens.weight",
    "lm_head.weight": "lm_head.weight",
}


def hf_marian(s: dict, max_seq_len: int, **config) -> nn.Module:
    """HF `MarianMTModel` (sdpa) of tformer's Post-Norm encoder-decoder shape: ReLU FFN, embeddings
    scaled by sqrt(d_model) (shared by the encoder, the decoder and the output layer unless
    `tie_word_embeddings=False`), pad 0, the
    decoder starting from id 1, EOS 2, no EOS forced at the length limit; `config`: extra MarianConfig
    fields (they override the ones above)."""
    fields = dict(
        vocab_size=s["vocab"],
        d_model=s["d_model"],
        encoder_layers=s["layers"],
        decoder_layers=s["layers"],
        encoder_attention_heads=s["heads"],
        decoder_attention_heads=s["heads"],
        encoder_ffn_dim=s["d_ff"],
        decoder_ffn_dim=s["d_ff"],
        max_position_embeddings=max_seq_len,
        activation_function="relu",
        dropout=0.0,
        scale_embedding=True,
        pad_token_id=0,
        decoder_start_token_id=1,
        eos_token_id=2,
        bos_token_id=None,
        forced_eos_token_id=None,
    )
    cfg = transformers.MarianConfig(**{**fields, **config})
    return transformers.MarianMTModel._from_config(cfg, attn_implementation="sdpa")


def tformer_marian_config(hf_config) -> ModelConfig:
    """The tformer `ModelConfig` of a Marian config (Post-Norm, sinusoidal positions, ReLU; the
    encoder's, the decoder's and the output layer's embeddings all one or all apart, as
    `tie_word_embeddings` has them in `transformers` 5)."""
    same = (
        hf_config.encoder_attention_heads == hf_config.decoder_attention_heads
        and hf_config.encoder_ffn_dim == hf_config.decoder_ffn_dim
        and hf_config.share_encoder_decoder_embeddings
        and hf_config.activation_function == "relu"
    )
    if not same:
        raise ValueError(
            "only Marian configs with one head count and FFN width, shared embeddings and ReLU map onto tformer"
        )
    return ModelConfig(
        arch="encoder_decoder",
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.d_model,
        n_layers=hf_config.decoder_layers,
        n_encoder_layers=hf_config.encoder_layers,
        n_heads=hf_config.decoder_attention_heads,
        d_ff=hf_config.decoder_ffn_dim,
        max_seq_len=hf_config.max_position_embeddings,
        dropout=0.0,
        norm="layernorm",
        norm_placement="post",
        positions="sinusoidal",
        ffn="relu",
        embed_scale=hf_config.scale_embedding,
        share_embeddings=hf_config.tie_word_embeddings,  # HF ties all three or none
        tie_embeddings=hf_config.tie_word_embeddings,
    )


def marian_hidden_order(d_model: int) -> torch.Tensor:
    """Marian's feature of each of tformer's model features. tformer's sinusoids interleave (feature 2i
    holds sin of frequency i, 2i + 1 its cos, as the paper writes them); Marian's put every sin first
    (feature i) and every cos after (ceil(d/2) + i). The same network in another order of its d_model features:
    every weight that reads or writes them, every norm and the embeddings are reordered alike."""
    k = torch.arange(d_model)
    return torch.where(k % 2 == 0, k // 2, (d_model + 1) // 2 + k // 2)  # an odd d: one sin more than cos


def marian_names(model: nn.Module) -> list[tuple[str, str, str]]:
    """(tformer's name, Marian's name, which axes hold model features) for every tensor of tformer's
    model: "cols" (the weight reads them: q, k, v, FFN up, embeddings), "rows" (writes them: attention
    out, FFN down), "vector" (one value per feature: norms, output biases), "" (none: q/k/v/up biases)."""
    names = []
    for name in model.state_dict():
        if name in EMBEDDINGS:
            names.append((name, EMBEDDINGS[name], "cols"))
            continue
        stack, _, i, rest = name.split(".", 3)  # encoder|decoder, blocks, i, attn.q_proj.weight
        module, kind = rest.rsplit(".", 1)
        writes = module.endswith(("o_proj", "down_proj"))
        if module.endswith("norm") or (writes and kind == "bias"):
            axes = "vector"
        elif writes:
            axes = "rows"
        else:
            axes = "cols" if kind == "weight" else ""
        names.append((name, f"model.{stack}.layers.{i}.{MARIAN_BLOCK_NAMES[module]}.{kind}", axes))
    return names


def _reorder(tensor: torch.Tensor, axes: str, order: torch.Tensor) -> torch.Tensor:
    if axes == "cols":
        return tensor[:, order]
    if axes in ("rows", "vector"):
        return tensor[order]
    return tensor


def marian_state_for_tformer(hf: nn.Module, model: nn.Module) -> dict[str, torch.Tensor]:
    """HF Marian's weights as a state dict of tformer's model built from `tformer_marian_config`, its
    d_model features in tformer's order (`marian_hidden_order`). The final logits bias must be zero
    (tformer's output layer has none)."""
    theirs = hf.state_dict()
    if theirs["final_logits_bias"].any():
        raise ValueError("Marian's final_logits_bias is not zero: tformer's output layer has no bias")
    order = marian_hidden_order(hf.config.d_model)
    return {ours: _reorder(theirs[name], axes, order) for ours, name, axes in marian_names(model)}


MARIAN_FIELDS = (  # what decides the function a tformer encoder-decoder computes
    "arch",
    "vocab_size",
    "resolved_src_vocab_size",
    "share_embeddings",
    "tie_embeddings",
    "d_model",
    "n_layers",
    "resolved_n_encoder_layers",
    "n_heads",
    "resolved_n_kv_heads",
    "resolved_head_dim",
    "d_ff",
    "norm",
    "norm_eps",
    "norm_placement",
    "positions",
    "ffn",
    "bias",
    "embed_scale",
    "moe",
)


def marian_of_tformer(model: nn.Module, pad_id: int, bos_id: int, eos_id: int) -> nn.Module:
    """The HF `MarianMTModel` (sdpa, fp32, evaluation mode) that computes what tformer's Post-Norm
    encoder-decoder `model` does: `marian_state_for_tformer` the other way. The decoder starts from
    `bos_id`; the model must be one Marian can express (`tformer_marian_config` of its config must give
    the model's config back)."""
    cfg = model.cfg
    shape = dict(
        vocab=cfg.vocab_size, d_model=cfg.d_model, layers=cfg.n_layers, heads=cfg.n_heads, d_ff=cfg.d_ff
    )
    hf = hf_marian(
        shape,
        cfg.max_seq_len,
        encoder_layers=cfg.resolved_n_encoder_layers,
        tie_word_embeddings=cfg.tie_embeddings,
        scale_embedding=cfg.embed_scale,
        pad_token_id=pad_id,
        decoder_start_token_id=bos_id,
        eos_token_id=eos_id,
    )
    back = tformer_marian_config(hf.config)
    differ = [f for f in MARIAN_FIELDS if getattr(back, f) != getattr(cfg, f)]
    if differ:
        raise ValueError(
            f"Marian cannot express this model's {', '.join(f'{f}={getattr(cfg, f)!r}' for f in differ)}"
        )
    inverse = torch.argsort(marian_hidden_order(cfg.d_model))
    state = model.state_dict()
    theirs = {name: _reorder(state[ours], axes, inverse) for ours, name, axes in marian_names(model)}
    theirs["model.shared.weight"] = theirs["model.encoder.embed_tokens.weight"]
    missing, unexpected = hf.load_state_dict(theirs, strict=False)
    left = set(missing) - {
        "final_logits_bias",
        *(f"model.{s}.embed_positions.weight" for s in ("encoder", "decoder")),
    }
    if left or unexpected:
        raise ValueError(f"Marian's weights do not match: missing {sorted(left)}, unexpected {unexpected}")
    return hf.eval()


def hf_canonical_outputs(
    hf, src, mask, beams, *, bos, eos, banned, max_len, min_len
) -> list[tuple[list[int], bool]]:
    """HF `generate` with the same settings: its canonical beam search (`length_penalty=0`,
    `early_stopping="never"`: the hypotheses tformer's alpha 0 finds) or greedy; max_len / min_len count
    generated tokens, EOS included, as tformer's do. bos: the decoder's start."""
    with torch.no_grad():
        sequences = hf.generate(
            input_ids=src,
            attention_mask=mask.long(),
            decoder_start_token_id=bos,
            num_beams=beams,
            do_sample=False,
            length_penalty=0.0,
            early_stopping="never",
            max_new_tokens=max_len,
            min_new_tokens=min_len,
            suppress_tokens=banned,
        )
    return hf_outputs(sequences, eos)


def hf_outputs(sequences: torch.Tensor, eos_id: int) -> list[tuple[list[int], bool]]:
    """HF `generate`'s sequences as tformer's hypotheses read: (the tokens before the first EOS, ended
    with EOS), after the decoder's start token (padding follows an EOS; a sequence without one ran to the
    limit and has none)."""
    out = []
    for seq in sequences[:, 1:].tolist():
        ended = eos_id in seq
        out.append((seq[: seq.index(eos_id)] if ended else seq, ended))
    return out
