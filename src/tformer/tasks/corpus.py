"""The corpus a run's data config names, checked to serve the run's task."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path

from tformer.data.corpora import Corpus, MissingDataError, corpus_task, load_corpus
from tformer.data.tokenizer import Tokenizer
from tformer.json_files import read_json
from tformer.schema import ConfigError
from tformer.train.config import DataConfig

PATH_OPTION = {
    "trans-de-en": "path",
    "bbc-news": "root",
    "shakespeare": "root",
    "sotu": "root",
    "bible": "root",
    "wordnet": "root",
}  # loader keyword for data.path


def load_task_corpus(data: DataConfig, task: str, **options) -> Corpus:
    """The corpus `data` names, checked to serve `task`; data.path (if set) says where its files are."""
    kind = corpus_task(data.corpus)
    if kind != task:
        noun = {"lm": "language-modelling"}
        raise ConfigError(
            f"data.corpus {data.corpus!r} is a {noun.get(kind, kind)} corpus, not a {noun.get(task, task)} one"
        )
    own = OWN_DATA[task]
    if data.path is not None:
        if data.corpus not in PATH_OPTION:
            raise ConfigError(
                f"data.path is not supported for corpus {data.corpus!r} (it names where an installed corpus's "
                f"files are); for your own data use {own}"
            )
        options[PATH_OPTION[data.corpus]] = data.path
        try:
            return load_corpus(data.corpus, **options)
        except (MissingDataError, OSError) as err:  # the user's path: installing the package would not help
            if isinstance(err, MissingDataError):
                reason, kind = str(err).split(". Install it with")[0], FileNotFoundError
            else:
                reason, kind = err.strerror or str(err), type(err)
            raise kind(
                f"data.path={data.path!r}: {reason} (data.path names a copy of the {data.corpus} package's "
                f"files; for your own data use {own})"
            ) from None
    return load_corpus(data.corpus, **options)


# how a task takes the user's own data (tformer.data.corpora.USER_CORPORA)
OWN_DATA = {
    "lm": "data.corpus=text:<file or folder>",
    "translation": "data.corpus=pairs:<file of source<TAB>target lines>",
    "classification": "data.corpus=labels:<folder with one folder of text files per label>",
}


def train_tokenizer(texts: Iterable[str], vocab_size: int, field: str = "data.vocab_size") -> Tokenizer:
    """Byte-level BPE on `texts`; warns, naming `field`, when the texts run out of merges first.

    The model is sized to the vocabulary the tokenizer learned, so a short one costs nothing but
    is worth knowing: the config asked for more.
    """
    tokenizer = Tokenizer.train_bpe(texts, vocab_size)
    if tokenizer.vocab_size < vocab_size:
        warnings.warn(
            f"the tokenizer learned {tokenizer.vocab_size:,} tokens, fewer than {field}={vocab_size:,}: "
            "the training texts ran out of merges (pairs seen at least twice); the model uses "
            f"{tokenizer.vocab_size:,}",
            UserWarning,
            stacklevel=2,
        )
    return tokenizer


MANIFEST = "data.json"


def write_manifest(run_dir: Path, corpus: Corpus, **extra) -> None:
    """run_dir/data.json: the corpus manifest (source, split rule, counts, split hashes) and `extra`."""
    (Path(run_dir) / MANIFEST).write_text(json.dumps({**corpus.manifest(), **extra}, indent=2))


JOINED = "lm_pieces_joined"  # data.json: the run packs adjacent chunks of one file as one document


def joins_pieces(run_dir: Path, corpus: Corpus) -> bool:
    """Whether a language-model run packs adjacent chunks of one text file as one document: runs
    recorded since 2026-12-01 say so in data.json; one recorded before packed a document per chunk
    and keeps doing so (its resume goes on with the data it started with); a new run joins them."""
    path = Path(run_dir) / MANIFEST
    if not corpus.pieces or not path.is_file():
        return True
    return bool(read_json(path).get(JOINED, False))


def warn_if_split_changed(run_dir: Path, corpus: Corpus, split: str) -> None:
    """A warning when the split an evaluation scores is not the one the run recorded (its score then
    does not compare with the run's, and documents may have moved in from its training split)."""
    other, changed = compare_with_record(run_dir, corpus)
    if other:
        warnings.warn(
            f"this run trained on {other}; the {split} split scored here is {_describe(corpus.manifest())}'s, "
            "so its scores do not compare with the run's",
            UserWarning,
            stacklevel=3,
        )
    elif split in changed:
        warnings.warn(
            f"the {split} split differs from the one this run recorded (data.json): documents, pairs or "
            "articles were added, removed, renamed or edited since it trained, or a split or decoding rule "
            "of tformer changed (docs/data.md, 'Changes that move data')",
            UserWarning,
            stacklevel=3,
        )


def split_changes(run_dir: Path, corpus: Corpus) -> list[str]:
    """The splits whose documents differ from those the run recorded in data.json (files added, removed,
    renamed or edited in a text folder, pairs or articles of a data package changed); [] when they match
    or nothing was recorded (a run recorded before content hashes compares ids alone)."""
    return compare_with_record(run_dir, corpus)[1]


def another_corpus(run_dir: Path, corpus: Corpus) -> str:
    """The corpus a run's data.json records where it is not `corpus` (another task, installed corpus or
    direction; a user's folder may have moved, so its path is not compared), else ""."""
    return compare_with_record(run_dir, corpus)[0]


def compare_with_record(run_dir: Path, corpus: Corpus) -> tuple[str, list[str]]:
    """(another_corpus, split_changes) from one read of data.json and one hashing of the corpus; a
    data.json without splits is a ValueError naming it."""
    path = Path(run_dir) / MANIFEST
    if not path.is_file():
        return "", []
    recorded = read_json(path)
    if not isinstance(recorded.get("ids_sha256"), dict):  # emptied or edited: no check would be made
        raise ValueError(
            f"{path} records no splits (no ids_sha256 object); damaged or edited? Restore it from a copy, "
            "or start a new run"
        )
    now = corpus.manifest()
    installed = not any(":" in str(m.get("name")) for m in (recorded, now))
    if {"name", "task"} <= recorded.keys() and (
        any(recorded.get(k) != now[k] for k in ("task", "direction"))
        or (installed and recorded.get("name") != now["name"])
    ):
        return _describe(recorded), []
    changed = []
    for split in now["ids_sha256"]:
        for key in ("ids_sha256", "content_sha256"):
            before = recorded.get(key, {}).get(split)
            if before is not None and before != now[key][split] and split not in changed:
                changed.append(split)
    return "", changed


def _describe(manifest: dict) -> str:
    direction = f", {manifest.get('direction')}" if manifest.get("direction") else ""
    return f"corpus {manifest.get('name')!r} ({manifest.get('task')}{direction})"


def check_data_unchanged(run_dir: Path, corpus: Corpus, data: DataConfig) -> None:
    """A resumed run reads the data it started with: ConfigError naming the splits that changed since
    data.json recorded them. A run directory without data.json records it now."""
    other, changed = compare_with_record(run_dir, corpus)
    if other:
        raise ValueError(
            f"{Path(run_dir) / MANIFEST} records {other}, not this run's {_describe(corpus.manifest())}: it is "
            "another run's data.json; restore this run's, or start a new run"
        )
    if changed:
        where = data.corpus if data.path is None else data.path
        raise ConfigError(
            f"the {', '.join(changed)} split(s) of {where!r} differ from those this run recorded in "
            f"{Path(run_dir) / MANIFEST} (documents or pairs added, removed, renamed or edited since, or a "
            "split or decoding rule of tformer changed: docs/data.md, 'Changes that move data'): the run "
            "would go on with other data; restore the data or start a new run"
        )
    if not (Path(run_dir) / MANIFEST).is_file():
        write_manifest(run_dir, corpus)
