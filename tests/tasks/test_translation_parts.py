"""The translation task's parts, each against a reference written out here: truncation and encoding keep
EOS within the source limit; the evaluation during training scores a spread sample of the split asked for
(BLEU by sacrebleu, with the zh tokenizer for a Chinese target; the loss per target token); separate BPE
vocabularies each learn their own side."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import sacrebleu
import torch
import torch.nn.functional as F
from torch import nn

from tests.generate.helpers import text_of, tiny_translator_and_classifier
from tests.tasks.test_translation import set_up_task, small_config, spread_of
from tformer import build_model
from tformer.data.datasets import Seq2SeqCollator, Seq2SeqDataset
from tformer.generate.beam import SearchConfig
from tformer.tasks import make_task
from tformer.tasks.translation import Translator, evaluate_loss, truncate
from tformer.train.presets import tiny_translation

EOS = 2


def test_truncate_keeps_the_eos_and_cuts_only_longer_sources() -> None:
    body = list(range(3, 12))
    assert truncate(body + [EOS], 5, EOS) == (body[:4] + [EOS], True)
    exact = body[:4] + [EOS]
    assert truncate(exact, 5, EOS) == (exact, False)  # exactly max_len: as it is, not "cut"


def test_translator_encode_ends_every_source_with_eos_within_max_src_len() -> None:
    translator, _ = tiny_translator_and_classifier()
    tok, n = translator.src_tok, translator.max_src_len
    texts = [text_of(tok, n, add_eos=True), text_of(tok, n + 4, add_eos=True), "the dog barked"]
    ids, cut = translator.encode(texts)
    full = [tok.encode(t, add_eos=True) for t in texts]  # as the training pairs' sources are
    assert ids == [x if len(x) <= n else x[: n - 1] + [tok.eos_id] for x in full]
    assert cut == [1] and all(x[-1] == tok.eos_id for x in ids)


class Echo:
    """A translator stand-in that "translates" each source into `answer(source)`, recording the sources."""

    def __init__(self, answer=lambda s: s) -> None:
        self.answer, self.seen = answer, []

    def translate(self, sources, search_cfg, warn=True):
        self.seen += list(sources)
        return [self.answer(s) for s in sources]


@torch.no_grad()
def loss_per_token(model, items, bos_id: int, eos_id: int) -> float:
    """Cross-entropy per target token, one pair at a time: src (with EOS) -> BOS + tgt predicts tgt + EOS."""
    total, count = 0.0, 0
    for src, tgt in items:
        tgt_in, tgt_out = torch.cat([torch.tensor([bos_id]), tgt]), torch.cat([tgt, torch.tensor([eos_id])])
        logits = model(src[None], tgt_in[None], None, None)[0]
        total += float(F.cross_entropy(logits.float(), tgt_out, reduction="sum"))
        count += len(tgt_out)
    return total / count


def test_training_evaluation_scores_a_spread_sample_of_the_split_it_is_asked_for(
    dictionary_file: Path, tmp_path: Path
) -> None:
    """evaluate(model, max_batches, split): BLEU over max_batches * batch_size pairs spread over that
    split, and the loss over as many of its pairs, spread likewise (not the validation split's)."""
    cfg = small_config(dictionary_file)
    task = make_task("translation")
    task.setup(cfg, tmp_path, torch.device("cpu"))
    torch.manual_seed(0)
    model = build_model(task.model_config(cfg)).eval()
    echo = Echo()
    task.translator = lambda m: echo
    result = task.evaluate(model, 1, "test")
    take = cfg.batch_size
    sample = spread_of(list(task.corpus["test"]), take)
    assert echo.seen == [p.src for p in sample]
    copied = sacrebleu.corpus_bleu([p.src for p in sample], [[p.tgt for p in sample]])
    assert result["bleu"] == pytest.approx(copied.score) and result["bleu_sentences"] == len(sample) == take
    assert task.describe_result(result).count(f"(on {take} validation sentences)") == 1  # the summary says it
    ds = task.dataset(task.corpus["test"])
    items = spread_of([ds[i] for i in range(len(ds))], take)
    expected = loss_per_token(model, items, task.tgt_tok.bos_id, task.tgt_tok.eos_id)
    assert result["eval_loss"] == pytest.approx(expected, rel=1e-4)


def test_training_evaluation_of_a_chinese_target_scores_with_the_zh_tokenizer(tmp_path: Path) -> None:
    """en-zh: BLEU during training is sacrebleu's with tokenize="zh", as `tformer eval` reports it."""
    cfg = tiny_translation().with_overrides(
        {
            "data.corpus": "libreoffice",
            "data.direction": "en-zh",
            "data.vocab_size": 400,
            "data.max_train_docs": 500,
        }
    )
    task = make_task("translation")
    task.setup(cfg, tmp_path, torch.device("cpu"))
    model = build_model(task.model_config(cfg)).eval()
    refs = {p.src: p.tgt for p in task.corpus["val"]}
    echo = Echo(lambda s: refs[s][: max(1, len(refs[s]) - 3)])  # each reference less its last characters
    task.translator = lambda m: echo
    result = task.evaluate(model, 1, "val")
    hyps, wanted = [echo.answer(s) for s in echo.seen], [refs[s] for s in echo.seen]
    zh = sacrebleu.corpus_bleu(hyps, [wanted], tokenize="zh").score
    assert zh != sacrebleu.corpus_bleu(hyps, [wanted]).score  # the premise: 13a scores it otherwise
    assert result["bleu"] == pytest.approx(zh)


def test_separate_vocabularies_are_trained_each_on_its_own_side(
    dictionary_file: Path, tmp_path: Path
) -> None:
    """Of two BPE vocabularies of one size, each spells its own language in fewer tokens than the other
    does (the target one had been trained on the source side)."""
    cfg = small_config(dictionary_file)
    cfg = cfg.replace(data=cfg.data.replace(tokenizer="separate", vocab_size=300, src_vocab_size=300))
    task = make_task("translation")
    task.setup(cfg, tmp_path, torch.device("cpu"))
    pairs = list(task.corpus["val"])

    def n_tokens(tok, texts) -> int:
        return sum(len(tok.encode(t)) for t in texts)

    german, english = [p.src for p in pairs], [p.tgt for p in pairs]
    assert n_tokens(task.src_tok, german) < n_tokens(task.tgt_tok, german)
    assert n_tokens(task.tgt_tok, english) < n_tokens(task.src_tok, english)


def test_translator_cuts_sources_to_the_models_positions_too() -> None:
    """max_src_len above the model's max_seq_len: sources are cut to the model's limit (with EOS)."""
    translator, _ = tiny_translator_and_classifier()  # model max_seq_len 32
    tok = translator.src_tok
    wide = Translator(translator.model, tok, tok, max_src_len=100)
    ids, cut = wide.encode([text_of(tok, 40, add_eos=True), "the dog barked"])
    assert cut == [0] and len(ids[0]) == 32 and ids[0][-1] == tok.eos_id
    assert ids[1] == tok.encode("the dog barked", add_eos=True)


def test_translating_keeps_an_eval_mode_model_in_eval_mode() -> None:
    translator, _ = tiny_translator_and_classifier()
    translator.model.eval()
    translator.translate(["the dog barked"], SearchConfig(method="greedy", max_len=4))
    assert not translator.model.training


def test_sampled_translations_draw_from_the_configs_seed() -> None:
    """No generator passed: the draws are those of a generator seeded with cfg.seed."""
    translator, _ = tiny_translator_and_classifier()
    sources, _ = translator.encode(["the dog barked", "the market rose"])
    outs = {}
    for seed in (3, 4):
        cfg = SearchConfig(method="sample", temperature=1.0, max_len=12, seed=seed)
        own = [h.tokens for h in translator.hypotheses(sources, cfg)]
        ref = translator.hypotheses(sources, cfg, generator=torch.Generator().manual_seed(seed))
        assert own == [h.tokens for h in ref]
        outs[seed] = own
    assert outs[3] != outs[4]


class Confident(nn.Module):
    """A stand-in seq2seq model that puts logit 1e4 on token 3 everywhere (targets elsewhere: huge loss)."""

    def __init__(self, vocab: int = 8) -> None:
        super().__init__()
        self.vocab, self.w = vocab, nn.Parameter(torch.zeros(()))

    def forward(self, src, tgt_in, src_mask=None, tgt_mask=None, tgt_right_padded=False):
        logits = torch.zeros(*tgt_in.shape, self.vocab)
        logits[..., 3] = 1e4
        return logits + self.w


def test_evaluation_perplexity_past_a_float_is_inf_not_an_overflow() -> None:
    """A loss of about 1e4 nats/token: perplexity inf, not OverflowError (nor exp(50), which it had been
    capped at, a number that read as measured)."""
    ds = Seq2SeqDataset([([4, 5, 2], [6, 7]), ([5, 2], [4])], max_src_len=8, max_tgt_len=8)
    result = evaluate_loss(Confident(), ds, Seq2SeqCollator(0, 1, 2), 2, None, torch.device("cpu"))
    assert result["eval_loss"] == pytest.approx(1e4, rel=1e-3)
    assert result["perplexity"] == math.inf


def test_translation_counts_target_tokens_not_padding_or_sources() -> None:
    """Pairs with sources of 4 and 2 ids and targets of 2 and 1: 3 + 2 target tokens (with EOS) are
    counted, both as loss targets and as the tokens of tokens/s; padding and source ids are not."""
    task = make_task("translation")
    ds = Seq2SeqDataset([([5, 6, 7, 2], [8, 9]), ([5, 2], [8])], max_src_len=8, max_tgt_len=8)
    batch = Seq2SeqCollator(0, 1, 2)([ds[0], ds[1]])
    assert task.count_targets(batch) == 5
    assert task.count_inputs(batch) == 5


def test_dictionary_alternatives_join_the_training_pairs(dictionary_file: Path, tmp_path: Path) -> None:
    """A run with data.dictionary_alternatives trains on the plain pairs plus each alternatives entry's
    pairs, and its data.json says so; the held-out splits are the plain corpus's."""
    from tformer.data import load_corpus
    from tformer.train.loop import Trainer

    dictionary = tmp_path / "de-en"
    extra = "Der Hund schläft jetzt fest.; Der Hund schläft tief. :: The dog is fast asleep.; The dog sleeps deeply."
    dictionary.write_text(dictionary_file.read_text(encoding="utf-8") + extra + "\n", encoding="utf-8")
    cfg = small_config(dictionary, steps=1, eval_batches=1)
    cfg = cfg.replace(data=cfg.data.replace(dictionary_alternatives=True))
    Trainer(cfg, tmp_path / "run", make_task("translation"), progress=False).fit()
    manifest = json.loads((tmp_path / "run" / "data.json").read_text())
    plain = load_corpus("trans-de-en", path=str(dictionary), direction="de-en")
    assert manifest["train_pairs_used"] == len(plain["train"]) + 4  # 2 German x 2 English alternatives
    assert "train adds 4 sentence pairs of entries with ';' alternatives" in manifest["split_rule"]


def test_the_bleu_tokenizer_names_a_direction_that_is_not_a_string() -> None:
    """bleu_tokenizer(None) had been an AttributeError ('NoneType' object has no attribute 'rpartition')."""
    from tformer.eval.bleu import bleu_tokenizer

    with pytest.raises(TypeError, match="direction must be a str such as 'de-en', got NoneType"):
        bleu_tokenizer(None)


def test_target_padding_stays_out_of_moe_routing_and_keeps_the_causal_path(monkeypatch) -> None:
    """A batch's target padding takes no expert capacity and no share of the balance loss: the same real
    targets with and without 24 padded slots give the same loss, routing counts, drops and aux loss; the
    decoder's self-attention still runs SDPA's causal path (the collator pads on the right)."""
    from tformer import MoEConfig
    from tformer.data.datasets import Seq2SeqBatch
    from tformer.model import attention
    from tformer.model.moe import moe_layers
    from tformer.presets import tiny
    from tformer.tasks.translation import seq2seq_loss_sum

    torch.manual_seed(0)
    moe = MoEConfig(n_experts=8, top_k=2, capacity_factor=1.0, aux_loss_coef=0.01)
    model = build_model(tiny("encoder_decoder").replace(moe=moe, dropout=0.0, max_seq_len=64)).train()
    src = torch.randint(4, model.cfg.vocab_size, (2, 8))
    tgt = torch.randint(4, model.cfg.vocab_size, (2, 8))
    sdpa, calls = F.scaled_dot_product_attention, []

    def recorded(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recorded)

    def routed(n_pad: int) -> tuple[float, list[int], int, float]:
        tgt_in, tgt_out = F.pad(tgt, (0, n_pad), value=0), F.pad(tgt, (0, n_pad), value=-100)
        batch = Seq2SeqBatch(src, torch.ones_like(src, dtype=torch.bool), tgt_in, tgt_out, tgt_in != 0)
        loss, count = seq2seq_loss_sum(model, batch)
        assert count == 16
        dec = next(m for name, m in moe_layers(model) if name.startswith("decoder"))
        stats = dec.last_stats
        return loss.item(), stats["counts"].tolist(), int(stats["dropped"]), float(dec.last_aux)

    plain, padded = routed(0), routed(24)
    assert padded[1] == plain[1] and sum(plain[1]) == 32  # 16 real tokens x top-2, nothing from padding
    assert padded[2] == plain[2] > 0  # the capacity drops the same real assignments
    assert padded[0] == pytest.approx(plain[0], abs=1e-4) and padded[3] == pytest.approx(plain[3], abs=1e-7)
    n_dec = model.cfg.n_layers  # per call: decoder self-attention causal, no mask tensor
    causal = [c for c in calls if c == (True, True)]
    assert calls and len(causal) == 2 * n_dec  # both calls, every decoder layer


def test_a_left_padded_mask_declared_right_padded_is_refused() -> None:
    from tformer.presets import tiny

    model = build_model(tiny("encoder_decoder").replace(dropout=0.0))
    src, tgt = torch.randint(4, 50, (2, 5)), torch.randint(4, 50, (2, 4))
    left = torch.tensor([[False, True, True, True], [True, True, True, True]])
    with pytest.raises(
        ValueError, match=r"declared right-padded .* row 0 has a padded slot before a real token"
    ):
        model(src, tgt, None, left, tgt_right_padded=True)
    model(src, tgt, None, left.flip(1), tgt_right_padded=True)  # right padding: accepted


def test_bpe_dropout_trains_on_seeded_samples_of_each_pair(dictionary_file: Path, tmp_path: Path) -> None:
    """data.bpe_dropout: the training items are data.bpe_dropout_copies sampled segmentations of each pair
    (each one spells the pair's text; together they take more tokens than the plain encoding), the same
    ones for a run set up again (a resume) and others for another seed; validation keeps the plain one."""
    cfg = small_config(dictionary_file)
    cfg = cfg.replace(data=cfg.data.replace(seq_len=64))  # room for every sample: none left out
    plain = set_up_task(cfg, tmp_path / "plain")
    cfg = cfg.replace(data=cfg.data.replace(bpe_dropout=0.2, bpe_dropout_copies=3))
    task = set_up_task(cfg, tmp_path / "run")
    train, tok = list(task.corpus["train"]), task.tgt_tok
    ds = task.training_set()
    assert (
        task.train_loader(cfg).loader.loader.dataset is ds and task.train_ds is not ds
    )  # the plain one stays
    assert len(plain.train_ds) == len(train) and len(ds) == 3 * len(train)  # none too long here
    texts = [(p.src, p.tgt) for p in train] * 3
    assert [(tok.decode(s), tok.decode(t)) for s, t in zip(ds.src, ds.tgt)] == texts
    assert all(int(s[-1]) == tok.eos_id for s in ds.src)  # the source's EOS, as in the plain encoding
    size = sum(len(s) + len(t) for s, t in zip(ds.src, ds.tgt))
    assert size > 1.05 * 3 * sum(len(s) + len(t) for s, t in zip(plain.train_ds.src, plain.train_ds.tgt))
    n = len(train)
    assert sum(not torch.equal(ds.tgt[i], ds.tgt[i + n]) for i in range(n)) > n / 4  # copies differ
    again = set_up_task(cfg, tmp_path / "run")  # the run's own tokenizer, as a resume reads it
    assert all(
        torch.equal(a, b)
        for a, b in zip(again.training_set().src + again.training_set().tgt, ds.src + ds.tgt)
    )
    other = set_up_task(cfg.replace(seed=1), tmp_path / "run")
    assert any(not torch.equal(a, b) for a, b in zip(other.training_set().tgt, ds.tgt))
    assert all(
        torch.equal(a, b)
        for a, b in zip(task.val_ds.src + task.val_ds.tgt, plain.val_ds.src + plain.val_ds.tgt)
    )


def test_bpe_dropout_samples_too_long_for_seq_len_are_named(dictionary_file: Path, tmp_path: Path) -> None:
    """Samples are longer than the plain encoding: those over data.seq_len are left out with a warning
    (the longest pairs train less often), and when none fits the run stops with the split named."""
    from tformer.schema import ConfigError

    cfg = small_config(dictionary_file)
    n = 30  # the pairs are 17..29 source and 15..27 target tokens: each fits plain
    cfg = cfg.replace(data=cfg.data.replace(seq_len=n, bpe_dropout=0.3, bpe_dropout_copies=1))
    task = set_up_task(cfg, tmp_path / "some")
    assert task.train_ds.n_filtered == 0
    with pytest.warns(UserWarning, match=r"of the [\d,]+ BPE-dropout samples of the training pairs are longer than data.seq_len=30 tokens"):  # fmt: skip
        samples = task.training_set()
    assert samples.n_filtered > 0 and len(samples) > 0
    cfg = cfg.replace(data=cfg.data.replace(bpe_dropout=0.99))  # nearly one token per byte
    task = set_up_task(cfg, tmp_path / "none")
    with pytest.raises(ConfigError, match="no pair of the BPE-dropout samples of the train split fits data.seq_len=30 .* raise data.seq_len or lower data.bpe_dropout$"):  # fmt: skip
        task.training_set()
