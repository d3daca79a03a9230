"""Input validation done on the host before any compute: bad input gets a specific error.

Every check raises TypeError (wrong type or dtype) or ValueError (wrong shape or value), naming the
argument, what was given and what is allowed. Inside torch.compile only the checks of types and shapes
run: reading a value on the host (ids and positions in range) would break the compiled graph in two
at every forward. Eager calls, generation and evaluation check everything.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import Tensor

# what embedding lookups and index_select take (a uint8 index tensor would index as a mask)
_INT_DTYPES = (torch.int64, torch.int32)


META_MODEL = (
    "the model is on the meta device (its weights hold no data): give it storage and weights first, "
    "e.g. model.to_empty(device='cpu') and then load_weights"
)


def check_not_meta(model: torch.nn.Module) -> None:
    """A model built under torch.device('meta') has shapes but no values: named before anything runs."""
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ValueError(META_MODEL)


def check_tokens(
    tokens: object, vocab_size: int, name: str = "tokens", device: torch.device | None = None
) -> Tensor:
    """tokens: (B, T) integer ids in [0, vocab_size), on `device` (the embedding's, where given)."""
    if device is not None and device.type == "meta":
        raise ValueError(META_MODEL)
    if not isinstance(tokens, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(tokens).__name__}")
    if tokens.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be a torch.long (or torch.int32) tensor, got dtype {tokens.dtype}")
    if tokens.dim() != 2:
        raise ValueError(f"{name} must have shape (batch, seq_len), got {tuple(tokens.shape)}")
    if tokens.shape[0] == 0:
        raise ValueError(f"{name} is an empty batch (batch size 0)")
    if tokens.shape[1] == 0:
        raise ValueError(f"{name} holds empty sequences (seq_len 0)")
    if device is not None and tokens.device != device:
        raise ValueError(f"{name} are on {tokens.device}, the model on {device}: move one to the other")
    if torch.compiler.is_compiling():  # a host read would split the compiled graph (see the module doc)
        return tokens
    lo, hi = torch.aminmax(tokens)
    if lo.item() < 0 or hi.item() >= vocab_size:
        bad = ((tokens < 0) | (tokens >= vocab_size)).nonzero()[0].tolist()
        raise ValueError(
            f"{name} contains id {tokens[bad[0], bad[1]].item()} at (batch {bad[0]}, position {bad[1]}); "
            f"allowed ids are 0..{vocab_size - 1} (vocab_size={vocab_size})"
        )
    return tokens


def is_dtensor(t: object) -> bool:
    """A DTensor (only possible once torch.distributed.tensor is imported; this never imports it): a
    tensor-parallel layer's weight, or the logits of a head split by vocabulary."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def check_targets(
    targets: Tensor,
    n_classes: int,
    name: str = "targets",
    ignore_index: int | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """targets: integer class ids in [0, n_classes), or ignore_index (checked before the loss: torch's
    cross-entropy says only "Target 64 is out of bounds" on the CPU and asserts on a GPU); on `device`
    where given."""
    if not isinstance(targets, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of class ids, got {type(targets).__name__}")
    if targets.dtype != torch.long:  # cross-entropy takes int64 class ids (and -100 needs a signed type)
        raise TypeError(f"{name} must be a torch.long tensor of class ids, got dtype {targets.dtype}")
    if device is not None and targets.device != device:
        raise ValueError(f"{name} are on {targets.device}, the model on {device}: move one to the other")
    if torch.compiler.is_compiling():  # a host read would split the compiled graph (see the module doc)
        return targets
    bad_mask = (targets < 0) | (targets >= n_classes)
    if ignore_index is not None:
        bad_mask &= targets != ignore_index
    if bool(bad_mask.any()):  # one host sync; the rest only on the error path
        bad = bad_mask.nonzero()[0].tolist()
        where = ", ".join(f"{axis} {i}" for axis, i in zip(("batch", "position"), bad))
        also = f" or {ignore_index} (ignored)" if ignore_index is not None else ""
        raise ValueError(
            f"{name} contains id {targets[tuple(bad)].item()} at ({where}); allowed ids are "
            f"0..{n_classes - 1}{also} (the model has {n_classes} outputs)"
        )
    return targets


def check_positions(
    positions: Tensor, batch: int, length: int, max_seq_len: int, scheme: str, what: str = "sequence"
) -> Tensor:
    """positions: (T,) or (B, T) integer positions in [0, max_seq_len) of the `what` (source, target...)."""
    if not isinstance(positions, Tensor) or positions.dtype not in _INT_DTYPES:
        raise TypeError(
            "positions must be a torch.long (or torch.int32) tensor, got "
            f"{getattr(positions, 'dtype', type(positions))}"
        )
    if positions.shape not in ((length,), (batch, length)):
        raise ValueError(
            f"positions must have shape ({length},) or ({batch}, {length}), got {tuple(positions.shape)}"
        )
    if torch.compiler.is_compiling():
        return positions
    lo, hi = torch.aminmax(positions)
    if lo.item() < 0:
        raise ValueError(f"positions must be >= 0, got {lo.item()}")
    if hi.item() >= max_seq_len:
        hint = {
            "rope": "raise max_seq_len (with rope scaling to stretch a trained context)",
            "none": "raise max_seq_len",
        }.get(scheme, f"positions='{scheme}' has no entries beyond it")
        raise ValueError(
            f"the {what} reaches position {hi.item()} but the model allows at most max_seq_len={max_seq_len} "
            f"positions (0..{max_seq_len - 1}); {hint}"
        )
    return positions


def check_key_padding(mask: Tensor | None, batch: int, length: int, name: str) -> Tensor | None:
    """mask: (B, T) bool, True for real tokens, or None."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must be a bool tensor (True = real token), got {getattr(mask, 'dtype', type(mask))}"
        )
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"{name} must have shape ({batch}, {length}) (batch, keys), got {tuple(mask.shape)}")
    return mask


def left_padded_row(mask: Tensor | None) -> int | None:
    """The first row of `mask` (B, T) bool, True for real tokens, that pads before a real token; None where
    every row's real tokens come first (or under torch.compile: a host read would split the graph)."""
    if mask is None or torch.compiler.is_compiling():
        return None
    late = mask[:, 1:] & ~mask[:, :-1]  # (B, T - 1) a real token right after a pad
    return int(late.any(1).nonzero()[0, 0]) if late.any() else None


def check_source_padding(mask: Tensor | None) -> None:
    """ValueError where a source mask pads on the left. The encoder numbers its positions from the first
    slot and takes none from the caller, so a left-padded row's tokens would sit at other positions than
    the same tokens unpadded (and `cls` pooling would read a pad): outputs silently different from the
    unpadded sequence's."""
    row = left_padded_row(mask)
    if row is not None:
        raise ValueError(
            f"source key_padding_mask: row {row} has padding before a real token; pad on the right (real "
            "tokens first): the encoder counts positions from the first slot"
        )


class NonFiniteOutputError(ValueError):
    """A trained model's outputs are NaN or infinite: decoding, classifying or scoring them would print
    garbage (or an empty translation) as if it were a result."""


def check_finite_scores(result: dict) -> None:
    """NonFiniteOutputError where a float in an evaluation's result (a loss, a perplexity) is NaN or
    infinite: a diverged or damaged model has no result to print or write, and JSON would not hold it."""
    for key, value in result.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise NonFiniteOutputError(
                f"the run's {key} is {value}: the model's outputs are NaN or infinite (damaged or diverged "
                "weights, or an overflow in low precision)"
            )


def check_finite_outputs(values: Tensor, what: str) -> None:
    """NonFiniteOutputError where `values` (logits (..., V)) hold NaN or +inf, or a row of -inf alone (a
    -inf logit on its own is a token ruled out, as a masked or scripted model gives)."""
    top = values.amax(dim=-1)
    if bool((values.isnan().any(dim=-1) | (top == math.inf) | (top == -math.inf)).any()):
        raise NonFiniteOutputError(
            f"the model's {what} are NaN or infinite: its weights or activations hold NaN or inf (damaged or "
            "diverged weights, or an overflow in low precision)"
        )
