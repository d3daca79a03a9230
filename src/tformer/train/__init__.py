"""Training: checkpoints and weight import / export (config, optim, step and loop are their own modules)."""

from tformer._lazy import lazy_exports

_EXPORTS = {
    "CheckpointError": "tformer.train.checkpoint",
    "LoadedCheckpoint": "tformer.train.checkpoint",
    "LoadResult": "tformer.train.checkpoint",
    "capture_rng_state": "tformer.train.checkpoint",
    "latest_checkpoint": "tformer.train.checkpoint",
    "list_checkpoints": "tformer.train.checkpoint",
    "load_checkpoint": "tformer.train.checkpoint",
    "load_state_dict_checked": "tformer.train.checkpoint",
    "restore_rng_state": "tformer.train.checkpoint",
    "rng_key": "tformer.train.checkpoint",
    "save_checkpoint": "tformer.train.checkpoint",
    "import_torch_weights": "tformer.train.weights",
    "load_weights": "tformer.train.weights",
    "save_weights": "tformer.train.weights",
}
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

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
