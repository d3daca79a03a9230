"""`tformer translate`: translate one sentence (--text), a file (--file, one sentence per line) or stdin.

Empty lines: an error for --text; skipped with a warning in file / stdin mode, where an empty output line
stands for each, so output line n answers input line n. With --nbest N each input line gets N output lines
(fewer only where fewer outputs exist), `LINE<tab>TEXT<tab>SCORE` best first, LINE its input line's
number counted from 1; a skipped line gets none. Sources longer than the run's max length are
truncated, with one warning that counts them; outputs cut at the length limit before an end token are
named in one warning after them. Outputs are printed a chunk of lines at a time (each
chunk searched in length-sorted batches), so a long file shows its first translations early and an
interrupted run keeps what it printed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tformer.cli.options import (
    input_lines,
    input_name,
    load_run_arg,
    named_as_flags,
    read_input_file,
    read_stdin,
    utf8_text,
    warn,
)
from tformer.data.corpus_base import is_blank
from tformer.generate.beam import SearchConfig

CHUNK_LINES = 512  # input lines searched (sorted by length) and printed together


@dataclass(frozen=True)
class Texts:
    """The texts to process, their 1-based line numbers (--text counts as line 1), the number of input
    lines and where they came from ("--text", a file's name, "stdin")."""

    texts: list[str]
    numbers: list[int]
    n_lines: int
    where: str

    def warn_truncated(
        self, command: str, cut: Sequence[int], limit: int, special: str | None = None
    ) -> None:
        """One warning for the texts (indices into `texts`) cut to `limit` tokens (counting the `special`
        token each is given, if any), naming their lines."""
        if not cut:
            return
        from tformer.runs import first_few, token_limit

        limit_words = token_limit(limit, special)
        if self.where == "--text":
            warn(command, f"the text is longer than {limit_words}: truncated")
            return
        lines = [self.numbers[i] for i in cut]
        shown = first_few(lines)
        which = f"line {shown} is" if len(lines) == 1 else f"{len(lines)} lines are"
        detail = "" if len(lines) == 1 else f" (lines {shown})"
        warn(command, f"{self.where}: {which} longer than {limit_words}: truncated{detail}")

    def warn_unfinished(
        self, command: str, cut: Sequence[tuple[int, int]], limit: str, n_best: int | None = None
    ) -> None:
        """One warning for the outputs that stopped at the length limit (`limit`, in words) before an end
        token: cut, often mid-sentence or in a loop that repeats itself. `cut`: (input line, how many of its
        outputs were cut: 1, or up to n_best of its n-best list)."""
        if not cut:
            return
        from tformer.runs import first_few

        lines, outputs = [number for number, _ in cut], sum(k for _, k in cut)
        s = "s" if outputs != 1 else ""
        if self.where == "--text":
            which = "the output" if n_best is None else f"{outputs} of the {n_best} outputs"
        elif n_best is None:
            which = (
                f"the output of line {lines[0]}" if len(lines) == 1 else f"the outputs of {len(lines)} lines"
            )
        elif len(lines) == 1:
            which = f"{outputs} output{s} in the {n_best}-best list of line {lines[0]}"
        else:
            which = f"{outputs} output{s} in the {n_best}-best lists of {len(lines)} lines"
        where = "" if self.where == "--text" else f"{self.where}: "
        detail = f" (lines {first_few(lines)})" if len(lines) > 1 else ""
        warn(command, f"{where}{which} reached the length limit, {limit}, before an end token: cut{detail}")


def read_texts(args: argparse.Namespace, command: str) -> Texts:
    """The texts of --text, --file or stdin. Empty lines are skipped with a warning; `AlignedOutput`
    prints an empty output line for each, so output line n answers input line n."""
    if args.text is not None and args.file is not None:
        raise ValueError("give --text or --file, not both (or neither, to read stdin)")
    if args.text is not None:
        if is_blank(args.text):  # spaces, or invisible characters only (a zero-width space, a BOM)
            raise ValueError("the text is empty: give --text with some words (or --file FILE)")
        return Texts([utf8_text(args.text, "--text").strip()], [1], 1, "--text")
    if args.file is not None and args.file != "-":
        path = Path(args.file)
        lines, where = input_lines(read_input_file(path)), input_name(path)
    else:
        if sys.stdin is not None and sys.stdin.isatty():  # nothing piped in: say what the command waits for
            print(f"tformer {command}: reading stdin, one text per line (end with Ctrl-D)", file=sys.stderr)
        lines, where = input_lines(read_stdin()), "stdin"
    texts, numbers = [], []
    for n, line in enumerate(lines, 1):
        if not is_blank(line):
            texts.append(line.strip())
            numbers.append(n)
        else:
            warn(command, f"{where} line {n} is empty: skipped")
    if not texts:
        raise ValueError(f"{where} holds no non-empty line")
    return Texts(texts, numbers, len(lines), where)


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
    min_len = SearchConfig().min_len if args.min_len is None else args.min_len
    if args.max_len is not None and 1 <= args.max_len <= min_len:  # (also the default 1: --max-len 1 had
        # returned one unfinished token without a word)
        default = " (the default)" if args.min_len is None else ""
        raise ValueError(
            f"--min-len {min_len}{default} leaves no room for the end within --max-len {args.max_len}"
        )
    if args.min_len is not None:
        given["min_len"] = args.min_len
    with named_as_flags("SearchConfig", {"beam_size": "--beam"}, cli_words):
        return SearchConfig(method=method, max_len=args.max_len, batch_size=args.batch_size, **given)


def run(args: argparse.Namespace) -> int:
    import torch

    from tformer.tasks.translation import load_translator

    search_cfg = search_from_args(args)
    n_best = nbest_from_args(args, search_cfg)
    if args.plot_attention is not None and args.text is None:
        raise ValueError("--plot-attention draws the attention of one sentence: give it with --text")
    if args.plot_attention is not None and args.ensemble:
        raise ValueError("--plot-attention draws one model's attention: leave out --ensemble")
    given = read_texts(args, "translate")
    translator = load_translator(load_run_arg(args, "translate"))
    context = translator.model.cfg.max_seq_len
    if search_cfg.min_len >= context:  # outputs stop at the context: the end could never come
        raise ValueError(
            f"--min-len {search_cfg.min_len} leaves no room for the end within the model's context of {context} "
            "tokens"
        )
    if args.max_len is not None and args.max_len > context:
        warn(
            "translate",
            f"--max-len {args.max_len} is above the model's context: outputs stop at {context} tokens",
        )
    sources, cut = translator.encode(given.texts)
    given.warn_truncated("translate", cut, translator.max_src_len, translator.special)
    out = AlignedOutput(given.n_lines)
    # one sampling stream over the chunks (each chunk reseeded would repeat the draws of the one before)
    device = next(translator.model.parameters()).device
    sampling = search_cfg.method == "sample"
    generator = torch.Generator(device=device).manual_seed(search_cfg.seed) if sampling else None
    unfinished: list[tuple[int, int]] = []  # (input line, its outputs cut at the length limit)
    for start in range(0, len(sources), CHUNK_LINES):
        chunk, numbers = sources[start : start + CHUNK_LINES], given.numbers[start : start + CHUNK_LINES]
        if n_best is not None:
            for hyps, number in zip(translator.nbest(chunk, search_cfg, n_best), numbers):
                print(
                    "".join(f"{number}\t{translator.text(h)}\t{h.score:.4f}\n" for h in hyps),
                    end="",
                    flush=True,
                )
                if n_cut := sum(not h.finished for h in hyps):
                    unfinished.append((number, n_cut))
                best = hyps[0]
            continue
        hyps = translator.hypotheses(chunk, search_cfg, generator=generator)
        for h, number in zip(hyps, numbers):
            out.print(translator.text(h) + (f"\t{h.score:.4f}" if args.scores else ""), number)
            if not h.finished:
                unfinished.append((number, 1))
            best = h
    if n_best is None:
        out.close()
    given.warn_unfinished("translate", unfinished, length_limit(search_cfg, context, given, sources), n_best)
    if args.plot_attention is not None:  # one sentence (--text): its best output, as printed
        plot_attention(translator, sources[0], best, args.plot_attention)
    return 0


def length_limit(search_cfg: SearchConfig, context: int, given: Texts, sources: list[list[int]]) -> str:
    """The outputs' length limit in words: --max-len or the model's context; without --max-len the rule
    (--text: its number for the one source)."""
    import torch

    if search_cfg.max_len is not None:
        return (
            f"--max-len {search_cfg.max_len}"
            if search_cfg.max_len <= context
            else f"the model's context of {context} tokens"
        )
    if given.where == "--text":
        n = int(search_cfg.max_lens(torch.tensor([len(sources[0])]), context)[0])
        return f"{n} tokens (from the source's {len(sources[0])}; --max-len sets one)"
    a, b = search_cfg.max_len_a, search_cfg.max_len_b
    return f"{a:g} x the source's tokens + {b}, at most the model's context of {context} (--max-len sets one)"


def plot_attention(translator, source: list[int], hypothesis, path: str) -> None:
    """Draw the cross-attention of `hypothesis` (the output for `source`) into the PNG at `path`."""
    from tformer.eval.attention import cross_attention_map, plot_cross_attention

    amap = cross_attention_map(translator.model, source, hypothesis, translator.src_tok, translator.tgt_tok)
    layers, heads, rows, cols = amap.weights.shape
    written = plot_cross_attention(amap, path)
    print(
        f"tformer translate: cross-attention of {rows} output tokens over {cols} source tokens ({layers} "
        f"layer{'s' if layers != 1 else ''}, {heads} head{'s' if heads != 1 else ''} averaged): {written}",
        file=sys.stderr,
    )


def nbest_from_args(args: argparse.Namespace, search_cfg: SearchConfig) -> int | None:
    """--nbest N, checked against the search: beam search alone keeps more than one, at most --beam."""
    if args.nbest is None:
        return None
    if search_cfg.method != "beam":
        raise ValueError(f"--nbest applies to beam search only, not with --{search_cfg.method}")
    if args.nbest > search_cfg.beam_size:
        default = " (the default)" if args.beam_size is None else ""
        raise ValueError(
            f"--nbest {args.nbest} is above --beam {search_cfg.beam_size}{default}: a beam keeps at most that "
            f"many (give --beam {args.nbest} or more)"
        )
    if args.scores:
        warn("translate", "--scores is implied by --nbest, whose lines end with the score")
    return args.nbest


class AlignedOutput:
    """Prints each output on its input's line: an empty line stands for each skipped (empty) input line,
    so the n_lines output lines pair with the input lines (e.g. for scoring against references)."""

    def __init__(self, n_lines: int) -> None:
        self.n_lines, self.line = n_lines, 1  # the next output line

    def print(self, text: str, number: int) -> None:
        print("\n" * (number - self.line) + text, flush=True)
        self.line = number + 1

    def close(self) -> None:
        if self.n_lines >= self.line:
            print("\n" * (self.n_lines - self.line), flush=True)
