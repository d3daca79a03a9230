"""A small word list the trainer and distributed tests build their throwaway corpora from."""

WORDS = [
    "the",
    "king",
    "is",
    "dead",
    "long",
    "live",
    "the",
    "king",
    "and",
    "all",
    "his",
    "men",
    "who",
    "fought",
    "for",
    "him",
    "in",
    "the",
    "field",
    "of",
    "war",
]


def write_word_corpus(root, docs: int = 12, words: int = 400) -> None:
    """`docs` text files of `words` random words each (seeded) under `root`."""
    import torch

    gen = torch.Generator().manual_seed(0)
    for i in range(docs):
        picks = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (words,), generator=gen)]
        (root / f"doc{i:02d}.txt").write_text(" ".join(picks) + "\n")
