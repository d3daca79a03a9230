"""The user's own data as corpora: `text:<file or folder>` (language modelling), `pairs:<file>`
(translation: `source<TAB>target` lines), `labels:<folder>` (classification: one subfolder of text
files per label). Read afresh on every call (the user may edit them); split by a hash of the text, so
identical texts stay in one split (labelled texts: identical up to whitespace, kept once).
`tformer.data.corpora.load_corpus` reaches them by those prefixes.
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import unicodedata
import warnings
from pathlib import Path

from tformer.data.corpus_base import (
    SPLITS,
    TEXT_SUFFIXES,
    Corpus,
    Document,
    Pair,
    fraction_counts,
    read_text,
    split_by_hash,
)


def _piece_size(text: str) -> int:
    """The least characters of a piece one text file is cut into: about 50 pieces, 256 to 4,096 chars."""
    return min(4096, max(256, len(text) // 50))


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
        docs = _non_empty(path, [Document(str(p.relative_to(path)), read_text(p, warn=True)) for p in files])
        unit = "files"
        if len(docs) < 3:
            raise ValueError(
                f"text folder {str(path)!r} has {len(docs)} non-empty text file(s) ({', '.join(TEXT_SUFFIXES)}); "
                "need at least 3 to split into train / val / test"
                + (
                    f" (or give the file itself, text:{shlex.quote(str(path / docs[0].id))}, which is cut "
                    "into pieces)"
                    if len(docs) == 1 and len(_chunks(docs[0].text, _piece_size(docs[0].text))) >= 3
                    else ""
                )
            )
    elif path.is_file():
        text = read_text(path, warn=True)
        size = _piece_size(text)
        docs = [Document(f"{path.name}:{i}", chunk) for i, chunk in enumerate(_chunks(text, size))]
        unit = f"chunks of >= {size} chars cut at line ends"
        if len(docs) < 3:
            raise ValueError(
                f"text file {str(path)!r} ({len(text):,} chars on {len(text.splitlines())} line(s)) cuts into "
                f"{len(docs)} piece(s) of >= {size} chars at line ends; need at least 3 to split into "
                "train / val / test: give it more text or more line breaks"
            )
    else:
        what = "is neither a file nor a folder" if path.exists() else "does not exist"
        raise FileNotFoundError(f"text corpus path {str(path)!r} {what}")
    n_val, n_test = fraction_counts(len(docs), 0.05, 0.05, 1)
    rule = f"{unit} by sha256(text): test={n_test}, val={n_val}, train=the rest"
    splits = split_by_hash(docs, lambda d: d.text, n_val, n_test)
    return Corpus(f"text:{path}", "lm", splits, rule, str(path), pieces=path.is_file())


def _non_empty(path: Path, docs: list[Document]) -> list[Document]:
    """The documents holding more than white space, with a warning naming those left out (each would have
    become a lone end-of-text token in the packed stream)."""
    empty = [d.id for d in docs if not d.text.strip()]
    if empty:
        shown = ", ".join(empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
        warnings.warn(
            f"text folder {str(path)!r}: skipped {len(empty)} empty (or white-space only) file(s): {shown}",
            stacklevel=3,
        )
    return [d for d in docs if d.text.strip()]


def _dangling(link: Path) -> str:
    """What a link that leads to no file is, for a warning: a loop (a -> b -> a) or a broken link."""
    try:
        link.resolve(strict=True)
    except RuntimeError:  # Python < 3.13: pathlib's own loop error
        return " (a link loop)"
    except OSError as e:
        return " (a link loop)" if e.errno == errno.ELOOP else " (a broken link)"
    return " (a broken link)"


def _folder_texts(path: Path) -> list[Path]:
    """A text folder's files with a text suffix, sorted; hidden files and folders are left out silently,
    other files (wrong suffix, broken links) and linked folders (not followed: a link may loop) with a
    warning naming them."""
    found = sorted(
        p for p in path.rglob("*") if not any(s.startswith(".") for s in p.relative_to(path).parts)
    )
    # rglob steps over a folder it may not list: the folder itself is an error, one inside it (lost+found at
    # a volume's root, say) is named, as skipped files are, so that its files do not leave the corpus unsaid
    if not os.access(path, os.R_OK | os.X_OK):
        raise PermissionError(f"text folder {str(path)!r}: cannot read it (give this user read access)")
    closed = [p for p in found if p.is_dir() and not p.is_symlink() and not os.access(p, os.R_OK | os.X_OK)]
    if closed:
        shown = ", ".join(str(p) for p in closed[:3]) + (
            f" and {len(closed) - 3} more" if len(closed) > 3 else ""
        )
        warnings.warn(
            f"text folder {str(path)!r}: cannot read the folder(s) {shown}; their files are left out of the "
            "corpus (give this user read access to take them)",
            stacklevel=3,
        )
    files = [p for p in found if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES]
    taken = set(files)
    skipped = [
        p.relative_to(path).as_posix()
        + (_dangling(p) if p.is_symlink() and not p.exists() else "")
        + (" (a linked folder, not followed)" if p.is_symlink() and p.is_dir() else "")
        for p in found
        if p not in taken and (not p.is_dir() or p.is_symlink())
    ]
    if skipped:
        shown = ", ".join(skipped[:3]) + (f" and {len(skipped) - 3} more" if len(skipped) > 3 else "")
        warnings.warn(
            f"text folder {str(path)!r}: skipped {len(skipped)} file(s) that are not text files "
            f"({', '.join(TEXT_SUFFIXES)}) or linked folders: {shown}",
            stacklevel=3,
        )
    return files


def load_pairs(path: str | Path, direction: str = "de-en") -> Corpus:
    """The user's translation pairs: one text file, a `source<TAB>target` pair per line (empty lines
    skipped; any other line without exactly one tab is an error naming it). Identical pairs are kept once;
    pairs with the same source stay in one split (5% val, 5% test by sha256 of the source); both compare
    the texts with each run of whitespace as one space. `direction`
    names the two languages (it picks sacrebleu's tokenizer for the target, e.g. "en-zh"). Read afresh on
    every call."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(
            f"pairs corpus {str(path)!r} is a folder: give one text file of source<TAB>target lines"
        )
    if not path.is_file():
        two = "," in str(path) and all(Path(part).expanduser().is_file() for part in str(path).split(","))
        raise FileNotFoundError(
            f"pairs corpus file {str(path)!r} does not exist"
            + ("; a pairs corpus is one file of source<TAB>target lines, not two files" if two else "")
        )
    if not isinstance(direction, str) or not re.fullmatch(r"[a-z]{2,3}-[a-z]{2,3}", direction):
        raise ValueError(
            f"data.direction for a pairs corpus names its two languages as lower-case ISO 639 codes, "
            f"source-target such as 'de-en' or 'en-zh' (the target's code picks sacrebleu's BLEU tokenizer), "
            f"got {direction!r}"
        )
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
        key = (_normalised(src), _normalised(tgt))  # a copy with a doubled space is the same pair
        if key not in seen:
            seen.add(key)
            pairs.append(Pair(f"{path.name}:{number}", src, tgt))
    if len(pairs) < 3:
        raise ValueError(f"pairs corpus {str(path)!r} holds {len(pairs)} distinct pair(s); need at least 3")
    n_val, n_test = fraction_counts(len(pairs), 0.05, 0.05, 1)
    rule = (
        f"identical pairs once (whitespace-normalised); by sha256(whitespace-normalised source): test={n_test}, "
        f"val={n_val}, train=the rest"
    )
    splits = split_by_hash(pairs, lambda p: _normalised(p.src), n_val, n_test)
    return Corpus(f"pairs:{path}", "translation", splits, rule, str(path), direction=direction)


def _normalised(text: str) -> str:
    """A text with each run of whitespace one space: the key that tells labelled texts apart."""
    return " ".join(text.split())


def load_labelled(path: str | Path) -> Corpus:
    """The user's labelled texts: a folder with one subfolder per label (its name is the label) holding
    text files (as `text:` folders: nested folders read, hidden files skipped, other files warned about).
    Texts identical up to whitespace (a doubled space, another line break) are kept once, the first in
    (label, file) order; each label is split on its own (10% val, 10% test by sha256 of the
    whitespace-normalised text, at least one each), so every label is in every split. A label folder
    without text files is skipped with a warning; one whose name is not UTF-8 or holds a control
    character (it would break `tformer classify`'s one line per text) is an error. Read afresh on every
    call."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise (ValueError if path.exists() else FileNotFoundError)(
            f"labelled corpus {str(path)!r} {'is not a folder' if path.exists() else 'does not exist'}: give "
            "a folder with one subfolder of text files per label"
        )
    folders = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    loose = [p.name for p in path.iterdir() if p.is_file() and not p.name.startswith(".")]
    if loose:
        warnings.warn(
            f"labelled corpus {str(path)!r}: {len(loose)} file(s) outside the label folders are not read "
            f"(e.g. {loose[0]!r})",
            stacklevel=3,
        )
    seen: dict[str, str] = {}  # whitespace-normalised text -> the document id that has it
    across: list[str] = []  # texts under two labels
    splits: dict[str, list[Document]] = {s: [] for s in SPLITS}
    labels, no_files = [], []
    for folder in folders:
        try:
            folder.name.encode("utf-8")
        except UnicodeEncodeError:  # bytes the file system holds that are not text: no label can be them
            raise ValueError(
                f"label folder {str(folder)!r} has a name that is not valid UTF-8 text; rename it (the "
                "folder's name is the label)"
            ) from None
        control = next((c for c in folder.name if unicodedata.category(c) in ("Cc", "Zl", "Zp")), None)
        if control is not None:  # a label is printed on one line (classify's output, eval's per-class rows)
            raise ValueError(
                f"label folder {str(folder)!r} has a name holding a control character ({control!r}); rename "
                "it (the folder's name is the label, printed on one line)"
            )
        docs, files = [], _folder_texts(folder)
        for p in files:
            text, doc_id = (
                read_text(p, warn=True).strip(),
                f"{folder.name}/{p.relative_to(folder).as_posix()}",
            )
            key = _normalised(text)  # whitespace variants of a text are one text: never in two splits
            if key and key in seen and seen[key].split("/", 1)[0] != folder.name:
                across.append(f"{doc_id} (as {seen[key]})")
            elif key and key not in seen:
                seen[key] = doc_id
                docs.append(Document(doc_id, text, folder.name))
        if not files:  # a folder without text files is no label
            no_files.append(folder.name)
            continue
        if len(docs) < 3:  # (empty ones, and texts already under an earlier label, are not counted)
            raise ValueError(
                f"label {folder.name!r} ({folder}) has {len(docs)} distinct non-empty text file(s) of its "
                f"{len(files)}; each label needs at least 3 to be in the train, val and test splits"
            )
        n_val, n_test = fraction_counts(len(docs), 0.1, 0.1, 1)
        for s, items in split_by_hash(docs, lambda d: _normalised(d.text), n_val, n_test).items():
            splits[s].extend(items)
        labels.append(folder.name)
    if no_files:
        warnings.warn(
            f"labelled corpus {str(path)!r}: skipped {len(no_files)} label folder(s) without text files "
            f"({', '.join(TEXT_SUFFIXES)}), so not labels: {', '.join(map(repr, no_files[:3]))}"
            f"{f' and {len(no_files) - 3} more' if len(no_files) > 3 else ''}",
            stacklevel=3,
        )
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
    rule = (
        "texts identical up to whitespace once; per label, by sha256(whitespace-normalised text): "
        "test=10%, val=10% (at least 1), train=the rest"
    )
    return Corpus(
        f"labels:{path}", "classification", {s: tuple(v) for s, v in splits.items()}, rule, str(path),
        tuple(labels),
    )  # fmt: skip
