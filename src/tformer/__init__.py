"""tformer: build, train, run and compare Transformers.

from tformer import ModelConfig, build_model
model = build_model(ModelConfig(arch="decoder", norm_placement="pre", positions="rope"))
"""

from typing import TYPE_CHECKING

from tformer._lazy import lazy_exports
from tformer.allocator import keep_freed_memory
from tformer.config import ConfigError, ModelConfig, MoEConfig, RopeConfig
from tformer.presets import PRESETS, get_preset

__version__ = "0.1.0"

if TYPE_CHECKING:  # what static tools see; at run time each name is imported on first use
    from tformer.model import build_model

__getattr__, __dir__ = lazy_exports(globals())

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
