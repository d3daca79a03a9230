"""Package attributes imported on first use (PEP 562), so that `import tformer` and the command line's
`--help` do not import torch. `from tformer.data import Tokenizer` and `tformer.build_model` work as
before; only the time of the import moves."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], exports: dict[str, str]) -> tuple[Callable, Callable]:
    """(__getattr__, __dir__) for a package whose names `exports` maps to the modules that define them;
    `namespace` is the package's globals(). Other names are tried as the package's submodules."""

    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        # looked up at each use, not kept here: a name patched in its module (and put back) is seen as it is
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        if name.startswith("__"):  # probes such as __wrapped__ or __path__ lookups: never a submodule
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:  # a submodule (`tformer.model` after `import tformer`), as the eager imports had bound them
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
