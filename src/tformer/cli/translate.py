"""`tformer translate`: translate one sentence (--text), a file (--file, one sentence per line) or stdin.

Empty lines: an error for --text; skipped with a warning in file / stdin mode, where an empty output line
stands for each, so output line n answers input line n. Sources longer than the run's max length are truncated with a warning.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from tformer.cli.options import (
    input_lines,
    input_name,
    named_as_flags,
    read_input_file,
    read_stdin,
    utf8_text,
    warn,
)
from tformer.generate.beam import SearchConfig


def read_texts(args: argparse.Namespace, command: str) -> tuple[list[str], list[int], int]:
    """The texts to process, their 1-based line numbers (--text counts as line 1) and the number of input
    lines. Empty lines are skipped with a warning; `aligned` prints an empty output line for each, so
    output line n answers input line n."""
    if args.text is not None and args.file is not None:
        raise ValueError("give --text or --file, not both (or neither, to read stdin)")
    if args.text is not None:
        if not args.text.strip():
            raise ValueError("the text is empty: give --text with some words (or --file FILE)")
        return [utf8_text(args.text, "--text").strip()], [1], 1
    if args.file is not None:
        path = Path(args.file)
        lines, where = input_lines(read_input_file(path)), input_name(path)
    else:
        lines, where = input_lines(read_stdin()), "stdin"
    texts, numbers = [], []
    for n, line in enumerate(lines, 1):
        if line.strip():
            texts.append(line.strip())
            numbers.append(n)
        else:
            warn(command, f"{where} line {n} is empty: skipped")
    if not texts:
        raise ValueError(f"{where} holds no non-empty line")
    return texts, numbers, len(lines)


# options that only one search method reads: flag -> SearchConfig field (their defaults are SearchConfig's)
METHOD_OPTIONS = {
    "sample": {"--temperature": "temperature", "--top-k": "top_k", "--top-p": "top_p", "--seed": "seed"},
    "beam": {"--beam": "beam_size", "--length-penalty": "length_penalty"},
}


def search_from_args(args: argparse.Namespace) -> SearchConfig:
    """The search the options ask for; an option of another method than the chosen one is an error."""
    if args.greedy and args.sample:
        raise ValueError("give --greedy or --sample, not both")
    method = "greedy" if args.greedy else "sample" if args.sample else "beam"
    given: dict[str, object] = {}
    for owner, options in METHOD_OPTIONS.items():
        flags = [flag for flag in options if getattr(args, options[flag]) is not None]
        if flags and owner != method:
            verb = "applies" if len(flags) == 1 else "apply"
            if owner == "sample":
                raise ValueError(f"{', '.join(flags)} {verb} to sampling only: add --sample (or drop it)")
            raise ValueError(f"{', '.join(flags)} {verb} to beam search only, not with --{method}")
        given.update({options[flag]: getattr(args, options[flag]) for flag in flags})
    cli_words = {"(method='greedy' for argmax)": "(--greedy for argmax)",
                 "(or null: from the source length)": "(or leave --max-len out: from the source length)"}  # fmt: skip
    with named_as_flags("SearchConfig", {"beam_size": "--beam"}, cli_words):
        return SearchConfig(method=method, max_len=args.max_len, batch_size=args.batch_size, **given)


def run(args: argparse.Namespace) -> int:
    from tformer.runs import load_run
    from tformer.tasks.translation import load_translator

    search_cfg = search_from_args(args)
    texts, numbers, n_lines = read_texts(args, "translate")
    translator = load_translator(load_run(args.run))
    context = translator.model.cfg.max_seq_len
    if args.max_len is not None and args.max_len > context:
        warn(
            "translate",
            f"--max-len {args.max_len} is above the model's context: outputs stop at {context} tokens",
        )
    sources, cut = translator.encode(texts)
    for i in cut:
        warn("translate", f"line {numbers[i]} is longer than {translator.max_src_len} tokens: truncated")
    outputs = (
        translator.text(h) + (f"\t{h.score:.4f}" if args.scores else "")
        for h in translator.hypotheses(sources, search_cfg)
    )
    aligned(outputs, numbers, n_lines)
    return 0


def aligned(outputs: Iterable[str], numbers: list[int], n_lines: int) -> None:
    """Print each output on its input's line: an empty line stands for each skipped (empty) input line, so
    the n_lines output lines pair with the input lines (e.g. for scoring against references)."""
    line = 1
    for text, number in zip(outputs, numbers):
        print("\n" * (number - line) + text, flush=True)
        line = number + 1
    if n_lines >= line:
        print("\n" * (n_lines - line), flush=True)
