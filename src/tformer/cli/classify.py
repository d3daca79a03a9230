"""`tformer classify`: the label and class probabilities of one text (--text), or of each line of a file
(--file) or of stdin. Empty lines: an error for --text, skipped with a warning otherwise. Texts longer
than the run's max length keep their first tokens, with a warning.

Output, one line per text: the label, a tab, then `class=probability` pairs; --json prints one JSON
object per line instead, with its input's line number. In text output an empty line stands for each
skipped input line, so output line n answers input line n.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

from tformer.cli.options import load_run_arg
from tformer.cli.translate import AlignedOutput, read_texts


def run(args: argparse.Namespace) -> int:
    from tformer.tasks.classification import load_classifier, one_line_label

    given = read_texts(args, "classify")
    classifier = load_classifier(load_run_arg(args, "classify"))
    ids, cut = classifier.encode(given.texts)
    given.warn_truncated("classify", cut, classifier.max_len, classifier.special)
    probs = classifier.probabilities(ids, batch_size=args.batch_size)

    def lines() -> Iterator[tuple[str, int]]:
        for row, number in zip(probs.tolist(), given.numbers):
            label = classifier.labels[max(range(len(row)), key=row.__getitem__)]
            if args.json:
                text = json.dumps(
                    {"line": number, "label": label, "probabilities": dict(zip(classifier.labels, row))}
                )
            else:
                shown = [
                    one_line_label(name) for name in classifier.labels
                ]  # (a run trained before names were checked)
                text = (
                    one_line_label(label) + "\t" + " ".join(f"{name}={p:.4f}" for name, p in zip(shown, row))
                )
            yield text, number

    if args.json:  # JSON lines carry their input line's number instead of blank lines
        for line, _ in lines():
            print(line, flush=True)
    else:
        out = AlignedOutput(given.n_lines)
        for line, number in lines():
            out.print(line, number)
        out.close()
    return 0
