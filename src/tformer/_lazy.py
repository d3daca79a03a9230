"""Package attributes imported on first use (PEP 562), so that `import tformer` and the command line's
`--help` do not import torch. `from tformer.data import Tokenizer` and `tformer.build_model` work as
before; only the time of the import moves."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], exports: dict[str, str]) -> tuple[Callable, Callable]:
    """(__getattr__, __dir__) for a package whose names `exports` maps to the modules that define them;
    `namespace` is the package's globals(), where each name is kept once imported."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
