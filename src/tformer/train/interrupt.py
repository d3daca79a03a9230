"""Stopping a run at a step boundary.

Ctrl-C (SIGINT), SIGTERM or a hang-up (SIGHUP: the terminal closed) during `Trainer.fit` does not
interrupt the step in flight: a checkpoint
written from the middle of a step would hold a loader position past the step's batches, RNG states that
dropout already advanced and, after `optimizer.step()`, weights one step ahead of the scheduler, so a
resume would not continue exactly. The signal is noted instead; the loop finishes the step (its
logging, evaluation and save cadence), saves, and raises `Stopped`. A second Ctrl-C stops at once,
without saving: the last committed checkpoint stays as it was. Under torchrun every rank learns of a
signal that reached any rank in the same step (one small all-reduce per step), so all ranks save the
same step. Output that can no longer be written (stdout piped into a reader that went away, a closed
terminal) stops the run the same way (`GuardedStream`), as SIGPIPE: training to nobody's screen would
go on unseen, a crash would lose the steps since the last checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())
SIGPIPE = getattr(signal, "SIGPIPE", 13)  # the stop for lost output (13 where the platform has none)


class Stopped(KeyboardInterrupt):
    """The run stopped on a signal: at a step boundary after saving a checkpoint, or before training
    started (`RaiseOnSignals`), with nothing to save."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class StopRequests:
    """Context manager: while active (and only in the main thread, where Python delivers signals),
    SIGINT, SIGTERM and SIGHUP set `signum` instead of raising; a second SIGINT raises KeyboardInterrupt. Under
    torchrun a Ctrl-C can reach a worker twice (from the terminal where workers share its process group,
    then forwarded by torchrun; torch 2.13's torchrun starts workers in their own sessions and forwards
    it once), so there repeats are ignored: torchrun itself kills workers that have not exited 30 s
    later. A signal the process was told to ignore stays ignored."""

    # a second SIGINT sooner than this after the first is the same keypress, forwarded by a wrapper (a
    # parent such as `timeout` passing on what the terminal sent it); a person's second Ctrl-C comes later
    REPEAT_S = 0.25

    def __init__(self, announce: bool = True) -> None:
        self.announce = announce
        self.signum: int | None = None
        self._first = 0.0
        self._previous: dict[int, object] = {}
        self._torchrun = "TORCHELASTIC_RUN_ID" in os.environ

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _note(self, signum: int, frame) -> None:
        if self.signum is not None:
            again = signum == signal.SIGINT and not self._torchrun
            if again and time.monotonic() - self._first > self.REPEAT_S:
                raise KeyboardInterrupt  # the second Ctrl-C: stop now
            return
        self.request(signum)

    def request(self, signum: int) -> None:
        """Stop at the end of this step, as on signal `signum` (the first request counts)."""
        if self.signum is not None:
            return
        self.signum, self._first = signum, time.monotonic()
        if self.announce:
            again = " (Ctrl-C again stops at once, without saving)" if signum == signal.SIGINT else ""
            name = "output lost" if signum == SIGPIPE else signal.Signals(signum).name
            with contextlib.suppress(OSError):  # after a hang-up the terminal may be gone: the stop matters
                print(
                    f"\n{name}: stopping when this step ends, after saving a checkpoint{again}",
                    file=sys.stderr,
                    flush=True,
                )

    def agreed(self, comm) -> int | None:
        """The signal to stop on if any process received one (a collective under torchrun: every rank
        calls it once per step), else None."""
        ranks = comm.ranks_where(self.signum is not None)
        if not ranks:
            return None
        return self.signum or int(signal.SIGINT)  # another rank's: most likely the same Ctrl-C


class RaiseOnSignals:
    """Context manager for work with nothing to save yet (a run being set up: its data read, its
    vocabulary trained; an export's directory being written): the first SIGTERM or SIGHUP raises `Stopped`, a KeyboardInterrupt as Ctrl-C's is,
    so the cleanup a Ctrl-C gets runs for them too (they had ended the process at once, with no word,
    leaving a half-made run directory); repeats (a scheduler or torchrun signalling again) are ignored
    until the context ends, so they cannot cut that cleanup short: put the cleanup inside the context.
    Python acts on a signal between its own instructions, so one that comes while native code runs (the
    tokenizer's training) is acted on when that returns. Main thread only; a signal the process ignores
    stays ignored."""

    def __init__(self, message: str = "stopped before training started") -> None:
        self.message = message
        self._previous: dict[int, object] = {}
        self.signum: int | None = None

    def __enter__(self) -> RaiseOnSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                if sig != signal.SIGINT and signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._raise)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _raise(self, signum: int, frame) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        raise Stopped(signum, f"{signal.Signals(signum).name}: {self.message}")


class GuardedStream:
    """A text stream (stdout, stderr) that stops writing once its reader is gone: the first write or flush
    that fails (a broken pipe, a terminal that hung up) calls `lost` and every later one is dropped."""

    def __init__(self, stream, lost) -> None:
        self.stream, self.lost, self.gone = stream, lost, False

    def _guard(self, method: str, *args):
        if self.gone:  # (told again: a later fit of the same trainer stops too; a stop request is idempotent)
            self.lost()
            return None
        try:
            return getattr(self.stream, method)(*args)
        except OSError:  # BrokenPipeError, EIO
            self.gone = True
            self.lost()
            return None

    def write(self, text: str) -> int:
        self._guard("write", text)
        return len(text)

    def flush(self) -> None:
        self._guard("flush")

    def __getattr__(self, name: str):  # isatty, fileno, encoding ... (tqdm reads some)
        return getattr(self.stream, name)

    # tqdm clears its bar before a line written above it only when the line's file is the bar's, or both
    # are sys.stdout / sys.stderr: a guarded stream is the stream it guards
    def __eq__(self, other: object) -> bool:
        return self.stream == getattr(other, "stream", other)

    def __hash__(self) -> int:
        return hash(self.stream)
