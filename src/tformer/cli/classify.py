"""`tformer classify`: the label and class probabilities of one text (--text), or of each line of a file
(--file) or of stdin. Empty lines: an error for --text, skipped with a warning otherwise. Texts longer
than the run's max length keep their first tokens, with a warning.

Output, one line per text: the label, a tab, then `class=probability` pairs; --json prints one JSON
object per line instead.
"""

from __future__ import annotations

import argparse
import json

from tformer.cli.translate import read_texts, warn


def run(args: argparse.Namespace) -> int:
    from tformer.runs import load_run
    from tformer.tasks.classification import load_classifier

    texts, numbers = read_texts(args, "classify")
    classifier = load_classifier(load_run(args.run))
    ids, cut = classifier.encode(texts)
    for i in cut:
        warn("classify", f"line {numbers[i]} is longer than {classifier.max_len} tokens: truncated")
    probs = classifier.probabilities(ids, batch_size=args.batch_size)
    for row in probs.tolist():
        label = classifier.labels[max(range(len(row)), key=row.__getitem__)]
        if args.json:
            print(
                json.dumps({"label": label, "probabilities": dict(zip(classifier.labels, row))}), flush=True
            )
        else:
            shown = " ".join(f"{name}={p:.4f}" for name, p in zip(classifier.labels, row))
            print(f"{label}\t{shown}", flush=True)
    return 0
