"""A user's own data, details the main tests leave open: the folder's own too-few error, upper-case
suffixes, blank and whitespace-differing labelled texts, pairs that share a source."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from tformer.data import SPLITS, load_corpus
from tformer.data import corpora as C


def test_a_text_folder_of_two_files_names_the_folder(tmp_path):
    for i in range(2):
        (tmp_path / f"{i}.txt").write_text(f"text {i}\n")
    with pytest.raises(
        ValueError, match=r"text folder .* has 2 non-empty text file\(s\) \(.txt, .md.*need at least 3"
    ):
        C.load_text(tmp_path)
    (tmp_path / "1.txt").unlink()  # one short file: no piece of advice that would fail too
    with pytest.raises(ValueError, match=r"need at least 3 to split into train / val / test$"):
        C.load_text(tmp_path)
    # one file long enough to cut into pieces: the error says that the file itself can be the corpus
    (tmp_path / "0.txt").write_text("a line of some twenty chars\n" * 300)
    with pytest.raises(
        ValueError, match=f"need at least 3 .* \\(or give the file itself, text:{tmp_path / '0.txt'}, "
    ):
        C.load_text(tmp_path)
    C.load_text(tmp_path / "0.txt")  # as the advice says


def test_text_suffixes_are_matched_in_any_case(tmp_path):
    """NOTES.TXT and Readme.Md are text files: read, not skipped with a warning."""
    for name in ("NOTES.TXT", "Readme.Md", "plain.txt"):
        (tmp_path / name).write_text(f"the text of {name}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        corpus = C.load_text(tmp_path)
    assert sorted(d.id for s in SPLITS for d in corpus[s]) == ["NOTES.TXT", "Readme.Md", "plain.txt"]


def test_labelled_texts_are_compared_without_surrounding_blanks(tmp_path):
    """A copy that differs only by a trailing newline is the same text (read once); a file of blank lines
    is empty (not a document)."""
    for label in ("pos", "neg"):
        (tmp_path / label).mkdir()
        for i in range(4):
            (tmp_path / label / f"{i}.txt").write_text(f"{label} text number {i}")
        (tmp_path / label / "copy.txt").write_text(f"{label} text number 0\n")
        (tmp_path / label / "blank.txt").write_text("\n  \n")
    corpus = load_corpus(f"labels:{tmp_path}")
    docs = [d for s in SPLITS for d in corpus[s]]
    assert sorted(d.id for d in docs) == sorted(
        f"{label}/{i}.txt" for label in ("neg", "pos") for i in range(4)
    )
    assert all(d.text == d.text.strip() for d in docs)


def test_pairs_sharing_a_source_are_all_kept_in_one_split(tmp_path):
    """Identical pairs are read once, but two translations of one source are two pairs (in one split)."""
    lines = [f"quelle {i}\tsource {i}" for i in range(40)] + [
        f"quelle {i}\tanother source {i}" for i in range(40)
    ]
    (tmp_path / "p.tsv").write_text("\n".join(lines) + "\n")
    corpus = load_corpus(f"pairs:{tmp_path / 'p.tsv'}")
    split_of = {(p.src, p.tgt): s for s in SPLITS for p in corpus[s]}
    assert sorted(split_of) == sorted(tuple(x.split("\t")) for x in lines)
    assert all(split_of[(f"quelle {i}", f"source {i}")] == split_of[(f"quelle {i}", f"another source {i}")]
               for i in range(40))  # fmt: skip


def test_each_label_holds_out_ten_percent_for_val_and_for_test(tmp_path):
    """Each label is split on its own: 30 texts give 3 val, 3 test; 20 give 2 and 2."""
    for label, n in (("a", 30), ("b", 20)):
        (tmp_path / label).mkdir()
        for i in range(n):
            (tmp_path / label / f"{i}.txt").write_text(f"label {label} text {i}")
    corpus = load_corpus(f"labels:{tmp_path}")
    counts = {(s, label): sum(d.label == label for d in corpus[s]) for s in SPLITS for label in "ab"}
    assert counts == {("train", "a"): 24, ("val", "a"): 3, ("test", "a"): 3,
                      ("train", "b"): 16, ("val", "b"): 2, ("test", "b"): 2}  # fmt: skip


def _label(root, name: str | bytes, texts: list[str]) -> None:
    folder = os.path.join(os.fsencode(root), name if isinstance(name, bytes) else name.encode())
    os.mkdir(folder)
    for i, text in enumerate(texts):
        with open(os.path.join(folder, f"{i}.txt".encode()), "w") as f:
            f.write(text)


def test_label_folders_that_cannot_be_labels_are_named(tmp_path):
    """A folder name that is not UTF-8 text had crashed every evaluation (in the confusion plot); a folder
    of empty files had vanished without a word; a folder that does not exist is said to be missing."""
    _label(tmp_path, "pos", [f"good text {i}" for i in range(3)])
    _label(tmp_path, b"n\xffg", [f"bad text {i}" for i in range(3)])
    with pytest.raises(ValueError, match="has a name that is not valid UTF-8 text; rename it"):
        C.load_labelled(tmp_path)
    os.rename(os.path.join(os.fsencode(tmp_path), b"n\xffg"), tmp_path / "neg")
    _label(tmp_path, "blank", ["  \n"] * 3)
    with pytest.raises(
        ValueError, match=r"label 'blank' .* has 0 distinct non-empty text file\(s\) of its 3"
    ):
        C.load_labelled(tmp_path)
    with pytest.raises(FileNotFoundError, match="labelled corpus .*nowhere' does not exist"):
        C.load_labelled(tmp_path / "nowhere")


def test_a_pairs_split_error_speaks_of_sources(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("".join(f"Hallo\thello {i}\n" for i in range(4)))  # one source: one split
    with pytest.raises(
        ValueError, match="pairs with the same source stay in one split: 1 distinct sources of 4"
    ):
        load_corpus(f"pairs:{path}")


def test_pairs_differing_only_in_whitespace_are_one_pair_in_one_split(tmp_path):
    """A copy of a pair with a doubled space had been a second pair, often in another split (a source
    seen in training scored again in test)."""
    lines = [f"quelle nummer {i}\tsource {i}" for i in range(200)]
    lines += [f"quelle  nummer {i}\tsource {i}" for i in range(200)]  # the same pairs, one space doubled
    lines += [f"quelle nummer {i} \tanother  source {i}" for i in range(0, 200, 7)]  # another target
    (tmp_path / "p.tsv").write_text("\n".join(lines) + "\n")
    corpus = load_corpus(f"pairs:{tmp_path / 'p.tsv'}")
    assert sum(len(corpus[s]) for s in SPLITS) == 200 + len(range(0, 200, 7))
    split_of = {}
    for s in SPLITS:
        for p in corpus[s]:
            assert split_of.setdefault(" ".join(p.src.split()), s) == s  # one source, one split


@pytest.mark.parametrize("direction", ["de-EN", "en-zh-CN", "en_zh", "german-english", "de"])
def test_a_pairs_direction_must_be_two_language_codes(tmp_path, direction):
    (tmp_path / "p.tsv").write_text("".join(f"quelle {i}\tsource {i}\n" for i in range(20)))
    with pytest.raises(ValueError, match=rf"data.direction .* lower-case ISO 639 codes.*got '{direction}'"):
        load_corpus(f"pairs:{tmp_path / 'p.tsv'}", direction=direction)


def test_cjk_references_scored_with_13a_are_warned_about():
    from tformer.eval.bleu import score_translations

    refs = ["我们今天去公园散步。", "他喜欢读书。", "这是一个很好的例子。"]
    with pytest.warns(UserWarning, match=r"most references are Chinese or Japanese text.*'<source>-zh'"):
        score_translations(refs, refs, "13a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert score_translations(refs, refs, "zh").bleu == pytest.approx(100)
        score_translations(["the cat sat"], ["the cat sat"], "13a")


def test_a_folder_the_user_cannot_read_is_named_not_left_out(tmp_path, monkeypatch):
    """pathlib's rglob steps over a folder it may not list (mode 000 for a user other than root), so its
    files had vanished from the corpus without a word: text and labelled folders name it in a warning
    (lost+found at a volume's root is such a folder), and a corpus folder that cannot be read is an
    error. As root every folder reads, so the check is shown the folders as such a user sees them."""
    import re

    from tformer.data import user_corpora

    for i in range(4):
        (tmp_path / "text" / "sub").mkdir(parents=True, exist_ok=True)
        (tmp_path / "text" / f"{i}.txt").write_text(f"text {i}\n")
        (tmp_path / "labels" / "sport" / "sub").mkdir(parents=True, exist_ok=True)
        (tmp_path / "labels" / "sport" / f"{i}.txt").write_text(f"sport {i}\n")
        (tmp_path / "labels" / "news").mkdir(parents=True, exist_ok=True)
        (tmp_path / "labels" / "news" / f"{i}.txt").write_text(f"news {i}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        C.load_text(tmp_path / "text")  # readable: loads, nothing said
    closed = {tmp_path / "text" / "sub", tmp_path / "labels" / "sport" / "sub"}
    real = os.access
    monkeypatch.setattr(user_corpora.os, "access", lambda p, mode: Path(p) not in closed and real(p, mode))
    for load, folder in ((C.load_text, tmp_path / "text"), (C.load_labelled, tmp_path / "labels")):
        sub = next(p for p in closed if folder in p.parents)
        with pytest.warns(
            UserWarning, match=re.escape(f"cannot read the folder(s) {sub}; their files are left")
        ):
            load(folder)
    closed.add(tmp_path / "text")
    with pytest.raises(
        PermissionError, match=re.escape(f"text folder {str(tmp_path / 'text')!r}: cannot read it")
    ):
        C.load_text(tmp_path / "text")


def test_two_files_given_as_a_pairs_corpus_are_told_it_takes_one(tmp_path):
    (tmp_path / "src.txt").write_text("hallo\n")
    (tmp_path / "tgt.txt").write_text("hello\n")
    with pytest.raises(
        FileNotFoundError, match="a pairs corpus is one file of source<TAB>target lines, not two"
    ):
        C.load_pairs(f"{tmp_path / 'src.txt'},{tmp_path / 'tgt.txt'}")
    with pytest.raises(FileNotFoundError, match=r"does not exist$"):
        C.load_pairs(tmp_path / "none.txt")
