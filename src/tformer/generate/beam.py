"""Decoding for encoder-decoder models: batched beam search, greedy and sampled search.

Shapes: B sentences, S source length, K beams, N sentences still searching, R decoder rows
(N x beams), V vocabulary, t tokens generated so far. `src (B, S)` int64 with `src_mask (B, S)` bool,
True for real tokens. The source is encoded once; the first step runs one row per sentence (every beam
starts from the same BOS), so the cross-attention K/V are projected once per source, and the rows are
then fanned out to K beams with `cache.reorder(index)`, which also follows the beams every step.

Beam search, per sentence:
- score(y) = log p(y | x) / lp(|y|), lp(L) = ((5 + L) / 6) ** alpha (GNMT, Wu et al., 2016); |y| counts
  the generated tokens, EOS included. alpha = 0 ranks by raw log-probability.
- EOS is not a candidate before min_len tokens have been generated (`SearchConfig.min_len`, default 1:
  never an empty translation, as fairseq's default; the search functions' own default is 0, no limit).
- each step takes the 2K best extensions of the live beams; an EOS extension ranked among the best K
  is a finished hypothesis (as in fairseq, so beam size 1 is greedy search when alpha = 0); the K best
  non-EOS extensions are the next live beams.
- the sentence stops when the best finished score can no longer be beaten: log-probabilities only
  fall, so a live beam with log-probability s <= 0 ends at best at s / max lp(L) over the lengths L
  still allowed. It also stops at its max length, where the live beams count as (unfinished)
  hypotheses. Stopped sentences leave the batch (their cache rows are dropped).
- n-best (`beam_search_nbest`, n <= K): the n best finished hypotheses are kept, and a sentence stops
  when its n-th best can no longer be beaten by the same bound; n = 1 is the rule above.
`beam_search(..., cached=False)` re-runs the decoder over the whole prefix every step: the slow twin
that the cached search is tested against.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tformer.config import MAX_SIZE
from tformer.generate.engine import check_token_id
from tformer.generate.sampling import make_generator, sample_next
from tformer.model.attention import Memory
from tformer.model.checks import check_finite_outputs, check_not_meta
from tformer.model.decode_step import Seq2SeqDecodeStep
from tformer.model.ensemble import Ensemble, mean_log_probs
from tformer.model.linear import decoding_layout
from tformer.model.masks import Mask
from tformer.schema import Config, require_bool

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # generated ids, EOS excluded
    score: float  # log_prob / lp(length) for beam search; log_prob for greedy / sampling
    log_prob: float  # log p(tokens + EOS | source) (without EOS when unfinished)
    finished: bool  # ended with EOS (False: cut at the max length)


@dataclass(frozen=True)
class SearchConfig(Config):
    """How to decode. method: "beam", "greedy" or "sample" (temperature / top_k / top_p / seed).

    max_len: most target tokens (EOS included) for every sentence; null: max_len_a * source length +
    max_len_b per sentence, and at least min_len + 1 (room for the end after min_len tokens). Both are
    capped by the model's context (max_seq_len). min_len: tokens generated before EOS may end a
    hypothesis (1: never an empty output; 0: no limit); a max_len given must leave room for the end.
    """

    method: Literal["beam", "greedy", "sample"] = "beam"
    beam_size: int = 4
    length_penalty: float = 0.6
    max_len: int | None = None
    max_len_a: float = 1.5
    max_len_b: int = 10
    min_len: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 32

    def check(self) -> None:
        self._require(self.beam_size >= 1, "beam_size", "must be >= 1")
        self._require(self.beam_size <= MAX_SIZE, "beam_size", f"must be at most {MAX_SIZE:,}")
        if self.max_len is not None:
            self._require(self.max_len >= 1, "max_len", "must be >= 1 (or null: from the source length)")
        self._require(self.max_len_a >= 0, "max_len_a", "must be >= 0")
        self._require(self.max_len_b >= 1, "max_len_b", "must be >= 1")
        self._require(0 <= self.min_len <= MAX_SIZE, "min_len", f"must be in [0, {MAX_SIZE:,}] (0: no limit)")
        if self.max_len is not None:  # the end could never come: every output would stop unfinished
            self._require(
                self.min_len < self.max_len,
                "min_len",
                f"must be below max_len {self.max_len}: min_len {self.min_len} leaves no room for the end",
            )
        self._require(
            0 < self.temperature < math.inf,
            "temperature",
            "must be finite and > 0 (method='greedy' for argmax)",
        )
        self._require(
            abs(self.length_penalty) <= MAX_ALPHA,
            "length_penalty",
            f"must be in [-{MAX_ALPHA:g}, {MAX_ALPHA:g}] (0 means none; GNMT used 0.6 to 1)",
        )
        self._require(math.isfinite(self.max_len_a), "max_len_a", "must be finite")
        self._require(self.top_k >= 0, "top_k", "must be >= 0 (0 means off)")
        self._require(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        self._require(self.batch_size >= 1, "batch_size", "must be >= 1")
        self._require_seed()

    def max_lens(self, src_lens: Tensor, max_seq_len: int) -> Tensor:
        """(B,) most target tokens per sentence, from the (B,) source lengths."""
        if self.max_len is not None:
            lens = torch.full_like(src_lens, min(self.max_len, max_seq_len))  # (a huge one overflowed int64)
        else:
            # clamped as floats: a length beyond int64 (max_len_a 1e30, max_len_b 2**63 - 1) had wrapped
            # to a negative number, which the clamp below turned into 1 token
            lens = ((src_lens.double() * self.max_len_a).floor() + float(self.max_len_b)).clamp(
                self.min_len + 1,
                max_seq_len,  # (a min_len past it had been cut at it, unfinished)
            )
            return lens.long()
        return lens.clamp(1, max_seq_len)


MAX_ALPHA = 10.0  # ((5 + length) / 6) ** alpha stays finite in float32 up to ~45k tokens at this alpha


def length_penalty(length: int | Tensor, alpha: float) -> float | Tensor:
    """GNMT length penalty ((5 + length) / 6) ** alpha."""
    return ((5 + length) / 6) ** alpha


# ----------------------------------------------------------------------------- decoder steppers


def select_memory(memory: Memory, rows: Tensor) -> Memory:
    """The memory of sentences `rows` (R,), one row per decoder row."""
    allowed = memory.mask.allowed
    allowed = allowed if allowed.shape[0] == 1 else allowed.index_select(0, rows)  # (R|1, 1, 1, S)
    return Memory(memory.states.index_select(0, rows), memory.positions, Mask(allowed))


class CachedSteps:
    """Feeds each row's newest token; self-attention K/V in a KVCache that follows the rows."""

    def __init__(self, model: nn.Module, memory: Memory, capacity: int, flat: bool = True) -> None:
        self.model, self.memory = model, memory
        self.rows = memory
        self.row_sentence = torch.arange(memory.states.shape[0], device=memory.states.device)  # (R,)
        self.cache = model.new_cache(
            min(capacity, model.cfg.max_seq_len)
        )  # (the model's positions end there)
        # after the first step: the flat decoding step where the model is one it knows
        self.step = Seq2SeqDecodeStep.build(model) if flat else None

    def logits(self, prefix: Tensor) -> Tensor:
        """prefix (R, t + 1) starting with BOS -> next-token logits (R, V)."""
        if self.step is not None and self.cache.seq_len:
            return self.step(prefix[:, -1], self.rows, self.cache)
        return self.model.decode(prefix[:, -1:], self.rows, cache=self.cache)[:, -1]

    def select(self, index: Tensor, row_sentence: Tensor) -> None:
        """Keep rows `index` (R',) of the last step; row_sentence (R',): the source sentence of each."""
        if torch.equal(row_sentence, self.row_sentence):
            # The beams moved among their own sentence's rows, which share one encoder memory: the
            # cross-attention K/V are already right, only the self-attention K/V follow the beams.
            cross, self.cache.cross_kv = self.cache.cross_kv, [None] * len(self.cache.cross_kv)
            self.cache.reorder(index)
            self.cache.cross_kv = cross
        else:
            self._follow(row_sentence)
            self.cache.reorder(index, self.rows.states)

    def _follow(self, row_sentence: Tensor) -> None:
        # Beams of one sentence share its memory: rebuild only when the set of sentences changes.
        if not torch.equal(row_sentence, self.row_sentence):
            self.rows, self.row_sentence = select_memory(self.memory, row_sentence), row_sentence


class FullPrefixSteps(CachedSteps):
    """The slow twin: no cache; the decoder re-reads the whole prefix every step."""

    def logits(self, prefix: Tensor) -> Tensor:
        return self.model.decode(prefix, self.rows)[:, -1]

    def select(self, index: Tensor, row_sentence: Tensor) -> None:
        self._follow(row_sentence)


class EnsembleSteps:
    """The steps of an `Ensemble`'s members side by side: each member feeds its rows through its own
    encoder output and cache; the next-token log-probabilities are the log of their mean probability."""

    def __init__(self, members: list[CachedSteps]) -> None:
        self.members = members

    def logits(self, prefix: Tensor) -> Tensor:
        return mean_log_probs([m.logits(prefix) for m in self.members])

    def select(self, index: Tensor, row_sentence: Tensor) -> None:
        for m in self.members:
            m.select(index, row_sentence)


def make_steps(
    model: nn.Module, src: Tensor, src_mask: Tensor | None, capacity: int, cached: bool, flat: bool
) -> CachedSteps | EnsembleSteps:
    """The stepper of a search: the source encoded once, then cached steps (or the uncached slow twin);
    for an `Ensemble`, one per member."""
    if isinstance(model, Ensemble):
        return EnsembleSteps([make_steps(m, src, src_mask, capacity, cached, flat) for m in model.members])
    steps = CachedSteps if cached else FullPrefixSteps
    return steps(model, model.encode(src, src_mask), capacity, flat and cached)


def _next_log_probs(
    steps: CachedSteps | EnsembleSteps, prefix: Tensor, banned: Sequence[int], eos_id: int, min_len: int
) -> Tensor:
    """Log-probabilities of the next token (R, V): banned ids never, EOS not before min_len tokens."""
    logits = steps.logits(prefix)
    check_finite_outputs(logits, "next-token logits")  # NaN scores would end every beam with nothing
    logp = F.log_softmax(logits.float(), dim=-1)  # (R, V)
    banned = [*banned, eos_id] if prefix.shape[1] <= min_len else banned  # prefix: BOS + tokens so far
    if banned:
        logp[:, list(banned)] = NEG_INF
    return logp


def _check_ids(model: nn.Module, bos_id: int, eos_id: int, banned: Sequence[int]) -> list[int]:
    """BOS, EOS and the banned ids inside the model's vocabulary, some id left to choose; the banned ids
    as a list. (The low-level searches may ban EOS: every hypothesis then runs to its max length, as the
    benchmarks want; `search` refuses it.)"""
    if isinstance(banned, (str, bytes)) or not hasattr(banned, "__iter__"):
        raise TypeError(f"banned must be a list of token ids, got {type(banned).__name__}")
    banned = list(banned)
    vocab = model.cfg.vocab_size
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id), *(("banned id", b) for b in banned)):
        check_token_id(value, vocab, name)
    if len({int(b) for b in banned}) >= vocab:
        raise ValueError(
            f"banned ids cover the whole vocabulary of {vocab} tokens: nothing is left to choose"
        )
    return banned


def _check_model_and_src(model: nn.Module, src: Tensor, caller: str) -> Tensor:
    """An encoder-decoder and a (batch, length) tensor of token ids, as torch.long."""
    arch = getattr(getattr(model, "cfg", None), "arch", None)
    if arch != "encoder_decoder":
        raise ValueError(
            f"{caller} needs an encoder-decoder, got {'a model of arch ' + repr(arch) if arch else type(model).__name__}"
            + ("; a decoder LM generates with tformer.generate.engine.generate" if arch == "decoder" else "")
        )
    if not isinstance(src, Tensor) or src.dim() != 2 or src.dtype not in (torch.long, torch.int32):
        raise TypeError("src must be a (batch, length) tensor of token ids (torch.long or torch.int32)")
    return src.long()


def _check_lengths(max_len: int | Tensor, min_len: int) -> None:
    """The low-level searches' lengths as given (`search` derives them from a validated SearchConfig)."""
    if isinstance(max_len, Tensor):
        if max_len.dim() != 1 or max_len.dtype.is_floating_point or max_len.dtype == torch.bool:
            raise TypeError(f"max_len must be an int or a (B,) integer tensor, got a {max_len.dtype} tensor of shape {tuple(max_len.shape)}")  # fmt: skip
    elif isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral):
        raise TypeError(f"max_len must be an int or a (B,) integer tensor, got {max_len!r}")
    if isinstance(min_len, bool) or not isinstance(min_len, numbers.Integral) or min_len < 0:
        raise ValueError(f"min_len must be an int >= 0 (0: EOS may come first), got {min_len!r}")


def _check(model: nn.Module, src: Tensor, src_mask: Tensor | None, max_lens: Tensor) -> None:
    if src.dim() != 2 or src.shape[0] == 0 or src.shape[1] == 0:
        raise ValueError(f"src must be a non-empty (B, S) batch of token ids, got shape {tuple(src.shape)}")
    if src_mask is not None and not bool(src_mask.any(dim=1).all()):
        raise ValueError("every source sentence needs at least one real token")
    if max_lens.shape != (src.shape[0],) or int(max_lens.min()) < 1:
        raise ValueError("max_len must be >= 1 for every sentence")
    if int(max_lens.max()) > model.cfg.max_seq_len:
        raise ValueError(
            f"max_len {int(max_lens.max())} exceeds the model's context of {model.cfg.max_seq_len}"
        )


def _as_lens(max_len: int | Tensor, b: int, device: torch.device) -> Tensor:
    if isinstance(max_len, Tensor):
        return max_len.to(device=device, dtype=torch.long)
    return torch.full((b,), int(max_len), dtype=torch.long, device=device)


def _evaluating(search_fn):
    """Run a search with the model in eval mode (no dropout), putting its mode back afterwards, also
    when the search raises: a model straight from build_model, or mid-training, is in training mode."""

    @functools.wraps(search_fn)
    def run(model: nn.Module, *args, **kwargs):
        was_training = model.training
        model.eval()
        try:
            return search_fn(model, *args, **kwargs)
        finally:
            model.train(was_training)

    return run


# ----------------------------------------------------------------------------- beam search


@_evaluating
@torch.no_grad()
def beam_search(
    model: nn.Module,
    src: Tensor,
    src_mask: Tensor | None,
    *,
    bos_id: int,
    eos_id: int,
    max_len: int | Tensor,
    beam_size: int = 4,
    alpha: float = 0.6,
    banned: Sequence[int] = (),
    min_len: int = 0,
    cached: bool = True,
    flat: bool = True,
) -> list[Hypothesis]:
    """The best hypothesis per source sentence (see the module docstring for the rules).

    max_len: most generated tokens (EOS included), one int or (B,) per sentence. banned: token ids
    never generated (pass the pad and BOS ids). min_len: tokens generated before EOS may end one. flat: run the cached steps after the first as the flat
    `Seq2SeqDecodeStep` where the model is one it knows (False: `model.decode` every step).
    """
    return [
        kept[0]
        for kept in _beam(
            model, src, src_mask, bos_id, eos_id, max_len, beam_size, alpha, banned, min_len, cached, flat, 1
        )
    ]


@_evaluating
@torch.no_grad()
def beam_search_nbest(
    model: nn.Module,
    src: Tensor,
    src_mask: Tensor | None,
    *,
    n_best: int,
    bos_id: int,
    eos_id: int,
    max_len: int | Tensor,
    beam_size: int = 4,
    alpha: float = 0.6,
    banned: Sequence[int] = (),
    min_len: int = 0,
    cached: bool = True,
    flat: bool = True,
) -> list[list[Hypothesis]]:
    """The n_best best hypotheses the search finds per source sentence, best first (`beam_search`'s
    arguments; n_best at most beam_size). A sentence searches until its n_best-th best can no longer be
    beaten; the beams do not depend on what is kept, and nothing found after `beam_search` would stop
    beats its answer, so the first is that answer (its score can differ in the last bits where the
    sentences that search longer change the batch's row count, which a product's rounding can follow).
    Fewer than n_best come back only where fewer outputs exist (a tiny vocabulary)."""
    check_n_best(n_best, "beam", beam_size)
    return _beam(
        model,
        src,
        src_mask,
        bos_id,
        eos_id,
        max_len,
        beam_size,
        alpha,
        banned,
        min_len,
        cached,
        flat,
        int(n_best),
    )


def check_n_best(n_best: int, method: str, beam_size: int) -> None:
    """n_best is an int >= 1, 1 for a method other than beam search, and at most the beam size."""
    if isinstance(n_best, bool) or not isinstance(n_best, numbers.Integral) or n_best < 1:
        raise ValueError(f"n_best must be an int >= 1, got {n_best!r}")
    if n_best > 1 and method != "beam":
        raise ValueError(f"n_best {n_best} needs beam search: method {method!r} finds one output per source")
    if (
        not isinstance(beam_size, bool)
        and isinstance(beam_size, numbers.Integral)
        and 1 <= beam_size < n_best
    ):
        raise ValueError(f"n_best {n_best} is above beam_size {beam_size}: a beam keeps at most that many")


def _beam(
    model, src, src_mask, bos_id, eos_id, max_len, beam_size, alpha, banned, min_len, cached, flat, n_best
) -> list[list[Hypothesis]]:
    if not abs(alpha) <= MAX_ALPHA:
        raise ValueError(
            f"alpha (the length penalty) must be in [-{MAX_ALPHA:g}, {MAX_ALPHA:g}], got {alpha}"
        )
    if isinstance(beam_size, bool) or not isinstance(beam_size, numbers.Integral) or beam_size < 1:
        raise ValueError(f"beam_size must be an int >= 1, got {beam_size!r}")
    beam_size = int(beam_size)
    src = _check_model_and_src(model, src, "beam_search")
    _check_lengths(max_len, min_len)
    require_bool(cached=cached, flat=flat)
    b, device = src.shape[0], src.device
    max_lens = _as_lens(max_len, b, device)
    _check(model, src, src_mask, max_lens)
    banned = _check_ids(model, bos_id, eos_id, banned)  # an id outside the vocabulary had indexed past it
    k = beam_size
    steps = make_steps(model, src, src_mask, int(max_lens.max()) + 1, cached, flat)
    alive = torch.arange(b, device=device)  # (N,) source sentence of each searching sentence
    scores = torch.zeros(b, 1, device=device)  # (N, beams) log-probabilities of the live beams
    prefix = torch.full((b, 1), bos_id, dtype=torch.long, device=device)  # (R, t + 1)
    kept: list[list[Hypothesis]] = [[] for _ in range(b)]  # per sentence: its n_best best so far, best first
    floor = torch.full((b,), NEG_INF, device=device)  # (B,) the n_best-th best score (-inf: fewer kept)
    for t in range(1, int(max_lens.max()) + 1):
        logp = _next_log_probs(steps, prefix, banned, eos_id, min_len)  # (R, V)
        n, nb, v = scores.shape[0], scores.shape[1], logp.shape[-1]
        cand = (scores[:, :, None] + logp.view(n, nb, v)).view(n, nb * v)  # (N, nb * V)
        top, pos = cand.topk(min(2 * k, nb * v), dim=-1)  # (N, C), best first; pos = beam * V + token
        token, row = pos % v, torch.arange(n, device=device)[:, None] * nb + pos // v  # (N, C)
        valid, is_eos = torch.isfinite(top), token == eos_id
        last = (max_lens[alive] == t)[:, None]  # (N, 1): the live beams end here too
        in_top_k = torch.arange(top.shape[1], device=device)[None, :] < k
        ends = valid & in_top_k & (is_eos | last)
        _record(kept, floor, n_best, alive, prefix, top, token, row, ends, is_eos, length_penalty(t, alpha))
        live = top.masked_fill(~valid | is_eos | last, NEG_INF)
        if live.shape[1] < k:  # tiny vocabularies at the first step: the slots past them are dead (-inf),
            # but each must be a row of its own sentence (it had been row 0, the first sentence's: a beam
            # that later moved into the slot read that sentence's cross-attention keys and values)
            extra = k - live.shape[1]
            live = F.pad(live, (0, extra), value=NEG_INF)
            token, row = F.pad(token, (0, extra)), torch.cat([row, row[:, :1].expand(-1, extra)], dim=1)
        scores, pick = live.topk(k, dim=-1)  # (N, K)
        token, row = token.gather(1, pick), row.gather(1, pick)
        lp_max = length_penalty(max_lens[alive] if alpha >= 0 else torch.full_like(alive, t + 1), alpha)
        bound = scores[:, 0] / lp_max  # (N,) the best score a live beam can still reach
        searching = torch.isfinite(bound) & (floor[alive] < bound)
        if not bool(searching.any()):
            break
        keep_rows = row[searching].flatten()  # (R',)
        alive, scores = alive[searching], scores[searching]
        prefix = torch.cat([prefix.index_select(0, keep_rows), token[searching].flatten()[:, None]], dim=1)
        steps.select(keep_rows, alive.repeat_interleave(k))
    return [hyps or [Hypothesis([], NEG_INF, NEG_INF, False)] for hyps in kept]


def _record(kept, floor, n_best, alive, prefix, top, token, row, ends, is_eos, lp) -> None:
    """Let the hypotheses that end at this step into their sentence's n_best best (`kept`, best first)
    where they beat its n_best-th (`floor`); of equal scores the one found first stays ahead."""
    final = torch.where(ends, top / lp, torch.full_like(top, NEG_INF))  # (N, C)
    enters = final > floor[alive][:, None]  # (N, C)
    at = enters.flatten().nonzero().squeeze(1)  # (E,) row-major: each sentence's candidates best first
    if at.numel() == 0:
        return

    def pick(values: Tensor) -> Tensor:  # (E,)
        return values.flatten().index_select(0, at)

    # the fields copied to the host in two tensors (no float64: MPS has none), the prefixes in a third
    # (on a GPU: three waits a step, not one per field)
    ids = torch.stack([pick(alive[:, None].expand_as(top)), pick(token), pick(is_eos).long()]).tolist()
    values = torch.stack([pick(final), pick(top)]).tolist()
    bodies = prefix.index_select(0, row.flatten().index_select(0, at))[:, 1:].tolist()
    for s, last, eos, value, log_prob, body in zip(*ids, *values, bodies):
        hyps = kept[s]
        if len(hyps) == n_best and value <= hyps[-1].score:  # (an earlier candidate of this step raised it)
            continue
        place = next((j for j, h in enumerate(hyps) if h.score < value), len(hyps))
        hyps.insert(place, Hypothesis(body + ([] if eos else [last]), value, log_prob, bool(eos)))
        del hyps[n_best:]
        if len(hyps) == n_best:
            floor[s] = hyps[-1].score


# ----------------------------------------------------------------------------- greedy and sampling


@_evaluating
@torch.no_grad()
def sample_search(
    model: nn.Module,
    src: Tensor,
    src_mask: Tensor | None,
    *,
    bos_id: int,
    eos_id: int,
    max_len: int | Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    banned: Sequence[int] = (),
    min_len: int = 0,
    flat: bool = True,
    generator: torch.Generator | None = None,
) -> list[Hypothesis]:
    """One token per step per sentence: argmax when temperature is 0 (greedy), else a seeded draw after
    temperature / top-k / top-p. Sentences leave the batch when they emit EOS or reach their max length.
    flat: as in `beam_search`. generator: draw from it (a stream that goes on across calls, e.g. over the
    batches of one input) instead of a new one seeded with `seed`."""
    src = _check_model_and_src(model, src, "sample_search")
    _check_lengths(max_len, min_len)
    require_bool(flat=flat)
    b, device = src.shape[0], src.device
    max_lens = _as_lens(max_len, b, device)
    _check(model, src, src_mask, max_lens)
    banned = _check_ids(model, bos_id, eos_id, banned)
    steps = make_steps(model, src, src_mask, int(max_lens.max()) + 1, True, flat)
    if generator is None:
        generator = make_generator(seed, device)
    alive = torch.arange(b, device=device)  # (N,)
    prefix = torch.full((b, 1), bos_id, dtype=torch.long, device=device)  # (N, t + 1)
    log_prob = torch.zeros(b, device=device)  # (N,)
    out: list[Hypothesis | None] = [None] * b
    for t in range(1, int(max_lens.max()) + 1):
        logp = _next_log_probs(steps, prefix, banned, eos_id, min_len)  # (N, V)
        nxt = sample_next(logp, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        log_prob = log_prob + logp.gather(1, nxt[:, None]).squeeze(1)
        ended = (nxt == eos_id) | (max_lens[alive] == t)
        ended_rows = ended.nonzero().flatten().tolist()
        for i in ended_rows:
            eos = int(nxt[i]) == eos_id
            tokens = prefix[i, 1:].tolist() + ([] if eos else [int(nxt[i])])
            out[int(alive[i])] = Hypothesis(tokens, float(log_prob[i]), float(log_prob[i]), eos)
        if len(ended_rows) == len(alive):
            break
        if not ended_rows:  # every row goes on: the cache and the memory rows stay as they are (no copy)
            prefix = torch.cat([prefix, nxt[:, None]], dim=1)
            continue
        keep = (~ended).nonzero().flatten()  # (N',)
        alive, log_prob = alive[keep], log_prob[keep]
        prefix = torch.cat([prefix[keep], nxt[keep, None]], dim=1)
        steps.select(keep, alive)
    return out  # type: ignore[return-value]


def search(
    model: nn.Module,
    src: Tensor,
    src_mask: Tensor | None,
    cfg: SearchConfig,
    *,
    bos_id: int,
    eos_id: int,
    banned: Sequence[int] = (),
    fast_decode: bool = True,
    generator: torch.Generator | None = None,
) -> list[Hypothesis]:
    """Decode a batch with the method `cfg` names; max lengths from cfg and the source lengths.

    generator: for method "sample", the stream to draw from (on src's device); None: a new one seeded
    with cfg.seed. A caller that splits one input into batches passes one generator for all of them, so
    each batch draws fresh numbers (`Translator` does).

    fast_decode: on the CPU, where it pays on this machine (`tformer.model.linear.row_blocking_pays`),
    compute the linear layers' products of a few rows as row-blocked products
    (`tformer.model.linear.row_blocked_linears`; one sentence with beam 4: 1.27x, greedy 1.14x on the
    translation preset's model) and run each step after the first as the flat
    `tformer.model.decode_step.Seq2SeqDecodeStep`; False: `model.decode` with `F.linear` throughout
    (the slow twin)."""
    return [
        hyps[0]
        for hyps in search_nbest(
            model,
            src,
            src_mask,
            cfg,
            n_best=1,
            bos_id=bos_id,
            eos_id=eos_id,
            banned=banned,
            fast_decode=fast_decode,
            generator=generator,
        )
    ]


def search_nbest(
    model: nn.Module,
    src: Tensor,
    src_mask: Tensor | None,
    cfg: SearchConfig,
    *,
    n_best: int,
    bos_id: int,
    eos_id: int,
    banned: Sequence[int] = (),
    fast_decode: bool = True,
    generator: torch.Generator | None = None,
) -> list[list[Hypothesis]]:
    """`search`, returning the n_best best hypotheses per sentence, best first (`beam_search_nbest`).
    Beam search alone keeps more than one: greedy and sampled search take n_best 1."""
    src = _check_model_and_src(model, src, "search")
    if not isinstance(cfg, SearchConfig):
        raise TypeError(f"cfg must be a SearchConfig, got {type(cfg).__name__}")
    check_n_best(n_best, cfg.method, cfg.beam_size)
    require_bool(fast_decode=fast_decode)
    check_not_meta(model)
    if generator is not None and (
        not isinstance(generator, torch.Generator) or generator.device.type != src.device.type
    ):
        raise ValueError(
            f"generator must be a torch.Generator on {src.device.type}, like src, got {generator!r}"
        )
    if src_mask is not None and (
        not isinstance(src_mask, Tensor) or src_mask.dtype != torch.bool or src_mask.shape != src.shape
    ):
        raise ValueError(
            f"src_mask must be a bool tensor of src's shape {tuple(src.shape)} (True = real token)"
        )
    banned = _check_ids(model, bos_id, eos_id, banned)
    vocab = model.cfg.vocab_size
    if eos_id in {int(b) for b in banned}:  # no hypothesis could ever finish
        raise ValueError(f"eos_id {eos_id} is among the banned ids: no output could end")
    if cfg.min_len and len({int(b) for b in banned} | {int(eos_id)}) >= vocab:
        raise ValueError(
            f"every id but eos_id {eos_id} is banned: min_len {cfg.min_len} tokens cannot come before it (min_len=0)"
        )
    with decoding_layout(model) if fast_decode else contextlib.nullcontext():
        return _search(
            model,
            src,
            src_mask,
            cfg,
            n_best=int(n_best),
            bos_id=bos_id,
            eos_id=eos_id,
            banned=banned,
            flat=fast_decode,
            generator=generator,
        )


def _search(
    model, src, src_mask, cfg, *, n_best, bos_id, eos_id, banned, flat, generator
) -> list[list[Hypothesis]]:
    src_lens = src_mask.sum(dim=1) if src_mask is not None else torch.full((src.shape[0],), src.shape[1])
    max_lens = cfg.max_lens(src_lens.to(src.device), model.cfg.max_seq_len)
    common = dict(
        bos_id=bos_id, eos_id=eos_id, max_len=max_lens, banned=banned, min_len=cfg.min_len, flat=flat
    )
    if cfg.method == "beam":
        return beam_search_nbest(
            model, src, src_mask, n_best=n_best, beam_size=cfg.beam_size, alpha=cfg.length_penalty, **common
        )
    if cfg.method == "greedy":
        return [[h] for h in sample_search(model, src, src_mask, **common)]
    hyps = sample_search(
        model,
        src,
        src_mask,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        seed=cfg.seed,
        generator=generator,
        **common,
    )
    return [[h] for h in hyps]
