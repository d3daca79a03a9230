"""Training: checkpoints and weight import / export (config, optim, step and loop are their own modules)."""

from typing import TYPE_CHECKING

from tformer._lazy import lazy_exports

if TYPE_CHECKING:  # what static tools see; at run time each name is imported on first use
    from tformer.train.checkpoint import (
        LoadedCheckpoint,
        LoadResult,
        latest_checkpoint,
        list_checkpoints,
        load_checkpoint,
        load_state_dict_checked,
        save_checkpoint,
    )
    from tformer.train.state_io import CheckpointError, capture_rng_state, restore_rng_state, rng_key
    from tformer.train.weights import (
        import_torch_weights,
        load_weights,
        save_weights,
    )

__getattr__, __dir__ = lazy_exports(globals())

__all__ = [
    "CheckpointError",
    "LoadResult",
    "LoadedCheckpoint",
    "capture_rng_state",
    "import_torch_weights",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_state_dict_checked",
    "load_weights",
    "restore_rng_state",
    "rng_key",
    "save_checkpoint",
    "save_weights",
]
