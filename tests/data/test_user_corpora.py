"""A user's own data: text files and folders (split by file or by chunks of one file), tab-separated pairs,
labelled folders; text that is not UTF-8, binary files, links and file names that are not UTF-8."""

from __future__ import annotations

import pytest

from tformer.data import SPLITS, corpus_task, load_corpus
from tformer.data import corpora as C

from .helpers import assert_disjoint


def test_text_folder_splits_by_file(tmp_path):
    for i in range(30):
        (tmp_path / "sub").mkdir(exist_ok=True)
        (tmp_path / "sub" / f"f{i:02d}.txt").write_text(f"text number {i}\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("hidden")
    with pytest.warns(UserWarning, match=r"skipped 1 file\(s\) that are not text files .*: image.png$"):
        corpus = load_corpus(f"text:{tmp_path}")
    assert sum(len(corpus[s]) for s in SPLITS) == 30
    assert len(corpus["val"]) == 2 and len(corpus["test"]) == 2
    assert_disjoint(corpus)
    (tmp_path / "image.png").unlink()
    (tmp_path / "sub" / "f30.txt").write_text("text number 30\n")
    assert sum(len(load_corpus(f"text:{tmp_path}")[s]) for s in SPLITS) == 31  # read afresh: no stale cache


def test_text_folder_names_a_linked_folder_it_does_not_follow(tmp_path):
    """A link to a folder is not followed (it may loop); it had been left out without a word."""
    (tmp_path / "real").mkdir()
    for i in range(5):
        (tmp_path / "real" / f"r{i}.txt").write_text(f"linked text {i}\n")
    (tmp_path / "outer").mkdir()
    for i in range(3):
        (tmp_path / "outer" / f"o{i}.txt").write_text(f"outer text {i}\n")
    (tmp_path / "outer" / "linked").symlink_to(tmp_path / "real", target_is_directory=True)
    with pytest.warns(
        UserWarning, match=r"skipped 1 file\(s\) .*: linked \(a linked folder, not followed\)$"
    ):
        corpus = load_corpus(f"text:{tmp_path / 'outer'}")
    assert sum(len(corpus[s]) for s in SPLITS) == 3


def test_text_single_file_splits_by_chunks(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes("".join(f"line {i} caf\xe9\r\n" for i in range(2000)).encode("cp1252"))
    corpus = C.load_text(path)
    assert len(corpus["test"]) >= 1 and len(corpus["val"]) >= 1
    assert_disjoint(corpus)
    text = "".join(
        d.text for d in sorted((d for s in SPLITS for d in corpus[s]), key=lambda d: int(d.id[9:]))
    )
    assert text == "".join(f"line {i} café\n" for i in range(2000))  # decoded and rejoined exactly
    # chunks of at least len / 50 characters (here 28,890 / 50 = 577), each but the last, cut at line ends
    pieces = sorted((d for s in SPLITS for d in corpus[s]), key=lambda d: int(d.id[9:]))
    assert all(len(d.text) >= len(text) // 50 and d.text.endswith("\n") for d in pieces[:-1])
    assert 40 <= len(pieces) <= 50 and corpus.split_rule.startswith(f"chunks of >= {len(text) // 50} chars")
    for lines, size in ((400, 256), (60000, 4096)):  # the chunk size is kept within [256, 4096]
        (tmp_path / f"{lines}.txt").write_text("".join(f"line number {i:07d}\n" for i in range(lines)))
        rule = C.load_text(tmp_path / f"{lines}.txt").split_rule
        assert rule.startswith(f"chunks of >= {size} chars"), rule
    # a language model reads chunks that stay adjacent in a split as one document (one EOS after the
    # run, not one per chunk: one file is not ~50 documents)
    for split in SPLITS:
        runs, chunks = corpus.lm_texts(split), corpus[split]
        assert "".join(runs) == "".join(d.text for d in chunks) and all(r in text for r in runs)
        breaks = sum(int(b.id[9:]) != int(a.id[9:]) + 1 for a, b in zip(chunks, chunks[1:]))
        assert len(runs) == breaks + 1
    assert len(corpus.lm_texts("train")) < len(corpus["train"])
    first = corpus["train"][:3]
    assert [int(d.id[9:]) for d in first] == [0, 1, 2] and len(corpus.lm_texts("train", limit=3)) == 1
    for i in range(3):  # a folder's files stay documents of their own
        (tmp_path / "folder").mkdir(exist_ok=True)
        (tmp_path / "folder" / f"{i}.txt").write_text(f"file {i}\n")
    folder = C.load_text(tmp_path / "folder")
    assert [len(folder.lm_texts(s)) for s in SPLITS] == [len(folder[s]) for s in SPLITS] == [1, 1, 1]


def test_text_too_small_or_missing(tmp_path):
    (tmp_path / "tiny.txt").write_text("one line\n")
    with pytest.raises(ValueError, match="at least 3"):
        C.load_text(tmp_path / "tiny.txt")
    with pytest.raises(FileNotFoundError):
        load_corpus(f"text:{tmp_path / 'nowhere'}")


def test_text_folder_names_what_it_skips_and_a_split_left_empty(tmp_path):
    """Files it skips had gone unmentioned; identical files, which stay together in one split, could leave
    val or test empty, and the error came later without naming the split."""
    for i in range(6):
        (tmp_path / f"copy{i}.txt").write_text("the same text\n" if i else "other text\n")
    (tmp_path / "notes.py").write_text("x = 1\n")
    (tmp_path / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    (tmp_path / "loop.txt").symlink_to(tmp_path / "loop.txt")  # had read "a broken link" too
    with (
        pytest.warns(
            UserWarning,
            match=r"skipped 3 file\(s\) .*: gone.txt \(a broken link\), loop.txt \(a link loop\), notes.py",
        ),
        pytest.raises(
            ValueError,
            match=r"leaves its train split\(s\) empty \(train 0, val 5, test 1; .*2 distinct of 6",
        ),
    ):
        load_corpus(f"text:{tmp_path}")


def test_text_folder_skips_empty_files_by_name(tmp_path):
    """An empty or white-space-only file had become a document of its own: a lone end-of-text token in the
    packed stream, and a file counted towards the three a split needs."""
    for i in range(4):
        (tmp_path / f"t{i}.txt").write_text(f"text number {i}\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.md").write_text("  \n\n\t\n")
    with pytest.warns(
        UserWarning, match=r"skipped 2 empty \(or white-space only\) file\(s\): blank.md, empty.txt$"
    ):
        corpus = load_corpus(f"text:{tmp_path}")
    assert sorted(d.id for s in SPLITS for d in corpus[s]) == [f"t{i}.txt" for i in range(4)]
    (tmp_path / "t0.txt").write_text("\n")
    (tmp_path / "t1.txt").write_text("")
    with (
        pytest.warns(UserWarning, match="skipped 4 empty"),
        pytest.raises(ValueError, match="has 2 non-empty"),
    ):
        load_corpus(f"text:{tmp_path}")


def test_a_text_file_too_short_to_cut_says_why(tmp_path):
    (tmp_path / "one.txt").write_text("word " * 100_000)  # one long line: one piece at line ends
    with pytest.raises(
        ValueError, match=r"500,000 chars on 1 line\(s\)\) cuts into 1 piece.*more line breaks"
    ):
        load_corpus(f"text:{tmp_path / 'one.txt'}")


def test_read_text_handles_bad_utf8(tmp_path):
    path = tmp_path / "x.txt"
    path.write_bytes(b"a \xa315.8m fee\r\n")
    assert C.read_text(path) == "a \u00a315.8m fee\n"
    with pytest.warns(UserWarning, match=r"x.txt is not UTF-8 \(byte 0xa3 at offset 2\); read as cp1252"):
        assert C.read_text(path, warn=True) == "a \u00a315.8m fee\n"  # a user's file: said
    # with a UTF-8 byte-order mark in front: the mark is dropped and the offset counts it (the mark had
    # been decoded as three cp1252 letters, and the offset pointed 3 bytes early)
    path.write_bytes(b"\xef\xbb\xbfcaf\xc3\xa9 \xe9 end")
    with pytest.warns(UserWarning, match=r"x.txt is not UTF-8 \(byte 0xe9 at offset 9\); read as cp1252"):
        assert C.read_text(path, warn=True) == "caf\u00c3\u00a9 \u00e9 end"
    # mostly UTF-8 with a stray byte: its characters kept, the byte U+FFFD (cp1252 had garbled them all)
    path.write_bytes("caf\u00e9 na\u00efve \u00fcber ".encode() + b"\xe9 end")
    with pytest.warns(
        UserWarning, match=r"x.txt is UTF-8 but for 1 invalid byte\(s\) \(the first 0xe9 at offset 19\)"
    ):
        assert C.read_text(path, warn=True) == "caf\u00e9 na\u00efve \u00fcber \ufffd end"


@pytest.mark.parametrize(
    "data", [b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "hello".encode("utf-16")], ids=["png", "utf-16"]
)
def test_binary_and_utf16_files_are_not_text(tmp_path, data):
    """They had been decoded as cp1252 / latin-1 and trained on."""
    (tmp_path / "a.txt").write_bytes(data)
    with pytest.raises(ValueError, match=r"a.txt is not a text file \(it holds NUL bytes"):
        C.read_text(tmp_path / "a.txt")


def test_an_empty_text_path_is_an_error():
    """`text:` alone had read every .txt under the working directory."""
    for name in ("text:", "text:  ", "pairs:", "labels:"):
        with pytest.raises(ValueError, match="needs a path after the colon"):
            load_corpus(name)


def test_an_option_a_corpus_does_not_take_is_named_with_those_it_does():
    """Had been Python's "unexpected keyword argument" from inspect (no corpus named), or pathlib's
    TypeError for a path option of another type."""
    with pytest.raises(TypeError, match=r"^corpus 'shakespeare' takes no option 'foo'; its options: root$"):
        load_corpus("shakespeare", foo=1)
    with pytest.raises(TypeError, match=r"^corpus 'pydoc' takes no option 'root'; its options: none$"):
        load_corpus("pydoc", root="/x")
    with pytest.raises(TypeError, match=r"^corpus 'shakespeare': option root must be a path, got int$"):
        load_corpus("shakespeare", root=3)
    with pytest.raises(
        TypeError, match=r"^corpus 'pairs:x.tsv' takes no option 'foo'; its options: direction$"
    ):
        load_corpus("pairs:x.tsv", foo=1)


def test_an_empty_user_corpus_path_is_refused_by_the_config(tmp_path, monkeypatch):
    """Before anything reads the path: an empty one had been taken for the working directory, so a run
    with a relative --out was first told it lay inside its data folder."""
    from tformer.schema import ConfigError
    from tformer.train.loop import Trainer
    from tformer.train.presets import get_train_preset

    monkeypatch.chdir(tmp_path)
    for name in ("text:", "pairs: ", "labels:"):
        with pytest.raises(ConfigError, match=r"data.corpus needs a path after the colon \(text:<file"):
            Trainer(get_train_preset("tiny-lm").with_overrides({"data.corpus": name}), "run", "lm")
    assert list(tmp_path.iterdir()) == []


def test_binary_without_nul_bytes_and_joined_files_in_a_users_text(tmp_path):
    """Random bytes without a NUL had been read as latin-1 (with a warning) and trained on; byte-order
    marks of files joined together had become vocabulary tokens."""
    import random

    rng = random.Random(0)
    noise = bytes(rng.randrange(1, 256) for _ in range(4000))
    (tmp_path / "blob.txt").write_bytes(noise)
    with pytest.raises(ValueError, match=r"blob.txt does not look like text: not UTF-8, and [\d,]+ of its"):
        C.read_text(tmp_path / "blob.txt", warn=True)
    log = "caf\xe9 \x1b[31mred\x1b[0m\x0bline\x1cfield\x1a\n" * 50  # latin-1 with ESC, VT, separators, SUB
    (tmp_path / "log.txt").write_bytes(log.encode("latin-1"))
    with pytest.warns(UserWarning, match="is not UTF-8"):
        assert C.read_text(tmp_path / "log.txt", warn=True) == log  # text that uses control codes is text
    (tmp_path / "joined.txt").write_bytes(b"\xef\xbb\xbfone\n\xef\xbb\xbftwo\n")
    assert C.read_text(tmp_path / "joined.txt", warn=True) == "one\ntwo\n"


def test_a_users_pairs_file(tmp_path):
    lines = [f"quelle {i} satz\tsource {i} sentence" for i in range(60)]
    (tmp_path / "p.tsv").write_text("\n".join([lines[0], "", *lines, lines[3]]) + "\n")  # a blank, repeats
    corpus = load_corpus(f"pairs:{tmp_path / 'p.tsv'}", direction="de-en")
    assert corpus.task == "translation" and corpus_task(f"pairs:{tmp_path}") == "translation"
    got = [p for s in SPLITS for p in corpus[s]]
    assert sorted((p.src, p.tgt) for p in got) == sorted(tuple(x.split("\t")) for x in lines)  # once each
    assert [len(corpus[s]) for s in SPLITS] == [54, 3, 3] and corpus.direction == "de-en"
    assert load_corpus(f"pairs:{tmp_path / 'p.tsv'}").manifest() == corpus.manifest()  # deterministic
    (tmp_path / "bad.tsv").write_text("a\tb\nc\td\te\n")
    with pytest.raises(
        ValueError, match=r"bad.tsv line 2: expected one source<TAB>target pair, found 2 tabs"
    ):
        load_corpus(f"pairs:{tmp_path / 'bad.tsv'}")
    (tmp_path / "bad.tsv").write_text("a\tb\n \tc\n")
    with pytest.raises(ValueError, match="line 2: expected one source<TAB>target pair, found an empty side"):
        load_corpus(f"pairs:{tmp_path / 'bad.tsv'}")
    with pytest.raises(ValueError, match="is a folder: give one text file"):
        load_corpus(f"pairs:{tmp_path}")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(f"pairs:{tmp_path / 'nope.tsv'}")


def test_a_users_labelled_folders(tmp_path):
    for label in ("pos", "neg", "empty"):
        (tmp_path / label).mkdir()
    for i in range(12):
        (tmp_path / "pos" / f"{i}.txt").write_text(f"good text number {i}")
        (tmp_path / "neg" / f"{i}.txt").write_text(f"bad text number {i}")
    (tmp_path / "neg" / "copy.txt").write_text("bad text number 0")  # a duplicate: read once
    (tmp_path / "pos" / ".draft.txt").write_text("hidden")
    (tmp_path / "notes.txt").write_text("loose")
    with pytest.warns(UserWarning) as seen:
        corpus = load_corpus(f"labels:{tmp_path}")
    said = [str(w.message) for w in seen]
    assert any("1 file(s) outside the label folders are not read" in m for m in said)
    assert any("skipped 1 label folder(s) without text files" in m and "'empty'" in m for m in said)
    assert corpus.task == "classification" and corpus.labels == ("neg", "pos")  # an empty folder is no label
    for s, n in zip(SPLITS, (10, 1, 1)):
        assert sorted(d.label for d in corpus[s]) == ["neg"] * n + ["pos"] * n  # stratified
    assert not any("draft" in d.id for s in SPLITS for d in corpus[s])
    with pytest.raises(
        TypeError, match="takes no option 'direktion'; its options: none"
    ):  # a typo is not dropped
        load_corpus(f"labels:{tmp_path}", direktion="de-en")
    (tmp_path / "neg" / "3.txt").write_text("good text number 3")  # also under pos: kept there only
    with pytest.warns(UserWarning, match=r"1 text\(s\) appear under two labels, each kept under the first only: "
                      r"pos/3.txt \(as neg/3.txt\)"):  # fmt: skip
        load_corpus(f"labels:{tmp_path}")
    (tmp_path / "neg" / "3.txt").write_text("bad text number 3")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "1.txt").write_text("alone")
    with pytest.raises(ValueError, match="label 'odd' .* has 1 distinct non-empty text file"):
        load_corpus(f"labels:{tmp_path}")
    one = tmp_path / "one"
    (one / "only").mkdir(parents=True)
    for i in range(3):
        (one / "only" / f"{i}.txt").write_text(f"text {i}")
    with pytest.raises(ValueError, match="has 1 label folder.*a classifier needs at least 2"):
        load_corpus(f"labels:{one}")
    with pytest.raises(ValueError, match="is not a folder"):
        load_corpus(f"labels:{tmp_path / 'notes.txt'}")


def test_a_file_name_that_is_not_utf8_is_recorded(tmp_path):
    """A Latin-1 file name had failed in data.json's hash with a codec error naming no file."""
    import os

    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"text {i}\n" * 20)
    os.rename(tmp_path / "0.txt", os.fsdecode(bytes(tmp_path / "r") + b"\xe9sum\xe9.txt"))
    assert load_corpus(f"text:{tmp_path}").manifest()["counts"] == {"train": 1, "val": 1, "test": 1}
