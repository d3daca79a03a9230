"""`tformer <command>`: dispatch to the subcommands. Errors a user can fix print one line, exit 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from tformer.schema import ConfigError

COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], str]] = {
    # name: (help, add_arguments, "module:function")
}


def register(name: str, help: str, target: str) -> Callable:
    def wrap(add_arguments: Callable[[argparse.ArgumentParser], None]) -> Callable:
        COMMANDS[name] = (help, add_arguments, target)
        return add_arguments

    return wrap


@register("demo", "smoke run: build each architecture and train a tiny decoder for a few steps", "demo:run")
def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tformer", description="Build, train, run and compare Transformers."
    )
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, (help_text, add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, func_name = COMMANDS[args.command][2].split(":")
    import importlib

    func = getattr(importlib.import_module(f"tformer.cli.{module_name}"), func_name)
    try:
        return int(func(args) or 0)
    except (ConfigError, ValueError, TypeError, FileNotFoundError) as err:
        print(f"tformer {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tformer {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
