"""Bad input raises a specific TypeError/ValueError naming the problem and the allowed range, before
any compute (RELIABILITY D1-D7)."""

from __future__ import annotations

import pytest
import torch

from tformer import ModelConfig, build_model
from tformer.presets import tiny

from .helpers import make


@pytest.fixture
def lm():
    return make(tiny().replace(positions="learned", max_seq_len=16))


def test_token_id_out_of_range(lm) -> None:
    tokens = torch.randint(0, 128, (2, 5))
    tokens[1, 3] = 128
    with pytest.raises(
        ValueError, match=r"contains id 128 at \(batch 1, position 3\); allowed ids are 0..127"
    ):
        lm(tokens)
    tokens[1, 3] = -1
    with pytest.raises(ValueError, match="contains id -1"):
        lm(tokens)


def test_wrong_dtype(lm) -> None:
    for dtype in (torch.float32, torch.int16, torch.uint8):  # uint8 / int16 had failed inside torch
        with pytest.raises(
            TypeError, match=rf"must be a torch.long \(or torch.int32\) tensor, got dtype {dtype}"
        ):
            lm(torch.zeros(2, 5, dtype=dtype))
    ids = torch.ones(1, 2, dtype=torch.long)  # uint8 positions had indexed the table as a mask
    with pytest.raises(
        TypeError, match=r"positions must be a torch.long \(or torch.int32\) tensor, got torch.uint8"
    ):
        lm(ids, positions=torch.tensor([0, 1], dtype=torch.uint8))
    assert torch.equal(lm(ids.int()), lm(ids))
    with pytest.raises(TypeError, match="must be a torch.Tensor of token ids, got list"):
        lm([[1, 2, 3]])


def test_empty_batch_and_sequence(lm) -> None:
    with pytest.raises(ValueError, match=r"empty batch \(batch size 0\)"):
        lm(torch.zeros(0, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"empty sequences \(seq_len 0\)"):
        lm(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must have shape \(batch, seq_len\), got \(5,\)"):
        lm(torch.zeros(5, dtype=torch.long))


@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "rope", "none"])
def test_sequence_longer_than_the_model_allows(positions: str) -> None:
    model = make(tiny().replace(positions=positions, max_seq_len=16))
    model(torch.zeros(1, 16, dtype=torch.long))  # exactly the limit works
    with pytest.raises(
        ValueError, match=r"the sequence reaches position 16 but the model allows at most max_seq_len=16"
    ):
        model(torch.zeros(1, 17, dtype=torch.long))
    seq2seq = make(tiny("encoder_decoder").replace(positions=positions, max_seq_len=16))
    fits, long = torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 17, dtype=torch.long)
    for src, tgt, side in ((long, fits, "source"), (fits, long, "target")):  # which side is too long
        with pytest.raises(ValueError, match=rf"the {side} reaches position 16 but the model allows"):
            seq2seq(src, tgt)


def test_cached_decoding_past_the_limit(lm) -> None:
    cache = lm.new_cache()
    lm(torch.zeros(1, 16, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        lm(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_a_cache_takes_one_batch_and_a_positive_capacity(lm) -> None:
    cache = lm.new_cache()
    lm(torch.zeros(1, 4, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="this KV cache holds a batch of 1 rows, got 2"):
        lm(torch.zeros(2, 1, dtype=torch.long), cache=cache)
    for capacity in (0, -1):
        with pytest.raises(ValueError, match=f"capacity of at least 1 position, got {capacity}"):
            lm.new_cache(capacity)
    # one beyond the context could never be used, and its buffers are allocated whole (10**9 had
    # failed in the allocator, asking for 512 GB)
    with pytest.raises(ValueError, match=rf"a KV cache of 1,000,000,000 positions is more than the model's context \(max_seq_len {lm.cfg.max_seq_len}\)"):  # fmt: skip
        lm.new_cache(10**9)
    assert lm.new_cache(lm.cfg.max_seq_len).capacity == lm.cfg.max_seq_len


def test_a_cache_of_another_model_or_type_is_named(lm) -> None:
    x = torch.zeros(1, 3, dtype=torch.long)
    assert torch.equal(lm(x, cache=None), lm(x))  # None: no cache
    with pytest.raises(
        TypeError, match=r"cache must be a KVCache from model.new_cache\(\) \(or None\), got dict"
    ):
        lm(x, cache={})
    deeper = make(tiny().replace(positions="learned", max_seq_len=16, n_layers=3))
    with pytest.raises(ValueError, match="this KV cache was made for 2 layers; the model has 3"):
        deeper(x, cache=lm.new_cache())
    cache = lm.new_cache()
    lm(x, cache=cache)
    gqa = make(tiny().replace(positions="learned", max_seq_len=16, n_kv_heads=2))
    with pytest.raises(
        ValueError, match=r"holds 4 key/value heads of 16 in layer 0, got 2 of 16: .*another model"
    ):
        gqa(x, cache=cache)


def test_an_encoder_decoder_cache_keeps_to_one_source() -> None:
    """The cross-attention K/V are projected once per source: a cache given another memory refuses it
    (it had decoded against the first source's K/V); truncate(0) starts over for a new source."""
    model = make(tiny().replace(arch="encoder_decoder", n_layers=2)).eval()
    src = torch.randint(0, 128, (2, 5))
    first = model.encode(src)
    other = model.encode(torch.randint(0, 128, (2, 7)))
    tgt = torch.randint(0, 128, (2, 3))
    cache = model.new_cache()
    model.decode(tgt[:, :2], first, cache=cache)
    with pytest.raises(ValueError, match="holds the cross-attention keys/values of another encoder memory"):
        model.decode(tgt[:, 2:], other, cache=cache)
    for bad in ("a", -1, 1.5, True):
        with pytest.raises(ValueError, match="truncate takes a length >= 0"):
            cache.truncate(bad)
    cache.truncate(0)
    cached = model.decode(tgt, other, cache=cache)
    torch.testing.assert_close(cached, model.decode(tgt, other), rtol=0, atol=1e-5)
    again = model.new_cache()  # the same source encoded again for every step: equal values, accepted
    steps = [model.decode(tgt[:, i : i + 1], model.encode(src), cache=again) for i in range(3)]
    torch.testing.assert_close(torch.cat(steps, 1), model.decode(tgt, model.encode(src)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("method", ["beam", "greedy"])
def test_cached_search_under_bf16_autocast(method: str, fast: bool) -> None:
    """Under autocast the decoder casts the memory once per call: the cache is bound to the caller's
    memory, so cached decoding goes on (the cast copy had been taken for another source)."""
    from tformer.generate.beam import SearchConfig, search

    torch.manual_seed(0)
    model = make(tiny().replace(arch="encoder_decoder", n_layers=2)).eval()
    src = torch.randint(4, 128, (3, 6))
    cfg = SearchConfig(method=method, beam_size=3, max_len_a=0.0, max_len_b=5)
    with torch.autocast("cpu", torch.bfloat16):
        hyps = search(model, src, None, cfg, bos_id=1, eos_id=2, fast_decode=fast)
    assert len(hyps) == 3 and all(len(h.tokens) >= 1 for h in hyps)


def test_mask_of_wrong_shape_or_dtype(lm) -> None:
    tokens = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"key_padding_mask must have shape \(2, 5\) \(batch, keys\), got \(2, 4\)"
    ):
        lm(tokens, key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(
        TypeError, match=r"key_padding_mask must be a bool tensor \(True = real token\), got torch.int64"
    ):
        lm(tokens, key_padding_mask=torch.ones(2, 5, dtype=torch.long))


def test_positions_of_wrong_shape(lm) -> None:
    with pytest.raises(ValueError, match=r"positions must have shape \(5,\) or \(2, 5\)"):
        lm(torch.zeros(2, 5, dtype=torch.long), positions=torch.arange(4))


def test_decoder_without_memory_and_mismatched_batches() -> None:
    model = make(tiny("encoder_decoder"))
    src, tgt = torch.zeros(2, 5, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="the decoder needs the encoder memory"):
        model.decode(tgt, None)
    with pytest.raises(ValueError, match="source batch size 2 does not match target batch size 3"):
        model(src, tgt)
    with pytest.raises(ValueError, match="target batch size 3 does not match the encoder memory's 2"):
        model.decode(tgt, model.encode(src))
    other = make(tiny("encoder_decoder").with_overrides({"d_model": 32, "d_ff": 64}))
    with pytest.raises(
        ValueError, match=r"memory's states are \(3, 5, 32\), not \(batch, source length, d_model=64"
    ):
        model.decode(tgt, other.encode(torch.zeros(3, 5, dtype=torch.long)))  # another model's memory
    with pytest.raises(ValueError, match="source tokens contains id 999"):
        model(torch.full((3, 5), 999), tgt)


def test_build_model_rejects_non_config() -> None:
    with pytest.raises(TypeError, match="build_model expects a ModelConfig, got dict"):
        build_model({"d_model": 3})  # type: ignore[arg-type]
    assert isinstance(
        build_model(ModelConfig(n_layers=1, d_model=16, n_heads=2, d_ff=8, vocab_size=10)), torch.nn.Module
    )


# ----------------------------------------------------------------------------- found by a mutation audit
def test_a_refused_decode_call_does_not_pin_the_cache_to_its_source() -> None:
    """A decode call that fails its argument checks before any cross-attention K/V are projected leaves
    the cache free to decode another source."""
    model = build_model(tiny("encoder_decoder")).eval()
    first = model.encode(torch.randint(0, 128, (2, 5)))
    other = model.encode(torch.randint(0, 128, (2, 7)))
    tgt = torch.randint(0, 128, (2, 3))
    cache = model.new_cache()
    with pytest.raises(ValueError):
        model.decode(tgt, first, key_padding_mask=torch.ones(2, 9, dtype=torch.bool), cache=cache)
    torch.testing.assert_close(
        model.decode(tgt, other, cache=cache), model.decode(tgt, other), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("arch", ["encoder", "encoder_decoder"])
def test_a_left_padded_source_is_refused_and_a_right_padded_one_equals_it_unpadded(arch: str) -> None:
    """The encoder numbers positions from the first slot and takes none from the caller: a left-padded
    source had given other outputs than the same tokens unpadded, silently (cls pooling read the pad).
    Right padding computes exactly what the unpadded sequence does; beam search refuses the same mask."""
    from tformer.generate.beam import SearchConfig, search

    torch.manual_seed(0)
    cfg = tiny(arch).replace(dropout=0.0) if arch == "encoder_decoder" else tiny(arch).replace(n_classes=3)
    model = build_model(cfg).eval()
    src, tgt = torch.tensor([[5, 6, 7]]), torch.tensor([[1, 9]])
    left, right = torch.tensor([[0, 5, 6, 7]]), torch.tensor([[5, 6, 7, 0]])
    left_mask, right_mask = (
        torch.tensor([[False, True, True, True]]),
        torch.tensor([[True, True, True, False]]),
    )
    run = (
        (lambda s, m: model(s, m))
        if arch == "encoder"
        else (lambda s, m: model(s, tgt, src_key_padding_mask=m))
    )
    with torch.no_grad():
        torch.testing.assert_close(run(right, right_mask), run(src, None), rtol=1e-6, atol=1e-6)
        with pytest.raises(ValueError, match=r"source key_padding_mask: row 0 has padding before a real token; "
                                             r"pad on the right \(real tokens first\)"):  # fmt: skip
            run(left, left_mask)
    if arch == "encoder_decoder":
        with pytest.raises(ValueError, match="row 1 has padding before a real token"):
            search(model, torch.cat([right, left]), torch.cat([right_mask, left_mask]), SearchConfig(), bos_id=1,
                   eos_id=2)  # fmt: skip
