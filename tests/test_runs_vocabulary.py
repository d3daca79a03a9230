"""Loading a run checks its tokenizers against the model's vocabularies; the truncation warning says the
limit counts the special token a text is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from tformer.config import ModelConfig
from tformer.data import Tokenizer
from tformer.model import build_model
from tformer.runs import check_vocabularies, load_run, token_limit, warn_truncated
from tformer.train.checkpoint import CheckpointError, save_checkpoint
from tformer.train.config import TrainConfig

TEXTS = ["to be or not to be, that is the question whether tis nobler in the mind to suffer"] * 20


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_bpe(TEXTS, 280)


def tiny(vocab_size: int, **kw) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_seq_len=16, **kw
    )


def saved_run(run: Path, model_cfg: ModelConfig, tokenizer: Tokenizer) -> Path:
    meta = {
        "model_config": model_cfg.to_dict(),
        "train_config": TrainConfig(model=model_cfg).to_dict(),
        "tokenizer": tokenizer.to_json_str(),
    }
    return save_checkpoint(run, 1, build_model(model_cfg), meta=meta)


def test_a_run_whose_tokenizer_has_another_vocabulary_is_refused(tok: Tokenizer, tmp_path: Path) -> None:
    assert load_run(saved_run(tmp_path / "ok", tiny(tok.vocab_size), tok)).tokenizer == tok
    for size in (tok.vocab_size - 10, tok.vocab_size + 10):  # either way, ids are read as other tokens
        ckpt = saved_run(tmp_path / str(size), tiny(size), tok)
        with pytest.raises(CheckpointError) as err:
            load_run(ckpt)
        assert str(err.value) == (
            f"{ckpt / 'meta.json'}: the tokenizer has {tok.vocab_size:,} tokens but the model's vocab_size "
            f"is {size:,}: they must be equal (a tokenizer of another run?)"
        )


def test_a_translation_runs_source_tokenizer_is_checked_against_src_vocab_size(tok: Tokenizer) -> None:
    other = Tokenizer.train_bpe(TEXTS, 270)
    separate = tiny(
        other.vocab_size, arch="encoder_decoder", share_embeddings=False, src_vocab_size=tok.vocab_size
    )
    check_vocabularies(Path("c"), separate, other, tok)  # target `other`, source `tok`
    with pytest.raises(
        CheckpointError, match=r"the source tokenizer has [\d,]+ tokens but the model's src_vocab_size"
    ):
        check_vocabularies(Path("c"), separate, other, other)
    joint = tiny(tok.vocab_size, arch="encoder_decoder")
    check_vocabularies(Path("c"), joint, tok, None)
    unshared = tiny(tok.vocab_size, arch="encoder_decoder", share_embeddings=False, src_vocab_size=300)
    with pytest.raises(CheckpointError, match="the tokenizer has .* the model's src_vocab_size is 300"):
        check_vocabularies(Path("c"), unshared, tok, None)


def test_the_truncation_warning_says_the_limit_counts_the_special_token() -> None:
    assert token_limit(64) == "64 tokens"
    assert token_limit(64, "BOS") == "63 tokens (the model reads 64, the BOS among them)"
    with pytest.warns(UserWarning) as seen:
        warn_truncated([2], 64, special="BOS")
    assert str(seen[0].message) == (
        "1 text(s) longer than 63 tokens (the model reads 64, the BOS among them) were truncated (index 2)"
    )
    with pytest.warns(UserWarning, match=r"^1 text\(s\) longer than 64 tokens were truncated"):
        warn_truncated([0], 64)
