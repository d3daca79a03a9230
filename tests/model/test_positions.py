"""Position encodings against formulas written out here (the papers') and Hugging Face's frequency code:
RoPE scaling (linear, NTK-aware, YaRN's ramp and temperature), partial rotary, RoPE in cross-attention,
and how the input-position tables and the embedding scale are added."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import transformers

from tformer import RopeConfig
from tformer.model.positions import RotaryEmbedding, make_rotary, rope_inv_freq, sinusoidal_table
from tformer.presets import tiny

from .helpers import make, rand_tokens


def test_linear_scaling_equals_hugging_faces_frequencies() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=256, rope_theta=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    )  # fmt: skip
    theirs, their_scale = ROPE_INIT_FUNCTIONS["linear"](hf_cfg, "cpu")
    ours, scale = rope_inv_freq(32, RopeConfig(scaling="linear", factor=4.0), 256)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-6, atol=0)
    assert scale == their_scale == 1.0


def test_ntk_scaling_by_hand() -> None:
    """base' = base * s^(d / (d - 2)): the highest frequency is kept, the lowest divided by s exactly."""
    d, theta, s = 16, 10000.0, 4.0
    ours, scale = rope_inv_freq(d, RopeConfig(theta=theta, scaling="ntk", factor=s), 64)
    base = theta * s ** (d / (d - 2))
    want = torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    torch.testing.assert_close(ours, want, rtol=1e-12, atol=0)
    assert ours[0] == 1.0 and float(ours[-1]) == pytest.approx(theta ** (-(d - 2) / d) / s, rel=1e-12)
    assert scale == 1.0


def test_yarn_rotations_ramp_by_hand() -> None:
    """The paper's ramp: a pair that turns at least beta_fast times in the trained context keeps its
    frequency, one that turns at most beta_slow times is interpolated (/ s), linear in r between."""
    d, theta, s, original = 64, 10000.0, 4.0, 512
    rope = RopeConfig(theta=theta, scaling="yarn", factor=s, original_max_seq_len=original)
    ours, scale = rope_inv_freq(d, rope, original * 4)
    fast, slow = rope.yarn_beta_fast, rope.yarn_beta_slow
    regimes = set()
    for i in range(d // 2):
        theta_i = theta ** (-2 * i / d)
        r = original * theta_i / (2 * math.pi)
        if r >= fast:
            want, regime = theta_i, "kept"
        elif r <= slow:
            want, regime = theta_i / s, "interpolated"
        else:
            g = (r - slow) / (fast - slow)
            want, regime = (1 - g) * theta_i / s + g * theta_i, "blended"
        regimes.add(regime)
        assert float(ours[i]) == pytest.approx(want, rel=1e-12), i
    assert regimes == {"kept", "interpolated", "blended"}
    assert scale == pytest.approx(0.1 * math.log(s) + 1)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_the_yarn_temperature_scales_the_rotation_tables(layout: str) -> None:
    rope = RopeConfig(scaling="yarn", factor=4.0, original_max_seq_len=16, layout=layout)
    inv_freq, scale = rope_inv_freq(8, rope, 64)
    rot = make_rotary(8, 64, rope)
    angle = torch.arange(64, dtype=torch.float64)[:, None] * inv_freq
    torch.testing.assert_close(rot.cos, (angle.cos() * scale).float())
    torch.testing.assert_close(rot.sin, (angle.sin() * scale).float())
    x = torch.randn(1, 1, 3, 8)
    y = rot(x, torch.arange(3))  # a rotation times the temperature: lengths grow by `scale`
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1) * scale)


def test_partial_rotary_rotates_the_first_features_and_keeps_the_rest() -> None:
    """fraction 0.5 of head_dim 16: features 0-7 rotate in pairs (j, j + 4) at theta^(-2j/8) (the
    GPT-NeoX / Hugging Face partial_rotary_factor layout); features 8-15 pass through unchanged."""
    rot = RotaryEmbedding(16, 32, RopeConfig(fraction=0.5))
    x = torch.randn(2, 3, 5, 16)
    positions = torch.arange(5) + 7
    y = rot(x, positions)
    assert torch.equal(y[..., 8:], x[..., 8:])
    inv = torch.tensor([10000.0 ** (-2 * j / 8) for j in range(4)], dtype=torch.float64)
    angle = (positions[:, None].double() * inv).float()  # (T, 4)
    x1, x2 = x[..., :4], x[..., 4:8]
    want = torch.cat((x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()), -1)
    torch.testing.assert_close(y[..., :8], want)


def test_rope_in_cross_attention_rotates_the_memory_keys_by_their_positions() -> None:
    """With rope.cross_attention on, scores depend on target position minus source position: shifting
    both by the same offset leaves the output unchanged (unrotated keys would not)."""
    cfg = tiny("encoder_decoder")
    model = make(cfg, rope=RopeConfig(cross_attention=True))
    src, tgt = rand_tokens(cfg), rand_tokens(cfg, t=6)
    memory = model.encode(src)
    shifted = dataclasses.replace(memory, positions=memory.positions + 17)
    a = model.decode(tgt, memory)
    b = model.decode(tgt, shifted, positions=torch.arange(6) + 17)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    c = model.decode(tgt, shifted)  # only the source moved: the relative positions change
    assert not torch.allclose(a, c, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
@pytest.mark.parametrize("embed_scale", [True, False])
def test_input_positions_are_added_to_the_scaled_token_embedding(positions: str, embed_scale: bool) -> None:
    cfg = tiny().replace(positions=positions, embed_scale=embed_scale, dropout=0.0)
    model = make(cfg)
    tokens, pos = rand_tokens(cfg, t=5), torch.arange(5) + 3
    table = sinusoidal_table(cfg.max_seq_len, cfg.d_model) if positions == "sinusoidal" else None
    table = table if table is not None else model.input_positions.pos_embed.weight
    scale = math.sqrt(cfg.d_model) if embed_scale else 1.0
    want = model.tok_embed(tokens) * scale + table[pos]
    torch.testing.assert_close(model.embed(tokens, pos), want)


@pytest.mark.parametrize(
    "changes",
    [
        {"positions": "rope"},
        {
            "positions": "rope",
            "rope": RopeConfig(layout="interleaved", fraction=0.5, scaling="yarn", factor=2.0),
        },
        {"positions": "sinusoidal"},
        {"arch": "encoder_decoder", "positions": "sinusoidal"},
    ],
    ids=["rope-half", "rope-interleaved-yarn", "sinusoidal", "enc-dec"],
)
def test_a_model_built_on_meta_computes_its_position_tables_when_it_gets_storage(changes, tmp_path) -> None:
    """The recipe tformer's own meta-device error gives (to_empty, then load_weights): the position tables
    are computed, not saved, and had stayed uninitialised memory (wrong logits or NaN)."""
    from tformer import build_model
    from tformer.train.weights import load_weights, save_weights

    cfg = tiny(changes.get("arch", "decoder")).replace(**{k: v for k, v in changes.items() if k != "arch"})
    torch.manual_seed(0)
    built = build_model(cfg).eval()
    save_weights(built, tmp_path / "w.safetensors")
    with torch.device("meta"):
        shell = build_model(cfg)
    shell = shell.to_empty(device="cpu").eval()
    load_weights(shell, tmp_path / "w.safetensors")
    for (name, a), b in zip(built.named_buffers(), shell.buffers()):
        assert torch.equal(a, b), name
    tokens = rand_tokens(cfg, 2, 9)
    with torch.no_grad():
        args = (tokens, tokens) if cfg.arch == "encoder_decoder" else (tokens,)
        assert torch.equal(shell(*args), built(*args))
        shell.share_memory()  # the tables are computed into the shared tensors, which stay shared
        assert all(b.is_shared() for b in shell.buffers()) and torch.equal(shell(*args), built(*args))
        with torch.device("meta"):  # the other recipe: load_state_dict(assign=True), which applies nothing
            assigned = build_model(cfg)
        assigned.load_state_dict(built.state_dict(), assign=True)
        assert torch.equal(assigned.eval()(*args), built(*args))
