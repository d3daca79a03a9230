"""KVCache.reorder, which beam search calls every step: the rows it keeps against index_select of the
filled slots, over fan-out, permutations with repeats, shrinking rows and many steps."""

from __future__ import annotations

import pytest
import torch

from tformer.model.cache import KVCache


def filled_kv(cache: KVCache) -> list[torch.Tensor]:
    return [buf[:, :, : cache.lengths[i]].clone() for i, buf in enumerate(cache.k)] + [
        buf[:, :, : cache.lengths[i]].clone() for i, buf in enumerate(cache.v)
    ]


def test_reorder_keeps_the_rows_asked_for_over_many_steps() -> None:
    torch.manual_seed(0)
    cache, layers = KVCache(2, 12), 2
    for layer in range(layers):  # a prefill of 3 positions for 2 sentences
        cache.update(layer, torch.randn(2, 3, 3, 4), torch.randn(2, 3, 3, 4))
    want = filled_kv(cache)
    generator = torch.Generator().manual_seed(1)
    indices = [torch.tensor([0, 0, 0, 1, 1, 1])]  # fan out to 3 beams each
    indices += [torch.randint(0, 6, (6,), generator=generator) for _ in range(4)]  # beams move (repeats)
    indices += [torch.tensor([5, 0, 2]), torch.tensor([1, 1]), torch.tensor([0])]  # sentences finish
    for index in indices:
        cache.reorder(index)
        want = [t.index_select(0, index) for t in want]
        assert [t.shape[0] for t in cache.k] == [len(index)] * layers
        got = filled_kv(cache)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        for layer in range(layers):  # the next step writes its own slot, as a decoding step does
            k, v = torch.randn(len(index), 3, 1, 4), torch.randn(len(index), 3, 1, 4)
            cache.update(layer, k, v)
            want[layer] = torch.cat([want[layer], k], dim=2)
            want[layers + layer] = torch.cat([want[layers + layer], v], dim=2)
        assert all(torch.equal(g, w) for g, w in zip(filled_kv(cache), want))
        assert all(buf.is_contiguous() for buf in cache.k + cache.v)


def test_reorder_under_autograd_stays_differentiable() -> None:
    cache = KVCache(1, 8)
    k = torch.randn(2, 1, 3, 4, requires_grad=True)
    cache.update(0, k, torch.randn(2, 1, 3, 4))
    cache.reorder(torch.tensor([1, 1, 0]))
    cache.k[0][:, :, :3].sum().backward()
    assert torch.equal(k.grad, torch.tensor([1.0, 2.0])[:, None, None, None].expand(2, 1, 3, 4))


def test_a_cache_filled_in_another_dtype_is_refused_before_anything_is_written() -> None:
    """A cache prefilled by an fp32 model and handed to its bf16 copy: one clear error, and the cache
    stays as it was (it had advanced layer 0 and then decoded 0.4 off the full forward)."""
    import pytest

    from tformer import build_model
    from tformer.presets import tiny

    torch.manual_seed(0)
    model = build_model(tiny().replace(dropout=0.0)).eval()
    ids = torch.randint(0, 128, (2, 6))
    cache = model.new_cache(16)
    with torch.no_grad():
        model(ids[:, :5], cache=cache)
        half = build_model(tiny().replace(dropout=0.0)).eval().to(torch.bfloat16)
        with pytest.raises(ValueError, match=r"holds torch.float32 keys/values on cpu, got torch.bfloat16"):
            half(ids[:, 5:], cache=cache)
        assert cache.lengths == [5, 5]
        step = model(ids[:, 5:], cache=cache)[:, -1]
        full = model(ids)[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


def test_truncate_forgets_the_slots_from_its_length_and_never_reveals_unwritten_ones() -> None:
    """A prefilled prompt reused: truncate(n) keeps the first n slots; a length beyond what is filled keeps
    what is filled (the empty slots behind it hold no keys yet); the next update writes at the kept end."""
    torch.manual_seed(0)
    cache = KVCache(2, 10)
    k, v = torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 3)
    for layer in range(2):
        cache.update(layer, k, v)
    cache.truncate(9)
    assert cache.lengths == [4, 4]
    cache.truncate(2)
    assert cache.lengths == [2, 2]
    k2, v2 = torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3)
    keys, values = cache.update(0, k2, v2)
    assert torch.equal(keys, torch.cat([k[:, :, :2], k2], dim=2))
    assert torch.equal(values, torch.cat([v[:, :, :2], v2], dim=2))
    with pytest.raises(ValueError, match="KV cache holds 10 positions; cannot add 8 after 3"):
        cache.update(0, torch.randn(1, 2, 8, 3), torch.randn(1, 2, 8, 3))


# ----------------------------------------------------------------------------- found by a mutation audit
def test_reorder_selects_the_cross_attention_rows_and_names_their_source() -> None:
    """reorder applies index_select to every layer's cross-attention K and V (beam search over an encoder
    memory), and takes `source` as the memory those rows now match."""
    from tformer.model.cache import KVCache

    cache = KVCache(2, 8)
    source = torch.randn(3, 5, 4)
    cache.use_source(source)
    want = [(torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)) for _ in range(2)]
    for layer in range(2):
        cache.update(layer, torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4))
        assert cache.cross(layer, lambda layer=layer: want[layer]) is want[layer]
    index = torch.tensor([2, 2, 0])
    new_source = source.index_select(0, index)
    cache.reorder(index, new_source)
    for layer in range(2):
        k, v = cache.cross_kv[layer]
        assert torch.equal(k, want[layer][0].index_select(0, index))
        assert torch.equal(v, want[layer][1].index_select(0, index))
    assert cache.cross_source is new_source
    cache.use_source(new_source)  # the reordered memory is this cache's source now
    with pytest.raises(ValueError, match="another encoder memory"):
        cache.use_source(source)  # the old one is not
