"""Host memory allocator settings for CPU work: keep the memory a step frees for the next step.

A training step allocates and frees the same large activations, gradients and logits at every step.
glibc's malloc returns blocks above its mmap threshold to the system when they are freed, and trims
the top of its heap, so the next step page-faults on every 4 KB page of them again (and the kernel
zeroes each page). On the benchmark machine that was 53,000-137,000 faults and 0.17-0.38 s of system
CPU time per LM training step (docs/performance.md). `keep_freed_memory()` sets three glibc
parameters (mallopt(3)) so that freed memory stays in the process for reuse:

- M_MMAP_MAX 0: the main heap serves every block (glibc maps blocks above 128 KB-32 MB afresh and
  unmaps them when freed); its freed blocks serve the next step. Other threads' arenas still map
  blocks that do not fit one of their 64 MiB heaps;
- M_TRIM_THRESHOLD 2 GiB: free memory at the top of the heap is handed back only beyond that;
- M_TOP_PAD 64 MiB: the heap grows in steps of at least that (fewer brk calls).

The price: memory the process freed stays with it until it exits (holes inside the heap always did),
as PyTorch's CUDA caching allocator keeps device memory; processes forked from it (data loader
workers) inherit the setting. The `tformer` command line calls it before every command; Python users
call it themselves. It changes nothing where the user already chose (TFORMER_MALLOC=default, any
MALLOC_* variable, glibc.malloc tunables in GLIBC_TUNABLES, or an allocator in LD_PRELOAD such as
jemalloc or tcmalloc) and nothing off glibc (macOS, Windows, musl).
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4  # glibc's <malloc.h>
SETTINGS = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1, M_TOP_PAD: 64 * 2**20}
ENV = "TFORMER_MALLOC"  # "keep" (the default) or "default" (leave glibc as it is)
_state: str | None = None  # what the first call did; later calls report it


def users_choice(environ: dict | None = None) -> str | None:
    """Why the user's environment says to leave malloc alone, or None where it does not."""
    env = os.environ if environ is None else environ
    wanted = env.get(ENV, "keep").strip().lower()
    if wanted not in ("keep", "default"):
        raise ValueError(f"{ENV} must be 'keep' or 'default', not {env[ENV]!r}")
    if wanted == "default":
        return f"{ENV}=default"
    chosen = sorted(k for k in env if k.startswith("MALLOC_"))
    if chosen:
        return f"{chosen[0]} is set"
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    if "malloc" in env.get("LD_PRELOAD", ""):
        return "LD_PRELOAD loads an allocator"
    return None


def keep_freed_memory() -> str:
    """Apply `SETTINGS` once per process; returns what happened: "kept", or "left: <why>"."""
    global _state
    if _state is not None:
        return _state
    reason = users_choice()
    if reason is None and (sys.platform != "linux" or platform.libc_ver()[0] != "glibc"):
        reason = "not glibc"
    if reason is None:
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        failed = [param for param, value in SETTINGS.items() if mallopt(param, value) != 1]
        reason = f"mallopt refused {failed}" if failed else None
    _state = "kept" if reason is None else f"left: {reason}"
    return _state
