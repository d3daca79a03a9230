"""Attention masks as data, built from absolute slot indices.

Shapes: B batch, Tq queries, Tk keys. A `Mask` holds `allowed` (B or 1, 1, Tq, Tk) bool, True where a
query may attend to a key. `is_causal` is a hint that `allowed` is exactly the square lower-triangular
pattern, with no padding or only right padding (which no real query reaches), so a fused kernel may use its own causal path (SDPA's `is_causal=True` is
top-left aligned and is only correct when Tq == Tk, which is why the hint is set only then).
`is_full` is a hint that `allowed` is all True (no padding, and either a bidirectional mask or one
new token over the cache, which attends to every cached key), so a fused kernel may skip the mask.
`tokens` (B, Tq) bool, True for the real query tokens, is set where padding is known (None: every
query is a real token); position-wise layers that pool statistics over tokens (MoE routing) read it.

Every query row keeps at least one allowed key: a row with none (a fully padded sample) is opened to
all its keys so the softmax stays finite; such rows are padding and their outputs are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tformer.model.checks import left_padded_row


@dataclass(frozen=True)
class Mask:
    allowed: Tensor  # (B|1, 1, Tq, Tk) bool
    is_causal: bool = False
    is_full: bool = False
    tokens: Tensor | None = None  # (B, Tq) bool: the real query tokens (None: all)


def _finite_rows(allowed: Tensor) -> Tensor:
    """Open rows that allow no key at all (fully padded samples) so softmax stays finite."""
    return allowed | ~allowed.any(dim=-1, keepdim=True)


def causal_mask(
    q_start: int, t_q: int, key_padding: Tensor | None, device: torch.device, right_padded: bool = False
) -> Mask:
    """Causal self-attention mask for queries in slots [q_start, q_start + t_q) over keys [0, q_start + t_q).

    key_padding: (B, Tk) bool, True for real tokens, covering every key slot (cache included).
    right_padded: the caller's word that every row's real tokens come first (a training batch of targets).
    A real query then never reaches a padded key under the causal pattern, so the mask keeps the causal
    hint (SDPA's fused causal path) and only `tokens` records the padding; padded queries see the padding
    before them, and their outputs are ignored, as everywhere. Said by the caller, not read from the
    tensor: reading it would be a host sync and a graph break under torch.compile.
    """
    t_k = q_start + t_q
    q_slot = torch.arange(q_start, t_k, device=device)  # (Tq,)
    k_slot = torch.arange(t_k, device=device)  # (Tk,)
    allowed = (k_slot[None, :] <= q_slot[:, None])[None, None]  # (1, 1, Tq, Tk)
    if key_padding is None:
        return Mask(allowed, is_causal=q_start == 0, is_full=t_q == 1)
    if right_padded and q_start == 0:  # the causal pattern already hides the padding
        check_right_padded(key_padding)
        return Mask(allowed, is_causal=True, is_full=t_q == 1, tokens=key_padding)
    allowed = allowed & key_padding[:, None, None, :]  # (B, 1, Tq, Tk)
    return Mask(_finite_rows(allowed), tokens=key_padding[:, q_start:])


def check_right_padded(key_padding: Tensor) -> None:
    """ValueError unless every row's real tokens come first: a left-padded mask declared right-padded would
    let real queries attend to padding. A host read, skipped under torch.compile as the token checks are."""
    row = left_padded_row(key_padding)
    if row is not None:
        raise ValueError(
            f"the target padding mask was declared right-padded (tgt_right_padded=True), but row {row} has "
            "a padded slot before a real token: pad on the right, or leave tgt_right_padded False"
        )


def padding_mask(t_q: int, key_padding: Tensor | None, t_k: int, device: torch.device) -> Mask:
    """Bidirectional mask: every query sees every real key. key_padding: (B, Tk) bool or None."""
    if key_padding is None:
        return Mask(torch.ones(1, 1, t_q, t_k, dtype=torch.bool, device=device), is_full=True)
    allowed = key_padding[:, None, None, :].expand(-1, 1, t_q, -1)  # (B, 1, Tq, Tk)
    return Mask(_finite_rows(allowed), tokens=key_padding if t_q == t_k else None)  # self-attention: its own
