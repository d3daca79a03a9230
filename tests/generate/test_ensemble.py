"""Ensembles of encoder-decoders (tformer.model.ensemble): the averaged distribution against one written
out from the members' own forwards, the searches against a greedy search done by hand, cached against
uncached, one model twice against the model alone, the evaluation mode kept, and bad members named."""

from __future__ import annotations

import pytest
import torch

from tformer import build_model
from tformer.generate.beam import beam_search, sample_search
from tformer.model.ensemble import Ensemble
from tformer.presets import tiny

PAD, BOS, EOS = 0, 1, 2
SEARCH = dict(bos_id=BOS, eos_id=EOS, max_len=7, banned=(PAD, BOS))


def members(dropout: float = 0.0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two encoder-decoders of one vocabulary but of other shapes and positions, in evaluation mode."""
    torch.manual_seed(0)
    cfg = tiny("encoder_decoder").replace(vocab_size=24, dropout=dropout)
    a = build_model(cfg).eval()
    b = build_model(cfg.replace(n_layers=1, d_ff=96, positions="sinusoidal", norm_placement="post")).eval()
    return a, b


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(3, 24, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(src, dtype=torch.bool)
    mask[2, 4:] = False
    return src.masked_fill(~mask, PAD), mask


def test_the_forward_is_the_log_of_the_members_mean_probability() -> None:
    a, b = members()
    src, mask = batch()
    tgt = torch.randint(3, 24, (3, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mean = (a(src, tgt, mask).softmax(-1) + b(src, tgt, mask).softmax(-1)) / 2
        torch.testing.assert_close(Ensemble([a, b])(src, tgt, mask), mean.log(), atol=1e-5, rtol=1e-5)


def test_greedy_search_picks_the_argmax_of_the_mean_probability_step_by_step() -> None:
    """The cached ensemble search against a greedy search done here with the members' whole forwards."""
    a, b = members()
    src, mask = batch()
    found = sample_search(Ensemble([a, b]), src, mask, **SEARCH)
    with torch.no_grad():
        for i, hyp in enumerate(found):
            prefix = [BOS]
            for _ in range(7):
                tgt = torch.tensor([prefix])
                p = sum(m(src[i : i + 1], tgt, mask[i : i + 1])[0, -1].softmax(-1) for m in (a, b)) / 2
                p[[PAD, BOS]] = 0
                nxt = int(p.argmax())
                if nxt == EOS:
                    break
                prefix.append(nxt)
            assert hyp.tokens == prefix[1:] and hyp.finished == (nxt == EOS)


def test_beam_search_cached_equals_uncached_and_one_model_twice_is_the_model() -> None:
    a, b = members()
    src, mask = batch()
    ensemble = Ensemble([a, b])
    cached = beam_search(ensemble, src, mask, beam_size=3, **SEARCH)
    uncached = beam_search(ensemble, src, mask, beam_size=3, cached=False, **SEARCH)
    assert [h.tokens for h in cached] == [h.tokens for h in uncached]
    assert [h.score for h in cached] == pytest.approx([h.score for h in uncached], abs=1e-5)
    alone = beam_search(a, src, mask, beam_size=3, **SEARCH)
    twice = beam_search(Ensemble([a, a]), src, mask, beam_size=3, **SEARCH)
    assert [h.tokens for h in twice] == [h.tokens for h in alone]
    assert [h.score for h in twice] == pytest.approx([h.score for h in alone], abs=1e-5)
    assert [h.tokens for h in cached] != [h.tokens for h in alone]  # the second member counts


def test_an_ensemble_of_evaluated_models_stays_in_evaluation_mode_after_a_search() -> None:
    """A search restores the mode it found: an ensemble left in training mode had switched its members'
    dropout back on after the search (the loss scored next read higher than either member's)."""
    a, b = members(dropout=0.3)
    ensemble = Ensemble([a, b])
    assert not ensemble.training
    src, mask = batch()
    beam_search(ensemble, src, mask, beam_size=2, **SEARCH)
    assert not a.training and not b.training
    tgt = torch.randint(3, 24, (3, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ensemble(src, tgt, mask), ensemble(src, tgt, mask))  # no dropout
    assert Ensemble([a.train(), b.train()]).training
    assert not Ensemble([a.train(), b.eval()]).training and a.training  # the members' modes left alone


def test_bad_members_are_named() -> None:
    a, b = members()
    with pytest.raises(TypeError, match="an ensemble takes a list of one or more models"):
        Ensemble([])
    with pytest.raises(ValueError, match="an ensemble takes encoder-decoders, got models of arch"):
        Ensemble([a, build_model(tiny("decoder"))])
    other = build_model(tiny("encoder_decoder").replace(vocab_size=30))
    with pytest.raises(
        ValueError, match=r"differ in vocab_size \(\[24, 30\]\): they must share vocabularies"
    ):
        Ensemble([a, other])
    src, mask = batch()
    with pytest.raises(ValueError, match="an ensemble returns log-probabilities"):
        Ensemble([a, b])(src, src, mask, targets=src)
