"""The docs point at tests that exist: every `file.py::test_name` of docs/reliability.md's case table
(`::other_test` after it names a test of the same file) is a test function of that file under tests/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = re.compile(r"`([\w/]*\.py)?::(\w+)")


def cited_tests(text: str) -> list[tuple[int, str | None, str]]:
    """(line number, test file or None, test name) of every citation, shorthand resolved within its row."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        path = None
        for m in REFERENCE.finditer(line):
            path = m.group(1) or path
            found.append((number, path, m.group(2)))
    return found


def test_shorthand_takes_the_file_named_before_it_in_the_row() -> None:
    row = "| X1 case | `a/test_x.py::test_one`, `::test_two`, `b/test_y.py::test_three` |\n| X2 | `::test_four` |"
    assert cited_tests(row) == [
        (1, "a/test_x.py", "test_one"),
        (1, "a/test_x.py", "test_two"),
        (1, "b/test_y.py", "test_three"),
        (2, None, "test_four"),
    ]


def test_every_test_docs_reliability_cites_exists() -> None:
    cited = cited_tests((ROOT / "docs" / "reliability.md").read_text())
    assert len(cited) > 100
    wrong = []
    for number, path, name in cited:
        source = ROOT / "tests" / path if path else None
        if source is None or not source.is_file():
            wrong.append(f"line {number}: {path or '(no file before ::)'}::{name}: no such test file")
        elif not re.search(rf"^\s*def {name}\(", source.read_text(), flags=re.M):
            wrong.append(f"line {number}: {path}::{name}: no such test")
    assert not wrong, "\n".join(wrong)
