"""LibreOffice's help pages and UI strings as English-German / -French / -Chinese translation pairs.

The Debian packages `libreoffice-help-<lang>` and `libreoffice-l10n-<lang>` install the same help
pages in every language and the translated UI catalogs; no office binary is needed. Two sources:

- help: `/usr/share/libreoffice/help/<lang>/text/**/*.html`. Every `<p>` and `<h1>`..`<h6>` carries an
  `id` that is the same in every language, so a segment is keyed by (page, id, occurrence) and paired
  with the segment of the same key in the other language. Inline markup is dropped (`<br>` becomes a
  space; of a platform or module switch only the default wording stays), entities decoded,
  whitespace collapsed.
- ui: `/usr/lib/libreoffice/program/resource/<lang>/LC_MESSAGES/*.mo`, read with the standard
  library's `gettext`; the English source is the message id after its `context\\x04` prefix.
  Accelerator marks are removed (`(_A)` after a CJK label, else the first `~` or `_` before a letter
  or digit) and `%PRODUCTNAME` reads "LibreOffice"; strings that still hold a placeholder (`%1`, `$1`,
  `$name$`, `$(ARG1)`, `{0}`, `#1`, `<tag>`, ...) are dropped rather than cut up.

Kept: both sides non-empty, English with at least one letter, the translation not the English left
untranslated (compared without whitespace), a Chinese side with Chinese characters. Exact duplicate
pairs keep their first occurrence (help first, then ui). The split keeps together pairs that share
their English or their translation up to case and punctuation ("Seed:" and "Seed"), directly or
through other pairs, and orders those groups by sha256: no source or reference of one split appears
in another, in either direction.

    corpus = load_corpus("libreoffice", direction="en-fr")   # or de-en, en-de, fr-en, en-zh, zh-en
"""

from __future__ import annotations

import gettext
import hashlib
import html
import re
from pathlib import Path

from tformer.data.corpus_base import (
    Corpus,
    MissingDataError,
    Pair,
    cached_by_files,
    linked_groups,
    normalized,
    split_by_hash,
)

HELP_ROOT = Path("/usr/share/libreoffice/help")
UI_ROOT = Path("/usr/lib/libreoffice/program/resource")
ENGLISH_HELP = "en-US"
# language code in a direction: (help folder, UI folder, Debian package suffix)
LANGUAGES = {"de": ("de", "de", "de"), "fr": ("fr", "fr", "fr"), "zh": ("zh-CN", "zh_CN", "zh-cn")}
DIRECTIONS = tuple(d for lang in LANGUAGES for d in (f"en-{lang}", f"{lang}-en"))
PARTS = ("all", "help", "ui")

_SEGMENT = re.compile(r'<(p|h[1-6])\b[^>]*?\bid="([^"]+)"[^>]*>(.*?)</\1\s*>', re.S)
_TAG = re.compile(r"<[^>]*>")
_BREAK = re.compile(r"<br\b[^>]*>", re.I)
_TOKEN = re.compile(r"<(/?)([A-Za-z][A-Za-z0-9]*)([^>]*)>|<[^>]*>|([^<]+)")
_PLACEHOLDER = re.compile(
    r"%[A-Za-z0-9_]+|\$\([^)]*\)|\{[^}]*\}|\$[A-Z][A-Z0-9_]+\$?|\$\d+\$?|\$[A-Za-z_]+\$|#\d|<[^>]+>"
)
_ACCELERATOR = re.compile(r"\s*\([_~][A-Za-z0-9]\)")  # "添加(_A)": a mnemonic in brackets (CJK UIs)
_MNEMONIC = re.compile(r"[~_](?=[^\W_])")  # "_Open", "Sa~ve": the mark before the mnemonic letter
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")


def install_command(lang: str) -> str:
    """The apt command that installs English and `lang` (a key of LANGUAGES): help pages and UI catalogs."""
    suffix = LANGUAGES[lang][2]
    packages = f"libreoffice-help-en-us libreoffice-help-{suffix} libreoffice-l10n-{suffix}"
    return f"apt-get update && apt-get install -y --no-install-recommends {packages}"


def _require_dir(path: Path, what: str, lang: str) -> Path:
    if not path.is_dir():
        raise MissingDataError(what, path, install_command(lang))
    return path


def segment_text(fragment: str) -> str:
    """Plain text of a help segment's inner HTML: tags dropped, `<br>` a space, entities decoded,
    whitespace collapsed. Of a platform or module switch only the default wording is kept: its
    alternatives (`<span hidden="true" class="MAC">`, `class="CALC"`, ...) are dropped with their
    content, the default (`<span hidden="true">` without a class) stays."""
    if "hidden" not in fragment:  # no switch: the quick way
        return " ".join(html.unescape(_TAG.sub("", _BREAK.sub(" ", fragment))).split())
    parts: list[str] = []
    skip = 0  # depth of <span> nesting inside a dropped alternative
    for m in _TOKEN.finditer(fragment):
        closing, tag, attrs, text = m.groups()
        if text is not None:
            if not skip:
                parts.append(text)
        elif tag is None:  # a comment or declaration
            continue
        elif skip:
            if tag.lower() == "span" and not attrs.rstrip().endswith("/"):
                skip += -1 if closing else 1
        elif tag.lower() == "span" and not closing and "hidden" in attrs and "class=" in attrs:
            skip = 1
        elif tag.lower() == "br":
            parts.append(" ")
    return " ".join(html.unescape("".join(parts)).split())


def help_segments(page: Path) -> dict[tuple[str, int], str]:
    """(id, occurrence) -> plain text of every <p>/<h1-6> with an id on one help page."""
    out: dict[tuple[str, int], str] = {}
    seen: dict[str, int] = {}
    for m in _SEGMENT.finditer(page.read_text(encoding="utf-8")):
        seg_id = m.group(2)
        n = seen[seg_id] = seen.get(seg_id, -1) + 1
        out[(seg_id, n)] = segment_text(m.group(3))
    return out


def ui_text(text: str) -> str:
    """A UI string as text: the accelerator mark removed ("(_A)" in CJK catalogs, else the first `~` or
    `_` before a letter or digit), `%PRODUCTNAME` as "LibreOffice", whitespace collapsed."""
    text = _ACCELERATOR.sub("", text)
    text = _MNEMONIC.sub("", text, count=1).replace("%PRODUCTNAME", "LibreOffice")
    return " ".join(text.split())


def _keep(en: str, xx: str, lang: str) -> bool:
    """Both sides present, the English has a letter, the translation is not the English left
    untranslated (compared without whitespace), and a Chinese side holds Chinese characters."""
    if not en or not xx or not any(c.isalpha() for c in en):
        return False
    if "".join(en.split()) == "".join(xx.split()):
        return False
    return lang != "zh" or bool(_CJK.search(xx))


@cached_by_files(maxsize=3)
def parse_help(lang: str, root: Path = HELP_ROOT) -> tuple[tuple[str, str, str], ...]:
    """(id, English, translation) of every help segment present in both languages."""
    english = _require_dir(root / ENGLISH_HELP / "text", "LibreOffice English help", lang)
    other = _require_dir(root / LANGUAGES[lang][0] / "text", f"LibreOffice {lang} help", lang)
    pairs = []
    for page in sorted(english.rglob("*.html")):
        rel = page.relative_to(english)
        if not (other / rel).is_file():
            continue
        translated = help_segments(other / rel)
        for key, en in help_segments(page).items():
            xx = translated.get(key, "")
            if _keep(en, xx, lang):
                pairs.append((f"help/{rel.as_posix()}#{key[0]}.{key[1]}", en, xx))
    return tuple(pairs)


@cached_by_files(maxsize=3)
def parse_ui(lang: str, root: Path = UI_ROOT) -> tuple[tuple[str, str, str], ...]:
    """(id, English, translation) of every translated UI string without placeholders."""
    folder = _require_dir(root / LANGUAGES[lang][1] / "LC_MESSAGES", f"LibreOffice {lang} UI catalogs", lang)
    pairs = []
    for catalog in sorted(folder.glob("*.mo")):
        with catalog.open("rb") as f:
            messages = gettext.GNUTranslations(f)._catalog  # msgid -> msgstr; tuple keys are plurals
        for key in sorted(k for k in messages if isinstance(k, str) and k):  # not plurals, not the header
            context, _, source = key.rpartition("\x04")
            en, xx = ui_text(source), ui_text(messages[key])
            if _keep(en, xx, lang) and not _PLACEHOLDER.search(en) and not _PLACEHOLDER.search(xx):
                digest = hashlib.sha256(source.encode()).hexdigest()[:8]  # a context can hold several strings
                pairs.append((f"ui/{catalog.stem}/{context}#{digest}", en, xx))
    return tuple(pairs)


def groups(pairs: list[tuple[str, str, str]]) -> list[str]:
    """A group key per (id, English, translation): pairs that share their English or their translation
    (up to case and punctuation), directly or through other pairs, get the same key, so no source or
    reference of one split appears in another, whichever the direction."""
    return linked_groups([("en:" + normalized(en), "xx:" + normalized(xx)) for _, en, xx in pairs])


def load_libreoffice(
    direction: str = "en-de",
    parts: str = "all",
    n_val: int = 1000,
    n_test: int = 2000,
    help_root: str | Path = HELP_ROOT,
    ui_root: str | Path = UI_ROOT,
) -> Corpus:
    """LibreOffice help and UI segments in `direction` (English to or from de / fr / zh); `parts`:
    "all", "help" or "ui". The split is the same for both directions of a language."""
    return _load(direction, parts, n_val, n_test, Path(help_root), Path(ui_root))


@cached_by_files(maxsize=8)
def _load(direction: str, parts: str, n_val: int, n_test: int, help_root: Path, ui_root: Path) -> Corpus:
    if direction not in DIRECTIONS:
        raise ValueError(
            f"unknown language pair {direction!r} for corpus 'libreoffice'; available: {', '.join(DIRECTIONS)}"
        )
    if parts not in PARTS:
        raise ValueError(f"parts must be one of {', '.join(PARTS)}, got {parts!r}")
    first, second = direction.split("-")
    lang = second if first == "en" else first
    raw: list[tuple[str, str, str]] = []
    if parts in ("all", "help"):
        raw += parse_help(lang, help_root)
    if parts in ("all", "ui"):
        raw += parse_ui(lang, ui_root)
    seen, unique = set(), []
    for item in raw:
        if item[1:] not in seen:
            seen.add(item[1:])
            unique.append(item)
    group_of = dict(zip((p[0] for p in unique), groups(unique)))
    splits = split_by_hash(unique, lambda p: group_of[p[0]], n_val, n_test)
    rule = (
        f"{parts} segments, duplicates dropped; pairs sharing their English or their translation (up to case "
        f"and punctuation) grouped, groups ordered by sha256: test={n_test}, val={n_val}, train=the rest"
    )
    src, tgt = (1, 2) if direction.startswith("en-") else (2, 1)
    pairs = {s: tuple(Pair(p[0], p[src], p[tgt]) for p in items) for s, items in splits.items()}
    source = f"{help_root} + {ui_root}"
    return Corpus("libreoffice", "translation", pairs, rule, source, direction=direction)
