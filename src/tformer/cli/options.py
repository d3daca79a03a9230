"""Shared CLI plumbing: building a TrainConfig from a preset or YAML file plus dotted overrides."""

from __future__ import annotations

import argparse
import contextlib
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from tformer.data.corpus_base import decode_text, read_text
from tformer.schema import ConfigError, yaml_value
from tformer.train.config import TrainConfig
from tformer.train.presets import TRAIN_PRESETS, get_train_preset


@contextlib.contextmanager
def named_as_flags(config: str, renames: dict[str, str] | None = None, phrases: dict[str, str] | None = None):
    """A ConfigError about `config`'s fields, built from command-line options, names the options the
    user typed (`--max-new-tokens`), not the fields (`SamplingConfig.max_new_tokens`). A field's flag
    is --field-with-dashes unless `renames` gives another; `phrases` rewrites the API's advice in the
    command line's words."""
    try:
        yield
    except ConfigError as err:
        flag = lambda m: (renames or {}).get(m.group(1), "--" + m.group(1).replace("_", "-"))  # noqa: E731
        text = re.sub(rf"\b{config}\.(\w+)", flag, str(err))
        for api, cli in (phrases or {}).items():
            text = text.replace(api, cli)
        raise ConfigError(text) from None


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


positive_int, nonnegative_int = _int_at_least(1), _int_at_least(0)
MAX_THREADS = 1024  # far above any CPU's cores; OpenMP crashes (segfault) at some 100,000 threads


def thread_count(text: str, low: int = 0) -> int:
    """--threads: `low` (0: torch's default) up to MAX_THREADS."""
    value = _int_at_least(low)(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_THREADS:,} threads, got {value:,}")
    return value


def nonempty_text(text: str) -> str:
    """A path option's value: an empty one would read as the working directory ("."), so it is named."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a path")
    return text


def add_config_arguments(
    p: argparse.ArgumentParser, default_preset: str, presets: Sequence[str] | None = None
) -> None:
    """--preset (one of `presets`, default all), --config and --set."""
    p.add_argument(
        "--preset",
        default=None,
        help=f"training preset: {', '.join(presets or TRAIN_PRESETS)} "
        f"(default {default_preset} unless --config is given)",
    )
    p.add_argument(
        "--config",
        type=lambda text: Path(nonempty_text(text)),
        default=None,
        help="a YAML or JSON TrainConfig file",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dotted override, repeatable: --set model.d_model=128 --set optim.lr=1e-3 --set steps=50. "
        "The value is read as YAML: ~, null and an empty value mean null (data.path=~ is no path, not "
        "your home folder: write the path out, e.g. data.path=$HOME/corpus); quote a string that would "
        "read as a number or boolean: data.path='\"1e5\"'",
    )


def parse_overrides(items: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in items:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(f"--set expects KEY=VALUE (for example model.d_model=128), got {item!r}")
        key, raw = item.split("=", 1)
        try:
            value = yaml_value(raw) if raw.strip() else None  # YAML 1.2's numbers: 010 is ten
            unquoted = raw.strip()[:1] not in ("'", '"')
            if (isinstance(value, str) and unquoted) or (isinstance(value, dict) and raw.strip()[:1] != "{"):
                value = raw.strip()  # a plain string as typed: ' #' is no comment, 'text: x' no mapping
            out[key.strip()] = value
        except yaml.constructor.ConstructorError as err:  # a key twice in a mapping, a key not plain
            raise ConfigError(f"--set {item}: {err.problem}") from None
        except yaml.YAMLError:
            raise ConfigError(
                f"--set {item}: the value is not valid YAML (quote a string: {key.strip()}='\"...\"')"
            ) from None
    return out


def resolve_train_config(
    args: argparse.Namespace, default_preset: str, resume_dir: Path | None = None
) -> TrainConfig:
    """--preset or --config plus --set; resuming `resume_dir` without either: the run's own config (its
    config.json, else its newest checkpoint's) plus --set."""
    if resume_dir is not None and args.config is None and args.preset is None:
        from tformer.train.checkpoint import checkpoint_meta, latest_checkpoint

        own, last = resume_dir / "config.json", latest_checkpoint(resume_dir)
        if own.is_file():
            return TrainConfig.load(own).with_overrides(parse_overrides(args.overrides))
        if last is not None and "train_config" in (meta := checkpoint_meta(last)):
            return TrainConfig.from_dict(meta["train_config"]).with_overrides(parse_overrides(args.overrides))
    if args.config is not None and args.preset is not None:
        raise ConfigError("give either --preset or --config, not both")
    if args.config is not None:
        if not args.config.is_file():
            raise FileNotFoundError(f"config file {args.config} does not exist or is not a file")
        from tformer.train.resume import absolute_data_paths  # (imports torch: not for --help)

        # the file's relative data paths from its folder (the Trainer reads --set's from the working one)
        cfg = absolute_data_paths(TrainConfig.load(args.config), base=args.config.parent)
    else:
        cfg = get_train_preset(default_preset if args.preset is None else args.preset)
    return cfg.with_overrides(parse_overrides(args.overrides))


def utf8_text(text: str, where: str) -> str:
    """Text from the command line or stdin, which Python decodes with surrogate escapes: bytes that are
    not UTF-8 become lone surrogates, which no tokenizer takes. An error naming where they came from."""
    if any("\udc80" <= c <= "\udcff" for c in text):
        raise ValueError(f"{where} is not valid UTF-8 text")
    return text


def read_input_file(path: Path) -> str:
    """A text file given to a command (prompts, sources, texts to score or classify): decoded as the
    corpora are (tformer.data.corpus_base.read_text: UTF-8, else cp1252 / latin-1 with a warning; binary
    files refused). "-" is stdin; a pipe or device (/dev/stdin, a shell's <(...)) is read like a file."""
    if str(path) == "-":
        return read_stdin()
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory, not a file")
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    return read_text(path, warn=True)


def input_name(path: Path) -> str:
    """How messages name an input file: "stdin" for "-"."""
    return "stdin" if str(path) == "-" else str(path)


def read_stdin() -> str:
    """stdin, decoded as input files are (read_input_file): UTF-8, else cp1252 / latin-1 with a warning."""
    if sys.stdin is None:  # started with stdin closed (`<&-`)
        raise ValueError("stdin is closed: give the input as a file or pipe it in")
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a text stream put in its place (an embedding program, a test)
        return utf8_text(sys.stdin.read(), "stdin")
    return decode_text(stream.read(), "stdin", warn=True)


def input_lines(text: str) -> list[str]:
    """The lines of an input file or stdin, split at line ends ("\n", "\r\n", "\r") only: str.splitlines
    would also split inside a line at U+2028, form feeds and the like, and misnumber the lines after."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # stdin keeps \r; files do not
    return lines[:-1] if lines and not lines[-1] else lines


def refuse_torchrun(command: str, why: str) -> None:
    """ConfigError (printed once, by rank 0) where a one-process command was started by torchrun: every
    rank would run it whole, side by side."""
    import os

    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        raise ConfigError(f"tformer {command} runs in one process ({why}); start it without torchrun")


def warn_oversubscribed(command: str, threads: int | None) -> None:
    """Warn when `threads` torch threads would share this process's cores (they run, but slower, and a
    measurement under them says so little of the machine)."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if threads and threads > cores:
        warn(command, f"--threads {threads} is more than the {cores} core{'s' if cores != 1 else ''} this "
                      "process may use: the threads take turns on them, which is slower than one per core")  # fmt: skip


def warn(command: str, message: str) -> None:
    print(f"tformer {command}: warning: {message}", file=sys.stderr)


def load_run_arg(args, command: str):
    """The run `--run` names, averaged over `--average` checkpoints; where averaged, one stderr line says
    which (stdout stays the command's output). With `--ensemble`, the other runs' models joined to it."""
    run = _load_one(args.run, args, command)
    if getattr(args, "ensemble", None):
        run = ensemble_arg(args, command, run)
    return run


def _load_one(path: str, args, command: str):
    """One run as --run loads it, with the notes --run gets (averaged steps, a checkpoint short of the
    run's planned steps); every command that loads a run (generate, eval, translate, classify, export)
    comes here, once per run of an ensemble."""
    from tformer.runs import load_run

    run = load_run(path, device=getattr(args, "device", "cpu"), average=args.average)
    if run.averaged_steps:
        steps = ", ".join(map(str, run.averaged_steps))
        whose = "" if path == args.run else f" of {path}"
        print(
            f"tformer {command}: weights{whose}: the mean of the checkpoints of steps {steps}",
            file=sys.stderr,
        )
    planned = run.train_config.steps
    # a run stopped early (Ctrl-C, a kill), still training, or a checkpoint asked for by name
    if run.step < planned:
        if Path(path).resolve() == run.checkpoint.resolve():
            note = f"the weights of step {run.step} of the run's {planned}"
        else:
            from tformer.train.checkpoint import CHECKPOINTS_DIR, unfinished_checkpoints

            run_dir = run.checkpoint.parent.parent
            # a resume refuses to pass a damaged newer checkpoint (`refuse_unfinished`): say what to move
            damaged = unfinished_checkpoints(run_dir, run.step)
            first = (
                f"move {', '.join(p.name for p in damaged)} out of {shlex.quote(str(run_dir / CHECKPOINTS_DIR))}, "
                "then "
                if damaged
                else ""
            )
            note = (
                f"the checkpoint used is of step {run.step} of the run's {planned} (if the run stopped early, "
                f"{first}`tformer train --out {shlex.quote(str(run_dir))} --resume` continues it)"
            )
        if path != args.run:
            note = f"{path}: {note}"
        print(f"tformer {command}: note: {note}", file=sys.stderr)
    return run


def ensemble_arg(args, command: str, run):
    """--ensemble: the other runs' models joined to `run`'s (a translation run), each loaded as --run is
    (--average N applies to each, with the same notes); one stderr line names them."""
    from tformer.runs import TASK_NOUN

    if run.train_config.task != "translation":
        raise ValueError(
            f"--ensemble is for translation runs; this is a {TASK_NOUN[run.train_config.task]} run"
        )
    from tformer.tasks.translation import ensemble_of

    run = ensemble_of(run, [_load_one(path, args, command) for path in args.ensemble])
    names = ", ".join(shlex.quote(str(p)) for p in (run.checkpoint, *run.ensemble))
    print(f"tformer {command}: an ensemble of {len(run.ensemble) + 1} runs' models: {names}", file=sys.stderr)
    return run
