"""What every corpus loader builds on: the `Corpus` of `Document` / `Pair` items and its three
splits, the hash split that keeps identical texts together, text decoding for files of unknown
encoding, the in-process cache keyed on the data's files, and where an installed package lives.
`tformer.data.corpora` (the installed corpora and the registry) and `tformer.data.user_corpora` (the
user's own files) both build on it.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import importlib.util
import inspect
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar

SPLITS = ("train", "val", "test")
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
    pieces: bool = False  # LM: the documents are pieces of one text in order, ids "<name>:<index>"

    def __post_init__(self) -> None:  # loaders cache corpora: make the split table read-only
        object.__setattr__(self, "splits", MappingProxyType(dict(self.splits)))

    def __getitem__(self, split: str) -> tuple[Item, ...]:
        return self.splits[split]

    def texts(self, split: str) -> list[str]:
        """The documents' texts (LM / classification) or the sources (translation)."""
        return [item.src if isinstance(item, Pair) else item.text for item in self.splits[split]]

    def lm_texts(self, split: str, limit: int | None = None, join: bool = True) -> list[str]:
        """The texts a language model reads as documents (each followed by EOS when packed): the first
        `limit` documents' texts, where pieces of one text that are adjacent in the split are joined back
        into one (one file cut into chunks for splitting is one document, not one per chunk; join=False:
        one per chunk, as runs recorded before 2026-12-01 read them)."""
        items = self.splits[split][:limit]
        if not (self.pieces and join):
            return [item.text for item in items]
        out: list[str] = []
        previous = None
        for item in items:
            index = int(item.id.rsplit(":", 1)[1])
            if previous is not None and index == previous + 1:
                out[-1] += item.text
            else:
                out.append(item.text)
            previous = index
        return out

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


_WORDS = re.compile(r"\w+")


def normalized(text: str) -> str:
    """Text up to case and punctuation ("Seed:" = "seed"): the unit that must not recur in two splits of a
    translation corpus."""
    return " ".join(_WORDS.findall(text.casefold())) or text


# characters that draw nothing: Unicode's default-ignorable code points (zero-width spaces and joiners,
# the BOM, bidirectional marks, variation selectors, invisible operators) and the Hangul fillers
INVISIBLE = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f"
    "\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0000-\U000e0fff]"
)


def is_blank(text: str) -> bool:
    """Nothing but whitespace and characters that draw nothing (`INVISIBLE`: a zero-width space, a BOM, a
    joiner): no text to translate or classify. Format characters that draw something (the Arabic number
    sign, an end-of-ayah mark) are text."""
    return not INVISIBLE.sub("", text).strip()


def sha256_hex(key: str) -> str:
    """The hex sha256 of a text (what the hash splits order by)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def linked_groups(keys: Sequence[Sequence[str]]) -> list[str]:
    """One group key per item, from each item's keys: items that share any key, directly or through
    other items, get the same group key (the least key of their group), so a split that keeps groups
    together keeps all of them in one split."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for item_keys in keys:
        first = find(item_keys[0])
        for other in item_keys[1:]:
            root = find(other)
            if root != first:
                parent[max(first, root)] = min(first, root)
                first = min(first, root)
    return [find(item_keys[0]) for item_keys in keys]


def split_by_hash(
    items: Sequence[T], key: Callable[[T], str], n_val: int, n_test: int
) -> dict[str, tuple[T, ...]]:
    """Order items by sha256(key); the first `n_test` go to test, the next `n_val` to val, the rest to train.

    Items sharing a key stay together (a group that starts while a split still wants items goes to it
    whole), so duplicates and near-duplicates never straddle splits. Val counts its own items from where
    test ended: a large group at the end of test does not eat val's share. Each split keeps the corpus
    order.
    """
    order = sorted(range(len(items)), key=lambda i: (sha256_hex(key(items[i])), key(items[i])))
    split_of: dict[int, str] = {}
    size = dict.fromkeys(SPLITS, 0)
    previous, name = None, "test"
    for i in order:
        k = key(items[i])
        if k != previous:
            name = "test" if size["test"] < n_test else "val" if size["val"] < n_val else "train"
            previous = k
        split_of[i] = name
        size[name] += 1
    return {s: tuple(x for i, x in enumerate(items) if split_of[i] == s) for s in SPLITS}


def check_fractions(val_frac: float, test_frac: float) -> None:
    """Held-out fractions each in [0, 1), together below 1 (train keeps the rest): else a ValueError."""
    for name, frac in (("val_frac", val_frac), ("test_frac", test_frac)):
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
            raise ValueError(f"{name} must be a fraction in [0, 1), got {frac!r}")
    if val_frac + test_frac >= 1:
        raise ValueError(
            f"val_frac {val_frac} + test_frac {test_frac} leave nothing to train on (their sum must be < 1)"
        )


def fraction_counts(n: int, val_frac: float, test_frac: float, min_each: int) -> tuple[int, int]:
    """(val, test) counts for n units at these fractions, at least `min_each` each, train keeping one."""
    check_fractions(val_frac, test_frac)
    n_val, n_test = max(min_each, round(n * val_frac)), max(min_each, round(n * test_frac))
    if n - n_val - n_test < 1:
        raise ValueError(
            f"{n} units are too few to split into train/val/test (need at least {2 * min_each + 1})"
        )
    return n_val, n_test


def read_text(path: Path, warn: bool = False) -> str:
    """Decode a text file: UTF-8 (BOM allowed); UTF-8 with its few invalid bytes as U+FFFD where its valid
    multi-byte characters outnumber them; else cp1252, else latin-1 (`warn`: with a warning naming the
    file, for a user's files; the installed BBC articles are cp1252 by design); newlines normalised. A file holding NUL bytes is not text (a binary,
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
    bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0  # a UTF-8 mark is no text
    try:
        text = raw[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        utf8 = raw[bom:].decode("utf-8", errors="replace")
        bad = utf8.count("\ufffd")
        non_ascii = len(utf8) - len(utf8.encode("ascii", "ignore"))
        if non_ascii - bad > bad:  # more valid multi-byte characters than bad bytes
            # UTF-8 with a few stray bytes (cp1252 text hardly ever forms valid UTF-8 sequences): keep its
            # characters, each stray byte U+FFFD, rather than garble every one of them as cp1252
            if warn:
                warnings.warn(
                    f"{name} is UTF-8 but for {bad} invalid byte(s) (the first {raw[bom + e.start]:#04x} at "
                    f"offset {bom + e.start}), read as U+FFFD",
                    UserWarning,
                    stacklevel=3,
                )
            return _clean(utf8, warn)
        encoding = "cp1252"
        try:
            text = raw[bom:].decode(encoding)
        except UnicodeDecodeError:
            encoding, text = "latin-1", raw[bom:].decode("latin-1")
        if warn:
            controls = len(raw) - len(raw.translate(None, BINARY_BYTES))
            if controls > max(16, len(raw) // 25):  # text next to none; random bytes 20 in 256
                raise ValueError(
                    f"{name} does not look like text: not UTF-8, and {controls:,} of its {len(raw):,} bytes are "
                    "control codes no text uses (binary data?)"
                ) from None
            warnings.warn(
                f"{name} is not UTF-8 (byte {raw[bom + e.start]:#04x} at offset {bom + e.start}); read as "
                f"{encoding}",
                UserWarning,
                stacklevel=3,
            )
    return _clean(text, warn)


def _clean(text: str, warn: bool) -> str:
    """Newlines normalised; in a user's file (`warn`) byte-order marks inside it (files joined together)
    dropped too: they are not text either."""
    if warn:
        text = text.replace("\ufeff", "")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def package_dir(module: str, what: str, install: str) -> Path:
    """Where an installed (data) package lives, found with importlib; never imports it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataError(what, f"python package {module!r}", install)
    return Path(next(iter(spec.submodule_search_locations)))


def require_path(path: Path, what: str, install: str) -> Path:
    """`path`, or a MissingDataError naming what is missing and the command that installs it."""
    if not path.exists():
        raise MissingDataError(what, path, install)
    return path
