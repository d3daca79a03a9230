"""`tformer <command>`: dispatch to the subcommands. Errors a user can fix print one line, exit 2."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import NoReturn

from tformer.allocator import keep_freed_memory
from tformer.cli.options import nonempty_text, nonnegative_int, positive_int, thread_count
from tformer.data.corpus_base import MissingDataError
from tformer.schema import ConfigError

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], str]] = {
    # name: (help, add_arguments, "module:function")
}


def register(name: str, help: str, target: str) -> Callable:
    def wrap(add_arguments: Callable[[argparse.ArgumentParser], None]) -> Callable:
        COMMANDS[name] = (help, add_arguments, target)
        return add_arguments

    return wrap


def add_run_arguments(p: argparse.ArgumentParser, device: bool = True) -> None:
    """--run and --average: the commands that load a trained run; --device where the command computes."""
    p.add_argument("--run", required=True, type=nonempty_text, help="run directory or checkpoint directory")
    p.add_argument(
        "--average",
        type=positive_int,
        default=1,
        metavar="N",
        help="use the mean of the weights of the run directory's newest N checkpoints (checkpoint "
        "averaging; default 1: the newest alone). A run keeps keep_last of them, saved every save_every steps",
    )
    if device:
        p.add_argument(
            "--device",
            default="cpu",
            type=nonempty_text,
            help="where the model runs: cpu (default), cuda, cuda:N, or auto (a GPU where there is one)",
        )


@register(
    "train", "train a model (language modelling by default) from a preset or a config file", "train:run"
)
def _train_args(p: argparse.ArgumentParser) -> None:
    from tformer.cli.options import add_config_arguments

    add_config_arguments(p, default_preset="shakespeare")
    p.add_argument(
        "--out", default=None, help="run directory (default runs/<preset>, runs/<config stem> or runs/run)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue exactly from the run directory's last checkpoint, with the run's own config.json "
        "(--set may change steps, the eval / save / log / sample cadence, eval_batches, sample_tokens, "
        "keep_last, the non-finite and spike guards, device, compile, activation_checkpointing, fused_loss "
        "and parallel.*; model, data, optimizer, batch and seed must stay as they were)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="plain lines instead of a progress bar (for logs): one per logged step with loss, lr, tokens/s "
        "and ETA, then the evaluations and samples (the default when stderr is not a terminal)",
    )
    p.add_argument("--no-sample", action="store_true", help="do not print a generated sample at the end")


@register("generate", "generate text with a trained decoder (KV-cached sampling, streamed)", "generate:run")
def _generate_args(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)
    p.add_argument("--prompt", default=None, help="prompt text (\\n for a newline, \\\\ for a backslash)")
    p.add_argument(
        "--prompts-file",
        type=nonempty_text,
        default=None,
        help="one prompt per line (escapes as --prompt; - reads stdin); generates for all as a batch",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="tokens to generate (default: 200, or --min-new-tokens where that is larger, capped by what the "
        "model's context leaves after the prompt; with --truncate-prompt at least half the context)",
    )
    p.add_argument(
        "--min-new-tokens",
        type=nonnegative_int,
        default=0,
        help="end-of-text cannot be drawn before this many new tokens (default: 0; --stop still stops)",
    )
    p.add_argument("--temperature", type=float, default=None, help="default: 0.8; 0 = greedy")
    p.add_argument(
        "--top-k", type=int, default=None, help="default: 50 (and any tied with the 50th); 0 = off"
    )
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling; default: 1.0 (off)")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="CTRL penalty on the tokens of the prompt and of the text so far; default: 1.0 (off)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=[],
        help="stop string, repeatable; \\n stands for a newline (\\\\ for a backslash). Looked for in the new "
        "text only; the output ends before it (streamed text that may begin one waits until it does not)",
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed; default: 0")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (temperature 0)")
    p.add_argument(
        "--num-samples",
        type=positive_int,
        default=1,
        help="continuations drawn per prompt, as rows of one batch, each under a '--- sample j of N ---' line "
        "('--- prompt i of n, sample j of N ---' for several prompts); not streamed; refused with greedy "
        "decoding (default: 1)",
    )
    p.add_argument("--no-stream", dest="stream", action="store_false", help="print only when done")
    p.add_argument(
        "--compile",
        action="store_true",
        help="run each decoding step compiled with torch.compile (dense and dropless MoE decoders; others decode "
        "without it, with a warning): compiling takes ~35-40 s the first time on 2 CPU cores (3-9 s when "
        "torch's on-disk cache holds it), then each step is faster at batch 1",
    )
    p.add_argument(
        "--truncate-prompt",
        action="store_true",
        help="keep the last tokens of a prompt longer than the context allows (with a warning) instead of "
        "stopping with an error",
    )


def add_ensemble_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ensemble",
        nargs="+",
        default=None,
        metavar="RUN",
        help="a translation run: search with these runs' models too, their next-token probabilities averaged "
        "with --run's (runs of the same vocabularies; --average applies to each)",
    )


@register(
    "translate", "translate text with a trained encoder-decoder (beam search by default)", "translate:run"
)
def _translate_args(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)
    add_ensemble_argument(p)
    p.add_argument("--text", default=None, help="one sentence")
    p.add_argument(
        "--file",
        type=nonempty_text,
        default=None,
        help="one sentence per line; - or neither --text nor --file: stdin",
    )
    p.add_argument("--beam", type=int, default=None, dest="beam_size", help="beam size (default 4)")
    p.add_argument("--length-penalty", type=float, default=None, help="GNMT alpha, 0 = none (default 0.6)")
    p.add_argument("--max-len", type=int, default=None, help="most target tokens (default 1.5 x source + 10)")
    p.add_argument(
        "--min-len", type=int, default=None, help="tokens before the end may come (default 1; 0: no limit)"
    )
    p.add_argument("--greedy", action="store_true", help="greedy search instead of beam search")
    p.add_argument("--sample", action="store_true", help="sample instead of beam search")
    p.add_argument("--temperature", type=float, default=None, help="with --sample (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="with --sample; 0 = off (default)")
    p.add_argument("--top-p", type=float, default=None, help="with --sample (default 1.0: off)")
    p.add_argument("--seed", type=int, default=None, help="with --sample (default 0)")
    p.add_argument(
        "--batch-size", type=positive_int, default=32, help="sentences decoded together (default 32)"
    )
    p.add_argument("--scores", action="store_true", help="print each output's score after a tab")
    p.add_argument(
        "--nbest",
        type=positive_int,
        default=None,
        help="print the N best of the beam, best first, as LINE<tab>TEXT<tab>SCORE (N at most --beam)",
    )
    p.add_argument(
        "--plot-attention",
        type=nonempty_text,
        default=None,
        metavar="PNG",
        help="with --text: draw the translation's cross-attention over the source (one panel per decoder "
        "layer, heads averaged) into this PNG",
    )


@register("classify", "label texts with a trained encoder classifier", "classify:run")
def _classify_args(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)
    p.add_argument("--text", default=None, help="one text")
    p.add_argument(
        "--file",
        type=nonempty_text,
        default=None,
        help="one text per line; - or neither --text nor --file: stdin",
    )
    p.add_argument("--batch-size", type=positive_int, default=32, help="texts scored together (default 32)")
    p.add_argument("--json", action="store_true", help="one JSON object per text")


@register(
    "eval",
    "evaluate a trained run on a split or a file of your own: LM perplexity, translation BLEU / chrF, "
    "classification accuracy",
    "evaluate:run",
)
def _eval_args(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)
    add_ensemble_argument(p)
    p.add_argument("--split", default=None, choices=["train", "val", "test"], help="default: test")
    p.add_argument(
        "--text-file",
        type=nonempty_text,
        default=None,
        help="a language-model run: score it on this text file (- reads stdin) instead of a split",
    )
    p.add_argument(
        "--pairs-file",
        type=nonempty_text,
        default=None,
        help="a translation run: score it on this file of source<TAB>reference lines (- reads stdin) instead "
        "of a split",
    )
    p.add_argument(
        "--labelled-file",
        type=nonempty_text,
        default=None,
        help="a classification run: score it on this file of label<TAB>text lines (- reads stdin) instead of "
        "a split",
    )
    p.add_argument(
        "--max-batches",
        type=positive_int,
        default=None,
        help="score a sample of at most this many batches, spread over the split or file (default: a language "
        "model's 1000 batches of windows; translation and classification score the whole split; a "
        "translation batch is 32 sentences, a classification batch the run's batch_size texts)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


@register("bench", "measure training and decoding speed of a decoder config on this machine", "bench:run")
def _bench_args(p: argparse.ArgumentParser) -> None:
    from tformer.cli.options import add_config_arguments
    from tformer.train.presets import LM_PRESETS

    add_config_arguments(p, default_preset="shakespeare", presets=LM_PRESETS)
    p.add_argument("--batch-size", type=positive_int, default=None, help="default: the preset's batch size")
    p.add_argument("--seq-len", type=positive_int, default=None, help="default: the preset's data.seq_len")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed repeats (the best is reported)")
    p.add_argument(
        "--new-tokens",
        type=positive_int,
        default=None,
        help="tokens to decode (default 64, or what fits after the 8-token prompt in a shorter context)",
    )
    p.add_argument("--threads", type=thread_count, default=0, help="torch threads (0 = torch's default)")
    p.add_argument(
        "--compile-decoding",
        action="store_true",
        help="also time decoding with generate(compile=True) (as tformer generate --compile): its compile "
        "is timed apart, its steps beside the eager ones",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


@register(
    "export",
    "write a trained decoder LM as a Hugging Face transformers model directory (Llama, Qwen2-MoE or GLM-4-MoE)",
    "export:run",
)
def _export_args(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p, device=False)  # the directory holds the weights, wherever they were computed
    p.add_argument("--out", required=True, type=nonempty_text, help="the new directory to write")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the saved weights' type (default float32; the logit check runs in float32 first)",
    )


@register("demo", "smoke run: build each architecture and train a tiny decoder for a few steps", "demo:run")
def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=positive_int, default=30, help="training steps (default 30)")


@register(
    "experiment", "test a claim (norm, rope, moe): train the variants, write a report", "experiment:run"
)
def _experiment_args(p: argparse.ArgumentParser) -> None:
    from tformer.cli.experiment import add_arguments

    add_arguments(p)


class Parser(argparse.ArgumentParser):
    """argparse, with unknown options answered by the list of the allowed ones. An abbreviation is not an
    option (`--resum`, `--temp` had been taken for `--resume`, `--temperature` without a word)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if _torchrun_rank() > 0:  # under torchrun every rank parses the same command line: rank 0 says it
            self.exit(2)
        if "unrecognized arguments" in message:
            options = sorted({s for a in self._actions for s in a.option_strings if s.startswith("--")})
            message += f"; allowed options: {', '.join(options)}"
        elif message.endswith("required: command") and getattr(self, "commands", None):
            message += f" (one of {', '.join(self.commands)})"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _torchrun_rank() -> int:
    """This process's rank under torchrun (WORLD_SIZE > 1), else 0."""
    try:
        return int(os.environ.get("RANK", "0")) if _torchrun_world() > 1 else 0
    except ValueError:  # not numbers: not torchrun's
        return 0


def _torchrun_world() -> int:
    """WORLD_SIZE, 1 where it is unset or not a number (the command's own check names it)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _words(err: Exception) -> str:
    """An error as one line for the user: an operating-system error as `path: reason` (Python's own form,
    "[Errno 2] No such file or directory: '/proc/foo'", reads as a crash)."""
    if isinstance(err, OSError) and err.strerror and len(err.args) >= 2 and str(err).startswith("[Errno"):
        name = err.filename if err.filename is not None else ""
        return f"{name}: {err.strerror}" if name else err.strerror
    return str(err)


def _say(line: str) -> None:
    """One line on stderr in one write: under torchrun every rank shares the terminal, and print's two
    writes (the text, then the newline) had let two ranks' lines run into one."""
    if sys.stderr is None:  # started without one (pythonw, a closed descriptor)
        return
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tformer")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "(not installed)"


def build_parser() -> Parser:
    parser = Parser(prog="tformer", description="Build, train, run and compare Transformers.")
    parser.add_argument("--version", action="version", version=f"tformer {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True, parser_class=Parser)
    parser.commands = {}
    for name, (help_text, add_arguments, _) in COMMANDS.items():
        parser.commands[name] = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(parser.commands[name])
    return parser


def _refuse_options_before_the_command(parser: Parser, argv: list[str]) -> None:
    """An unknown option before the command (`tformer --bogus train`) is named as tformer's own, with what
    tformer takes there; it had been passed on to the command's error or answered "command required"."""
    for arg in argv:
        if not arg.startswith("-") or arg == "-":
            return  # the command: what follows is its own
        if arg not in ("-h", "--help", "--version"):
            parser.error(
                f"unknown option {arg} before the command; tformer takes --help and --version there, then "
                f"a command ({', '.join(parser.commands)}), whose options follow it"
            )


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush does not fail on the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is not a file (captured, replaced)
        pass


# what torch raises when an allocation fails (the CPU allocator; CUDA's "out of memory")
OUT_OF_MEMORY = ("can't allocate memory", "out of memory")

# what a collective raises on a rank whose peer exited (gloo, nccl): that rank's own error is the one to read
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "NCCL communicator was aborted",
)
TIMED_OUT = ("Timed out waiting", "collective operation timeout")  # gloo, NCCL's watchdog


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    _refuse_options_before_the_command(parser, argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    module_name, func_name = COMMANDS[args.command][2].split(":")
    rank = _torchrun_rank()  # under torchrun: say things once, from rank 0
    try:  # after parsing: --help does not import torch; a Ctrl-C while it loads (~1 s) is an interruption too
        import importlib

        func = getattr(importlib.import_module(f"tformer.cli.{module_name}"), func_name)
        from tformer.distributed.env import OtherRankFailed, said_by_a_lower_rank
        from tformer.train.step import NonFiniteError
    except KeyboardInterrupt:
        if not rank:
            _say(f"tformer {args.command}: interrupted")
        return 130
    formatwarning = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *_: f"tformer {args.command}: warning: {message}\n"
    try:
        with warnings.catch_warnings():  # the caller's filters come back afterwards
            if rank:
                warnings.simplefilter("ignore")  # every rank meets the same warnings; rank 0 prints them
            keep_freed_memory()  # glibc keeps what a step frees for the next (tformer/allocator.py)
            code = int(func(args) or 0)
            sys.stdout.flush()  # a pipe's buffered output fails here, not at exit, if its reader is gone
            return code
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop quietly, as a shell tool does
        _silence_stdout()
        return 128 + getattr(signal, "SIGPIPE", 13)  # 13 where the platform has none
    except OtherRankFailed as err:  # under torchrun: another rank's checks failed, and it said why
        if not rank:
            _say(f"tformer {args.command}: error: {err}")
        return 2
    except (ConfigError, ValueError, TypeError, OSError, MissingDataError, NonFiniteError) as err:
        # a config error is the same on every rank, as is one a lower rank's checks raised in the same words;
        # anything else may be this rank's own, so it is named
        said = said_by_a_lower_rank(err)  # None: not from the checks the ranks agree on
        if not rank or not (said or (said is None and isinstance(err, ConfigError))):
            where = f" (rank {rank})" if rank else ""
            _say(f"tformer {args.command}: error{where}: {_words(err)}")
        return 2
    except RuntimeError as err:
        # under torchrun, a rank waiting in a collective when another rank failed, exited or hung: one line
        # (the other rank's error, if it raised one, is printed by that rank; torchrun names a killed one)
        if _torchrun_world() > 1:
            why = None
            if any(peer in str(err) for peer in PEER_GONE):
                why = "another rank failed or exited (its error, if it raised one, is above)"
            elif rank and any(t in str(err) for t in TIMED_OUT):  # rank 0 keeps the traceback: a deadlock
                why = "a collective timed out (parallel.timeout_s): another rank hung, stopped or failed"
            if why is not None:
                _say(f"tformer {args.command}: rank {rank} stopped: {why}")
                return 1
        words = str(err).strip()
        if any(w in words for w in OUT_OF_MEMORY):  # a size the machine cannot hold: one line
            first = words.splitlines()[0]
            _say(
                f"tformer {args.command}: error: out of memory ({first}); use smaller sizes "
                "(batch, beam, sequence length, model) or a machine with more memory"
            )
            return 1
        raise
    except KeyboardInterrupt as e:  # Ctrl-C (130), or SIGTERM (143) for a training run's graceful stop
        if not rank:
            with contextlib.suppress(OSError):  # a hang-up (129) or lost output (141): stderr may be gone
                _say(f"tformer {args.command}: interrupted")
        return 128 + getattr(e, "signum", 2)
    finally:
        warnings.formatwarning = formatwarning


def entry() -> NoReturn:
    """The `tformer` command: `main`, then the interpreter's exit, where a Ctrl-C ends the process at once
    with the command's own exit code. Freeing torch's memory and threads at exit takes ~0.5-1 s, and a
    Ctrl-C there had turned a finished command into exit 130 with nothing said (or a traceback from a
    destructor, and exit 0); ignoring it instead would leave an exit that hangs (a thread, a process
    group's teardown) beyond Ctrl-C. The interpreter's last clean-up (after the exit hooks) puts Python
    handlers back to the default, so the last exit hook, registered first, ignores Ctrl-C for it."""
    atexit.register(_ignore_ctrl_c)
    code = main()
    for stream in (sys.stdout, sys.stderr):  # an error's or a stop's output too: os._exit drops buffers
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    with contextlib.suppress(ValueError):  # not the main thread: no signal handlers to set
        signal.signal(signal.SIGINT, lambda *_: os._exit(code))
    sys.exit(code)


def _ignore_ctrl_c() -> None:
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    entry()
