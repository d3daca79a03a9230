"""Streaming text to stdout token by token, stop strings from the command line, stop strings' needs."""

from __future__ import annotations

import argparse
import io

import pytest

from tformer.cli.generate import TextStream, sampling_from_args
from tformer.data.tokenizer import Tokenizer
from tformer.generate.engine import generate
from tformer.generate.sampling import SamplingConfig

TEXT = "naïve café, 日本語 and 🙂 — “quoted” "


def test_characters_split_over_byte_tokens_stream_whole():
    # min_frequency above the data's counts: no merges, one token per byte, so every non-ASCII
    # character spans 2-4 tokens
    tok = Tokenizer.train_bpe([TEXT * 3] * 5, 300, min_frequency=1000)
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT) + 10  # many characters are split over tokens
    out = io.StringIO()
    stream, seen = TextStream(tok.decode, out), []
    for t in ids:
        stream.add(t)
        seen.append(out.getvalue())
    stream.finish()
    assert out.getvalue() == tok.decode(ids) == TEXT
    assert all("\ufffd" not in s for s in seen)  # never a replacement character on the way
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))  # text only ever appended


def test_an_unfinished_character_at_the_end_is_written_by_finish():
    tok = Tokenizer.train_bpe([TEXT * 3] * 5, 300, min_frequency=1000)
    ids = tok.encode("ok 日")[:-1]  # the last byte of 日 never comes
    out = io.StringIO()
    stream = TextStream(tok.decode, out)
    for t in ids:
        stream.add(t)
    assert out.getvalue() == "ok "
    stream.finish()
    assert out.getvalue() == tok.decode(ids)


def test_streaming_with_stop_strings_never_writes_a_stop_string_or_what_follows():
    tok = Tokenizer.train_bpe([TEXT * 3] * 5, 300, min_frequency=1000)  # one token per byte
    text = "one ENDLESS two END three"
    ids = tok.encode(text)
    out = io.StringIO()
    stream, seen = TextStream(tok.decode, out, ("END", "\n\n")), []
    for t in ids:
        stream.add(t)
        seen.append(out.getvalue())
    stream.finish()
    assert out.getvalue() == "one "  # "ENDLESS" holds the stop string too
    assert "one " in seen[: len("one ") + 1]  # written as it came, before the stop string began
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))
    held = io.StringIO()  # a tail that could begin a stop string waits, and is written once it cannot
    stream = TextStream(tok.decode, held, ("END",))
    for t in tok.encode("go EN"):
        stream.add(t)
    assert held.getvalue() == "go "
    for t in tok.encode("ds"):
        stream.add(t)
    assert held.getvalue() == "go ENds"
    stream.add(tok.encode(" E")[0])
    stream.add(tok.encode(" E")[1])
    assert held.getvalue() == "go ENds "
    stream.finish()  # the run ended without the stop string: the held tail is written
    assert held.getvalue() == "go ENds E"


def test_stop_strings_on_the_command_line_read_backslash_n_as_a_newline():
    from tformer.cli.main import _generate_args

    parser = argparse.ArgumentParser()
    _generate_args(parser)  # the command's own options and defaults
    args = parser.parse_args(["--run", "r", "--prompt", "p", "--stop", "\\n\\n", "--stop", "END"])
    assert sampling_from_args(args).stop_strings == ("\n\n", "END")


def test_stop_strings_without_decode_are_an_error(tiny_cfg):
    from tformer import build_model

    model = build_model(tiny_cfg)
    with pytest.raises(ValueError, match="stop_strings need decode="):
        generate(model, [[1, 2, 3]], SamplingConfig(max_new_tokens=2, stop_strings=("x",)))


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SamplingConfig(temperature=float("inf")), "temperature"),
        (lambda: SamplingConfig(repetition_penalty=float("inf")), "repetition_penalty"),
    ],
)
def test_sampling_values_must_be_finite(make, field):
    from tformer.schema import ConfigError

    with pytest.raises(ConfigError, match=field):
        make()


def test_search_values_must_be_finite():
    from tformer.generate.beam import SearchConfig
    from tformer.schema import ConfigError

    for kwargs, field in (
        (dict(length_penalty=float("nan")), "length_penalty"),
        (dict(method="sample", temperature=float("inf")), "temperature"),
    ):
        with pytest.raises(ConfigError, match=field):
            SearchConfig(**kwargs)
    assert SearchConfig(length_penalty=-0.5).length_penalty == -0.5  # negative favours short outputs: allowed


def test_each_piece_of_streamed_text_is_flushed_as_it_is_written():
    """Streaming to a terminal or pipe: whatever a token adds is flushed at once, not left in a buffer
    until the run ends."""

    class Recording(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.unflushed = 0

        def write(self, text: str) -> int:
            self.unflushed += 1
            return super().write(text)

        def flush(self) -> None:
            self.unflushed = 0
            super().flush()

    tok = Tokenizer.train_bpe([TEXT * 3] * 5, 300, min_frequency=1000)  # one token per byte
    out = Recording()
    stream = TextStream(tok.decode, out, ("END",))
    for t in tok.encode("go EN ok " + TEXT):
        stream.add(t)
        assert out.unflushed == 0
    stream.finish()
    assert out.unflushed == 0 and out.getvalue() == "go EN ok " + TEXT
