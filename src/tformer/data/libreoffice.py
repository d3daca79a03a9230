"""LibreOffice's help pages and UI strings as English-German / -French / -Chinese translation pairs.

The Debian packages `libreoffice-help-<lang>` and `libreoffice-l10n-<lang>` install the same help
pages in every language and the translated UI catalogs; no office binary is needed. Two sources:

- help: `/usr/share/libreoffice/help/<lang>/text/**/*.html`. Every `<p>` and `<h1>`..`<h6>` carries an
  `id` that is the same in every language, so a segment is keyed by (page, id, occurrence) and paired
  with the segment of the same key in the other language. Inline markup is dropped, entities decoded,
  whitespace collapsed.
- ui: `/usr/lib/libreoffice/program/resource/<lang>/LC_MESSAGES/*.mo`, read with the standard
  library's `gettext`; the English source is the message id after its `context\\x04` prefix.
  Accelerator marks (`~`, `_`) are removed and `%PRODUCTNAME` reads "LibreOffice"; strings that still
  hold a placeholder (`%1`, `$(ARG1)`, `{0}`, `#1`, `<tag>`, ...) are dropped rather than cut up.

Kept: both sides non-empty, English with at least one letter, the translation not identical to the
English (untranslated). Exact duplicate pairs keep their first occurrence (help first, then ui).
The split groups pairs by their English text up to case and punctuation ("Seed:" and "Seed" stay
together), ordered by sha256, so one English segment never sits on both sides of a split.

    corpus = load_corpus("libreoffice", direction="en-fr")   # or de-en, en-de, fr-en, en-zh, zh-en
"""

from __future__ import annotations

import functools
import gettext
import html
import re
from pathlib import Path

from tformer.data.corpora import Corpus, MissingDataError, Pair, split_by_hash

HELP_ROOT = Path("/usr/share/libreoffice/help")
UI_ROOT = Path("/usr/lib/libreoffice/program/resource")
ENGLISH_HELP = "en-US"
# language code in a direction: (help folder, UI folder, Debian package suffix)
LANGUAGES = {"de": ("de", "de", "de"), "fr": ("fr", "fr", "fr"), "zh": ("zh-CN", "zh_CN", "zh-cn")}
DIRECTIONS = tuple(d for lang in LANGUAGES for d in (f"en-{lang}", f"{lang}-en"))
PARTS = ("all", "help", "ui")

_SEGMENT = re.compile(r'<(p|h[1-6])\b[^>]*?\bid="([^"]+)"[^>]*>(.*?)</\1\s*>', re.S)
_TAG = re.compile(r"<[^>]+>")
_PLACEHOLDER = re.compile(r"%[A-Za-z0-9_]+|\$\([^)]*\)|\{[^}]*\}|\$[A-Z][A-Z0-9_]+\$?|#\d|<[^>]+>")
_WORDS = re.compile(r"\w+")


def install_command(lang: str) -> str:
    """The apt command that installs English and `lang` (a key of LANGUAGES): help pages and UI catalogs."""
    suffix = LANGUAGES[lang][2]
    packages = f"libreoffice-help-en-us libreoffice-help-{suffix} libreoffice-l10n-{suffix}"
    return f"apt-get update && apt-get install -y --no-install-recommends {packages}"


def _require_dir(path: Path, what: str, lang: str) -> Path:
    if not path.is_dir():
        raise MissingDataError(what, path, install_command(lang))
    return path


def help_segments(page: Path) -> dict[tuple[str, int], str]:
    """(id, occurrence) -> plain text of every <p>/<h1-6> with an id on one help page."""
    out: dict[tuple[str, int], str] = {}
    seen: dict[str, int] = {}
    for m in _SEGMENT.finditer(page.read_text(encoding="utf-8")):
        seg_id = m.group(2)
        n = seen[seg_id] = seen.get(seg_id, -1) + 1
        out[(seg_id, n)] = " ".join(html.unescape(_TAG.sub("", m.group(3))).split())
    return out


def _ui_text(text: str) -> str:
    text = text.replace("%PRODUCTNAME", "LibreOffice").replace("~", "").replace("_", "")
    return " ".join(text.split())


def _keep(en: str, xx: str) -> bool:
    return bool(en and xx and en != xx and any(c.isalpha() for c in en))


@functools.lru_cache(maxsize=3)
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
            if _keep(en, xx):
                pairs.append((f"help/{rel.as_posix()}#{key[0]}.{key[1]}", en, xx))
    return tuple(pairs)


@functools.lru_cache(maxsize=3)
def parse_ui(lang: str, root: Path = UI_ROOT) -> tuple[tuple[str, str, str], ...]:
    """(id, English, translation) of every translated UI string without placeholders."""
    folder = _require_dir(root / LANGUAGES[lang][1] / "LC_MESSAGES", f"LibreOffice {lang} UI catalogs", lang)
    pairs = []
    for catalog in sorted(folder.glob("*.mo")):
        with catalog.open("rb") as f:
            messages = gettext.GNUTranslations(f)._catalog  # msgid -> msgstr; tuple keys are plurals
        seen: dict[str, int] = {}
        for key in sorted(k for k in messages if isinstance(k, str) and k):  # not plurals, not the header
            context, _, source = key.rpartition("\x04")
            n = seen[context] = seen.get(context, -1) + 1  # a context can hold several strings
            en, xx = _ui_text(source), _ui_text(messages[key])
            if _keep(en, xx) and not _PLACEHOLDER.search(en) and not _PLACEHOLDER.search(xx):
                pairs.append((f"ui/{catalog.stem}/{context}.{n}", en, xx))
    return tuple(pairs)


def _group(english: str) -> str:
    return " ".join(_WORDS.findall(english.casefold())) or english


@functools.lru_cache(maxsize=8)
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
        raw += parse_help(lang, Path(help_root))
    if parts in ("all", "ui"):
        raw += parse_ui(lang, Path(ui_root))
    seen, unique = set(), []
    for item in raw:
        if item[1:] not in seen:
            seen.add(item[1:])
            unique.append(item)
    splits = split_by_hash(unique, lambda p: _group(p[1]), n_val, n_test)
    rule = (
        f"{parts} segments, duplicates dropped; grouped by English text up to case and punctuation, "
        f"ordered by sha256: test={n_test}, val={n_val}, train=the rest"
    )
    src, tgt = (1, 2) if direction.startswith("en-") else (2, 1)
    pairs = {s: tuple(Pair(p[0], p[src], p[tgt]) for p in items) for s, items in splits.items()}
    source = f"{Path(help_root)} + {Path(ui_root)}"
    return Corpus("libreoffice", "translation", pairs, rule, source, direction=direction)
