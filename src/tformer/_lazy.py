"""Package attributes imported on first use (PEP 562), so that `import tformer` and the command line's
`--help` do not import torch. `from tformer.data import Tokenizer` and `tformer.build_model` work as
before; only the time of the import moves."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any


def type_checking_imports(source_file: str) -> dict[str, str]:
    """{name: module} of the `from module import name` statements under `if TYPE_CHECKING:` in a file:
    the one list of a package's lazy names, which static tools (type checkers, editors) read too."""
    try:
        tree = ast.parse(Path(source_file).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError) as e:  # an installation without the package's .py sources
        raise ImportError(
            f"tformer reads its lazy names from {source_file}, which cannot be read ({e})"
        ) from e
    exports: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.module:
                    exports.update({(a.asname or a.name): stmt.module for a in stmt.names})
    return exports


def lazy_exports(namespace: dict[str, Any]) -> tuple[Callable, Callable]:
    """(__getattr__, __dir__) for the package whose globals() are `namespace`: the names its
    `if TYPE_CHECKING:` block imports come from their modules on first use; other names are tried as
    the package's submodules."""
    package = namespace["__name__"]
    exports = type_checking_imports(namespace["__file__"])

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
