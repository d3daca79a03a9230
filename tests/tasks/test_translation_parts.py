"""The translation task's parts, each against a reference written out here: truncation and encoding keep
EOS within the source limit; the evaluation during training scores a spread sample of the split asked for
(BLEU by sacrebleu, with the zh tokenizer for a Chinese target; the loss per target token); separate BPE
vocabularies each learn their own side."""

from __future__ import annotations

from pathlib import Path

import pytest
import sacrebleu
import torch
import torch.nn.functional as F

from tests.generate.helpers import text_of, tiny_translator_and_classifier
from tests.tasks.test_translation import small_config, spread_of
from tformer import build_model
from tformer.tasks import make_task
from tformer.tasks.translation import truncate
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
    assert result["bleu"] == pytest.approx(copied.score)
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
