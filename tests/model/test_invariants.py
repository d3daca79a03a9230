"""Invariants every variant must keep: causality, cached decoding == full forward, padding
invariance, the RoPE relative-position property, SDPA == eager, RoPE in cross-attention off by default."""

from __future__ import annotations

import pytest
import torch

from tformer import RopeConfig
from tformer.config import MoEConfig
from tformer.model import NO_CACHE, build_model
from tformer.model.positions import RotaryEmbedding
from tformer.presets import tiny

from .helpers import make, rand_tokens

ROPES = {
    "rope-half": RopeConfig(),
    "rope-interleaved": RopeConfig(layout="interleaved"),
    "rope-partial": RopeConfig(fraction=0.5),
    "rope-linear": RopeConfig(scaling="linear", factor=2.0),
    "rope-ntk": RopeConfig(scaling="ntk", factor=4.0),
    "rope-yarn": RopeConfig(scaling="yarn", factor=4.0, original_max_seq_len=16),
    "rope-yarn-dims": RopeConfig(scaling="yarn", factor=4.0, original_max_seq_len=16, yarn_ramp="dims"),
}
SCHEMES = {"sinusoidal": {}, "learned": {}, "none": {}} | {k: {"rope": v} for k, v in ROPES.items()}


def scheme_changes(name: str) -> dict:
    return {"positions": "rope" if name.startswith("rope") else name, **SCHEMES[name]}


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_causality(placement: str, scheme: str, tiny_cfg) -> None:
    model = make(tiny_cfg, norm_placement=placement, **scheme_changes(scheme))
    tokens = rand_tokens(tiny_cfg, t=16)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 7) % tiny_cfg.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_kv_cache_decoding_equals_full_forward_decoder(scheme: str, kernel: str, tiny_cfg) -> None:
    model = make(tiny_cfg, attn_kernel=kernel, n_kv_heads=2, **scheme_changes(scheme))
    tokens = rand_tokens(tiny_cfg, t=20)
    full = model(tokens)
    cache = model.new_cache(32)
    steps = [model(tokens[:, :8], cache=cache)]  # prefill 8, then one token at a time
    steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(8, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_kv_cache_decoding_equals_full_forward_encoder_decoder(scheme: str, placement: str) -> None:
    cfg = tiny("encoder_decoder")
    model = make(cfg, norm_placement=placement, **scheme_changes(scheme))
    src, tgt = rand_tokens(cfg, t=11), rand_tokens(cfg, t=9)
    src_pad = torch.ones_like(src, dtype=torch.bool)
    src_pad[1, 7:] = False
    full = model(src, tgt, src_key_padding_mask=src_pad)
    memory = model.encode(src, src_pad)
    cache = model.new_cache(16)
    steps = [model.decode(tgt[:, :3], memory, cache=cache)]
    steps += [model.decode(tgt[:, i : i + 1], memory, cache=cache) for i in range(3, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert all(kv is not None for kv in cache.cross_kv)  # memory K/V were computed once and kept


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_gradients_through_cached_calls_equal_the_full_forward(arch: str) -> None:
    cfg = tiny(arch)
    model = make(cfg, dropout=0.0)
    src, tgt = rand_tokens(cfg, t=7), rand_tokens(cfg, t=9)

    def run(x: torch.Tensor, cache=None) -> torch.Tensor:
        return model(x, cache=cache) if arch == "decoder" else model.decode(x, model.encode(src), cache=cache)

    def grads(cached: bool) -> list[torch.Tensor]:
        model.zero_grad()
        if cached:  # a prefill, then two more calls into the same cache, all in one graph
            cache = model.new_cache(16)
            out = torch.cat([run(tgt[:, a:b], cache) for a, b in ((0, 4), (4, 5), (5, 9))], dim=1)
        else:
            out = run(tgt)
        out.square().mean().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    full, cached = grads(False), grads(True)
    assert len(full) == len(cached) > 0
    for a, b in zip(full, cached):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # inference keeps writing into the buffers in place
        cache = model.new_cache(16)
        run(tgt[:, :2], cache)
        buffer = cache.k[0]
        run(tgt[:, 2:3], cache)
        assert cache.k[0] is buffer


def test_cross_attention_kv_computed_once_per_source(monkeypatch) -> None:
    cfg = tiny("encoder_decoder")
    model = make(cfg)
    calls = []
    layer = model.decoder.blocks[0].cross_attn
    original = layer.memory_kv
    monkeypatch.setattr(layer, "memory_kv", lambda m: calls.append(1) or original(m))
    src, tgt = rand_tokens(cfg), rand_tokens(cfg, t=5)
    memory, cache = model.encode(src), model.new_cache(8)
    for i in range(5):
        model.decode(tgt[:, i : i + 1], memory, cache=cache)
    assert len(calls) == 1


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
@pytest.mark.parametrize("scheme", ["sinusoidal", "learned", "rope-half", "none"])
def test_padding_invariance(arch: str, scheme: str) -> None:
    """A right-padded batch gives each sample the same outputs as running it alone."""
    head = dict(n_classes=3, pooling="mean") if arch == "encoder" else {}  # the classifier's settings
    cfg = tiny(arch).replace(**head)
    model = make(cfg, **scheme_changes(scheme))
    lengths = [12, 7, 3]
    samples = [torch.randint(1, cfg.vocab_size, (1, n)) for n in lengths]
    batch = torch.zeros(3, 12, dtype=torch.long)
    pad = torch.zeros(3, 12, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(samples, lengths)):
        batch[i, :n], pad[i, :n] = s[0], True
    if arch == "decoder":
        out = model(batch, key_padding_mask=pad)
        for i, (s, n) in enumerate(zip(samples, lengths)):
            torch.testing.assert_close(out[i : i + 1, :n], model(s), rtol=1e-5, atol=1e-5)
    elif arch == "encoder":
        out = model(batch, key_padding_mask=pad)
        for i, s in enumerate(samples):
            torch.testing.assert_close(out[i : i + 1], model(s), rtol=1e-5, atol=1e-5)
    else:
        tgt = torch.randint(1, cfg.vocab_size, (3, 5))
        out = model(batch, tgt, src_key_padding_mask=pad)
        for i, s in enumerate(samples):
            torch.testing.assert_close(out[i : i + 1], model(s, tgt[i : i + 1]), rtol=1e-5, atol=1e-5)


def test_left_padding_with_positions_matches_unpadded(tiny_cfg) -> None:
    """Left-padded prompts (as in batched generation) with positions counted from the first real token."""
    model = make(tiny_cfg)
    s = rand_tokens(tiny_cfg, b=1, t=6)
    batch = torch.cat([torch.zeros(1, 4, dtype=torch.long), s], dim=1)
    pad = torch.tensor([[False] * 4 + [True] * 6])
    positions = (pad.cumsum(-1) - 1).clamp_min(0)
    out = model(batch, positions=positions, key_padding_mask=pad)
    torch.testing.assert_close(out[:, 4:], model(s), rtol=1e-5, atol=1e-5)


def test_fully_padded_row_is_finite() -> None:
    for arch in ("decoder", "encoder", "encoder_decoder"):
        cfg = tiny(arch)
        model = make(cfg)
        tokens = rand_tokens(cfg, t=6)
        pad = torch.ones(2, 6, dtype=torch.bool)
        pad[1] = False
        if arch == "encoder_decoder":
            out = model(tokens, tokens, src_key_padding_mask=pad, tgt_key_padding_mask=pad)
        else:
            out = model(tokens, key_padding_mask=pad)
        assert torch.isfinite(out).all(), arch


@pytest.mark.parametrize("rope", list(ROPES.values()), ids=list(ROPES))
def test_rope_scores_depend_only_on_relative_position(rope: RopeConfig) -> None:
    rot = RotaryEmbedding(head_dim=16, max_seq_len=64, rope=rope)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)
    rot = rot.double()

    def score(m: int, n: int) -> torch.Tensor:
        return (rot(q, torch.tensor([m])) * rot(k, torch.tensor([n]))).sum()

    for offset in (0, 3, -5):
        ref = score(20, 20 - offset)
        for m in (5, 11, 40, 63):
            if 0 <= m - offset < 64:
                torch.testing.assert_close(score(m, m - offset), ref, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(score(10, 7), score(10, 2))


def test_rope_layouts_are_permutations_of_each_other() -> None:
    half = RotaryEmbedding(16, 32, RopeConfig(layout="half"))
    inter = RotaryEmbedding(16, 32, RopeConfig(layout="interleaved"))
    x = torch.randn(2, 3, 10, 16)
    perm = torch.arange(16).view(2, 8).t().reshape(-1)  # interleaved slot 2j <- half j, 2j+1 <- half j + 8
    pos = torch.arange(10)
    torch.testing.assert_close(inter(x[..., perm], pos), half(x, pos)[..., perm])


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
@pytest.mark.parametrize("scheme", ["sinusoidal", "rope-half", "rope-yarn"])
def test_sdpa_equals_eager(arch: str, scheme: str) -> None:
    cfg = tiny(arch).replace(n_kv_heads=2, **scheme_changes(scheme))
    sdpa, eager = make(cfg, attn_kernel="sdpa"), make(cfg, attn_kernel="eager")
    eager.load_state_dict(sdpa.state_dict())
    tokens = rand_tokens(cfg, t=10)
    pad = torch.ones_like(tokens, dtype=torch.bool)
    pad[0, 6:] = False
    if arch == "encoder_decoder":
        a, b = (m(tokens, tokens[:, :7], src_key_padding_mask=pad) for m in (sdpa, eager))
    else:
        a, b = (m(tokens, key_padding_mask=pad) for m in (sdpa, eager))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rope_not_applied_in_cross_attention_by_default() -> None:
    """Shifting every target position leaves a RoPE encoder-decoder unchanged (self-attention is relative,
    cross-attention unrotated); with rope.cross_attention on, query positions then matter."""
    cfg = tiny("encoder_decoder")
    src, tgt = rand_tokens(cfg), rand_tokens(cfg, t=6)
    for cross, same in ((False, True), (True, False)):
        model = make(cfg, rope=RopeConfig(cross_attention=cross))
        memory = model.encode(src)
        a = model.decode(tgt, memory)
        b = model.decode(tgt, memory, positions=torch.arange(6) + 17)
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5) == same


@pytest.mark.parametrize("positions", ["sinusoidal", "rope"])
def test_a_dtype_round_trip_keeps_the_position_tables_and_expert_biases_float32(positions: str) -> None:
    """`.to(bfloat16)` had rounded the position tables for good (non-persistent: load_state_dict cannot
    restore them; 6e-4 off the logits after `.to(bf16).to(fp32)` + reload) and put the expert biases in
    bf16, where their +-1e-3 updates round one way. Both stay float32 now; the bf16 model computes in bf16."""
    cfg = tiny().replace(positions=positions, moe=MoEConfig(n_experts=4, top_k=2, bias_update_rate=1e-3))
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    want = model(x)
    model.to(torch.bfloat16)
    floats = {n: b.dtype for n, b in model.named_buffers() if b.is_floating_point()}
    assert floats and set(floats.values()) == {torch.float32}, floats
    assert model(x).dtype == torch.bfloat16
    router = next(m for m in model.modules() if hasattr(m, "expert_bias"))
    router.expert_bias.fill_(0.5)
    router.tokens_per_expert.copy_(torch.tensor([10, 0, 0, 0]))  # expert 0 above the mean: its bias falls
    router.update_bias(lambda t: None)  # one process: nothing to sum
    assert router.expert_bias.tolist() == pytest.approx([0.499, 0.501, 0.501, 0.501], abs=1e-7)
    model.to(torch.float32).load_state_dict(state)
    assert torch.equal(model(x), want)


# ----------------------------------------------------------------------------- found by a mutation audit
@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@torch.no_grad()
def test_chunked_prefill_over_a_cache_equals_full_forward(arch: str, kernel: str) -> None:
    """Several tokens per call after the cache holds some (Tq != Tk, no padding): each chunk's queries see
    the cached keys and the chunk's earlier ones (SDPA's top-left causal path would be wrong here)."""
    cfg = tiny(arch).replace(attn_kernel=kernel, n_kv_heads=2)
    model = build_model(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    cache = model.new_cache(16)
    if arch == "decoder":
        full = model(tokens)
        chunks = [model(tokens[:, a:b], cache=cache) for a, b in ((0, 5), (5, 9), (9, 10), (10, 12))]
    else:
        memory = model.encode(tokens.flip(1))
        full = model.decode(tokens, memory)
        chunks = [
            model.decode(tokens[:, a:b], memory, cache=cache) for a, b in ((0, 5), (5, 9), (9, 10), (10, 12))
        ]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_cross_attention_rope_rotates_memory_keys_at_their_source_positions() -> None:
    """With rope.cross_attention, cross-attention is softmax(R(q, target pos) R(k, source pos 0..S-1)^T / sqrt(E)) v,
    written out here with the stack's (separately tested) rotation."""
    import math

    from tformer import RopeConfig

    cfg = tiny("encoder_decoder").replace(rope=RopeConfig(cross_attention=True))
    model = build_model(cfg).eval()
    src = torch.randint(0, cfg.vocab_size, (2, 7))
    memory = model.encode(src)
    attn = model.decoder.blocks[0].cross_attn
    rot = model.decoder.rotary
    x, pos = torch.randn(2, 3, cfg.d_model), torch.arange(4, 7)
    e, h = attn.head_dim, attn.n_heads
    q = rot(attn.q_proj(x).view(2, 3, h, e).transpose(1, 2), pos)
    k = rot(attn.k_proj(memory.states).view(2, 7, -1, e).transpose(1, 2), torch.arange(7))
    v = attn.v_proj(memory.states).view(2, 7, -1, e).transpose(1, 2)
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(e), dim=-1)
    expected = attn.o_proj((w @ v).transpose(1, 2).reshape(2, 3, h * e))
    torch.testing.assert_close(attn(x, pos, memory, NO_CACHE), expected, rtol=1e-5, atol=1e-5)
