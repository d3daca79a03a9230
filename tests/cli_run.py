"""The tiny language-model run the command-line tests share: trained by `tformer train` itself on a few
files of a Hamlet word list (the tests prompt it with "to be" and look for "the question")."""

from __future__ import annotations

from pathlib import Path

from tformer.cli.main import main

WORDS = [
    "to",
    "be",
    "or",
    "not",
    "to",
    "be",
    "that",
    "is",
    "the",
    "question",
    "whether",
    "tis",
    "nobler",
    "in",
    "the",
    "mind",
    "to",
    "suffer",
]


def train_cli_run(root: Path) -> Path:
    """`tformer train --preset tiny-lm` for 4 steps on 8 files of WORDS under `root`; the run directory."""
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"d{i}.txt").write_text(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(300)))
    out = root / "run"
    code = main(
        [
            "train",
            "--preset",
            "tiny-lm",
            "--out",
            str(out),
            "--no-progress",
            "--set",
            f"data.corpus=text:{corpus}",
            "--set",
            "data.vocab_size=300",
            "--set",
            "steps=4",
            "--set",
            "eval_every=2",
            "--set",
            "save_every=2",
            "--set",
            "data.seq_len=32",
        ]
    )
    assert code == 0
    return out
