"""BPE-dropout (Provilkov et al., 2020): a trained BPE's segmentation with merges skipped at random.

At each merge step of a word, every candidate merge (an adjacent pair the BPE knows, tried in rank
order) is skipped with probability p; the first one kept is applied, and the word is done when all are
skipped (or none is left). A word thus reaches the model in many segmentations, a regulariser for small
translation corpora. p = 0 is the tokenizer's own encoding (tested against the tokenizers library on a
real corpus); p = 1 leaves every word in single bytes. Seeded with Python's `random.Random`, so a run and
its resume, on any machine, see the same segmentations (the library's own dropout draws from an unseeded
generator).
"""

from __future__ import annotations

import json
import math
import numbers
import random
from collections.abc import Sequence

from tformer.data.tokenizer import Tokenizer, _texts
from tformer.schema import require_bool


class BPEDropout:
    """Sampled segmentations of text with `tokenizer`'s vocabulary and merges, at dropout rate `p`."""

    def __init__(self, tokenizer: Tokenizer, p: float) -> None:
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be a number from 0 to 1, got {p!r}")
        spec = json.loads(tokenizer.to_json_str())
        model = spec.get("model") or {}
        unlike = _unlike_tformers_bpe(spec, model)
        if unlike:  # its encoding would not be the merges applied to the pre-tokens
            raise ValueError(
                f"BPE-dropout takes a byte-level BPE tokenizer as tformer trains them; this one {unlike}"
            )
        self.tokenizer, self.p = tokenizer, float(p)
        self._vocab: dict[str, int] = model["vocab"]
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        self._rank = {pair: rank for rank, pair in enumerate(merges)}.get
        self._log_p = math.log(self.p) if 0.0 < self.p < 1.0 else None

    def _skips(self, rng: random.Random) -> int | float:
        """How many candidates in a row are skipped: geometric, P(k or more) = p**k (one draw per step)."""
        if self._log_p is None:
            return math.inf if self.p == 1.0 else 0
        return int(math.log(1.0 - rng.random()) / self._log_p)

    def _word(self, piece: str, rng: random.Random) -> list[str]:
        symbols = list(piece)
        while len(symbols) > 1:
            candidates = [
                (rank, i)
                for i, rank in enumerate(map(self._rank, zip(symbols, symbols[1:])))
                if rank is not None
            ]
            skip = self._skips(rng) if candidates else math.inf
            if skip >= len(candidates):
                break
            _, i = min(candidates) if skip == 0 else sorted(candidates)[skip]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        return symbols

    def _sample(self, text: str, rng: random.Random) -> list[int]:
        vocab = self._vocab
        return [vocab[s] for piece in self.tokenizer.pre_tokens(text) for s in self._word(piece, rng)]

    def encode(self, text: str, rng: random.Random, add_eos: bool = False) -> list[int]:
        """One sampled segmentation of `text` (the tokenizer's EOS appended with add_eos)."""
        require_bool(add_eos=add_eos)
        if not isinstance(rng, random.Random):
            raise TypeError(
                f"rng must be a random.Random (encode_batch takes a seed), got {type(rng).__name__}"
            )
        return self._sample(text, rng) + [self.tokenizer.eos_id] * add_eos

    def encode_batch(self, texts: Sequence[str], seed: int | str, add_eos: bool = False) -> list[list[int]]:
        """One sampled segmentation of each text, all drawn from one generator seeded with `seed` (an int
        or a str: the same seed, the same samples, on any machine)."""
        require_bool(add_eos=add_eos)
        if isinstance(seed, bool) or not isinstance(seed, (numbers.Integral, str)):
            raise TypeError(f"seed must be an int or a str, got {seed!r}")
        rng = random.Random(seed if isinstance(seed, str) else int(seed))
        eos = [self.tokenizer.eos_id] * add_eos
        return [self._sample(text, rng) + eos for text in _texts(texts)]


def _unlike_tformers_bpe(spec: dict, model: dict) -> str | None:
    """What sets a tokenizer.json apart from the byte-level BPE `Tokenizer.train_bpe` writes (None: nothing)."""
    if model.get("type") != "BPE":
        return f"has a {model.get('type')!r} model, not BPE"
    if spec.get("normalizer"):
        return "normalizes text before it splits it"
    if (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        return "does not split text with the ByteLevel pre-tokenizer"
    options = ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "ignore_merges", "byte_fallback")
    set_ = [name for name in options if model.get(name)]
    if set_:
        return f"sets BPE options tformer's do not: {', '.join(set_)}"
    if any(not token.get("special") for token in spec.get("added_tokens") or []):
        return "has added tokens that are not special"
    return None
