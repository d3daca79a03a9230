"""Beam, greedy and sampled search for encoder-decoder models: against greedy, against the uncached
slow twin, against brute-force enumeration, and on scripted next-token distributions."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tformer import build_model
from tformer.generate.beam import SearchConfig, beam_search, sample_search, search
from tformer.model import linear as linear_module
from tformer.model.attention import Memory
from tformer.model.cache import KVCache
from tformer.model.masks import padding_mask
from tformer.presets import tiny
from tformer.schema import ConfigError

BOS, EOS, PAD = 1, 2, 0


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one thread is as fast as two and does not stall on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def seq2seq(**changes):
    torch.manual_seed(0)
    cfg = tiny("encoder_decoder").replace(vocab_size=24, max_seq_len=32, **changes)
    return build_model(cfg).eval()


def sources(b: int = 3, s: int = 7, vocab: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(3, vocab, (b, s), generator=gen)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[1, 4:] = False  # one padded sentence
    return src.masked_fill(~mask, PAD), mask


def tokens(hyps) -> list[list[int]]:
    return [h.tokens for h in hyps]


@pytest.mark.parametrize("changes", [{}, {"norm_placement": "post", "positions": "sinusoidal"}])
def test_beam_size_1_is_greedy(changes) -> None:
    model = seq2seq(**changes)
    src, mask = sources()
    common = dict(bos_id=BOS, eos_id=EOS, max_len=12, banned=(PAD, BOS))
    greedy = sample_search(model, src, mask, **common)
    beam = beam_search(model, src, mask, beam_size=1, alpha=0.0, **common)
    assert tokens(beam) == tokens(greedy)
    for b, g in zip(beam, greedy):
        assert b.log_prob == pytest.approx(g.log_prob, abs=1e-4)


@pytest.mark.parametrize(
    "changes", [{}, {"norm_placement": "post", "positions": "sinusoidal", "ffn": "relu", "norm": "layernorm"}]
)
@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.5])
def test_cached_beam_search_equals_uncached(changes, alpha: float) -> None:
    model = seq2seq(**changes)
    src, mask = sources()
    max_len = torch.tensor([9, 14, 5])  # per sentence
    common = dict(bos_id=BOS, eos_id=EOS, max_len=max_len, beam_size=4, alpha=alpha, banned=(PAD, BOS))
    fast = beam_search(model, src, mask, cached=True, **common)
    slow = beam_search(model, src, mask, cached=False, **common)
    assert tokens(fast) == tokens(slow)
    for f, s, n in zip(fast, slow, max_len.tolist()):
        assert f.score == pytest.approx(s.score, abs=1e-4)
        assert len(f.tokens) + f.finished <= n


@pytest.mark.parametrize("beam", [3, 40])
def test_batched_search_equals_one_sentence_at_a_time(beam: int) -> None:
    """Also with more beams than the vocabulary has tokens (24): the first step's slots past the vocabulary
    had pointed at the first sentence's row, whose source a beam moving into them later decoded against."""
    for seed in range(4):
        model = seq2seq()
        if seed:  # sharper distributions, other seeds: beams move between slots
            torch.manual_seed(seed)
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(std=0.6) if p.dim() > 1 else None
        src, mask = sources()
        common = dict(bos_id=BOS, eos_id=EOS, max_len=10, beam_size=beam, alpha=0.6, banned=(PAD, BOS))
        batched = beam_search(model, src, mask, **common)
        for i, hyp in enumerate(batched):
            n = int(mask[i].sum())
            alone = beam_search(model, src[i : i + 1, :n], None, **common)[0]
            assert alone.tokens == hyp.tokens, (seed, i)
            assert alone.score == pytest.approx(hyp.score, abs=1e-4), (seed, i)


@torch.no_grad()
@pytest.mark.parametrize("flat", [True, False])
def test_the_encoder_and_the_cross_attention_kv_run_once_per_search(flat: bool) -> None:
    """The source is encoded once and each layer's cross-attention K/V projected once for the whole
    search, while the beams reorder and sentences finish at different steps (their rows leave the batch)."""
    model = seq2seq()
    src, mask = sources()
    calls: dict[str, int] = {}

    def count(name):
        return lambda *_: calls.__setitem__(name, calls.get(name, 0) + 1)

    hooks = [model.encoder.register_forward_hook(count("encoder"))]
    for i, block in enumerate(model.decoder.blocks):
        for proj in ("k_proj", "v_proj"):
            hooks.append(getattr(block.cross_attn, proj).register_forward_hook(count(f"{i}.{proj}")))
    try:
        hyps = beam_search(
            model,
            src,
            mask,
            bos_id=BOS,
            eos_id=EOS,
            max_len=torch.tensor([9, 14, 5]),
            beam_size=4,
            alpha=0.6,
            banned=(PAD, BOS),
            flat=flat,
        )
    finally:
        for h in hooks:
            h.remove()
    assert len({len(h.tokens) for h in hyps}) > 1  # the sentences ended at different steps
    layers = range(len(model.decoder.blocks))
    assert calls == {"encoder": 1} | {f"{i}.{p}": 1 for i in layers for p in ("k_proj", "v_proj")}


@torch.no_grad()
def sequence_log_prob(model, src, seq: list[int]) -> float:
    """log p(seq | src) by one full forward, banned ids masked as in the search (seq: generated tokens)."""
    tgt = torch.tensor([[BOS] + seq[:-1]])
    logp = torch.log_softmax(model(src, tgt).float(), dim=-1)[0]  # (T, V)
    return float(sum(logp[t, tok] for t, tok in enumerate(seq)))


MAX_LEN = 3  # of `brute_force_scores`' outputs


def brute_force_scores(alpha: float) -> tuple[torch.nn.Module, torch.Tensor, dict[tuple[int, ...], float]]:
    """A tiny model, a source and the score of every output it can give: vocabulary 5 (pad, bos, eos and
    two words), max length 3 (MAX_LEN): 1 + 2 + 4 outputs end in EOS and 8 are cut at the max length."""
    torch.manual_seed(3)
    cfg = tiny("encoder_decoder").replace(vocab_size=5, max_seq_len=8, d_model=16, n_heads=2, d_ff=32)
    model = build_model(cfg).eval()
    src = torch.tensor([[3, 4, 4, 3, EOS]])
    words = (3, 4)
    outputs = [[*body, EOS] for n in range(MAX_LEN) for body in itertools.product(words, repeat=n)]
    outputs += [list(body) for body in itertools.product(words, repeat=MAX_LEN)]
    assert len(outputs) == 15
    # GNMT's penalty written out here, not the library's `length_penalty` (the code under test)
    return (
        model,
        src,
        {tuple(o): sequence_log_prob(model, src, o) / ((5 + len(o)) / 6) ** alpha for o in outputs},
    )


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.5])
def test_large_beam_finds_the_brute_force_best(alpha: float) -> None:
    """A beam of 20 keeps every prefix of `brute_force_scores`' outputs, so the search is exhaustive."""
    model, src, scored = brute_force_scores(alpha)
    best = max(scored, key=scored.get)
    hyp = beam_search(
        model,
        src,
        None,
        bos_id=BOS,
        eos_id=EOS,
        max_len=MAX_LEN,
        beam_size=20,
        alpha=alpha,
        banned=(PAD, BOS),
    )[0]
    assert tuple(hyp.tokens + [EOS] * hyp.finished) == best
    assert hyp.score == pytest.approx(scored[best], abs=1e-4)


class ScriptedModel(torch.nn.Module):
    """A stand-in encoder-decoder whose next-token log-probabilities depend only on the prefix length.

    table[t] is the distribution after t generated tokens (the same for every prefix); counts decoder calls.
    """

    def __init__(self, table: list[list[float]]) -> None:
        super().__init__()
        self.table = torch.tensor(table).log()
        self.cfg = tiny("encoder_decoder").replace(vocab_size=self.table.shape[1], max_seq_len=32)
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.calls = 0

    def encode(self, src, src_mask=None):
        b, s = src.shape
        return Memory(torch.zeros(b, s, 4), torch.arange(s), padding_mask(1, src_mask, s, src.device))

    def decode(self, tgt, memory, positions=None, key_padding_mask=None, cache=None):
        self.calls += 1
        start = cache.seq_len if cache is not None else 0
        t = min(start + tgt.shape[1] - 1, len(self.table) - 1)
        if cache is not None:
            cache.lengths = [start + tgt.shape[1]]
        return self.table[t].expand(tgt.shape[0], tgt.shape[1], -1).clone()

    def new_cache(self, capacity=None):
        return KVCache(1, capacity or 32)


# vocabulary: 0 pad, 1 bos, 2 eos, 3 "a", 4 "b"
def test_search_stops_once_the_best_finished_cannot_be_beaten() -> None:
    # EOS is certain-ish at step 1: a live beam's bound log(0.1) / lp(max) is below log(0.9) / lp(1)
    model = ScriptedModel([[0, 0, 0.9, 0.05, 0.05]] * 3)
    hyp = beam_search(
        model, torch.tensor([[3, 2]]), None, bos_id=BOS, eos_id=EOS, max_len=30, beam_size=2, alpha=0.0
    )[0]
    assert hyp.tokens == [] and hyp.finished and model.calls == 1
    assert hyp.log_prob == pytest.approx(math.log(0.9))


def test_length_penalty_can_prefer_the_longer_hypothesis() -> None:
    # step 1: EOS 0.5 vs "a" 0.5; step 2: EOS 0.45.  Raw: [] (log .5) beats [a] (log .225).
    table = [[0, 0, 0.5, 0.5, 0.0], [0, 0, 0.45, 0.55, 0.0], [0, 0, 1.0, 0.0, 0.0]]
    src = torch.tensor([[3, 2]])
    common = dict(bos_id=BOS, eos_id=EOS, max_len=3, beam_size=2)
    assert beam_search(ScriptedModel(table), src, None, alpha=0.0, **common)[0].tokens == []
    # alpha 4, lp(L) = ((5 + L) / 6)^4: [] log(.5) / 1 = -0.693; [a] log(.225) / 1.85 = -0.806;
    # [a, a] ends at step 3 with log(.5 * .55) / 3.16 = -0.408: the best.
    hyp = beam_search(ScriptedModel(table), src, None, alpha=4.0, **common)[0]
    assert hyp.tokens == [3, 3] and hyp.finished
    assert hyp.score == pytest.approx(math.log(0.5 * 0.55) / ((5 + 3) / 6) ** 4)  # EOS counts in the length


def test_a_negative_length_penalty_does_not_stop_the_search_early() -> None:
    # alpha < 0 favours short outputs, so a live beam's best reachable score is its score over lp(t + 1),
    # not over lp(max_len) (tiny for alpha -10: it would end the search after step 1 with []).
    # [] scores log(.1) / lp(1) = -2.30; [a] ends at step 2 with log(.9 * .9) / lp(2) = -0.98: the best.
    table = [[0, 0, 0.1, 0.9, 0.0], [0, 0, 0.9, 0.1, 0.0]]
    hyp = beam_search(
        ScriptedModel(table),
        torch.tensor([[3, 2]]),
        None,
        bos_id=BOS,
        eos_id=EOS,
        max_len=30,
        beam_size=2,
        alpha=-10.0,
    )[0]
    assert hyp.tokens == [3] and hyp.finished
    assert hyp.score == pytest.approx(math.log(0.9 * 0.9) / ((5 + 2) / 6) ** -10.0)


def test_max_length_returns_the_best_unfinished_hypothesis() -> None:
    model = ScriptedModel([[0, 0, 0.1, 0.6, 0.3]] * 4)
    hyp = beam_search(
        model, torch.tensor([[3, 2]]), None, bos_id=BOS, eos_id=EOS, max_len=2, beam_size=3, alpha=0.0
    )[0]
    assert hyp.tokens == [3, 3] and not hyp.finished
    assert hyp.log_prob == pytest.approx(2 * math.log(0.6))


def test_eos_outside_the_top_k_does_not_finish() -> None:
    # beam 1: EOS (0.3) is the second candidate; greedy continues with "a" and ends with EOS at step 2
    model = ScriptedModel([[0, 0, 0.3, 0.7, 0.0], [0, 0, 0.2, 0.8, 0.0], [0, 0, 1.0, 0.0, 0.0]])
    hyp = beam_search(
        model, torch.tensor([[3, 2]]), None, bos_id=BOS, eos_id=EOS, max_len=5, beam_size=1, alpha=0.0
    )[0]
    assert hyp.tokens == [3, 3] and hyp.finished


def test_min_len_keeps_eos_back_for_beam_greedy_and_sampling() -> None:
    # EOS is the likeliest first token (0.9): without a minimum every method ends at once, empty
    table = [[0, 0, 0.9, 0.06, 0.04], [0, 0, 0.7, 0.1, 0.2], [0, 0, 1.0, 0.0, 0.0]]
    src, common = torch.tensor([[3, 2]]), dict(bos_id=BOS, eos_id=EOS, max_len=5)
    assert beam_search(ScriptedModel(table), src, None, beam_size=2, alpha=0.0, **common)[0].tokens == []
    hyp = beam_search(ScriptedModel(table), src, None, beam_size=2, alpha=0.0, min_len=1, **common)[0]
    # the best of the outputs with a first word: [a] EOS (.06 * .7) beats [b] EOS (.04 * .7)
    assert hyp.tokens == [3] and hyp.finished
    assert hyp.log_prob == pytest.approx(math.log(0.06 * 0.7))  # EOS's share is never renormalised away
    greedy = sample_search(ScriptedModel(table), src, None, min_len=1, **common)[0]
    assert greedy.tokens == [3] and greedy.finished
    hyp = beam_search(ScriptedModel(table), src, None, beam_size=2, alpha=0.0, min_len=2, **common)[0]
    assert hyp.tokens == [3, 4] and hyp.finished  # two words before EOS may come
    drawn = sample_search(ScriptedModel(table), src, None, temperature=1.0, seed=1, min_len=1, **common)
    assert drawn[0].tokens and drawn[0].tokens[0] in (3, 4)
    # the config's default is 1 (what translate and eval use); a vocabulary of nothing but EOS is refused
    assert SearchConfig().min_len == 1
    out = search(ScriptedModel(table), src, None, SearchConfig(max_len=5), bos_id=BOS, eos_id=EOS)
    assert out[0].tokens == [3]
    with pytest.raises(ValueError, match="min_len"):
        search(ScriptedModel(table), src, None, SearchConfig(), bos_id=BOS, eos_id=EOS, banned=(0, 1, 3, 4))
    with pytest.raises(ConfigError, match="min_len"):
        SearchConfig(min_len=-1)


def test_greedy_search_moves_its_rows_only_when_a_sentence_ends(monkeypatch) -> None:
    """Rows are selected (the KV cache copied) only at the steps where some sentences end and others
    go on; the outputs equal each sentence searched alone."""
    from tformer.generate import beam as beam_module

    model, (src, mask) = seq2seq(), sources(b=4)
    max_lens = torch.tensor([2, 5, 5, 9])
    calls = []
    original = beam_module.CachedSteps.select
    monkeypatch.setattr(
        beam_module.CachedSteps,
        "select",
        lambda self, index, rows: calls.append(len(index)) or original(self, index, rows),
    )
    together = sample_search(model, src, mask, bos_id=BOS, eos_id=EOS, max_len=max_lens)
    ends = [len(h.tokens) + h.finished for h in together]  # the step at which each sentence ended
    assert len(calls) == len(set(ends)) - 1  # not at the last step, and not at a step where none ended
    monkeypatch.setattr(beam_module.CachedSteps, "select", original)
    for i, hyp in enumerate(together):
        alone = sample_search(
            model, src[i : i + 1], mask[i : i + 1], bos_id=BOS, eos_id=EOS, max_len=int(max_lens[i])
        )
        assert (hyp.tokens, hyp.finished) == (alone[0].tokens, alone[0].finished)
        assert hyp.log_prob == pytest.approx(alone[0].log_prob, abs=1e-5)


def test_sampling_is_seeded_and_greedy_ignores_the_seed() -> None:
    model = seq2seq()
    src, mask = sources()
    common = dict(bos_id=BOS, eos_id=EOS, max_len=10, banned=(PAD, BOS))
    a = sample_search(model, src, mask, temperature=1.0, seed=5, **common)
    b = sample_search(model, src, mask, temperature=1.0, seed=5, **common)
    assert tokens(a) == tokens(b)
    assert tokens(sample_search(model, src, mask, seed=1, **common)) == tokens(
        sample_search(model, src, mask, **common)
    )
    for h in a:
        assert BOS not in h.tokens and PAD not in h.tokens and EOS not in h.tokens


@pytest.mark.parametrize("method", ["beam", "greedy", "sample"])
def test_search_runs_a_training_mode_model_without_dropout_and_keeps_its_mode(method: str) -> None:
    """A model straight from build_model is in training mode: search had decoded it with dropout on."""
    model = seq2seq(dropout=0.3)
    src, mask = sources()
    cfg = SearchConfig(method=method, max_len=8, seed=3)
    expected = tokens(search(model, src, mask, cfg, bos_id=BOS, eos_id=EOS))  # seq2seq() is in eval mode
    model.train()
    for _ in range(2):
        assert tokens(search(model, src, mask, cfg, bos_id=BOS, eos_id=EOS)) == expected
        assert model.training


def test_a_tiny_sampling_temperature_is_greedy_not_nan() -> None:
    """Log-probabilities over a temperature of 1e-39 overflow to -inf: the draw had raised from torch."""
    model = seq2seq()
    src, mask = sources()
    common = dict(bos_id=BOS, eos_id=EOS, max_len=10, banned=(PAD, BOS))
    cold = sample_search(model, src, mask, temperature=1e-39, seed=4, **common)
    assert tokens(cold) == tokens(sample_search(model, src, mask, **common))


def test_search_config_dispatch_and_validation() -> None:
    model = seq2seq()
    src, mask = sources()
    greedy = search(model, src, mask, SearchConfig(method="greedy", max_len=6), bos_id=BOS, eos_id=EOS)
    beam1 = search(
        model, src, mask, SearchConfig(beam_size=1, length_penalty=0.0, max_len=6), bos_id=BOS, eos_id=EOS
    )
    assert tokens(greedy) == tokens(beam1)
    assert all(len(h.tokens) + h.finished <= 6 for h in greedy)
    lens = SearchConfig().max_lens(torch.tensor([4, 40]), max_seq_len=32)
    assert lens.tolist() == [16, 32]  # 1.5 * 4 + 10, then capped by the context
    for bad in (
        {"beam_size": 0},
        {"max_len": 0},
        {"max_len": 3, "min_len": 3},  # no room for the end
        {"top_p": 0.0},
        {"method": "nucleus"},
        {"seed": -(2**63) - 1},
        {"seed": 2**64},
    ):
        with pytest.raises(ConfigError):
            SearchConfig(**bad)
    with pytest.raises(ValueError, match="context"):
        beam_search(model, src, mask, bos_id=BOS, eos_id=EOS, max_len=64)
    with pytest.raises(ValueError, match="real token"):
        beam_search(model, src, torch.zeros_like(mask), bos_id=BOS, eos_id=EOS, max_len=4)


@pytest.mark.parametrize("method", ["beam", "greedy"])
def test_search_fast_decode_equals_slow_twin(monkeypatch, count_calls, method: str) -> None:
    """Row-blocked linear products (every layer, however small) vs F.linear: same hypotheses."""
    monkeypatch.setattr(linear_module, "DECODE_MIN_WEIGHT", 0)
    model = seq2seq(d_model=32, n_heads=4, d_ff=64)
    src, mask = sources()
    cfg = SearchConfig(method=method, beam_size=3, max_len=10)
    common = dict(bos_id=BOS, eos_id=EOS, banned=(PAD, BOS))
    calls = count_calls(linear_module, "row_blocked_linear")
    slow = search(model, src, mask, cfg, fast_decode=False, **common)
    assert not calls
    fast = search(model, src, mask, cfg, **common)
    assert calls and tokens(fast) == tokens(slow) and all(len(h.tokens) > 0 for h in fast)
    for f, s in zip(fast, slow):
        assert f.score == pytest.approx(s.score, abs=1e-4)
    assert not any("forward" in m.__dict__ for m in model.modules())  # restored on exit


def test_a_passed_generator_goes_on_across_calls() -> None:
    """search(..., generator=g) draws from g: its first call equals a fresh seed, the next goes on from
    there (a batch after batch input does not repeat its draws); anything else is named."""
    model = seq2seq()
    src, mask = sources()
    cfg = SearchConfig(method="sample", temperature=1.0, max_len=10, seed=5)
    ids = dict(bos_id=BOS, eos_id=EOS, banned=(PAD, BOS))
    seeded = tokens(search(model, src, mask, cfg, **ids))
    g = torch.Generator().manual_seed(5)
    first, second = (tokens(search(model, src, mask, cfg, generator=g, **ids)) for _ in range(2))
    assert first == seeded and second != first
    with pytest.raises(ValueError, match="generator must be a torch.Generator on cpu, like src, got 5"):
        search(model, src, mask, cfg, generator=5, **ids)


def test_sampled_translations_of_one_input_draw_one_stream_over_its_batches() -> None:
    """The same sentence four times, one per batch: four draws, not the first batch's draw four times;
    the whole input is still reproducible from the seed."""
    from tests.generate.helpers import tiny_translator_and_classifier

    translator, _ = tiny_translator_and_classifier()
    cfg = SearchConfig(method="sample", temperature=1.0, max_len=12, seed=3, batch_size=1)
    out = translator.translate(["the dog barked"] * 4, cfg)
    assert len(set(out)) > 1
    assert translator.translate(["the dog barked"] * 4, cfg) == out


def test_huge_length_settings_reach_the_context_not_one_token() -> None:
    """max_len_a * source + max_len_b beyond int64 had wrapped negative and been clamped to 1 token."""
    src_lens = torch.tensor([3, 5])
    for cfg in (
        SearchConfig(max_len_a=1e30),
        SearchConfig(max_len_b=2**63 - 1),
        SearchConfig(max_len=10**30),
    ):
        assert cfg.max_lens(src_lens, 64).tolist() == [64, 64]
    assert SearchConfig(max_len_a=1.5, max_len_b=2).max_lens(src_lens, 64).tolist() == [6, 9]


# ----------------------------------------------------------------------------- found by a mutation audit
@pytest.mark.parametrize("alpha", [1.0, -0.5, 2.0])
def test_a_hypothesis_log_prob_is_its_unnormalised_log_probability(alpha: float) -> None:
    """score = log p / lp(L), but log_prob is log p itself (EOS included) whatever the length penalty."""
    torch.manual_seed(3)
    cfg = tiny("encoder_decoder").replace(vocab_size=5, max_seq_len=8, d_model=16, n_heads=2, d_ff=32)
    model = build_model(cfg).eval()
    src = torch.tensor([[3, 4, 4, 3, EOS]])
    hyp = beam_search(
        model,
        src,
        None,
        bos_id=BOS,
        eos_id=EOS,
        max_len=4,
        beam_size=4,
        alpha=alpha,
        banned=(PAD, BOS),
        min_len=2,
    )[0]
    seq = hyp.tokens + [EOS] * hyp.finished
    assert len(seq) >= 3  # min_len 2: lp(L) != 1 (lp(1) is 1 for every alpha)
    assert hyp.log_prob == pytest.approx(sequence_log_prob(model, src, seq), abs=1e-4)
    assert hyp.score == pytest.approx(hyp.log_prob / ((5 + len(seq)) / 6) ** alpha, abs=1e-4)


class MarkovModel(ScriptedModel):
    """Next-token probabilities that depend on the previous token only: table[prev] (one row per id)."""

    def decode(self, tgt, memory, positions=None, key_padding_mask=None, cache=None):
        self.calls += 1
        if cache is not None:
            cache.lengths = [cache.seq_len + tgt.shape[1]]
        return self.table[tgt].clone()  # (R, T, V): position t follows token tgt[:, t]


@pytest.mark.parametrize("cached", [True, False])
def test_finished_hypotheses_do_not_take_live_beams(cached: bool) -> None:
    """Of the 2K best extensions, an EOS among the best K finishes and the K best non-EOS ones live on:
    after BOS "a" .4, EOS .35, "b" .25 (beam 2), [] finishes and both "a" and "b" live; "b" then ends
    with certainty and, with alpha 4, [b] (log .25 / lp(2)) beats [] (log .35 / lp(1)) and every
    continuation of "a" (uniform over 9 ids). Taking only K candidates had dropped "b" and answered []."""
    v, b = 11, 4  # "a" is id 3
    uniform = [0.0, 0.0] + [1.0 / 9] * 9  # after "a" (and any other id): EOS and the nine words alike
    table = [uniform] * v
    table[BOS] = [0.0, 0.0, 0.35, 0.4, 0.25] + [0.0] * 6
    table[b] = [0.0, 0.0, 1.0] + [0.0] * 8
    lp = lambda n: ((5 + n) / 6) ** 4.0  # noqa: E731  GNMT written out
    best_a = max(math.log(0.4 / 9) / lp(2), math.log(0.4 / 81) / lp(3))  # [a] EOS, and [a x] at max_len
    assert math.log(0.25) / lp(2) > max(math.log(0.35) / lp(1), best_a)  # the premise: [b] is the best
    hyp = beam_search(
        MarkovModel(table),
        torch.tensor([[3, 2]]),
        None,
        bos_id=BOS,
        eos_id=EOS,
        max_len=3,
        beam_size=2,
        alpha=4.0,
        cached=cached,
    )[0]
    assert hyp.tokens == [b] and hyp.finished
    assert hyp.score == pytest.approx(math.log(0.25) / lp(2))


def test_search_passes_the_sampling_filters_of_its_config() -> None:
    """method "sample" with top_k 1, or a top_p below every token's probability, keeps only the argmax:
    the draw is greedy whatever the seed (the filters had been dropped on the way to the sampler)."""
    model = seq2seq()
    src, mask = sources()
    ids = dict(bos_id=BOS, eos_id=EOS, banned=(PAD, BOS))
    greedy = tokens(search(model, src, mask, SearchConfig(method="greedy", max_len=10), **ids))
    for filters in ({"top_k": 1}, {"top_p": 1e-6}):
        for seed in (0, 1):
            cfg = SearchConfig(method="sample", temperature=1.0, max_len=10, seed=seed, **filters)
            assert tokens(search(model, src, mask, cfg, **ids)) == greedy, (filters, seed)


def test_search_reads_the_length_penalty_of_its_config() -> None:
    """The scripted case of test_length_penalty_can_prefer_the_longer_hypothesis through `search`:
    length_penalty 0 answers [], 4 answers [a, a] (scores as written out there)."""
    table = [[0, 0, 0.5, 0.5, 0.0], [0, 0, 0.45, 0.55, 0.0], [0, 0, 1.0, 0.0, 0.0]]
    src = torch.tensor([[3, 2]])
    for alpha, expected in ((0.0, []), (4.0, [3, 3])):
        cfg = SearchConfig(beam_size=2, length_penalty=alpha, max_len=3, min_len=0)
        hyp = search(ScriptedModel(table), src, None, cfg, bos_id=BOS, eos_id=EOS)[0]
        assert hyp.tokens == expected, alpha
    assert hyp.score == pytest.approx(math.log(0.5 * 0.55) / ((5 + 3) / 6) ** 4)


@pytest.mark.parametrize("method", ["beam", "greedy"])
def test_max_len_follows_each_sentences_real_length(method: str) -> None:
    """max_len null: max_len_a * (real source length) + max_len_b per sentence, padding not counted. EOS
    never comes here, so every output is exactly that long."""
    model = ScriptedModel([[0, 0, 0.0, 0.6, 0.4]])
    src = torch.tensor([[5, 6, 0, 0, 0], [5, 6, 7, 8, 9]])
    mask = src != 0
    cfg = SearchConfig(method=method, beam_size=2, max_len=None, max_len_a=1.5, max_len_b=2, min_len=0)
    out = search(model, src, mask, cfg, bos_id=BOS, eos_id=EOS, banned=(PAD, BOS))
    real = mask.sum(1).tolist()
    assert [len(h.tokens) for h in out] == [math.floor(1.5 * n) + 2 for n in real] == [5, 9]
    assert not any(h.finished for h in out)
