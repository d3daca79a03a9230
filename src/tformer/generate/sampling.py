"""Next-token selection: pure functions on logits, and the sampling config.

Shapes: B batch, V vocabulary, T previous tokens. `logits (B, V)` in, `(B, V)` out (filtered entries set
to -inf), `sample_next -> (B,)` token ids. Nothing here holds state; randomness comes only from the
caller's `torch.Generator`, so a seeded generator gives the same tokens on every run.

Order in `sample_with_config`: repetition penalty, temperature, top-k, top-p, then a draw.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from dataclasses import dataclass
from typing import Any

import torch

from tformer.model.checks import NonFiniteOutputError
from tformer.schema import Config, ConfigError, _coerce

__all__ = [
    "SamplingConfig",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "make_generator",
    "sample_next",
    "sample_with_config",
]


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        kind = f"a {logits.dtype} tensor" if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"logits must be a floating-point tensor (B, V), got {kind}")
    if logits.dim() != 2 or logits.size(1) == 0:
        raise ValueError(f"logits must be (B, V) with V >= 1, got shape {tuple(logits.shape)}")


def _number(name: str, value: object) -> None:
    """A TypeError naming `name` unless `value` is a real number (a bool or str is not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, (B, V) -> (B, V). temperature must be > 0 (0 means greedy: see sample_next)."""
    _check_logits(logits)
    _number("temperature", temperature)
    if not 0 < temperature < math.inf:
        raise ValueError(
            f"temperature must be finite and > 0 here (0 means greedy, handled by sample_next), got {temperature}"
        )
    scaled = logits / temperature
    # a tiny temperature can take finite logits to +-inf (and the softmax to NaN): such rows are
    # scaled after subtracting their largest logit, which keeps it at 0; other rows are left as they are
    # (in float64: a temperature below float32's range, e.g. 1e-46, is 0 there and 0 / 0 would be NaN).
    # Dividing by temperature >= 1 cannot overflow: decided on the host, no device sync either way
    if temperature >= 1:
        return scaled
    overflow = (torch.isfinite(logits) & ~torch.isfinite(scaled)).any(dim=-1, keepdim=True)
    shifted = (logits - logits.amax(dim=-1, keepdim=True)).double() / temperature
    return torch.where(overflow, shifted.to(scaled.dtype), scaled)


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the top_k largest logits of each row, the rest -inf. Logits equal to the k-th largest are
    kept too (as Hugging Face's TopKLogitsWarper keeps them, and apply_top_p its ties), so the set
    depends on the values alone, never on how torch.topk orders equal logits.

    top_k <= 0 or >= V leaves the logits unchanged. (B, V) -> (B, V).
    """
    _check_logits(logits)
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be an int, got {top_k!r}")
    if top_k <= 0 or top_k >= logits.size(-1):
        return logits
    kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering (Holtzman et al., 2020): keep the smallest set of most likely tokens whose
    probability mass reaches top_p; the token that crosses top_p is kept, and so is always the most
    likely one. Tokens whose logit equals the last kept one are kept too, so the set depends on the
    values alone, never on how the sort orders equal logits. top_p must be in (0, 1]; 1 leaves the
    logits unchanged. (B, V) -> (B, V).
    """
    _check_logits(logits)
    _number("top_p", top_p)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_p == 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.float().softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens, (B, V)
    drop_sorted = mass_before >= top_p
    drop_sorted[:, 0] = False
    last_kept = sorted_logits.masked_fill(drop_sorted, float("inf")).amin(dim=-1, keepdim=True)  # (B, 1)
    return logits.masked_fill(logits < last_kept, float("-inf"))


def apply_repetition_penalty(
    logits: torch.Tensor, prev_ids: torch.Tensor, penalty: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """CTRL repetition penalty (Keskar et al., 2019) on the tokens already present in each row.

    A present token's logit is divided by `penalty` if positive and multiplied by it if negative, so
    penalty > 1 makes repeats less likely. logits (B, V); prev_ids (B, T) long; mask (B, T) bool, True
    for real tokens (False marks padding, whose ids, even out of range, are ignored). penalty > 0;
    1 leaves the logits unchanged. Returns (B, V).
    """
    _check_logits(logits)
    _number("penalty", penalty)
    if not penalty > 0:
        raise ValueError(f"repetition penalty must be > 0, got {penalty}")
    if not isinstance(prev_ids, torch.Tensor) or prev_ids.dtype not in (torch.long, torch.int32):
        kind = f"{prev_ids.dtype} tensor" if isinstance(prev_ids, torch.Tensor) else type(prev_ids).__name__
        raise TypeError(f"prev_ids must be a torch.long (or int32) tensor of token ids, got a {kind}")
    if prev_ids.dim() != 2 or prev_ids.size(0) != logits.size(0):
        raise ValueError(f"prev_ids must be (B, T) with B={logits.size(0)}, got {tuple(prev_ids.shape)}")
    if mask is None:
        mask = torch.ones_like(prev_ids, dtype=torch.bool)
    if mask.shape != prev_ids.shape or mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool with the shape of prev_ids {tuple(prev_ids.shape)}")
    if penalty == 1.0:
        return logits
    ids = prev_ids.long().masked_fill(~mask, 0)  # (B, T)
    if ids.numel() and (ids.min() < 0 or ids.max() >= logits.size(-1)):
        raise ValueError(f"prev_ids must be in [0, {logits.size(-1)}) where mask is True")
    counts = torch.zeros(logits.shape, dtype=torch.long, device=logits.device)  # (B, V)
    present = counts.scatter_add_(-1, ids, mask.long()) > 0  # padding adds 0, never un-marks a token
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    # a tiny or huge penalty can take finite logits to +-inf, which the softmax turns into NaN: such rows
    # are penalised in float64 and shifted so that their largest value is 0, which keeps the order
    overflow = (present & torch.isfinite(logits) & ~torch.isfinite(penalised)).any(dim=-1, keepdim=True)
    wide, big = logits.double(), torch.finfo(torch.float64).max
    wide = torch.where(present, torch.where(wide > 0, wide / penalty, wide * penalty).clamp(-big, big), wide)
    shifted = (wide - wide.amax(dim=-1, keepdim=True)).to(logits.dtype)
    return torch.where(overflow, shifted, torch.where(present, penalised, logits))


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator on `device` seeded with `seed` (an int in torch.manual_seed's [-2**63, 2**64))."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must be in [-2**63, 2**64) (torch.manual_seed's range), got {seed}")
    return torch.Generator(device=device).manual_seed(int(seed))


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Draw one token per row: (B, V) -> (B,) long.

    temperature 0 is greedy argmax (no randomness, top_k / top_p irrelevant). Otherwise temperature,
    top-k and top-p filter the logits (in float32) and one token is drawn from the softmax with
    `generator`, which the caller seeds: same seed, same tokens.
    """
    _check_logits(logits)
    _number("temperature", temperature)
    _number("top_p", top_p)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (or None), got {type(generator).__name__}")
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be finite and >= 0 (0 means greedy), got {temperature}")
    # -inf is a masked token; NaN / +inf break argmax and the softmax. A row's max is NaN or +inf exactly
    # when the row holds one (max propagates NaN): one reduction and one host sync per step, and the max's
    # index is the greedy token (the first maximal one, as argmax)
    top, index = logits.max(dim=-1)
    if not bool(((top < math.inf) & (top > -math.inf)).all()):  # NaN fails both
        row = int((~((top < math.inf) & (top > -math.inf))).nonzero()[0])
        if top[row] == -math.inf:  # argmax would have answered id 0, a masked token
            raise ValueError(
                f"every logit of row {row} is -inf: all its tokens are masked, none can be drawn"
            )
        raise NonFiniteOutputError(
            f"the logits of row {row} hold NaN or +inf: the model's output overflowed (e.g. in low "
            "precision) or its weights hold NaN or inf"
        )
    if temperature == 0:
        return index
    filtered = apply_top_p(apply_top_k(apply_temperature(logits.float(), temperature), top_k), top_p)
    probs = filtered.softmax(dim=-1)  # (B, V)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)  # (B,)


@dataclass(frozen=True)
class SamplingConfig(Config):
    """How generate picks tokens.

    temperature: 0 greedy, < 1 sharper, > 1 flatter. top_k: keep the k most likely tokens, and any tied
    with the k-th (0 off). top_p: nucleus mass in (0, 1] (1 off). repetition_penalty: CTRL penalty (1
    off, > 1 discourages repeats) on every token of the prompt and of the text generated so far (left
    padding excluded). max_new_tokens: tokens generated at most. min_new_tokens: EOS cannot be drawn
    before this many new tokens (0 off; stop strings still stop). seed: seeds the sampling generator.
    stop_strings: a row stops once its new text (the prompt's not included) contains one of them; the
    ids generate returns still hold the token that completed it, and the CLI cuts the text at the stop
    string (`truncate_at_stop`).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0
    stop_strings: tuple[str, ...] = ()
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        # tformer.schema has no tuple type yet: check stop_strings here, every other field as Config does.
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "stop_strings":
                value = self._stop_strings(value)
            else:
                value = _coerce(type(self).__name__, f.name, value, hints[f.name])
            object.__setattr__(self, f.name, value)
        self.check()

    @staticmethod
    def _stop_strings(value: Any) -> tuple[str, ...]:
        if isinstance(value, (list, tuple)) and all(isinstance(s, str) and s for s in value):
            return tuple(value)
        shown = list(value) if isinstance(value, tuple) else value  # as a user would write it
        raise ConfigError(f"SamplingConfig.stop_strings must be a list of non-empty strings, got {shown!r}")

    def check(self) -> None:
        self._require(
            0.0 <= self.temperature < math.inf, "temperature", "must be finite and >= 0 (0 means greedy)"
        )
        self._require(self.top_k >= 0, "top_k", "must be >= 0 (0 means off)")
        self._require(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1] (1 means off)")
        self._require(
            0.0 < self.repetition_penalty < math.inf,
            "repetition_penalty",
            "must be finite and > 0 (1 means off)",
        )
        self._require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        self._require(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            f"must be >= 0 and <= SamplingConfig.max_new_tokens ({self.max_new_tokens})",
        )
        self._require_seed()

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "stop_strings": list(self.stop_strings)}  # plain JSON / YAML list


def sample_with_config(
    logits: torch.Tensor,
    config: SamplingConfig,
    *,
    generator: torch.Generator | None,
    prev_ids: torch.Tensor | None = None,
    prev_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Repetition penalty over prev_ids (B, T) (if given), then sample_next: (B, V) -> (B,)."""
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"config must be a SamplingConfig, got {type(config).__name__}")
    if prev_ids is not None:
        logits = apply_repetition_penalty(logits, prev_ids, config.repetition_penalty, prev_mask)
    return sample_next(
        logits, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p, generator=generator
    )
