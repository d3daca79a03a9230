"""Key/value caches for incremental decoding.

Shapes: k/v (B, Hkv, T, E). A cache is handed to the spine; each attention layer calls
`cache.update(layer_idx, k, v)` with the new keys/values and gets back all keys/values so far.
Cross-attention asks `cache.cross(layer_idx, compute)` for the encoder memory's K/V, computed once per
source: the decoder names the source first (`use_source`), and another one is an error, not stale K/V. `NO_CACHE` is
the null object used in training and full forwards; `as_cache` checks what a caller hands a model.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable

import torch
from torch import Tensor

KV = tuple[Tensor, Tensor]


class NoCache:
    """Null object: nothing is stored; every call computes."""

    seq_len = 0

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> KV:
        return k, v

    def use_source(self, source: Tensor) -> None:
        pass

    def cross(self, layer_idx: int, compute: Callable[[], KV]) -> KV:
        return compute()


NO_CACHE = NoCache()


def as_cache(cache: object, n_layers: int) -> NoCache | KVCache:
    """The cache a model call was given (None: no cache), checked against the model's layer count."""
    if cache is None or isinstance(cache, NoCache):
        return NO_CACHE
    if not isinstance(cache, KVCache):
        raise TypeError(
            f"cache must be a KVCache from model.new_cache() (or None), got {type(cache).__name__}"
        )
    if len(cache.lengths) != n_layers:
        raise ValueError(
            f"this KV cache was made for {len(cache.lengths)} layers; the model has {n_layers}: "
            "use model.new_cache()"
        )
    return cache


class KVCache:
    """Preallocated self-attention cache of `capacity` slots plus cross-attention K/V per layer.

    Writes go in place into (B, Hkv, capacity, E) buffers, so a decoding step copies only its own
    keys; `update` returns views of the filled prefix. Under autograd a write makes new buffers instead
    (a copy per call), so gradients flow through several cached calls. `reorder(index)` selects batch rows (beam search).
    """

    def __init__(self, n_layers: int, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or capacity < 1:
            raise ValueError(f"a KV cache needs a capacity of at least 1 position, got {capacity!r}")
        self.capacity = int(capacity)
        self.k: list[Tensor | None] = [None] * n_layers
        self.v: list[Tensor | None] = [None] * n_layers
        self.lengths = [0] * n_layers
        self.cross_kv: list[KV | None] = [None] * n_layers
        self.cross_source: Tensor | None = None  # the memory states cross_kv were projected from

    @property
    def seq_len(self) -> int:
        """Slots filled in layer 0: the absolute slot index of the next token."""
        return self.lengths[0]

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> KV:
        start, t = self.lengths[layer_idx], k.shape[2]
        if start + t > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; cannot add {t} after {start}")
        if self.k[layer_idx] is None:
            b, h, _, e = k.shape
            self.k[layer_idx] = k.new_empty(b, h, self.capacity, e)
            self.v[layer_idx] = v.new_empty(b, h, self.capacity, v.shape[-1])
        k_buf, v_buf = self.k[layer_idx], self.v[layer_idx]
        if k.shape[0] != k_buf.shape[0]:
            raise ValueError(
                f"this KV cache holds a batch of {k_buf.shape[0]} rows, got {k.shape[0]}: a new batch needs "
                "its own cache (model.new_cache())"
            )
        if k.shape[1] != k_buf.shape[1] or k.shape[3] != k_buf.shape[3] or v.shape[3] != v_buf.shape[3]:
            raise ValueError(
                f"this KV cache holds {k_buf.shape[1]} key/value heads of {k_buf.shape[3]} in layer {layer_idx}, "
                f"got {k.shape[1]} of {k.shape[3]}: it was made for another model (use model.new_cache())"
            )
        if k.dtype != k_buf.dtype or v.dtype != v_buf.dtype or k.device != k_buf.device:
            raise ValueError(
                f"this KV cache holds {k_buf.dtype} keys/values on {k_buf.device}, got {k.dtype} on {k.device} "
                f"in layer {layer_idx}: it was filled by a model in another dtype or on another device (or under "
                "another autocast); nothing was written (use model.new_cache())"
            )
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            # differentiable: new buffers, so the views an earlier call saved for backward stay intact
            k_buf = self.k[layer_idx] = k_buf.slice_scatter(k, dim=2, start=start, end=start + t)
            v_buf = self.v[layer_idx] = v_buf.slice_scatter(v, dim=2, start=start, end=start + t)
        else:
            k_buf[:, :, start : start + t] = k
            v_buf[:, :, start : start + t] = v
        self.lengths[layer_idx] = start + t
        return k_buf[:, :, : start + t], v_buf[:, :, : start + t]

    def use_source(self, source: Tensor) -> None:
        """Decode against the encoder memory whose states are `source` (as the caller passes them, before
        any autocast copy). The cross-attention K/V held were projected from one memory: another one (not
        the same tensor, nor equal values: the same source encoded again) is an error, not stale K/V."""
        if self.cross_source is None or all(kv is None for kv in self.cross_kv):
            self.cross_source = source
        elif source is not self.cross_source:
            same = source.shape == self.cross_source.shape and torch.equal(source, self.cross_source)
            if not same:
                raise ValueError(
                    "this KV cache holds the cross-attention keys/values of another encoder memory: decoding "
                    "a new source needs a new cache (model.new_cache(), or cache.truncate(0))"
                )
            self.cross_source = source

    def cross(self, layer_idx: int, compute: Callable[[], KV]) -> KV:
        """Layer `layer_idx`'s K/V of the encoder memory (see use_source), computed on first use."""
        if self.cross_kv[layer_idx] is None:
            self.cross_kv[layer_idx] = compute()
        return self.cross_kv[layer_idx]

    def reorder(self, index: Tensor, source: Tensor | None = None) -> None:
        """Keep batch rows `index` (B',) in every buffer, e.g. the surviving beams. `source`: the memory
        states whose rows the reordered cross-attention K/V now match (None: the next memory given to
        use_source is taken as theirs)."""
        self._check_rows(index)
        if source is not None and not isinstance(source, Tensor):
            raise TypeError(
                f"source must be the memory states (a tensor) or None, got {type(source).__name__}"
            )
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i] = self.k[i].index_select(0, index)
                self.v[i] = self.v[i].index_select(0, index)
            if self.cross_kv[i] is not None:
                k, v = self.cross_kv[i]
                self.cross_kv[i] = (k.index_select(0, index), v.index_select(0, index))
        if any(kv is not None for kv in self.cross_kv):
            self.cross_source = source

    def _check_rows(self, index: object) -> None:
        """`index` must pick rows this cache holds: a 1-D integer tensor on its device, each in [0, B)."""
        held = next(
            (t for t in self.k + [kv[0] for kv in self.cross_kv if kv is not None] if t is not None), None
        )
        if not isinstance(index, Tensor) or index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
            what = (
                f"{index.dtype} tensor of shape {tuple(index.shape)}"
                if isinstance(index, Tensor)
                else repr(index)
            )
            raise ValueError(f"reorder takes a 1-D int64 tensor of the batch rows to keep, got {what}")
        if held is None:
            return
        if index.device != held.device:
            raise ValueError(f"reorder's index is on {index.device}, the cache on {held.device}")
        rows = held.shape[0]
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= rows):
            raise ValueError(
                f"reorder's index picks rows {int(index.min())} to {int(index.max())}; the cache holds rows 0 to "
                f"{rows - 1}"
            )

    def truncate(self, length: int) -> None:
        """Forget slots from `length` on (e.g. to reuse a prefilled prompt); at 0 the encoder memory's
        K/V too, so the cache can decode another source."""
        try:
            ok = not isinstance(length, bool) and operator.index(length) >= 0
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"truncate takes a length >= 0 (the slots to keep), got {length!r}")
        length = operator.index(length)
        self.lengths = [min(n, length) for n in self.lengths]
        if length <= 0:
            self.cross_kv, self.cross_source = [None] * len(self.cross_kv), None

    @torch.no_grad()
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)
