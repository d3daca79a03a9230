"""Buffers that stay float32 whatever dtype the module is cast to.

`model.to(torch.bfloat16)` casts every floating buffer. For a few of tformer's that loses what cannot
come back: the position tables (non-persistent: a later `load_state_dict` does not restore them, and a
cast back to float32 keeps the rounding) and the router's expert biases (updated by steps of ~1e-3,
which bf16 rounds asymmetrically around most values, so the biases drift one way). Their modules keep
them in float32 and cast what they read to the input's dtype.
"""

from __future__ import annotations

from torch import nn


class Float32Buffers(nn.Module):
    """A module whose buffers named in `FLOAT32_BUFFERS` stay float32 through `.to()`, `.half()`, ..."""

    FLOAT32_BUFFERS: tuple[str, ...] = ()

    def _apply(self, fn, recurse: bool = True):
        kept = {name: self._buffers.get(name) for name in self.FLOAT32_BUFFERS}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers.get(name)
            if before is not None and after is not None and after.dtype != before.dtype:
                # the values from before the cast, on the device the cast moved them to
                self._buffers[name] = before.to(device=after.device)
        return self
