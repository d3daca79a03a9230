"""keep_freed_memory's decisions (tformer/allocator.py), with mallopt replaced: nothing here changes this
process's allocator."""

from __future__ import annotations

import ctypes
import os
import platform
import sys

import pytest

import tformer.allocator as allocator
from tformer.allocator import ENV, keep_freed_memory, users_choice

# glibc's <malloc.h>
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4


@pytest.mark.parametrize(
    "env, reason",
    [
        ({ENV: " Default "}, f"{ENV}=default"),  # written as the user pleases
        ({ENV: "KEEP"}, None),
        ({"MALLOC_TOP_PAD_": "1"}, "MALLOC_TOP_PAD_ is set"),
        ({"MALLOC_TRIM_THRESHOLD_": "1", "MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX is set"),
        ({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, None),  # tunables, none of them malloc's
        (
            {"GLIBC_TUNABLES": "glibc.pthread.rseq=0:glibc.malloc.arena_max=2"},
            "GLIBC_TUNABLES sets glibc.malloc",
        ),
        ({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, "LD_PRELOAD loads an allocator"),
        ({"LD_PRELOAD": "/usr/lib/libmimalloc.so"}, "LD_PRELOAD loads an allocator"),
        ({"LD_PRELOAD": "/usr/lib/libasan.so"}, None),
    ],
)
def test_more_of_the_users_choices(env: dict, reason: str | None) -> None:
    assert users_choice(env) == reason


class FakeLibc:
    """Stands for ctypes.CDLL(None): records mallopt calls, answers `answer(param)` (1: done, 0: refused)."""

    def __init__(self, answer=lambda param: 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

        def mallopt(param: int, value: int) -> int:
            self.calls.append((param, value))
            return self.answer(param)

        self.mallopt = mallopt


@pytest.fixture
def fresh(monkeypatch):
    """A fresh process's view: no decision yet, no allocator choice in the environment, glibc on Linux,
    and a fake libc."""
    for name in list(os.environ):
        if name.startswith("MALLOC_") or name in ("LD_PRELOAD", "GLIBC_TUNABLES", ENV):
            monkeypatch.delenv(name)
    monkeypatch.setattr(allocator, "_state", None)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("glibc", "2.39"))
    libc = FakeLibc()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)
    return libc


def test_it_sets_the_three_documented_parameters(fresh: FakeLibc) -> None:
    assert keep_freed_memory() == "kept"
    assert dict(fresh.calls) == {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1, M_TOP_PAD: 64 * 2**20}


def test_a_refused_parameter_is_named(fresh: FakeLibc) -> None:
    fresh.answer = lambda param: 0 if param == M_MMAP_MAX else 1
    assert keep_freed_memory() == f"left: mallopt refused [{M_MMAP_MAX}]"


def test_off_glibc_mallopt_is_not_looked_up(fresh: FakeLibc, monkeypatch) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("", ""))  # musl
    assert keep_freed_memory() == "left: not glibc" and fresh.calls == []


def test_the_first_decision_holds_for_the_process(fresh: FakeLibc, monkeypatch) -> None:
    monkeypatch.setenv(ENV, "default")
    assert keep_freed_memory() == f"left: {ENV}=default"
    monkeypatch.setenv(ENV, "keep")  # too late: the first call decided
    assert keep_freed_memory() == f"left: {ENV}=default" and fresh.calls == []
    monkeypatch.setattr(allocator, "_state", None)
    assert keep_freed_memory() == "kept" and len(fresh.calls) == 3
    monkeypatch.setenv(ENV, "default")
    assert keep_freed_memory() == "kept" and len(fresh.calls) == 3  # applied once
