"""tformer: build, train, run and compare Transformers.

from tformer import ModelConfig, build_model
model = build_model(ModelConfig(arch="decoder", norm_placement="pre", positions="rope"))
"""

from tformer._lazy import lazy_exports
from tformer.allocator import keep_freed_memory
from tformer.config import ConfigError, ModelConfig, MoEConfig, RopeConfig
from tformer.presets import PRESETS, get_preset

__version__ = "0.1.0"

_EXPORTS = {
    "build_model": "tformer.model",
}
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

__all__ = [
    "PRESETS",
    "ConfigError",
    "MoEConfig",
    "ModelConfig",
    "RopeConfig",
    "build_model",
    "get_preset",
    "keep_freed_memory",
]
