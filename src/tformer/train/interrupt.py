"""Stopping a run at a step boundary.

Ctrl-C (SIGINT) or SIGTERM during `Trainer.fit` does not interrupt the step in flight: a checkpoint
written from the middle of a step would hold a loader position past the step's batches, RNG states that
dropout already advanced and, after `optimizer.step()`, weights one step ahead of the scheduler, so a
resume would not continue exactly. The signal is noted instead; the loop finishes the step (its
logging, evaluation and save cadence), saves, and raises `Stopped`. A second Ctrl-C stops at once,
without saving: the last committed checkpoint stays as it was. Under torchrun every rank learns of a
signal that reached any rank in the same step (one small all-reduce per step), so all ranks save the
same step.
"""

from __future__ import annotations

import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """The run stopped at a step boundary on a signal, after saving a checkpoint."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class StopRequests:
    """Context manager: while active (and only in the main thread, where Python delivers signals),
    SIGINT and SIGTERM set `signum` instead of raising; a second SIGINT raises KeyboardInterrupt."""

    def __init__(self, announce: bool = True) -> None:
        self.announce = announce
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _note(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        if self.signum is None and self.announce:
            print(
                f"\n{signal.Signals(signum).name}: stopping when this step ends, after saving a checkpoint "
                "(Ctrl-C again stops at once, without saving)",
                file=sys.stderr,
                flush=True,
            )
        self.signum = self.signum or signum

    def agreed(self, comm) -> int | None:
        """The signal to stop on if any process received one (a collective under torchrun: every rank
        calls it once per step), else None."""
        ranks = comm.ranks_where(self.signum is not None)
        if not ranks:
            return None
        return self.signum or int(signal.SIGTERM)  # another rank's signal: most likely torchrun's SIGTERM
