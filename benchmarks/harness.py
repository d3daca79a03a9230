"""Shared timing harness for tformer's side-by-side benchmarks (the method: docs/performance.md).

Method: every variant runs in the same process, interleaved round-robin with a rotating order
(A B C, B C A, C A B, ...) after warm-up. We report each variant's best (minimum) time and its
paired-median ratio to a reference: the median over rounds of the same-round time ratio, which
cancels most of the drift of a shared machine. `LoadMeter` records how much CPU other processes
used meanwhile (from /proc/stat minus our own rusage) and the load average.

Other benchmark scripts may import this module: it knows nothing of models.

    from harness import Bench, LoadMeter, round_robin, summarize, print_table, write_json
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tformer.allocator import keep_freed_memory

RESULTS_DIR = Path(__file__).resolve().parent / "results"
UNRELIABLE_FOREIGN_SHARE = 0.15  # above this share of the machine used by others, say so


# ----------------------------------------------------------------------------- setup and machine
def setup(threads: int = 2, seed: int = 0) -> None:
    """Fix the thread count and seed everything the benchmarks use; set the host allocator as the
    `tformer` command line does (TFORMER_MALLOC=default measures glibc's default instead). Peers and
    tformer run in one process, so they share the setting; `machine_info()` records it."""
    keep_freed_memory()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)


def use_device(name: str) -> torch.device:
    """The device a script's models run on (`--device`); on a GPU its fp32 products stay fp32 (no TF32),
    as on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch.device(name)


def cpu_info() -> dict:
    """CPU model and the instruction-set flags that decide fp32/bf16 matmul speed."""
    name, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", "x86_64"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {
        "cpu": name,
        "cores": os.cpu_count(),
        "isa": [f for f in wanted if f in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16_matmul": "avx512_bf16" in flags or "amx_bf16" in flags,
    }


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


def gpu_info() -> dict:
    """The CUDA GPU, where there is one (its name and compute capability)."""
    if not torch.cuda.is_available():
        return {}
    return {"gpu": torch.cuda.get_device_name(), "gpu_capability": list(torch.cuda.get_device_capability())}


def machine_info() -> dict:
    return {
        **cpu_info(),
        **gpu_info(),
        "threads": torch.get_num_threads(),
        "malloc": keep_freed_memory(),
        **versions(),
    }


# ----------------------------------------------------------------------------- machine load
def _busy_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class LoadMeter:
    """Context manager: CPU share other processes used while it was open, and the load average.

    foreign_cpu_share = (machine busy CPU seconds - ours) / (wall seconds x cores); busy includes the
    hypervisor's steal time (CPU this VM was owed but did not get).
    """

    def __enter__(self) -> LoadMeter:
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_cpu_seconds(), _own_cpu_seconds()
        self.load0 = os.getloadavg()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t0
        own = _own_cpu_seconds() - self.own0
        foreign = max(0.0, (_busy_cpu_seconds() - self.busy0) - own)
        share = foreign / (wall * (os.cpu_count() or 1))
        self.result = {
            "wall_s": round(wall, 1),
            "own_cpu_s": round(own, 1),
            "foreign_cpu_share": round(share, 3),
            "loadavg_start": [round(v, 2) for v in self.load0],
            "loadavg_end": [round(v, 2) for v in os.getloadavg()],
            "reliable": share <= UNRELIABLE_FOREIGN_SHARE,
        }

    def line(self) -> str:
        r = self.result
        warn = (
            ""
            if r["reliable"]
            else f"  ABOVE {UNRELIABLE_FOREIGN_SHARE:.0%}: treat the numbers as unreliable"
        )
        return (
            f"foreign CPU {r['foreign_cpu_share']:.1%} of the machine over {r['wall_s']} s, "
            f"loadavg {r['loadavg_start'][0]} -> {r['loadavg_end'][0]}{warn}"
        )


# ----------------------------------------------------------------------------- timing
# untimed calls of each variant before the timed rounds. One had been too few: a peer's first timed
# calls (it ran first in round 1) were still slower, which raised the first round's ratio in tformer's
# favour in 74 of 101 pairs of the results up to 2026-12-03
WARMUP_CALLS = 3


def round_robin(
    variants: dict[str, Callable[[], object]],
    rounds: int,
    warmup: int = WARMUP_CALLS,
    progress: bool = True,
) -> dict[str, list[float]]:
    """Seconds per call of each variant: `warmup` untimed calls each, then `rounds` timed rounds in a
    rotating order (round r starts at variant r mod n: a number of rounds that is a multiple of n puts
    every variant in every position equally often)."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t)
        if progress:
            done = ", ".join(f"{n} {times[n][-1]:.3g}s" for n in names)
            print(f"  round {r + 1}/{rounds}: {done}", file=sys.stderr, flush=True)
    return times


def paired_median(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of times[num][r] / times[den][r] (> 1: `den` is faster than `num`)."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


@dataclass
class Row:
    """One variant's summary: best and median time, work per second, and speed vs the reference."""

    name: str
    best_s: float
    median_s: float
    rate_best: float  # work units per second at the best time (e.g. tokens/s)
    speedup_best: float  # reference best / this best (> 1: faster than the reference)
    speedup_paired: float  # paired median of reference time / this time
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "best_s": round(self.best_s, 5),
            "median_s": round(self.median_s, 5),
            "rate_best": round(self.rate_best, 2),
            "speedup_best": round(self.speedup_best, 3),
            "speedup_paired_median": round(self.speedup_paired, 3),
            **self.extra,
        }


def summarize(times: dict[str, list[float]], reference: str, work: float) -> dict[str, Row]:
    """Rows for every variant; `work` units are done per call (tokens, for tokens/s)."""
    ref_best = min(times[reference])
    return {
        name: Row(
            name=name,
            best_s=min(ts),
            median_s=statistics.median(ts),
            rate_best=work / min(ts),
            speedup_best=ref_best / min(ts),
            speedup_paired=paired_median(times, reference, name),
        )
        for name, ts in times.items()
    }


# ----------------------------------------------------------------------------- matmul peak
@dataclass(frozen=True)
class MatmulShape:
    """An (m x k) @ (k x n) product that occurs `count` times per measured call."""

    m: int
    k: int
    n: int
    count: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.count


def linear_train_shapes(tokens: int, d_in: int, d_out: int, count: int) -> list[MatmulShape]:
    """The three matmuls of a linear layer's training step: y = x W^T, dx = dy W, dW = dy^T x."""
    return [
        MatmulShape(tokens, d_in, d_out, count),
        MatmulShape(tokens, d_out, d_in, count),
        MatmulShape(d_out, tokens, d_in, count),
    ]


class MatmulPeak:
    """The matmul rate a model's own GEMM shapes reach on this machine, measured as a round-robin
    variant so that it sees the same load as the models.

    Each call runs every distinct shape once, in `dtype`, as `F.linear` on contiguous operands (the
    backward products with their own shapes, not their transposed layouts), and on the CPU in fp32 also
    as oneDNN's product (`torch.ops.mkldnn._linear_pointwise`, which tformer's fp32 training products
    take on AVX512 CPUs; since 2026-12-04), keeping the faster; `gflops_best()` weights each shape by
    how often the model runs it, so the rate is what the model's matmuls alone would reach on this
    machine at that moment.
    """

    def __init__(
        self, shapes: Sequence[MatmulShape], dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> None:
        self.shapes = list(shapes)
        self.operands = [
            (
                torch.randn(s.m, s.k, dtype=dtype, device=device),
                torch.randn(s.n, s.k, dtype=dtype, device=device),
            )
            for s in self.shapes
        ]
        gpu = torch.device(device).type == "cuda"
        self.sync = torch.cuda.synchronize if gpu else (lambda: None)
        # on a GPU a product is timed as the mean of 10 in a row: one alone between two synchronizations
        # is mostly the launch and the wait (an H200's peak on 8 x 256 tokens' shapes had read 31 TFLOP/s)
        self.reps = 10 if gpu else 1
        self.last: list[float] = []
        self.best: list[float] = [float("inf")] * len(self.shapes)
        self.products = [torch.nn.functional.linear]
        onednn = (
            getattr(torch.ops.mkldnn, "_linear_pointwise", None)
            if torch.backends.mkldnn.is_available()
            else None
        )
        if not gpu and dtype == torch.float32 and onednn is not None:
            self.products.append(lambda a, b: onednn(a, b, None, "none", [], ""))

    def __call__(self) -> None:
        self.last = []
        for i, (a, b) in enumerate(self.operands):
            times = []
            for product in self.products:
                self.sync()
                t = time.perf_counter()
                for _ in range(self.reps):
                    product(a, b)
                self.sync()
                times.append((time.perf_counter() - t) / self.reps)
            dt = min(times)
            self.last.append(dt)
            self.best[i] = min(self.best[i], dt)

    @property
    def flops(self) -> float:
        return sum(s.flops for s in self.shapes)

    def gflops_best(self) -> float:
        """Model-weighted GFLOP/s from each shape's best time."""
        return self.flops / sum(t * s.count for t, s in zip(self.best, self.shapes)) / 1e9


# ----------------------------------------------------------------------------- output
def print_table(title: str, rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """Print (and return) a table; columns are (key, header, format spec)."""
    widths = [max(len(h), *(len(format(r.get(k, ""), f)) for r in rows)) for k, h, f in columns]
    lines = [
        title,
        "  ".join(h.rjust(w) if i else h.ljust(w) for i, ((_, h, _), w) in enumerate(zip(columns, widths))),
    ]
    for r in rows:
        cells = [format(r.get(k, ""), f) for k, _, f in columns]
        lines.append(
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        )
    text = "\n".join(lines)
    print(text)
    return text


def write_json(name: str, payload: dict, out_dir: Path = RESULTS_DIR) -> Path:
    """Write payload (plus date, command, machine) to out_dir/name and return the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    full = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "machine": machine_info(),
        **payload,
    }
    path.write_text(json.dumps(full, indent=2) + "\n")
    print(f"wrote {path}")
    return path
