"""An endless, resumable stream of batches over a `ResumableLoader`."""

from __future__ import annotations

import torch

from tformer.data.loader import ResumableLoader


class BatchStream:
    """`next_batch(device)` walks epochs forever; `state_dict()` says where the next batch comes from."""

    def __init__(self, loader: ResumableLoader) -> None:
        self.loader = loader
        self._it = None

    def next_batch(self, device: torch.device):
        if self._it is None:
            self._it = self.loader.batches()
        return next(self._it).to(device)

    def state_dict(self) -> dict[str, int]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loader.load_state_dict(state)
        self._it = None
