"""The language-modelling task's own arithmetic, against hand computations: which windows an evaluation
scores, bits per character, the train loader's batches, and what the task reads from its config."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import tformer.tasks.lm as lm
from tests.train.helpers import small_config
from tests.words import write_word_corpus
from tformer.data.datasets import PackedLMDataset
from tformer.schema import ConfigError
from tformer.tasks.lm import LMTask, evaluate_lm
from tformer.train.presets import tiny_lm

VOCAB = 50


class Uniform(nn.Module):
    """Equal logits over VOCAB tokens (loss ln VOCAB per prediction); records the windows it is shown."""

    def __init__(self):
        super().__init__()
        self.seen: list[int] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.seen += ids[:, 0].tolist()
        return torch.zeros(*ids.shape, VOCAB)


def nine_windows() -> PackedLMDataset:
    """Stream 1, 2, ..., 36, EOS 0: 37 tokens, windows of 4 (+1): window i starts with token 4 i + 1."""
    return PackedLMDataset([list(range(1, 37))], seq_len=4, eos_id=0)


def test_evaluation_spreads_its_windows_over_the_split():
    """max_batches 1 of 3 windows out of 9: windows 0, 4 and 8 (first, middle, last), not 0, 1, 2."""
    model = Uniform()
    out = evaluate_lm(
        model, nine_windows(), chars=74, batch_size=3, max_batches=1, device=torch.device("cpu")
    )
    assert model.seen == [1, 17, 33]
    assert (out["windows"], out["windows_scored"], out["predictions"]) == (9, 3, 12)
    model = Uniform()
    out = evaluate_lm(
        model, nine_windows(), chars=74, batch_size=2, max_batches=None, device=torch.device("cpu")
    )
    assert model.seen == [4 * i + 1 for i in range(9)] and out["predictions"] == 36


def test_evaluation_loss_and_bits_per_character_by_hand():
    """Uniform logits: ln 50 nats a token; 37 tokens over 74 characters: bits/char = log2(50) / 2."""
    out = evaluate_lm(
        Uniform(), nine_windows(), chars=74, batch_size=4, max_batches=None, device=torch.device("cpu")
    )
    assert math.isclose(out["eval_loss"], math.log(VOCAB), rel_tol=1e-6)
    assert math.isclose(out["perplexity"], VOCAB, rel_tol=1e-5)
    assert math.isclose(out["bits_per_token"], math.log2(VOCAB), rel_tol=1e-6)
    assert math.isclose(out["bits_per_char"], math.log2(VOCAB) / 2, rel_tol=1e-6)


def loader_batches(seed: int, batch_size: int = 4) -> list[list[int]]:
    task = LMTask()
    task.train_ds = nine_windows()
    cfg = tiny_lm().replace(batch_size=batch_size, seed=seed)
    return task.train_loader(cfg).loader.batch_sampler.epoch_batches(0)


def test_the_train_loader_shuffles_by_the_run_seed_and_drops_a_partial_batch():
    """9 windows in batches of 4: two full batches (the ninth window waits for another epoch), in an order
    the run's seed picks."""
    batches = loader_batches(seed=5)
    assert [len(b) for b in batches] == [4, 4] and len(set(sum(batches, []))) == 8
    orders = {tuple(map(tuple, loader_batches(seed))) for seed in range(5, 9)}
    assert len(orders) == 4  # the seed matters
    assert loader_batches(seed=5) == batches  # and fixes the order
    assert all(tuple(map(tuple, o)) != ((0, 1, 2, 3), (4, 5, 6, 7)) for o in orders)  # shuffled


def test_the_model_config_takes_the_vocabulary_and_covers_seq_len():
    task = LMTask()
    task.tokenizer = SimpleNamespace(vocab_size=123)
    base = tiny_lm()
    cfg = base.replace(model=base.model.replace(max_seq_len=16), data=base.data.replace(seq_len=40))
    model = task.model_config(cfg)
    assert (model.vocab_size, model.max_seq_len) == (123, 40)


def test_the_result_line_counts_the_windows_eval_batches_scored(tmp_path):
    """eval_batches 2 of batch_size 3: 6 of the 9 validation windows."""
    task = LMTask()
    task.cfg = tiny_lm().replace(eval_batches=2, batch_size=3, data=tiny_lm().data.replace(corpus="text:x"))
    task.val_ds, task.run_dir = nine_windows(), tmp_path
    line = task.describe_result({"eval_loss": 1.0, "perplexity": math.e, "bits_per_char": 0.5})
    assert "6 of its 9 windows" in line
    # the report's own counts where it has them: a run resumed with another eval_batches reports the
    # evaluation it ran earlier (it had claimed the whole split for one that scored 32 of 60 windows)
    earlier = {
        "eval_loss": 1.0,
        "perplexity": math.e,
        "bits_per_char": 0.5,
        "windows": 9,
        "windows_scored": 4,
    }
    assert "4 of its 9 windows" in task.describe_result(earlier)
    whole = {**earlier, "windows_scored": 9}
    assert "windows" not in task.describe_result(whole)


def test_perplexity_is_exp_of_the_loss_until_it_overflows():
    from tformer.tasks.losses import perplexity

    assert perplexity(55.67) == pytest.approx(math.exp(55.67))  # it had been capped at exp(50)
    assert perplexity(800.0) == math.inf and perplexity(709.5) == pytest.approx(math.exp(709.5))
    assert math.isnan(perplexity(math.nan))  # not inf, as if it had been measured


def test_the_sample_prompt_is_the_first_four_words_of_the_first_validation_text():
    task = LMTask()
    task.cfg = tiny_lm().replace(data=tiny_lm().data.replace(corpus="text:x"))
    task.corpus = SimpleNamespace(texts=lambda split: ["  \n", "one two  three\nfour five six"])
    assert task.sample_prompt() == "one two three four"


def test_setup_counts_characters_with_one_per_eos_and_limits_the_train_documents(tmp_path: Path):
    """A folder's files are documents: the validation characters are the val files' lengths plus one each
    (their EOS); max_train_docs 2 trains on the first two train files' tokens (plus an EOS each)."""
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    write_word_corpus(corpus_dir, docs=24, words=300)
    cfg = small_config(corpus_dir)
    cfg = cfg.replace(data=cfg.data.replace(seq_len=16, max_train_docs=2))
    (tmp_path / "run").mkdir()
    task = LMTask()
    task.setup(cfg, tmp_path / "run", torch.device("cpu"))
    val_files = [corpus_dir / d.id for d in task.corpus["val"]]
    assert task.val_chars == sum(len(p.read_text()) + 1 for p in val_files)
    first_two = [(corpus_dir / d.id).read_text() for d in task.corpus["train"][:2]]
    assert task.train_ds.n_tokens == sum(len(task.tokenizer.encode(t)) + 1 for t in first_two)


def test_a_task_opened_on_a_run_with_a_tokenizer_checks_the_data_it_was_trained_on(tmp_path: Path):
    """A run directory holding a tokenizer is a run going on (`tformer eval` opens it with resume False):
    its data.json is checked, never rewritten to fit data that changed since."""
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    write_word_corpus(corpus_dir, docs=12, words=300)
    cfg = small_config(corpus_dir)
    run = tmp_path / "run"
    run.mkdir()
    LMTask().setup(cfg, run, torch.device("cpu"))
    manifest = (run / "data.json").read_text()
    (corpus_dir / "extra.txt").write_text("a new file the run never saw\n" * 40)
    with pytest.raises(ConfigError):
        LMTask().setup(cfg, run, torch.device("cpu"))
    assert (run / "data.json").read_text() == manifest


def test_a_sample_prompt_longer_than_the_model_keeps_its_end(monkeypatch):
    """A prompt of 100 tokens for a model of max_seq_len 8: its last 7 tokens (the text next to the
    continuation), leaving 1 new token."""
    seen = {}

    def fake_generate(model, prompts, sampling, eos_id, pad_id):
        seen["prompt"], seen["new"] = prompts[0], sampling.max_new_tokens
        return [[]]

    monkeypatch.setattr(lm, "generate", fake_generate)
    task = LMTask()
    task.tokenizer = SimpleNamespace(
        encode=lambda text: list(range(100)), decode=lambda ids: "", eos_id=2, pad_id=0
    )
    task.show_sample(SimpleNamespace(cfg=SimpleNamespace(max_seq_len=8)), prompt="long")
    assert seen == {"prompt": list(range(93, 100)), "new": 1}
