"""n-best beam search (`beam_search_nbest`, `search_nbest`, `Translator.nbest`): against brute-force
enumeration, against `beam_search`, against the uncached slow twin, and on scripted distributions."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.generate.helpers import tiny_translator_and_classifier
from tests.generate.test_beam import (  # noqa: F401  (_one_thread: the same autouse fixture)
    BOS,
    EOS,
    MAX_LEN,
    PAD,
    ScriptedModel,
    _one_thread,
    brute_force_scores,
    seq2seq,
    sequence_log_prob,
    sources,
)
from tformer import build_model
from tformer.generate.beam import SearchConfig, beam_search, beam_search_nbest, search, search_nbest
from tformer.presets import tiny


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.5])
def test_a_beam_wider_than_every_prefix_finds_the_brute_force_n_best(alpha: float) -> None:
    """A beam of 20 keeps every prefix of `brute_force_scores`' 15 outputs: the 6 best must be the
    enumeration's 6 best, in order."""
    model, src, scored = brute_force_scores(alpha)
    ranked = sorted(scored, key=scored.get, reverse=True)
    want = ranked[:6]
    assert scored[ranked[5]] - scored[ranked[6]] > 1e-3  # no tie at the cut
    hyps = beam_search_nbest(
        model,
        src,
        None,
        n_best=6,
        bos_id=BOS,
        eos_id=EOS,
        max_len=MAX_LEN,
        beam_size=20,
        alpha=alpha,
        banned=(PAD, BOS),
    )[0]
    assert [tuple(h.tokens + [EOS] * h.finished) for h in hyps] == want
    assert all(type(h.finished) is bool and type(h.score) is float for h in hyps)
    for h, seq in zip(hyps, want):
        assert h.score == pytest.approx(scored[seq], abs=1e-4)
        assert h.log_prob == pytest.approx(sequence_log_prob(model, src, list(seq)), abs=1e-4)


@pytest.mark.parametrize("alpha", [0.0, 0.6, -0.5])
@pytest.mark.parametrize("n_best", [2, 4])
def test_the_first_of_the_n_best_is_beam_searchs_answer(alpha: float, n_best: int) -> None:
    """The beams do not depend on what is kept, and nothing found after beam_search stops beats its
    answer: the first of the n best is that answer, for every sentence of a padded batch with its own
    max length (scores to rounding: the sentences that search on change the batch's row count)."""
    model = seq2seq()
    src, mask = sources(b=4)
    common = dict(
        bos_id=BOS, eos_id=EOS, max_len=torch.tensor([12, 5, 9, 3]), beam_size=4, alpha=alpha,
        banned=(PAD, BOS), min_len=1,
    )  # fmt: skip
    best = beam_search(model, src, mask, **common)
    lists = beam_search_nbest(model, src, mask, n_best=n_best, **common)
    for hyps, one in zip(lists, best):
        assert (hyps[0].tokens, hyps[0].finished) == (one.tokens, one.finished)
        assert hyps[0].score == pytest.approx(one.score, abs=1e-5)
        assert len(hyps) == n_best
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert len({(tuple(h.tokens), h.finished) for h in hyps}) == n_best  # no output twice


@pytest.mark.parametrize("changes", [{}, {"norm_placement": "post", "positions": "sinusoidal"}])
def test_cached_n_best_equals_uncached(changes) -> None:
    model = seq2seq(**changes)
    src, mask = sources()
    common = dict(n_best=3, bos_id=BOS, eos_id=EOS, max_len=10, beam_size=5, alpha=0.6, banned=(PAD, BOS))
    fast = beam_search_nbest(model, src, mask, **common)
    slow = beam_search_nbest(model, src, mask, cached=False, **common)
    assert [[h.tokens for h in hyps] for hyps in fast] == [[h.tokens for h in hyps] for hyps in slow]
    for f, s in zip(itertools.chain(*fast), itertools.chain(*slow)):
        assert f.finished == s.finished and f.score == pytest.approx(s.score, abs=1e-4)


def test_the_search_goes_on_until_the_n_th_best_cannot_be_beaten() -> None:
    # step 1: EOS .9 ends [] at once; "a" .06 and "b" .04 live. One best: nothing can beat log .9, stop.
    # Two best: step 2 ends [a] (.06 x .9) and [b] (.04 x .9); the live beams' .06 x .06 cannot beat
    # [a], the second best, so the search stops there (2 decoder calls).
    table = [[0, 0, 0.9, 0.06, 0.04]] * 4
    common = dict(bos_id=BOS, eos_id=EOS, max_len=30, beam_size=2, alpha=0.0)
    one = ScriptedModel(table)
    assert [
        h.tokens for h in beam_search_nbest(one, torch.tensor([[3, 2]]), None, n_best=1, **common)[0]
    ] == [[]]
    assert one.calls == 1
    two = ScriptedModel(table)
    hyps = beam_search_nbest(two, torch.tensor([[3, 2]]), None, n_best=2, **common)[0]
    assert [h.tokens for h in hyps] == [[], [3]] and all(h.finished for h in hyps)
    assert hyps[1].log_prob == pytest.approx(math.log(0.06 * 0.9)) and two.calls == 2


def test_the_search_goes_on_while_a_live_beam_can_beat_the_n_th_best() -> None:
    # step 1: [] ends with .6, "a" .4 lives. Step 2: [a] ends with .12, [a a] .28 lives: it cannot beat
    # [] (one best: stop) but can beat [a], the second best, and does at step 3 (.28 x .9 = .252).
    table = [[0, 0, 0.6, 0.4, 0], [0, 0, 0.3, 0.7, 0], [0, 0, 0.9, 0.1, 0]] + [[0, 0, 1.0, 0, 0]] * 3
    common = dict(bos_id=BOS, eos_id=EOS, max_len=10, beam_size=2, alpha=0.0)
    hyps = beam_search_nbest(ScriptedModel(table), torch.tensor([[3, 2]]), None, n_best=2, **common)[0]
    assert [h.tokens for h in hyps] == [[], [3, 3]]
    assert [h.log_prob for h in hyps] == pytest.approx([math.log(0.6), math.log(0.252)])
    assert beam_search(ScriptedModel(table), torch.tensor([[3, 2]]), None, **common)[0].tokens == []


def test_of_equal_scores_the_one_found_first_stays_ahead() -> None:
    # [] ends at step 1 with .5 and [a] at step 2 with .5 x 1: a tie, which beam_search gives to [];
    # the n best keep that order, so their first stays beam_search's answer
    table = [[0, 0, 0.5, 0.5, 0]] + [[0, 0, 1.0, 0, 0]] * 3
    common = dict(bos_id=BOS, eos_id=EOS, max_len=10, beam_size=2, alpha=0.0)
    hyps = beam_search_nbest(ScriptedModel(table), torch.tensor([[3, 2]]), None, n_best=2, **common)[0]
    assert [h.tokens for h in hyps] == [[], [3]] and hyps[0].score == hyps[1].score
    assert beam_search(ScriptedModel(table), torch.tensor([[3, 2]]), None, **common)[0] == hyps[0]


def test_a_later_better_hypothesis_goes_ahead_and_pushes_the_last_out() -> None:
    # step 1: [] ends with .2; "a" .5 and "b" .3 live. Step 2 ends [a] (.5 x .9 = .45) and [b] (.27),
    # both better than []: the two best are [a], [b] in that order, and [] is out.
    table = [[0, 0, 0.2, 0.5, 0.3], [0, 0, 0.9, 0.1, 0.0], [0, 0, 1.0, 0.0, 0.0]]
    hyps = beam_search_nbest(
        ScriptedModel(table), torch.tensor([[3, 2]]), None, n_best=2, bos_id=BOS, eos_id=EOS, max_len=30,
        beam_size=3, alpha=0.0,
    )[0]  # fmt: skip
    assert [h.tokens for h in hyps] == [[3], [4]]
    assert [h.log_prob for h in hyps] == pytest.approx([math.log(0.45), math.log(0.27)])


def test_a_tiny_vocabulary_returns_the_outputs_that_exist() -> None:
    # one word besides EOS (pad and bos banned) and max length 1: [] and the cut [a] are all there is
    torch.manual_seed(0)
    cfg = tiny("encoder_decoder").replace(vocab_size=4, max_seq_len=8, d_model=16, n_heads=2, d_ff=32)
    model = build_model(cfg).eval()
    hyps = beam_search_nbest(
        model, torch.tensor([[3, EOS]]), None, n_best=4, bos_id=BOS, eos_id=EOS, max_len=1, beam_size=4,
        banned=(PAD, BOS),
    )[0]  # fmt: skip
    assert sorted((h.tokens, h.finished) for h in hyps) == [([], True), ([3], False)]


def test_search_nbest_reads_its_config_and_search_is_its_first() -> None:
    model = seq2seq()
    src, mask = sources()
    cfg = SearchConfig(beam_size=3, length_penalty=1.0, max_len=9)
    common = dict(bos_id=BOS, eos_id=EOS, banned=(PAD, BOS))
    lists = search_nbest(model, src, mask, cfg, n_best=3, **common)
    assert [hyps[0] for hyps in lists] == search(model, src, mask, cfg, **common)
    direct = beam_search_nbest(
        model, src, mask, n_best=3, max_len=9, beam_size=3, alpha=1.0, min_len=1, **common
    )
    assert lists == direct
    greedy = search_nbest(model, src, mask, SearchConfig(method="greedy", max_len=9), n_best=1, **common)
    assert [len(hyps) for hyps in greedy] == [1, 1, 1]


@pytest.mark.parametrize(
    ("n_best", "message"),
    [
        (0, "n_best must be an int >= 1, got 0"),
        (True, "n_best must be an int >= 1, got True"),
        (2.0, "n_best must be an int >= 1, got 2.0"),
        (5, "n_best 5 is above beam_size 4: a beam keeps at most that many"),
    ],
)
def test_bad_n_best_is_named(n_best, message: str) -> None:
    model = seq2seq()
    src, mask = sources()
    common = dict(bos_id=BOS, eos_id=EOS, banned=(PAD, BOS))
    with pytest.raises(ValueError) as beam_error:
        beam_search_nbest(model, src, mask, n_best=n_best, max_len=5, beam_size=4, **common)
    with pytest.raises(ValueError) as search_error:
        search_nbest(model, src, mask, SearchConfig(beam_size=4), n_best=n_best, **common)
    assert str(beam_error.value) == str(search_error.value) == message


@pytest.mark.parametrize("method", ["greedy", "sample"])
def test_n_best_needs_beam_search(method: str) -> None:
    model = seq2seq()
    src, mask = sources()
    with pytest.raises(ValueError, match=f"n_best 2 needs beam search: method '{method}' finds one output"):
        search_nbest(model, src, mask, SearchConfig(method=method), n_best=2, bos_id=BOS, eos_id=EOS)


def test_translator_nbest_checks_n_best_before_any_batch() -> None:
    translator, _ = tiny_translator_and_classifier()
    with pytest.raises(ValueError, match="n_best 2 needs beam search: method 'greedy'"):
        translator.nbest([], SearchConfig(method="greedy"), 2)  # no sources: no batch would have checked it
    with pytest.raises(ValueError, match="n_best must be an int >= 1, got 0"):
        translator.nbest([], SearchConfig(), 0)
    sources, _ = translator.encode(["the dog barked", "the market rose and the dog barked"])
    lists = translator.nbest(sources, SearchConfig(beam_size=3, max_len=6), 3)
    assert [len(hyps) for hyps in lists] == [3, 3]
    assert [hyps[0] for hyps in lists] == translator.hypotheses(sources, SearchConfig(beam_size=3, max_len=6))


def test_translate_nbest_gives_texts_and_scores_best_first_the_first_translate_s() -> None:
    translator, _ = tiny_translator_and_classifier()
    texts = ["the dog barked", "the market rose and the dog barked"]
    cfg = SearchConfig(beam_size=3, max_len=6)
    lists = translator.translate_nbest(texts, cfg, 3)
    assert [len(pairs) for pairs in lists] == [3, 3]
    for pairs in lists:
        scores = [score for _, score in pairs]
        assert all(type(score) is float for score in scores) and scores == sorted(scores, reverse=True)
    assert [pairs[0][0] for pairs in lists] == translator.translate(texts, cfg)


def test_translate_nbest_checks_its_arguments_before_it_cuts_and_warns(recwarn) -> None:
    translator, _ = tiny_translator_and_classifier()
    long = " ".join(["the market rose and the dog barked"] * 10)  # over the 32-token limit
    with pytest.raises(ValueError, match="n_best 4 is above beam_size 3"):
        translator.translate_nbest([long], SearchConfig(beam_size=3, max_len=6), 4)
    with pytest.raises(TypeError, match="cfg must be a SearchConfig"):
        translator.translate_nbest([long], {"beam_size": 3}, 2)
    assert not recwarn.list  # nothing was said of the text before the refusal
    translator.translate_nbest([long], SearchConfig(beam_size=3, max_len=6), 2)
    assert len(recwarn.list) == 1 and "truncated" in str(recwarn.list[0].message)
    translator.translate_nbest([long], SearchConfig(beam_size=3, max_len=6), 2, warn=False)
    assert len(recwarn.list) == 1
