"""The corpus a run's data config names, checked to serve the run's task."""

from __future__ import annotations

import json
from pathlib import Path

from tformer.data.corpora import Corpus, corpus_task, load_corpus
from tformer.schema import ConfigError
from tformer.train.config import DataConfig

PATH_OPTION = {
    "trans-de-en": "path",
    "bbc-news": "root",
    "shakespeare": "root",
}  # loader keyword for data.path


def load_task_corpus(data: DataConfig, task: str, **options) -> Corpus:
    """The corpus `data` names, checked to serve `task`; data.path (if set) says where its files are."""
    kind = corpus_task(data.corpus)
    if kind != task:
        raise ConfigError(f"data.corpus {data.corpus!r} is a {kind} corpus, not a {task} one")
    if data.path is not None:
        if data.corpus not in PATH_OPTION:
            raise ConfigError(f"data.path is not supported for corpus {data.corpus!r}")
        options[PATH_OPTION[data.corpus]] = data.path
    return load_corpus(data.corpus, **options)


MANIFEST = "data.json"


def write_manifest(run_dir: Path, corpus: Corpus, **extra) -> None:
    """run_dir/data.json: the corpus manifest (source, split rule, counts, split hashes) and `extra`."""
    (Path(run_dir) / MANIFEST).write_text(json.dumps({**corpus.manifest(), **extra}, indent=2))


def split_changes(run_dir: Path, corpus: Corpus) -> list[str]:
    """The splits whose documents differ from those the run recorded in data.json (files added,
    removed or renamed in a text folder since); [] when they match or nothing was recorded."""
    path = Path(run_dir) / MANIFEST
    if not path.is_file():
        return []
    recorded = json.loads(path.read_text()).get("ids_sha256", {})
    now = corpus.manifest()["ids_sha256"]
    return [s for s in now if s in recorded and recorded[s] != now[s]]
