"""WordNet's glosses, labelled with their synset's lexicographer class: a 45-way text classification.

Debian's `wordnet-base` installs WordNet 3.0's database in /usr/share/wordnet. Each line of
`data.noun`, `data.verb`, `data.adj` and `data.adv` (after the licence, whose lines begin with two
spaces) is one synset: `offset lex_filenum ss_type ... | gloss`. The gloss (a definition, often with
quoted examples) is the text; the label is the lexicographer file the synset was written in
(`lex_filenum`, named as in WordNet's lexnames(5WN): "noun.animal", "verb.motion", "adj.all", ...).

Kept: each distinct gloss once (whitespace-normalised); a gloss that more than one class holds is left
out whole (it says nothing about either). Split per label, ordered by sha256 of the gloss: `test_frac`
and `val_frac` of each label's glosses, at least one each.

    corpus = load_corpus("wordnet")
"""

from __future__ import annotations

from pathlib import Path

from tformer.data.corpus_base import (
    SPLITS,
    Corpus,
    Document,
    MissingDataError,
    cached_by_files,
    check_fractions,
    fraction_counts,
    split_by_hash,
)

INSTALL = "apt-get update && apt-get install -y wordnet-base"
ROOT = Path("/usr/share/wordnet")
PARTS_OF_SPEECH = ("noun", "verb", "adj", "adv")
# lexnames(5WN): the lexicographer files by number
LEXNAMES = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact",
    "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event", "noun.feeling",
    "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object", "noun.person",
    "noun.phenomenon", "noun.plant", "noun.possession", "noun.process", "noun.quantity", "noun.relation",
    "noun.shape", "noun.state", "noun.substance", "noun.time", "verb.body", "verb.change", "verb.cognition",
    "verb.communication", "verb.competition", "verb.consumption", "verb.contact", "verb.creation",
    "verb.emotion", "verb.motion", "verb.perception", "verb.possession", "verb.social", "verb.stative",
    "verb.weather", "adj.ppl",
)  # fmt: skip


def parse_line(line: str) -> tuple[str, str, str] | None:
    """(offset, class name, gloss) of a data-file line, or None for the licence and blank lines."""
    if not line.strip() or line.startswith("  "):
        return None
    head, bar, gloss = line.partition(" | ")
    fields = head.split()
    if not bar or len(fields) < 3 or not fields[1].isdigit() or int(fields[1]) >= len(LEXNAMES):
        raise ValueError(f"not a WordNet data line: {line[:80]!r}")
    return fields[0], LEXNAMES[int(fields[1])], " ".join(gloss.split())


def data_files(root: str | Path | None) -> tuple[Path, ...]:
    """The four data files under `root` (None: where wordnet-base installs them), each checked to exist."""
    base = ROOT if root is None else Path(root)
    files = tuple(base / f"data.{pos}" for pos in PARTS_OF_SPEECH)
    for path in files:
        if not path.is_file():
            raise MissingDataError(f"WordNet's {path.name}", path, INSTALL)
    return files


@cached_by_files(maxsize=2)
def parse_glosses(
    noun_path: Path, verb_path: Path, adj_path: Path, adv_path: Path
) -> tuple[tuple[str, str, str], ...]:
    """(id "<pos>/<offset>", class name, gloss) of every synset in the data files, in file order (the cache
    is keyed on these four files: a folder given as data.path is not walked)."""
    out = []
    for path in (noun_path, verb_path, adj_path, adv_path):
        pos = path.name.removeprefix("data.")
        with path.open("rb") as f:  # decoded line by line, so that a bad byte is named by its line
            for number, raw in enumerate(f, 1):
                try:
                    parsed = parse_line(raw.decode("utf-8"))
                except UnicodeDecodeError as err:
                    raise ValueError(f"{path}, line {number}: not UTF-8 ({err.reason})") from None
                except ValueError as err:
                    raise ValueError(f"{path}, line {number}: {err}") from None
                if parsed is not None:
                    offset, label, gloss = parsed
                    out.append((f"{pos}/{offset}", label, gloss))
    return tuple(out)


def load_wordnet(root: str | Path | None = None, val_frac: float = 0.05, test_frac: float = 0.05) -> Corpus:
    """WordNet glosses labelled with their lexicographer class (45; labels sorted), split per label; `root`:
    a folder holding the data files (None: /usr/share/wordnet)."""
    check_fractions(val_frac, test_frac)
    return _load(*data_files(root), val_frac, test_frac)


@cached_by_files(maxsize=4)
def _load(
    noun_path: Path, verb_path: Path, adj_path: Path, adv_path: Path, val_frac: float, test_frac: float
) -> Corpus:
    synsets = parse_glosses(noun_path, verb_path, adj_path, adv_path)
    classes: dict[str, set[str]] = {}
    for _, label, gloss in synsets:
        classes.setdefault(gloss, set()).add(label)
    seen: set[str] = set()
    by_label: dict[str, list[Document]] = {}
    for item_id, label, gloss in synsets:
        if gloss and len(classes[gloss]) == 1 and gloss not in seen:
            seen.add(gloss)
            by_label.setdefault(label, []).append(Document(item_id, gloss, label))
    labels = tuple(sorted(by_label))
    splits: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for label in labels:
        docs = by_label[label]
        try:
            n_val, n_test = fraction_counts(len(docs), val_frac, test_frac, 1)
        except ValueError as error:
            raise ValueError(
                f"WordNet class {label!r} ({noun_path.parent}) has {len(docs)} distinct gloss(es): {error}"
            ) from None
        for s, items in split_by_hash(docs, lambda d: d.text, n_val, n_test).items():
            splits[s].extend(items)
    rule = (
        "distinct glosses (whitespace-normalised), those of more than one class left out; per label, "
        f"ordered by sha256(gloss): test={test_frac:.0%}, val={val_frac:.0%}, train=the rest"
    )
    held = {s: tuple(v) for s, v in splits.items()}
    return Corpus("wordnet", "classification", held, rule, str(noun_path.parent), labels)
