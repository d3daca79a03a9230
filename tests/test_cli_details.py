"""Details of `tformer` (cli/main.py) and `tformer bench` (cli/bench.py) the end-to-end tests leave open:
the exit code of a stop on a signal, warnings under torchrun and the restored warning format, the best
and the median of bench's timings, and bench's text output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch

import tformer.cli.evaluate as evaluate
from tformer.cli import bench
from tformer.cli.main import main
from tformer.model import compiled_step
from tformer.train.interrupt import Stopped

BENCH = ["bench", "--preset", "tiny-lm", "--repeats", "1", "--new-tokens", "4", "--batch-size", "2"]
BENCH += ["--seq-len", "16"]


def test_a_stop_on_a_signal_exits_128_plus_its_number(monkeypatch, capsys) -> None:
    """A training run stopped by SIGTERM (after its checkpoint) exits 143, a plain Ctrl-C 130."""

    def stopped(args):
        raise Stopped(signal.SIGTERM, "stopped")

    monkeypatch.setattr(evaluate, "run", stopped)
    assert main(["eval", "--run", "x"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "tformer eval: interrupted\n"

    def ctrl_c(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate, "run", ctrl_c)
    assert main(["eval", "--run", "x"]) == 130


def test_a_ctrl_c_while_a_finished_command_exits_is_ignored() -> None:
    """The `tformer` entry point: a Ctrl-C after the command's work is done, while the interpreter runs its
    exit hooks or its last clean-up (module teardown), changes neither the exit code, nor stderr, nor the
    command's buffered output; `python -m tformer` takes the same path."""
    for when in ("an exit hook", "the last clean-up"):  # (Python puts its signal handlers back for that)
        kill = "lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2))"
        script = (
            "import atexit, os, signal, sys, time\n"
            "import tformer.cli.main as cli\n"
            "class Late:\n"
            f"    def __del__(self): ({kill})()\n"
            "def main(argv=None):\n"
            "    print('the output')  # buffered: stdout is a pipe\n"
            + (
                f"    atexit.register({kill})\n"
                if when == "an exit hook"
                else "    sys.modules['late'] = Late()\n"
            )
            + "    return 3\n"
            "cli.main = main\n"
            "cli.entry()\n"
        )
        buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=buffered
        )
        assert (done.returncode, done.stdout, done.stderr) == (3, "the output\n", ""), (when, done)
    module = subprocess.run([sys.executable, "-m", "tformer", "--version"], capture_output=True, text=True)
    assert module.returncode == 0 and module.stdout.startswith("tformer "), module


def test_under_torchrun_only_rank_0_shows_a_commands_warnings(monkeypatch) -> None:
    def warns(args):
        warnings.warn("the same on every rank", stacklevel=2)
        return 0

    monkeypatch.setattr(evaluate, "run", warns)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, shown in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert main(["eval", "--run", "x"]) == 0
        assert len(seen) == shown, (rank, [str(w.message) for w in seen])


def test_the_callers_warning_format_comes_back(monkeypatch) -> None:
    """main() formats warnings as `tformer <cmd>: warning: ...` while the command runs, and puts the
    caller's format back afterwards, also after an error."""
    before = warnings.formatwarning

    def fine(args):
        assert "tformer eval: warning: w" in warnings.formatwarning("w", UserWarning, "f.py", 1)
        return 0

    def fails(args):
        raise ValueError("no")

    for run, code in ((fine, 0), (fails, 2)):
        monkeypatch.setattr(evaluate, "run", run)
        assert main(["eval", "--run", "x"]) == code
        assert warnings.formatwarning is before


def test_times_are_the_best_and_the_median_after_one_warm_up(monkeypatch) -> None:
    durations = iter([3.0, 1.0, 2.0])  # the timed calls after the (untimed) warm-up
    calls: list[int] = []
    clock = [0.0]

    def fn() -> None:
        calls.append(1)
        if len(calls) > 1:
            clock[0] += next(durations)

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    best, median = bench._times(fn, 3, torch.device("cpu"))
    assert len(calls) == 4 and (best, median) == (1.0, 2.0)


def fixed_times(monkeypatch) -> None:
    """Every timed measurement: best 0.25 s, median 0.5 s."""
    monkeypatch.setattr(bench, "_times", lambda fn, repeats, device, warmup=1: (fn(), (0.25, 0.5))[1])


def test_bench_rates_divide_by_the_best_time_and_the_medians_by_the_median(capsys, monkeypatch) -> None:
    fixed_times(monkeypatch)
    assert main([*BENCH, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["train_tokens_per_s"] == pytest.approx(2 * 16 / 0.25)
    assert r["train_tokens_per_s_median"] == pytest.approx(2 * 16 / 0.5)
    assert r["decode_tokens_per_s"] == pytest.approx(4 / 0.25)
    assert r["decode_tokens_per_s_median"] == pytest.approx(4 / 0.5)
    assert r["decode_ms_per_token"] == pytest.approx(1000 * 0.25 / 4)
    assert r["decode_calls"] == 1 and r["decode_new_tokens"] == 4 and r["decode_prompt_tokens"] == 8


def test_bench_compiled_decoding_rate_is_of_the_timed_calls_not_the_compiling_one(
    capsys, monkeypatch
) -> None:
    eager = compiled_step.step_program
    monkeypatch.setattr(compiled_step, "compiled_step_program", lambda: lambda *a: eager(*a))
    fixed_times(monkeypatch)
    assert main([*BENCH, "--json", "--compile-decoding"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["decode_compiled_tokens_per_s"] == pytest.approx(4 / 0.25)
    assert r["decode_compiled_tokens_per_s_median"] == pytest.approx(4 / 0.5)
    assert r["decode_compiled_ms_per_token"] == pytest.approx(1000 * 0.25 / 4)


def test_bench_text_output_says_what_the_json_holds(capsys, monkeypatch) -> None:
    fixed_times(monkeypatch)
    assert main([*BENCH, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert main(BENCH) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"model: {r['params_total']:,} parameters ({r['params_active']:,} active")
    assert "batch 2 x 16, cpu, float32, " in lines[0]
    assert f"training, best of 1 steps (median in brackets): {2 * 16 / 0.25:,.0f} tokens/s" in lines[2]
    assert lines[2].endswith(
        f"MFU {100 * r['train_mfu']:.1f}%, {r['train_activation_mib']:,.1f} MiB of activations kept for the backward"
    )
    assert "8-token prompt + 4 tokens, best of 1 call)" in lines[3]
    assert f"{4 / 0.25:,.1f} tokens/s ({1000 * 0.25 / 4:.2f} ms/token" in lines[3]


@pytest.mark.parametrize("command", [["bench", "--preset", "tiny-lm"], ["experiment", "norm", "--quick"]])
def test_one_process_commands_refuse_torchrun_before_writing(command, tmp_path, monkeypatch, capsys) -> None:
    """Under torchrun every rank had run the benchmark whole, or trained the same study into one
    directory (rank 1 then failed on rank 0's files, which stayed behind)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main([*command, "--out", "s"] if command[0] == "experiment" else command) == 2
    assert "runs in one process" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_a_collective_timeout_past_timedelta_is_a_config_error() -> None:
    from tformer.schema import ConfigError
    from tformer.train.config import ParallelConfig

    with pytest.raises(ConfigError, match="timeout_s must be from 1 to 1,000,000,000"):
        ParallelConfig(timeout_s=10**14)  # had overflowed datetime.timedelta on every rank


def test_a_world_size_that_is_not_a_number_is_named(capsys, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "x")
    assert main(["train", "--preset", "tiny-lm", "--set", "steps=1", "--out", "never"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "tformer train: error: the environment variable WORLD_SIZE='x' is not a whole number"
    )
