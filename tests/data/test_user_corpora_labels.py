"""A user's labelled folders, from an audit: folder names that would break one-line output, texts that
differ only in whitespace, label folders without text files."""

from __future__ import annotations

import unicodedata
import warnings

import pytest

from tformer.data import SPLITS
from tformer.data import corpora as C
from tformer.data.corpus_base import fraction_counts, split_by_hash


def _folder(root, name: str, texts: list[str]) -> None:
    (root / name).mkdir()
    for i, text in enumerate(texts):
        (root / name / f"{i:02d}.txt").write_text(text, encoding="utf-8")


@pytest.mark.parametrize(
    "name", ["two\nlines", "tab\there", "bell\x07", "del\x7f", "c1\x85", "line\u2028sep", "para\u2029sep"]
)
def test_a_label_folder_named_with_a_control_character_is_refused(tmp_path, name: str) -> None:
    """A newline or tab in a label had split `tformer classify`'s output line (one per input line) and
    eval's per-class rows: refused like a name that is not UTF-8, naming the folder."""
    _folder(tmp_path, "plain", [f"plain text {i}" for i in range(3)])
    _folder(tmp_path, name, [f"odd text {i}" for i in range(3)])
    with pytest.raises(ValueError) as error:
        C.load_labelled(tmp_path)
    message = str(error.value)
    assert "\n" not in message and repr(str(tmp_path / name)) in message
    control = next(c for c in name if unicodedata.category(c) in ("Cc", "Zl", "Zp"))  # all break a line
    assert f"holding a control character ({control!r})" in message
    assert "rename it" in message


def test_texts_differing_only_in_whitespace_are_one_text_in_one_split(tmp_path) -> None:
    """A copy with a doubled space or another line break had been a second text, free to land in another
    split than its original (a train / test leak): kept once, as first written, and split by the hash of
    the whitespace-normalised text."""
    texts = [f"story {i} about\nthe topic  number {i}" for i in range(30)]
    _folder(tmp_path, "a", texts + [" ".join(t.split()) + "\n\n" for t in texts])  # respaced copies after
    _folder(tmp_path, "b", [f"other text {i}\n\nwith lines" for i in range(10)])
    corpus = C.load_labelled(tmp_path)
    docs = {d.id: d for s in SPLITS for d in corpus[s]}
    assert sorted(i for i in docs if i.startswith("a/")) == [f"a/{i:02d}.txt" for i in range(30)]
    assert all(docs[f"a/{i:02d}.txt"].text == texts[i] for i in range(30))  # the original, as written
    ordered = [d for d in sorted(docs.values(), key=lambda d: d.id) if d.label == "a"]
    n_val, n_test = fraction_counts(30, 0.1, 0.1, 1)
    expected = split_by_hash(ordered, lambda d: " ".join(d.text.split()), n_val, n_test)
    assert {s: sorted(d.id for d in corpus[s] if d.label == "a") for s in SPLITS} == {
        s: sorted(d.id for d in expected[s]) for s in SPLITS
    }
    _folder(tmp_path, "c", [" ".join(texts[0].split()).upper()] + [f"c text {i}" for i in range(3)])
    _folder(tmp_path, "d", [texts[1].replace(" ", "\t")] + [f"d text {i}" for i in range(3)])
    with pytest.warns(UserWarning, match=r"1 text\(s\) appear under two labels.*d/00.txt \(as a/01.txt\)"):
        corpus = C.load_labelled(tmp_path)  # upper case is another text; a tab for a space is not
    assert "c/00.txt" in {d.id for s in SPLITS for d in corpus[s]}


def test_a_label_folder_without_text_files_is_named_in_a_warning(tmp_path) -> None:
    """An empty label folder had been dropped without a word (classes a, b of folders a, b, c)."""
    _folder(tmp_path, "a", [f"a text {i}" for i in range(3)])
    _folder(tmp_path, "b", [f"b text {i}" for i in range(3)])
    (tmp_path / "c").mkdir()
    with pytest.warns(
        UserWarning, match=r"skipped 1 label folder\(s\) without text files .*, so not labels: 'c'$"
    ):
        corpus = C.load_labelled(tmp_path)
    assert corpus.labels == ("a", "b")
    for name in ("d", "e", "f", "g"):
        (tmp_path / name).mkdir()
    with pytest.warns(UserWarning, match=r"skipped 5 label folder\(s\).*: 'c', 'd', 'e' and 2 more$"):
        C.load_labelled(tmp_path)
    for name in "cdefg":
        (tmp_path / name).rmdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every folder a label: nothing to say
        assert C.load_labelled(tmp_path).labels == ("a", "b")
