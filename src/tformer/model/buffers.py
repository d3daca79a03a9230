"""Buffers that stay float32 whatever dtype the module is cast to.

`model.to(torch.bfloat16)` casts every floating buffer. For a few of tformer's that loses what cannot
come back: the position tables (non-persistent: a later `load_state_dict` does not restore them, and a
cast back to float32 keeps the rounding) and the router's expert biases (updated by steps of ~1e-3,
which bf16 rounds asymmetrically around most values, so the biases drift one way). Their modules keep
them in float32 and cast what they read to the input's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Float32Buffers(nn.Module):
    """A module whose buffers named in `FLOAT32_BUFFERS` stay float32 through `.to()`, `.half()`, ...

    Subclasses whose buffers are computed (not saved) give `computed_buffers()`: a module built on the
    meta device computes them again when it gets storage (`model.to_empty(device=...)`, which leaves
    every tensor uninitialised, and `load_weights` restores only what is saved: the position tables had
    read leftover memory, wrong logits or NaN)."""

    FLOAT32_BUFFERS: tuple[str, ...] = ()

    def computed_buffers(self) -> dict[str, Tensor]:
        """{name: float32 tensor} of the buffers this module computes from its settings (none here)."""
        return {}

    def _apply(self, fn, recurse: bool = True):
        kept = {name: self._buffers.get(name) for name in self.FLOAT32_BUFFERS}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers.get(name)
            if before is not None and after is not None and before.is_meta and not after.is_meta:
                # given storage: from now on every _apply computes the tables again (a module shared by
                # several parents is applied once per parent, and to_empty's later visits would leave
                # uninitialised memory where the first had computed the tables)
                self._computes_its_buffers = True
            elif before is not None and after is not None and after.dtype != before.dtype:
                # the values from before the cast, on the device the cast moved them to
                self._buffers[name] = before.to(device=after.device)
        if getattr(self, "_computes_its_buffers", False):
            self._fill_computed()
        return self

    def _fill_computed(self, device: torch.device | None = None) -> None:
        """The computed buffers' values, into the tensors in place where they fit (a shared-memory copy stays
        shared), else as new tensors on `device` or the buffer's own."""
        for name, table in self.computed_buffers().items():
            buf = self._buffers.get(name)
            if buf is None:
                continue
            if not buf.is_meta and buf.shape == table.shape and buf.dtype == table.dtype:
                with torch.no_grad():
                    buf.copy_(table)
            elif device is not None or not buf.is_meta:
                self._buffers[name] = table.to(device if device is not None else buf.device)


def compute_tables_after_load(model: nn.Module, incompatible_keys=None) -> None:
    """A load_state_dict post-hook of tformer's models: `load_state_dict(..., assign=True)` gives a
    meta-built model the loaded tensors without applying a function to it, so the computed buffers (the
    position tables) stayed on meta; they are computed on the weights' device."""
    device = next((p.device for p in model.parameters() if not p.is_meta), None)
    if device is None:
        return
    for module in model.modules():
        if isinstance(module, Float32Buffers) and any(
            b is not None and b.is_meta for b in module._buffers.values()
        ):
            module._computes_its_buffers = True
            module._fill_computed(device)
