"""The JSON files tformer keeps beside its runs (data.json, setting.json, arm.json, metrics lines), read
so that a damaged or edited file is an error that names it, never a traceback from the code that reads
it. JSON lines files skip what a killed writer left half-written."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["first_bad_line", "read_json", "read_json_lines"]

JSON_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "true / false", type(None): "null"}


def _json_name(value: Any) -> str:
    return JSON_NAMES.get(type(value), "a number")


def read_json(path: str | Path, kind: type = dict) -> Any:
    """The value the JSON file `path` holds, which must be of type `kind` (an object by default);
    ValueError naming the file when it is unreadable, not JSON, or holds something else."""
    path = Path(path)
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:  # not JSON, not UTF-8, unreadable
        reason = " ".join(str(e).split())
        raise ValueError(f"{path} is not a readable JSON file ({reason}); damaged or edited?") from None
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ValueError(
            f"{path} holds {_json_name(value)} where tformer wrote {JSON_NAMES.get(kind, kind.__name__)}; "
            "damaged or edited?"
        )
    return value


def read_json_lines(path: str | Path, valid: Callable[[dict], bool] = lambda record: True) -> list[dict]:
    """The JSON objects of a JSON lines file, one per line, in order; a line that is not one (half
    written by a killed process, or edited) or that `valid` rejects is skipped. [] without the file."""
    path = Path(path)
    if not path.exists():
        return []
    return [record for _, record in _json_lines(path) if record is not None and valid(record)]


def first_bad_line(path: str | Path) -> int | None:
    """The number (from 1) of the first line of a JSON lines file that is not a JSON object (the lines
    `read_json_lines` skips); None where every line is one."""
    return next((n for n, record in _json_lines(Path(path)) if record is None), None)


def _json_lines(path: Path) -> Iterator[tuple[int, dict | None]]:
    """(line number from 1, the line's JSON object, or None where the line is not one)."""
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            yield n, None
            continue
        yield n, record if isinstance(record, dict) else None
