"""The host allocator settings (tformer/allocator.py): who decides, and that freed memory is reused."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from tformer.allocator import ENV, users_choice

GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_ALWAYS = THP.exists() and "[always]" in THP.read_text()

# Allocates, touches and frees a 64 MiB tensor (above glibc's largest mmap threshold) ten times, as
# training steps do, then counts the page faults of doing it twice more. With the memory kept, the first
# few rounds may still fault: the block can land a little higher in the heap each time (small blocks
# taken from its start) until the pages it slides over have all been touched once, by the sixth round
# at most in 26 runs here; from then on it faults no more.
PROBE = """
import resource, sys, torch, tformer
state = tformer.keep_freed_memory()
def touch():
    x = torch.ones(16 * 2**20)  # 64 MiB, every page written
    del x
for _ in range(10):
    touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
touch()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 2, state)
"""


@pytest.mark.parametrize(
    "env, reason",
    [
        ({}, None),
        ({ENV: "keep"}, None),
        ({ENV: "default"}, f"{ENV}=default"),
        ({"MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX is set"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "GLIBC_TUNABLES sets glibc.malloc"),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD loads an allocator"),
    ],
)
def test_the_users_environment_decides(env: dict, reason: str | None) -> None:
    assert users_choice(env) == reason


def test_a_bad_setting_is_named() -> None:
    with pytest.raises(ValueError, match="TFORMER_MALLOC must be 'keep' or 'default', not 'yes'"):
        users_choice({ENV: "yes"})


def _probe(setting: str) -> tuple[str, int]:
    chosen = ("MALLOC_", "LD_PRELOAD", "GLIBC_TUNABLES")  # the caller's own allocator choices
    env = {k: v for k, v in os.environ.items() if not k.startswith(chosen)}
    env[ENV] = setting
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    faults, state = out.stdout.strip().split(" ", 1)
    return state, int(faults)


def test_freed_memory_is_reused_without_page_faults() -> None:
    kept_state, kept = _probe("keep")
    left_state, left = _probe("default")
    assert left_state == f"left: {ENV}=default"
    if (
        not THP_ALWAYS
    ):  # glibc's default maps the block afresh: 16,384 faults of 4 KB (few 2 MB ones with THP)
        assert left > 8_000
    if GLIBC:
        assert kept_state == "kept" and kept < 1_000
    else:
        assert kept_state == "left: not glibc"


def test_the_command_line_applies_it_and_names_a_bad_setting(monkeypatch, capsys) -> None:
    import tformer.allocator as allocator
    import tformer.cli.main as cli

    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(1) or allocator.keep_freed_memory())
    monkeypatch.setattr(allocator, "_state", None)  # as in a fresh process
    monkeypatch.setenv(ENV, "yes")
    assert cli.main(["train", "--preset", "tiny-lm", "--set", "steps=0"]) == 2
    assert calls == [1]
    assert "TFORMER_MALLOC must be 'keep' or 'default', not 'yes'" in capsys.readouterr().err
