"""Sampling functions on logits (B, V) and SamplingConfig."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from tformer.generate.sampling import (
    SamplingConfig,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    make_generator,
    sample_next,
    sample_with_config,
)
from tformer.schema import ConfigError

NEG_INF = float("-inf")


def logits_from_probs(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log()


def test_temperature_scales():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    assert torch.equal(apply_temperature(logits, 2.0), torch.tensor([[1.0, -0.5, 0.25]]))
    with pytest.raises(ValueError, match="temperature"):
        apply_temperature(logits, 0.0)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_k_and_the_ties_of_the_kth(k):
    logits = torch.tensor([[0.1, 5.0, 5.0, 5.0, -2.0, 3.0, 5.0, 0.0], [1.0] * 8, [*range(8)]])  # ties
    out = apply_top_k(logits, k)
    # row 0: the four 5.0s tie (k <= 4 keeps them all); row 1: all tie; row 2: no ties, exactly k
    assert out.isfinite().sum(-1).tolist() == [{1: 4, 3: 4, 7: 7}[k], 8, k]
    kept = out.isfinite()
    assert torch.equal(out[kept], logits[kept])  # kept values unchanged
    assert (logits[0][kept[0]].min() >= logits[0][~kept[0]].max()).item()  # and they are the largest
    assert torch.equal(apply_top_k(logits, 0), logits) and torch.equal(apply_top_k(logits, 8), logits)


def test_top_p_keeps_ties_with_the_last_kept_token_in_any_vocabulary_order():
    """Sorted 0.534, 0.197, 0.197, 0.072: mass 0.6 is crossed by the first 0.197; its twin stays too."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    assert apply_top_p(logits, 0.6)[0].isfinite().tolist() == [True, True, True, False]
    for perm in ([3, 2, 1, 0], [1, 3, 0, 2], [2, 0, 3, 1]):
        out = apply_top_p(logits[:, perm], 0.6)
        assert torch.equal(out, apply_top_p(logits, 0.6)[:, perm]), perm


def test_top_p_hand_computed():
    logits = logits_from_probs([0.05, 0.5, 0.15, 0.3], [0.25, 0.25, 0.25, 0.25])
    # row 0 sorted: 0.5, 0.3, 0.15, 0.05 -> mass before each: 0, 0.5, 0.8, 0.95
    assert apply_top_p(logits, 0.4)[0].isfinite().tolist() == [False, True, False, False]
    assert apply_top_p(logits, 0.7)[0].isfinite().tolist() == [False, True, False, True]  # 0.3 crosses 0.7
    assert apply_top_p(logits, 0.9)[0].isfinite().tolist() == [False, True, True, True]
    assert apply_top_p(logits, 0.99)[0].isfinite().all()
    assert apply_top_p(logits, 1e-9)[0].isfinite().sum() == 1  # never empty
    assert apply_top_p(logits, 0.6)[1].isfinite().all()  # uniform: every token ties with the last kept
    assert apply_top_p(logits, 1e-9)[1].isfinite().all()
    out = apply_top_p(logits, 0.7)
    assert torch.equal(out[out.isfinite()], logits[out.isfinite()])
    with pytest.raises(ValueError, match="top_p"):
        apply_top_p(logits, 0.0)


def test_repetition_penalty_hand_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -4.0], [2.0, -1.0, 0.5, 3.0, -4.0]])
    prev = torch.tensor([[0, 1, 1, 0], [4, 9, 9, 9]])  # row 1 is right-padded with an out-of-range id 9
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    out = apply_repetition_penalty(logits, prev, 2.0, mask)
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0, -4.0], [2.0, -1.0, 0.5, 3.0, -8.0]]
    assert torch.equal(apply_repetition_penalty(logits, prev, 1.0, mask), logits)
    pad0 = torch.tensor([[3, 0, 0], [3, 0, 0]])  # pad id 0 is a real token id: the mask decides
    out = apply_repetition_penalty(logits, pad0, 2.0, pad0 != 0)
    assert out[:, 0].tolist() == [2.0, 2.0] and out[:, 3].tolist() == [1.5, 1.5]
    with pytest.raises(ValueError, match="prev_ids"):
        apply_repetition_penalty(logits, prev, 2.0)  # id 9 unmasked


def test_temperature_to_zero_is_greedy():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    greedy = sample_next(logits, temperature=0.0, generator=None)
    assert torch.equal(greedy, logits.argmax(-1))
    cold = sample_next(logits, temperature=1e-6, generator=make_generator(0))
    assert torch.equal(cold, greedy)


def test_tiny_temperature_or_penalty_picks_the_top_token_instead_of_nan():
    """Values this small take finite logits to +-inf (or, below float32's range, are 0 there); the softmax
    had given NaN and torch had raised."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2)) * 5
    greedy = logits.argmax(-1)
    for t in (1e-39, 1e-45, 1e-46, 1e-320):  # the last two are 0 in float32
        assert torch.equal(sample_next(logits, temperature=t, generator=make_generator(0)), greedy)
        assert torch.equal(sample_next(logits - 100, temperature=t, generator=make_generator(0)), greedy)
    masked = logits.clone()
    masked[:, greedy[0]] = NEG_INF  # a filtered token stays filtered
    cold = sample_next(masked, temperature=1e-39, generator=make_generator(0))
    assert torch.equal(cold, masked.argmax(-1))
    prev = torch.arange(50).repeat(6, 1)  # every token seen
    tiny = apply_repetition_penalty(logits, prev, 1e-40)  # positive logits grow 1e40-fold: the top wins
    for seed in range(5):
        assert torch.equal(sample_next(tiny, temperature=1.0, generator=make_generator(seed)), greedy)
    assert torch.equal(tiny.argmax(-1), greedy) and bool((tiny.amax(-1) == 0).all())  # shifted, top kept
    huge = apply_repetition_penalty(logits, prev, 1e40)  # positive logits shrink to ~0, negative to -inf
    draws = sample_next(huge, temperature=1.0, generator=make_generator(0))
    assert bool((logits.gather(1, draws[:, None]) > 0).all())


def test_seeded_sampling_is_deterministic():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))

    def draw(seed: int) -> torch.Tensor:
        gen = make_generator(seed)
        return torch.stack(
            [sample_next(logits, temperature=1.5, top_k=40, top_p=0.95, generator=gen) for _ in range(5)]
        )

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))
    assert draw(7).dtype == torch.long and draw(7).shape == (5, 8)


def test_filters_are_respected_by_samples():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(3)).expand(2000, 30)
    ids = sample_next(logits, top_k=4, generator=make_generator(0))
    assert set(ids.tolist()) <= set(logits[0].topk(4).indices.tolist())


def test_samples_follow_softmax():
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 20000
    ids = sample_next(probs.log().expand(n, -1), temperature=1.0, generator=make_generator(1234))
    counts = torch.bincount(ids, minlength=5).double()
    expected = probs.double() * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 25.0, chi2  # 4 degrees of freedom: P(chi2 > 25) ~ 5e-5; the seed is fixed anyway

    ids = sample_next(probs.log().expand(n, -1), temperature=2.0, generator=make_generator(5))
    tempered = (probs.log() / 2.0).softmax(-1).double() * n
    counts = torch.bincount(ids, minlength=5).double()
    assert ((counts - tempered) ** 2 / tempered).sum().item() < 25.0


def test_sample_with_config():
    logits = torch.tensor([[5.0, 4.9, -3.0]])
    cfg = SamplingConfig(temperature=0.0, repetition_penalty=10.0)
    assert sample_with_config(logits, cfg, generator=None).tolist() == [0]
    out = sample_with_config(logits, cfg, generator=None, prev_ids=torch.tensor([[0]]))
    assert out.tolist() == [1]  # 5.0 / 10 < 4.9


def test_config_defaults_and_round_trip():
    cfg = SamplingConfig()
    assert (cfg.temperature, cfg.top_k, cfg.top_p, cfg.repetition_penalty) == (1.0, 0, 1.0, 1.0)
    assert (cfg.max_new_tokens, cfg.seed, cfg.stop_strings) == (128, 0, ())
    cfg = SamplingConfig(temperature=0.7, top_k=50, stop_strings=["\n\n", "###"])
    assert cfg.stop_strings == ("\n\n", "###")
    assert SamplingConfig.from_json(cfg.to_json()) == cfg
    assert SamplingConfig.from_yaml(cfg.to_yaml()) == cfg
    assert SamplingConfig(temperature=1).temperature == 1.0 and isinstance(
        SamplingConfig(top_p=1).top_p, float
    )


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"top_k": 2.5}, "top_k"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop_strings": "###"}, "stop_strings"),
        ({"stop_strings": ["ok", ""]}, "stop_strings"),
    ],
)
def test_config_rejects(changes, field):
    with pytest.raises(ConfigError, match=f"SamplingConfig.{field}"):
        SamplingConfig(**changes)


def test_config_rejects_unknown_key():
    with pytest.raises(ConfigError, match="unknown key 'top_n'"):
        SamplingConfig.from_dict({"top_n": 3})


def test_chi2_bound_is_loose_but_meaningful():
    """The bound above would catch a sampler that ignores the logits (uniform draws)."""
    n, probs = 20000, torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    counts = torch.full((5,), n / 5, dtype=torch.float64)
    expected = probs.double() * n
    assert ((counts - expected) ** 2 / expected).sum().item() > 25.0


def test_the_sampling_helpers_name_what_they_cannot_use():
    """A row with every token masked had come back as id 0 (greedy) or failed inside torch.multinomial;
    integer logits, float prev_ids and an infinite temperature failed deep in torch or passed."""
    logits = torch.tensor([[0.5, 2.0, 1.0], [NEG_INF, NEG_INF, NEG_INF]])
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match="every logit of row 1 is -inf: all its tokens are masked"):
            sample_next(logits, temperature=temperature, generator=make_generator(0))
    with pytest.raises(TypeError, match="logits must be a floating-point tensor"):
        apply_top_k(torch.ones(1, 4, dtype=torch.long), 2)
    with pytest.raises(TypeError, match="prev_ids must be a torch.long"):
        apply_repetition_penalty(logits[:1], torch.tensor([[1.0]]), 1.3)
    ints = apply_repetition_penalty(logits[:1], torch.tensor([[1]], dtype=torch.int32), 2.0)
    assert ints[0].tolist() == [0.5, 1.0, 1.0]
    for call in (
        lambda: apply_temperature(logits, math.inf),
        lambda: sample_next(logits, temperature=math.inf, generator=None),
    ):
        with pytest.raises(ValueError, match="temperature must be finite"):
            call()


def test_left_padding_is_not_history_for_the_repetition_penalty():
    """A ragged batch is left-padded; the pad id must not count as a token the short row has seen."""
    from tformer import build_model
    from tformer.generate.engine import generate
    from tformer.presets import llama_like

    torch.manual_seed(0)
    model = build_model(llama_like(97, 32, 2, 4, 2, 64, 64)).eval()
    long, short = [5, 17, 33, 2, 9, 41], [60, 3]
    cfg = SamplingConfig(temperature=0.0, repetition_penalty=50.0, max_new_tokens=8)
    alone = generate(model, [short], cfg)[0]
    pad = alone[0]  # the short row's own first pick: penalised 50x if its padding were history
    batch = generate(model, [long, short], cfg, pad_id=pad)
    assert batch[1] == alone
    assert batch[0] == generate(model, [long], cfg)[0]


# ----------------------------------------------------------------------------- found by a mutation audit
def nucleus(probs: list[float], top_p: float) -> set[int]:
    """Naive top-p: the most likely tokens, best first, until their mass reaches top_p (the token that
    reaches it included), plus every token tied with the last one kept."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = [], Fraction(0)
    for i in order:
        if mass >= Fraction(top_p):
            break
        kept.append(i)
        mass += Fraction(probs[i])
    return {i for i in range(len(probs)) if probs[i] >= min(probs[j] for j in kept)}


def test_top_p_stops_at_the_token_whose_mass_reaches_top_p_exactly() -> None:
    """Dyadic probabilities, exact in float32: after 0.5 the mass is exactly 0.5, so top_p 0.5 keeps one
    token (the set already reaches p); 0.75 is reached by the second. A `>` for `>=` kept one more."""
    probs = [0.125, 0.5, 0.125, 0.25]
    logits = torch.tensor([probs]).log()
    assert torch.equal(logits.softmax(-1), torch.tensor([probs]))  # the premise: no rounding anywhere
    for top_p in (0.5, 0.75, 0.875, 0.9):
        kept = apply_top_p(logits, top_p)[0].isfinite()
        assert {i for i in range(4) if kept[i]} == nucleus(probs, top_p), top_p


def test_top_p_filters_the_tempered_distribution() -> None:
    """Temperature comes first: the nucleus is taken over softmax(logits / T), not over softmax(logits).
    p = .5 .3 .15 .05, top_p .6: at T 4 the flatter distribution needs three tokens, at T 0.25 the sharper
    one only the first (over the untempered one it would be two both times)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    n = 4000
    for temperature in (4.0, 0.25):
        tempered = (probs.log() / temperature).softmax(-1).tolist()
        expected = nucleus(tempered, 0.6)
        assert expected == ({0, 1, 2} if temperature == 4.0 else {0})  # != nucleus(probs, 0.6) == {0, 1}
        logits = probs.float().log().expand(n, -1)
        drawn = sample_next(logits, temperature=temperature, top_p=0.6, generator=make_generator(0))
        assert set(drawn.tolist()) == expected, temperature


def test_sample_with_config_leaves_the_masked_history_alone() -> None:
    """prev_mask False marks padding: its id (0 here, the top token) is not penalised; id 2 is (x10)."""
    logits = torch.tensor([[5.0, 4.9, -3.0]])
    cfg = SamplingConfig(temperature=0.0, repetition_penalty=10.0)
    prev, mask = torch.tensor([[0, 2]]), torch.tensor([[False, True]])
    expected = torch.tensor([[5.0, 4.9, -3.0 * 10.0]]).argmax(-1)  # CTRL written out on the real id only
    out = sample_with_config(logits, cfg, generator=None, prev_ids=prev, prev_mask=mask)
    assert out.tolist() == expected.tolist() == [0]
    unmasked = sample_with_config(logits, cfg, generator=None, prev_ids=prev, prev_mask=torch.ones_like(mask))
    assert unmasked.tolist() == [1]  # the same history as real tokens: 5.0 / 10 < 4.9
