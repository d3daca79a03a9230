"""StopRequests and GuardedStream (tformer/train/interrupt.py) on their own, without a training run."""

from __future__ import annotations

import errno
import io
import signal
import threading

import pytest

from tformer.train.interrupt import SIGPIPE, GuardedStream, StopRequests

SIGHUP = getattr(signal, "SIGHUP", None)


@pytest.fixture(autouse=True)
def _signals_as_in_a_terminal(monkeypatch):
    """Start from a terminal's handlers (a background job may inherit SIGINT ignored), outside torchrun,
    and put the session's handlers back after."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    sigs = [signal.SIGINT, signal.SIGTERM] + ([SIGHUP] if SIGHUP else [])
    before = {sig: signal.getsignal(sig) for sig in sigs}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def test_a_second_sigterm_does_not_stop_at_once(monkeypatch) -> None:
    monkeypatch.setattr(StopRequests, "REPEAT_S", 0.0)
    with StopRequests(announce=False) as stop:
        signal.raise_signal(signal.SIGTERM)
        try:
            signal.raise_signal(signal.SIGTERM)  # only a second Ctrl-C stops without saving
        except KeyboardInterrupt:
            pytest.fail("a second SIGTERM stopped the run at once")
        assert stop.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_a_second_ctrl_c_within_the_repeat_window_is_the_same_press(monkeypatch) -> None:
    monkeypatch.setattr(StopRequests, "REPEAT_S", 60.0)
    with StopRequests(announce=False) as stop:
        signal.raise_signal(signal.SIGINT)
        try:
            signal.raise_signal(signal.SIGINT)  # forwarded by a wrapper: the same press
        except KeyboardInterrupt:
            pytest.fail("a Ctrl-C repeated within REPEAT_S stopped the run at once")
        assert stop.signum == signal.SIGINT
    monkeypatch.setattr(StopRequests, "REPEAT_S", 0.0)
    with StopRequests(announce=False) as stop:
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_under_torchrun_a_repeated_ctrl_c_is_ignored(monkeypatch) -> None:
    monkeypatch.setattr(StopRequests, "REPEAT_S", 0.0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")
    with StopRequests(announce=False) as stop:
        signal.raise_signal(signal.SIGINT)
        try:
            signal.raise_signal(signal.SIGINT)  # torchrun forwarding the terminal's Ctrl-C
        except KeyboardInterrupt:
            pytest.fail("a repeated Ctrl-C under torchrun stopped the worker at once")
        assert stop.signum == signal.SIGINT


def test_the_first_request_is_the_one_kept() -> None:
    stop = StopRequests(announce=False)
    stop.request(signal.SIGTERM)
    stop.request(signal.SIGINT)
    assert stop.signum == signal.SIGTERM


def test_the_previous_handlers_come_back_and_an_ignored_signal_stays_ignored() -> None:
    def mine(signum, frame) -> None:
        pass

    signal.signal(signal.SIGTERM, mine)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # e.g. a job started in the background
    with StopRequests(announce=False) as stop:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is not mine
        signal.raise_signal(signal.SIGINT)
        assert stop.signum is None
    assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_outside_the_main_thread_nothing_is_installed() -> None:
    errors, handlers = [], []

    def run() -> None:
        try:
            with StopRequests(announce=False):
                handlers.append(signal.getsignal(signal.SIGTERM))
        except BaseException as e:  # noqa: BLE001 - signal.signal raises ValueError off the main thread
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors == [] and handlers == [signal.SIG_DFL]


class Comm:
    """The one collective StopRequests.agreed uses, for `others` ranks that received a signal too."""

    def __init__(self, others: bool) -> None:
        self.others = others

    def ranks_where(self, flag: bool) -> list[int]:
        return [r for r, f in enumerate([flag, self.others]) if f]


@pytest.mark.parametrize(
    "own, others, agreed",
    [
        (None, False, None),
        (None, True, int(signal.SIGINT)),  # another rank's signal: most likely the same Ctrl-C
        (signal.SIGTERM, False, int(signal.SIGTERM)),
        (signal.SIGTERM, True, int(signal.SIGTERM)),
    ],
)
def test_every_rank_agrees_on_the_stop(own, others, agreed) -> None:
    stop = StopRequests(announce=False)
    if own is not None:
        stop.request(own)
    assert stop.agreed(Comm(others)) == agreed


@pytest.mark.parametrize(
    "signum, name, again",
    [(signal.SIGINT, "SIGINT", True), (signal.SIGTERM, "SIGTERM", False), (SIGPIPE, "output lost", False)],
)
def test_the_announcement_names_the_signal(capsys, signum, name, again) -> None:
    StopRequests().request(signum)
    err = capsys.readouterr().err
    assert err.strip().startswith(f"{name}: stopping when this step ends")
    assert ("Ctrl-C again" in err) == again


class Failing(io.StringIO):
    """A stream whose writes fail with `error` after `ok` of them."""

    def __init__(self, error: OSError, ok: int = 0) -> None:
        super().__init__()
        self.error, self.ok, self.calls = error, ok, 0

    def write(self, text: str) -> int:
        self.calls += 1
        if self.calls > self.ok:
            raise self.error
        return super().write(text)


@pytest.mark.parametrize("error", [BrokenPipeError(errno.EPIPE, "pipe"), OSError(errno.EIO, "hung up")])
def test_a_lost_stream_is_written_no_more_and_says_so_each_time(error) -> None:
    lost = []
    inner = Failing(error, ok=1)
    out = GuardedStream(inner, lambda: lost.append(1))
    assert out.write("kept\n") == 5 and lost == []
    assert out.write("lost\n") == 5 and lost == [1]  # print() goes on; the run is told to stop
    out.write("more\n")
    out.flush()
    assert inner.calls == 2 and inner.getvalue() == "kept\n" and lost == [1, 1, 1]


def test_guards_of_one_stream_are_that_stream_and_each_other() -> None:
    """tqdm writes a line above its bar cleanly only when the line's file equals the bar's: two guards of
    one stream (the bar's and the line's) are equal, as are a guard and its stream, either way round."""
    inner, other = io.StringIO(), io.StringIO()
    a, b = GuardedStream(inner, lambda: None), GuardedStream(inner, lambda: None)
    assert a == b and b == a and a == inner and hash(a) == hash(b) == hash(inner)
    assert a != GuardedStream(other, lambda: None) and a != other
