"""A tiny Translator and Classifier over one small BPE vocabulary, for the tests of their arguments."""

from __future__ import annotations

import torch

from tformer import build_model
from tformer.data.tokenizer import Tokenizer
from tformer.presets import tiny
from tformer.tasks.classification import Classifier
from tformer.tasks.translation import Translator


def tiny_translator_and_classifier() -> tuple[Translator, Classifier]:
    """Random-weight models (seed 0) in training mode, as build_model returns them; 32-token limits."""
    tok = Tokenizer.train_bpe(["the market rose and the dog barked"] * 20, 270)
    torch.manual_seed(0)
    pair = build_model(tiny("encoder_decoder").replace(vocab_size=tok.vocab_size, max_seq_len=32))
    cfg = tiny("encoder").replace(vocab_size=tok.vocab_size, max_seq_len=32, n_classes=2)
    classifier = Classifier(build_model(cfg), tok, ["a", "b"], max_len=32)
    return Translator(pair, tok, tok, max_src_len=32), classifier


def text_of(tok, n_tokens: int, add_bos: bool = False, add_eos: bool = False) -> str:
    """A text the tokenizer spells in exactly n_tokens tokens (BOS / EOS counted when asked for)."""
    long = " ".join(["the market rose and the dog barked"] * 40)
    for k in range(1, len(long)):
        text = long[:k]  # one character more each time: the count grows a token or so at a time
        if len(tok.encode(text, add_bos=add_bos, add_eos=add_eos)) == n_tokens:
            return text
    raise AssertionError(f"no text of {n_tokens} tokens")
