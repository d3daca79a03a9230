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


def tiny_lm_argv(out: Path, corpus: str, steps: int) -> list[str]:
    """`tformer train --preset tiny-lm` on `corpus` (a data.corpus value) into `out`: vocabulary 300,
    windows of 32, an evaluation and a checkpoint every 2 steps."""
    sets = [f"data.corpus={corpus}", "data.vocab_size=300", f"steps={steps}", "eval_every=2", "save_every=2"]
    sets.append("data.seq_len=32")
    return [
        "train",
        "--preset",
        "tiny-lm",
        "--out",
        str(out),
        "--no-progress",
        *(x for kv in sets for x in ("--set", kv)),
    ]


def train_cli_run(root: Path) -> Path:
    """`tformer train --preset tiny-lm` for 4 steps on 8 files of WORDS under `root`; the run directory."""
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"d{i}.txt").write_text(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(300)))
    out = root / "run"
    assert main(tiny_lm_argv(out, f"text:{corpus}", steps=4)) == 0
    return out
