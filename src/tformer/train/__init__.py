"""Training: checkpoints (more to come: config, optim, schedule, losses, step, loop)."""

from tformer.train.checkpoint import (
    CheckpointError,
    LoadedCheckpoint,
    LoadResult,
    capture_rng_state,
    import_torch_weights,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_state_dict_checked,
    load_weights,
    restore_rng_state,
    rng_key,
    save_checkpoint,
    save_weights,
)

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
