"""README's Python examples run as written (in a scratch directory: they write runs/ there)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_python_example_runs(code: str, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md python block", "exec"), {"__name__": "readme"})
    for run in re.findall(r'load_run\("([^"]+)"\)', code):  # the run it trained and loaded is there
        assert list((tmp_path / run / "checkpoints").glob("step_*/COMMITTED")), run
