"""Translation: BLEU / chrF, a tiny seq2seq that learns to copy and to reverse, the task on a small
dictionary file through the trainer and the CLI (train, translate, eval), and bad input."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import random
import shutil
import warnings
from pathlib import Path

import pytest
import sacrebleu
import torch
import torch.nn.functional as F

from tests.generate.helpers import text_of
from tformer import build_model
from tformer.cli.main import main
from tformer.data import load_corpus
from tformer.data.datasets import IGNORE_INDEX
from tformer.eval.bleu import bleu_parts, bleu_tokenizer, copy_baseline, score_translations
from tformer.generate.beam import SearchConfig, sample_search
from tformer.presets import tiny
from tformer.runs import find_checkpoint, load_run
from tformer.schema import ConfigError
from tformer.tasks import make_task
from tformer.tasks.corpus import train_tokenizer
from tformer.tasks.stream import spread
from tformer.tasks.translation import evaluate_run, load_translation_corpus, load_translator
from tformer.train.config import DataConfig
from tformer.train.loop import Trainer
from tformer.train.presets import tiny_translation

PAD, BOS, EOS = 0, 1, 2


def test_bleu_and_chrf_of_identical_text_are_100() -> None:
    refs = ["Der alte Hund sieht die Katze heute.", "The young teacher calls the horse again!"]
    scores = score_translations(refs, refs)
    assert scores.bleu == pytest.approx(100.0) and scores.chrf == pytest.approx(100.0)
    assert "tok:13a" in scores.bleu_signature and scores.n == 2
    other = score_translations(["A cat.", "Nothing alike here at all."], refs)
    assert other.bleu < 10 and other.chrf < 40
    assert copy_baseline(refs, refs).bleu == pytest.approx(100.0)
    with pytest.raises(ValueError, match="hypotheses"):
        score_translations(refs[:1], refs)


def test_bleu_and_chrf_score_hypotheses_against_references_as_sacrebleu_does() -> None:
    """Shorter hypotheses than references: swapping the two changes both scores, so the order is pinned."""
    import sacrebleu

    hyps = ["The old dog sees the cat.", "The teacher calls the horse."]
    refs = ["The old dog sees the cat today in the garden.", "The young teacher calls the horse again!"]
    scores = score_translations(hyps, refs)
    assert scores.bleu == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
    assert scores.chrf == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)
    swapped = score_translations(refs, hyps)
    assert abs(swapped.bleu - scores.bleu) > 1 and abs(swapped.chrf - scores.chrf) > 10
    copied = copy_baseline(hyps, refs)  # the sources are the "translation"
    assert copied.bleu == pytest.approx(scores.bleu, abs=1e-9)


def test_bleus_parts_are_the_n_gram_precisions_and_brevity_penalty_counted_by_hand() -> None:
    """Counted here: "the cat sat on the mat today ." against "the cat sat on the mat ." matches 7/8
    words, 5/7 bigrams, 4/6 trigrams and 3/5 4-grams, is longer (BP 1, ratio 8/7), so BLEU is
    (7/8 x 5/7 x 4/6 x 3/5) ** (1/4) = 0.25 ** 0.25; "the cat sat on the" matches every n-gram and is
    short: BP exp(1 - 7/5)."""
    ref = ["the cat sat on the mat ."]
    long = score_translations(["the cat sat on the mat today ."], ref)
    assert long.bleu_precisions == pytest.approx((100 * 7 / 8, 100 * 5 / 7, 100 * 4 / 6, 100 * 3 / 5))
    assert (long.brevity_penalty, long.length_ratio, long.hyp_len, long.ref_len) == pytest.approx(
        (1, 8 / 7, 8, 7)
    )
    assert long.bleu == pytest.approx(100 * 0.25**0.25)
    short = score_translations(["the cat sat on the"], ref)
    assert short.bleu_precisions == pytest.approx((100, 100, 100, 100))
    assert short.brevity_penalty == pytest.approx(
        math.exp(1 - 7 / 5)
    ) and short.length_ratio == pytest.approx(5 / 7)
    assert short.bleu == pytest.approx(100 * math.exp(1 - 7 / 5))
    assert bleu_parts(long.bleu_precisions, long.brevity_penalty, long.length_ratio) == (
        "87.5/71.4/66.7/60.0, BP 1.000, length ratio 1.143"
    )


def test_chinese_references_are_scored_with_sacrebleus_zh_tokenizer() -> None:
    assert [bleu_tokenizer(d) for d in ("en-zh", "zh-en", "de-en", "en-fr")] == ["zh", "13a", "13a", "13a"]
    ref, hyp = ["点击此处打开宏管理器对话框。"], ["点击此处打开对话框。"]
    zh, plain = score_translations(hyp, ref, "zh"), score_translations(hyp, ref)
    assert "tok:zh" in zh.bleu_signature
    assert plain.bleu == 0.0 < zh.bleu  # without word boundaries 13a sees one "word" per sentence


# ----------------------------------------------------------------------------- learning


def synthetic_batch(gen: torch.Generator, n: int, transform) -> tuple[torch.Tensor, ...]:
    """Sequences of 3..6 symbols (ids 3..8): src = x + EOS, tgt = transform(x) (+ BOS / EOS)."""
    lengths = torch.randint(3, 7, (n,), generator=gen)
    s = int(lengths.max()) + 1
    src = torch.full((n, s), PAD)
    tgt_in, tgt_out = torch.full((n, s), PAD), torch.full((n, s), IGNORE_INDEX)
    for i, length in enumerate(lengths.tolist()):
        x = torch.randint(3, 9, (length,), generator=gen)
        y = transform(x)
        src[i, : length + 1] = torch.cat([x, torch.tensor([EOS])])
        tgt_in[i, : length + 1] = torch.cat([torch.tensor([BOS]), y])
        tgt_out[i, : length + 1] = torch.cat([y, torch.tensor([EOS])])
    return src, src != PAD, tgt_in, tgt_out


@pytest.mark.parametrize("name,transform", [("copy", lambda x: x), ("reverse", lambda x: x.flip(0))])
def test_tiny_seq2seq_learns_to_copy_and_to_reverse(name, transform) -> None:
    torch.manual_seed(0)
    cfg = tiny("encoder_decoder").replace(vocab_size=9, d_model=32, n_heads=2, d_ff=64, max_seq_len=16)
    model = build_model(cfg)
    steps = 200
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        src, mask, tgt_in, tgt_out = synthetic_batch(gen, 64, transform)
        logits = model(src, tgt_in, mask, None)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=IGNORE_INDEX)
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    src, mask, _, tgt_out = synthetic_batch(torch.Generator().manual_seed(99), 100, transform)
    hyps = sample_search(model.eval(), src, mask, bos_id=BOS, eos_id=EOS, max_len=10, banned=(PAD, BOS))
    wanted = [[t for t in row.tolist() if t not in (IGNORE_INDEX, EOS)] for row in tgt_out]
    exact = sum(h.tokens == w for h, w in zip(hyps, wanted)) / len(wanted)
    assert exact >= 0.9, f"{name}: {exact:.0%} exact"


# ----------------------------------------------------------------------------- the task


def small_config(dictionary: Path, **changes):
    cfg = tiny_translation()
    return cfg.replace(data=cfg.data.replace(path=str(dictionary)), **changes)


@pytest.mark.parametrize(
    "model_changes",
    [
        {"norm_placement": "post", "positions": "sinusoidal"},
        {"positions": "rope", "ffn": "swiglu", "norm": "rmsnorm"},
        {"moe": {"n_experts": 4, "top_k": 2}},
        {"moe": {"n_experts": 8, "top_k": 2, "d_expert": 16, "n_shared": 1, "first_dense": 1}},
    ],
    ids=["post-norm", "rope", "moe", "deepseekmoe"],
)
def test_variants_train_on_the_translation_task(dictionary_file: Path, tmp_path: Path, model_changes) -> None:
    cfg = small_config(dictionary_file, steps=2, eval_every=2, eval_batches=1)
    cfg = cfg.with_overrides({f"model.{k}": v for k, v in model_changes.items()} | {"model.n_layers": 2})
    trainer = Trainer(cfg, tmp_path / "run", make_task("translation"), progress=False)
    report = trainer.fit()
    assert report["step"] == 2 and report["eval_loss"] < 20 and 0 <= report["bleu"] <= 100


def test_resume_refuses_pairs_changed_since_the_run_started(dictionary_file: Path, tmp_path: Path) -> None:
    """Translation had re-read the dictionary and re-recorded data.json on resume, whatever it held now."""
    import shutil

    from tformer.schema import ConfigError

    dictionary = tmp_path / "de-en"
    shutil.copy(dictionary_file, dictionary)
    cfg = small_config(dictionary, steps=2, eval_every=2, eval_batches=1, save_every=1)
    Trainer(cfg, tmp_path / "run", make_task("translation"), progress=False).fit(until=1)
    lines = dictionary.read_text().splitlines()
    dictionary.write_text("\n".join(lines[: len(lines) // 2]) + "\n")
    with pytest.raises(ConfigError, match=r"split\(s\) of .* differ from those this run recorded"):
        Trainer(cfg, tmp_path / "run", make_task("translation"), resume=True, progress=False)
    dictionary.write_text("\n".join(lines) + "\n")  # restored: the run goes on
    assert (
        Trainer(cfg, tmp_path / "run", make_task("translation"), resume=True, progress=False).fit()["step"]
        == 2
    )


def test_separate_vocabularies(dictionary_file: Path, tmp_path: Path) -> None:
    cfg = small_config(dictionary_file, steps=1, eval_batches=1)
    cfg = cfg.replace(data=cfg.data.replace(tokenizer="separate", vocab_size=280, src_vocab_size=300))
    trainer = Trainer(cfg, tmp_path / "sep", make_task("translation"), progress=False)
    trainer.fit()
    model = trainer.model
    assert model.cfg.share_embeddings is False and model.src_embed is not model.tok_embed
    assert model.src_embed.num_embeddings != model.tok_embed.num_embeddings
    translator = load_translator(load_run(tmp_path / "sep"))
    assert translator.src_tok != translator.tgt_tok
    assert (
        len(translator.translate(["Der alte Hund sieht die Katze.", "Der Mann."], SearchConfig(max_len=8)))
        == 2
    )
    # the checkpoint keeps the source vocabulary too: deleted, it is restored; another one is refused
    source = tmp_path / "sep" / "src_tokenizer.json"
    kept = source.read_text()
    source.unlink()
    assert load_translator(load_run(tmp_path / "sep")).src_tok == translator.src_tok  # the checkpoint's own
    longer = cfg.replace(steps=2)
    with pytest.warns(UserWarning, match="src_tokenizer.json was missing: restored from"):
        Trainer(longer, tmp_path / "sep", make_task("translation"), resume=True, progress=False).close()
    assert source.read_text() == kept
    source.write_text((tmp_path / "sep" / "tokenizer.json").read_text())  # the target's: other ids
    from tformer.train.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="src_tokenizer.json is not the vocabulary step_000001 was"):
        Trainer(longer, tmp_path / "sep", make_task("translation"), resume=True, progress=False)
    # a checkpoint of an older version, which kept no copy of the source vocabulary (its manifest updated)
    from tformer.train.checkpoint import file_entry

    step = tmp_path / "sep" / "checkpoints" / "step_000001"
    meta = json.loads((step / "meta.json").read_text())
    del meta["meta"]["src_tokenizer"]
    (step / "meta.json").write_text(json.dumps(meta))
    commit = json.loads((step / "COMMITTED").read_text())
    commit["files"]["meta.json"] = file_entry(step / "meta.json")
    (step / "COMMITTED").write_text(json.dumps(commit))
    source.unlink()
    with pytest.raises(
        FileNotFoundError, match="the source tokenizer .* is missing, and this run's checkpoint keeps no copy"
    ):
        Trainer(longer, tmp_path / "sep", make_task("translation"), resume=True, progress=False)
    source.write_text(kept)  # put back: the run goes on, and its translator reads the file
    Trainer(longer, tmp_path / "sep", make_task("translation"), resume=True, progress=False).close()


def test_dictionary_terms_join_the_training_pairs(dictionary_file: Path, tmp_path: Path) -> None:
    cfg = small_config(dictionary_file, steps=1, eval_batches=1)
    cfg = cfg.replace(data=cfg.data.replace(dictionary_terms=2))
    Trainer(cfg, tmp_path / "terms", make_task("translation"), progress=False).fit()
    manifest = json.loads((tmp_path / "terms" / "data.json").read_text())
    plain = load_corpus("trans-de-en", path=str(dictionary_file), direction="de-en")
    assert manifest["train_pairs_used"] == len(plain["train"]) + 2  # "Hund :: dog", "Katzen :: cats"...
    assert "2 of 3 dictionary terms" in manifest["split_rule"]
    with pytest.raises(ConfigError, match="dictionary_terms"):
        DataConfig(corpus="shakespeare", dictionary_terms=10)


def test_libreoffice_english_to_chinese_trains_and_scores_with_zh_bleu(tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "lo")
    overrides = ["data.corpus=libreoffice", "data.direction=en-zh", "data.vocab_size=400", "steps=2"]
    overrides.append("data.max_train_docs=500")
    argv = ["train", "--preset", "tiny-translation", "--out", out, "--no-progress"]
    assert main([*argv, *(x for o in overrides for x in ("--set", o))]) == 0
    manifest = json.loads((tmp_path / "lo" / "data.json").read_text())
    assert manifest["name"] == "libreoffice" and manifest["direction"] == "en-zh"
    assert manifest["train_pairs_used"] == 500
    capsys.readouterr()
    assert main(["eval", "--run", out, "--max-batches", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["data"] == "libreoffice en-zh test split" and result["sentences"] == 32
    assert "tok:zh" in result["bleu_signature"]


@pytest.fixture(scope="module")
def trained_run(dictionary_file: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mt") / "run"
    code = main(
        [
            "train",
            "--preset",
            "tiny-translation",
            "--set",
            f"data.path={dictionary_file}",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    return out


def test_train_translate_eval_cli(trained_run: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    run = str(trained_run)
    assert (trained_run / "data.json").exists() and (trained_run / "tokenizer.json").exists()
    capsys.readouterr()
    assert main(["translate", "--run", run, "--text", "Der alte Hund sieht die Katze."]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert main(["translate", "--run", run, "--text", "Der Hund.", "--greedy", "--scores"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    float(line.rsplit("\t", 1)[1])
    assert main(["translate", "--run", run, "--text", "Der Hund.", "--greedy", "--max-len", "500"]) == 0
    assert "--max-len 500 is above the model's context: outputs stop at" in capsys.readouterr().err
    path = tmp_path / "in.txt"
    path.write_text(
        "Der alte Hund sieht die Katze.\n\n  \nDer junge Mann mag das Kind.\n\n", encoding="utf-8"
    )
    assert (
        main(["translate", "--run", run, "--file", str(path), "--beam", "2", "--length-penalty", "1.0"]) == 0
    )
    captured = capsys.readouterr()
    lines = captured.out.splitlines()  # one output line per input line: the skipped ones empty
    assert len(lines) == 5 and lines[1] == lines[2] == lines[4] == "" and lines[0] and lines[3]
    assert "line 2 is empty: skipped" in captured.err and "line 5 is empty" in captured.err
    monkeypatch.setattr("sys.stdin", io.StringIO("Der Vogel hört das Pferd.\n" + "Hund " * 60 + "\n"))
    assert main(["translate", "--run", run, "--sample", "--seed", "3", "--max-len", "5"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2
    assert (
        "line 2 is longer than 31 tokens (the model reads 32, the EOS among them): truncated" in captured.err
    )
    sampled = {}  # --seed reaches the sampler: the same seed the same text, seeds differ somewhere
    for seed in ("3", "3", "4", "5"):
        assert (
            main(
                [
                    "translate",
                    "--run",
                    run,
                    "--sample",
                    "--seed",
                    seed,
                    "--text",
                    "Der alte Hund sieht die Katze.",
                ]
            )
            == 0
        )
        sampled.setdefault(seed, []).append(capsys.readouterr().out)
    assert sampled["3"][0] == sampled["3"][1] and len({sampled[k][0] for k in sampled}) > 1
    text_file = tmp_path / "notes.txt"
    text_file.write_text("Der Hund.\n")
    assert main(["eval", "--run", run, "--text-file", str(text_file)]) == 2
    assert "--text-file is for language-model runs; this is a translation run" in capsys.readouterr().err
    assert main(["eval", "--run", run, "--max-batches", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sentences"] == 32 and 0 <= result["bleu"] <= 100 and result["copy_bleu"] >= 0
    assert Path(result["translations"]).read_text().count("\n") == 32
    assert Path(result["translations"]).name == "translations_test_sample.txt"  # the full split's stays
    assert main(["eval", "--run", run, "--split", "val", "--json"]) == 0  # the default --max-batches: all
    whole = json.loads(capsys.readouterr().out)
    assert Path(whole["translations"]).name == "translations_val.txt", whole["translations"]
    assert whole["sentences"] == whole["split_sentences"] and result["split_sentences"] > 32
    assert main(["eval", "--run", run, "--max-batches", "1"]) == 0  # the text output names the file
    out = capsys.readouterr().out
    assert f"translations: {result['translations']}" in out
    assert (
        f"32 of the split's {result['split_sentences']} sentences, --max-batches, beam 4" in out
    )  # a sample, said
    Path(result["translations"]).unlink()
    Path(result["translations"]).mkdir()  # a file that cannot be written: said, the scores still printed
    with pytest.warns(
        UserWarning, match="the translations were not written to .*translations_test_sample.txt"
    ):
        assert main(["eval", "--run", run, "--max-batches", "1"]) == 0
    assert "BLEU" in capsys.readouterr().out
    Path(result["translations"]).rmdir()
    from tformer.tasks.translation import format_result

    assert (
        result["hyp_len"] > 0 and len(result["bleu_precisions"]) == 4 and 0 < result["brevity_penalty"] <= 1
    )
    parts = bleu_parts(result["bleu_precisions"], result["brevity_penalty"], result["length_ratio"])
    assert f"BLEU {result['bleu']:.2f} ({parts}) | chrF" in format_result(result)
    text = format_result(
        result | {"sources_truncated": 3, "outputs_unfinished": 0}
    )  # the JSON's fields, said
    assert "| 3 sources longer than the run's max length, truncated\nsacrebleu signature: " in text
    text = format_result(result | {"sources_truncated": 1, "outputs_unfinished": 2})
    assert (
        "| 1 source longer than the run's max length, truncated | 2 outputs cut at the length limit before an "
        "end token\nsacrebleu signature: "
    ) in text


def test_scores_pair_each_translation_with_its_own_reference(trained_run: Path) -> None:
    """`tformer eval` and the training-time evaluation score translation i against reference i, and the
    copy baseline the sources against the references (chrF tells a misalignment even near BLEU 0, as the
    tiny model's is: the scores are compared exactly)."""
    from tformer.tasks.translation import evaluate_run, load_translation_corpus
    from tformer.train.config import TrainConfig

    cfg = TrainConfig.load(trained_run / "config.json")
    pairs = list(load_translation_corpus(cfg.data)["val"])
    srcs, refs = [p.src for p in pairs], [p.tgt for p in pairs]
    result = evaluate_run(trained_run, split="val")
    hyps = Path(result["translations"]).read_text(encoding="utf-8").splitlines()
    assert len(hyps) == len(refs) == result["sentences"]
    mine = score_translations(hyps, refs)
    assert (result["bleu"], result["chrf"]) == (mine.bleu, mine.chrf)
    assert abs(score_translations(hyps, refs[::-1]).chrf - mine.chrf) > 1e-3  # the pairing shows (tiny model)
    copied = score_translations(srcs, refs)
    assert (result["copy_bleu"], result["copy_chrf"]) == (copied.bleu, copied.chrf)
    Path(result["translations"]).unlink()

    class Perfect:  # translates every validation source into its own reference
        def translate(self, sources, search_cfg, warn=True):
            return [dict(zip(srcs, refs))[s] for s in sources]

    trainer = Trainer(cfg, trained_run, make_task("translation"), resume=True, progress=False)
    trainer.task.translator = lambda model: Perfect()
    during = trainer.task.evaluate(trainer.model, None, "val")
    assert during["bleu"] == pytest.approx(100.0) and during["chrf"] == pytest.approx(100.0)
    trainer.close()


def test_bad_input_gives_one_line_errors(trained_run: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    def error(argv: list[str]) -> str:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and [line for line in err.splitlines() if ": error: " in line] == [
            err.splitlines()[-1]
        ]
        return err.splitlines()[-1]

    run = str(trained_run)
    assert "text is empty" in error(["translate", "--run", run, "--text", "   "])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert "no non-empty line" in error(["translate", "--run", run, "--file", str(empty)])
    assert "does not exist" in error(["translate", "--run", run, "--file", str(tmp_path / "nope.txt")])
    assert "not both" in error(["translate", "--run", run, "--greedy", "--sample", "--text", "Hund"])
    sampled_at_zero = error(["translate", "--run", run, "--sample", "--temperature", "0", "--text", "Hund"])
    assert "--temperature must be finite and > 0 (--greedy for argmax), got 0.0" in sampled_at_zero
    no_length = error(["translate", "--run", run, "--max-len", "0", "--text", "Hund"])
    assert "--max-len must be >= 1 (or leave --max-len out: from the source length), got 0" in no_length
    out = str(tmp_path / "x")
    missing = error(
        ["train", "--preset", "tiny-translation", "--set", f"data.path={tmp_path / 'no-file'}", "--out", out]
    )
    assert "trans-de-en dictionary not found at" in missing and "use data.corpus=pairs:" in missing
    import functools

    import tformer.data.corpora as corpora

    # the package not installed: the loader at its default location, which holds nothing here
    absent = functools.partial(corpora.load_trans_de_en, path=tmp_path / "no-package" / "de-en")
    monkeypatch.setitem(corpora.CORPORA, "trans-de-en", absent)
    missing = error(["train", "--preset", "tiny-translation", "--set", "data.path=null", "--out", out])
    assert missing.endswith("Install it with: apt-get update && apt-get install -y trans-de-en")
    monkeypatch.undo()
    assert "available: bbc-news" in error(
        ["train", "--preset", "tiny-translation", "--set", "data.corpus=wmt14", "--out", out]
    )
    assert "'en-de' or 'de-en'" in error(
        ["train", "--preset", "tiny-translation", "--set", "data.direction=en-fr", "--out", out]
    )
    assert "classification corpus" in error(
        ["train", "--preset", "tiny-translation", "--set", "data.corpus=bbc-news", "--out", out]
    )
    assert "not a classification run" in error(["classify", "--run", run, "--text", "Hund"])
    assert "--length-penalty must be in [-10, 10]" in error(  # it had overflowed in a traceback
        ["translate", "--run", run, "--text", "Hund", "--length-penalty", "1000"]
    )
    assert "no pair of the train split fits data.seq_len=4" in error(  # a val loss had read 0 over 0 tokens
        ["train", "--preset", "tiny-translation", "--set", "data.seq_len=4", "--out", out]
    )
    assert not Path(out).exists()


def test_one_output_line_per_input_line(trained_run: Path, tmp_path: Path, capsys) -> None:
    """Input is split at newlines only (U+2028 and form feeds had split a line); an output the byte-level
    vocabulary spells with line breaks or tabs is kept on one line."""
    from tformer.generate.beam import Hypothesis
    from tformer.runs import load_run
    from tformer.tasks.translation import load_translator

    path = tmp_path / "in.txt"
    path.write_text("Der Hund\u2028sieht die Katze.\nDer Mann\x0cmag das Kind.\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", "--run", str(trained_run), "--file", str(path), "--greedy"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split("\n")) == 3 and "empty" not in captured.err  # 2 lines and the last \n
    translator = load_translator(load_run(trained_run))
    ids = translator.tgt_tok.encode("a\nb\tc\r\nd")
    assert translator.text(Hypothesis(ids, 0.0, 0.0, True)) == "a b c  d"


@pytest.mark.parametrize("method", [[], ["--greedy"], ["--sample", "--seed", "5"]])
def test_a_file_is_translated_chunk_by_chunk_as_in_one_piece(
    method, trained_run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """Output chunk by chunk (printed as each is done) equals the output of the whole file as one chunk
    (sampling: draws one stream over the chunks, in another order than in one chunk, and repeats with its
    seed); the sources cut to the run's max length get one warning that counts them and names their lines."""
    from tformer.cli import translate

    sentences = ["Der Hund.", "Die Katze sieht den Mann.", "", "Hund " * 40, "Das Kind.", "Katze " * 50]
    path = tmp_path / "in.txt"
    path.write_text("\n".join(sentences * 3) + "\n", encoding="utf-8")
    argv = ["translate", "--run", str(trained_run), "--file", str(path), "--max-len", "6", *method]
    outputs = []
    for chunk in (4, 4) if "--sample" in method else (1000, 4):
        monkeypatch.setattr(translate, "CHUNK_LINES", chunk)
        capsys.readouterr()
        assert main(argv) == 0
        outputs.append(capsys.readouterr())
    assert outputs[0].out == outputs[1].out and len(outputs[0].out.splitlines()) == 18
    err = outputs[1].err
    assert (
        f"{path}: 6 lines are longer than 31 tokens (the model reads 32, the EOS among them): truncated (lines 4, 6, 10, 12, 16, ...)"
        in err
    )
    assert err.count("longer than") == 1 and err.count("is empty: skipped") == 3


def test_min_len_reaches_the_command_line(trained_run: Path, capsys) -> None:
    run = str(trained_run)
    assert (
        main(
            ["translate", "--run", run, "--text", "Der Hund.", "--greedy", "--min-len", "5", "--max-len", "6"]
        )
        == 0
    )
    assert capsys.readouterr().out.strip()  # five tokens: no empty line
    assert main(["translate", "--run", run, "--text", "Der Hund.", "--min-len", "-1"]) == 2
    assert "--min-len must be in [0" in capsys.readouterr().err
    assert main(["translate", "--run", run, "--text", "Der Hund.", "--min-len", "5", "--max-len", "5"]) == 2
    assert "--min-len 5 leaves no room for the end within --max-len 5" in capsys.readouterr().err
    # the default min_len too (--max-len 1 had returned one unfinished token without a word)
    assert main(["translate", "--run", run, "--text", "Der Hund.", "--max-len", "1"]) == 2
    assert (
        "--min-len 1 (the default) leaves no room for the end within --max-len 1" in capsys.readouterr().err
    )
    # a --min-len past the length the source gives (1.5 x its tokens + 10) raises it: the output had been cut
    # there, shorter than --min-len and unfinished, without a word
    from tformer.generate.beam import SearchConfig

    assert SearchConfig(min_len=20).max_lens(torch.tensor([4, 30]), 64).tolist() == [21, 55]
    assert (
        main(["translate", "--run", run, "--text", "Der Hund.", "--greedy", "--min-len", "20", "--scores"])
        == 0
    )
    from tformer.tasks.translation import load_translator

    translator = load_translator(run)
    (hyp,) = translator.hypotheses(
        translator.encode(["Der Hund."])[0], SearchConfig(method="greedy", min_len=20)
    )
    assert len(hyp.tokens) >= 20


def test_the_python_api_takes_a_run_or_its_path_and_names_a_wrong_search(trained_run: Path) -> None:
    from tformer.generate.beam import SearchConfig
    from tformer.runs import load_run
    from tformer.tasks.classification import load_classifier
    from tformer.tasks.translation import load_translator

    greedy = SearchConfig(method="greedy")
    by_path = load_translator(str(trained_run)).translate(["Der Hund"], greedy)
    assert by_path == load_translator(load_run(trained_run)).translate(["Der Hund"], greedy)
    with pytest.raises(
        TypeError, match=r"cfg must be a SearchConfig \(e.g. SearchConfig\(beam_size=4\)\), got NoneType"
    ):
        load_translator(trained_run).translate(["Der Hund"], None)
    with pytest.raises(
        ValueError, match="is a translation run, not a classification run; use tformer translate"
    ):
        load_classifier(trained_run)
    with pytest.raises(
        TypeError, match=r"run must be a run from tformer.runs.load_run \(or its path\), got int"
    ):
        load_translator(3)
    with pytest.raises(ValueError, match=r"device 'gpu' is not one torch knows \(e.g. 'auto', 'cpu', 'cuda'"):
        load_run(trained_run, device="gpu")


def test_a_users_own_pairs_train_and_translate(tmp_path: Path, capsys) -> None:
    """`data.corpus=pairs:FILE`: the user's tab-separated pairs, end to end; data.path for the installed
    corpus names what to use instead when it finds no dictionary there."""
    words = {"hund": "dog", "katze": "cat", "mann": "man", "frau": "woman", "kind": "child", "baum": "tree"}
    rng = random.Random(0)
    lines = []
    for _ in range(200):
        chosen = rng.choices(list(words), k=rng.randint(2, 5))
        lines.append(" ".join(chosen) + "\t" + " ".join(words[w] for w in chosen))
    (tmp_path / "mine.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny-translation", "--set", f"data.corpus=pairs:{tmp_path / 'mine.tsv'}"]
    assert main([*argv, "--set", "steps=2", "--out", str(out), "--no-progress"]) == 0
    assert json.loads((out / "data.json").read_text())["name"] == f"pairs:{tmp_path / 'mine.tsv'}"
    capsys.readouterr()
    assert main(["translate", "--run", str(out), "--text", "hund katze"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert main(["eval", "--run", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sentences"] == len(
        load_corpus(f"pairs:{tmp_path / 'mine.tsv'}")["test"]
    )
    with open(tmp_path / "mine.tsv", "a", encoding="utf-8") as f:  # more pairs since: the splits move
        f.write("".join(f"hund {i} mann\tdog {i} man\n" for i in range(100)))
    with pytest.warns(UserWarning, match="the test split differs from the one this run recorded"):
        assert main(["eval", "--run", str(out), "--max-batches", "1", "--json"]) == 0
    assert (
        main(
            [
                "train",
                "--preset",
                "tiny-translation",
                "--set",
                f"data.path={tmp_path}",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "for your own data use data.corpus=pairs:<file of source<TAB>target lines>" in err
    assert "Install it with" not in err  # the user's path: installing the package would not help


def test_a_small_dictionary_copy_says_the_held_out_splits_take_most_of_it(dictionary_file: Path) -> None:
    """A user's smaller copy had trained on what the fixed 500 + 1,000 held-out pairs left, silently."""
    from tformer.data import corpora

    corpora.load_trans_de_en.cache_clear()
    with pytest.warns(
        UserWarning, match=r"yields [\d,]+ clean sentence pairs, .*take 1,500 of them.*data.corpus=pairs:"
    ):
        load_corpus("trans-de-en", path=str(dictionary_file))


# ----------------------------------------------------------------------------- found by a mutation audit
def spread_of(items: list, n: int) -> list:
    """n items taken evenly over `items`, first included (what a limited evaluation promises)."""
    return [items[i * len(items) // n] for i in range(n)]


def test_eval_of_a_sample_takes_it_spread_over_the_split_and_scores_the_loss_on_it(trained_run: Path) -> None:
    from tformer.tasks.translation import evaluate_run, load_translation_corpus
    from tformer.train.config import TrainConfig

    cfg = TrainConfig.load(trained_run / "config.json")
    result = evaluate_run(trained_run, split="test", max_batches=1)
    sample = spread_of(list(load_translation_corpus(cfg.data)["test"]), 32)  # TEST_SEARCH.batch_size 32
    srcs, refs = [p.src for p in sample], [[p.tgt for p in sample]]
    assert result["sentences"] == 32
    # the copy baseline is computed on the pairs scored (chrF: German copied into English is near BLEU 0)
    assert result["copy_bleu"] == pytest.approx(sacrebleu.corpus_bleu(srcs, refs).score)
    assert result["copy_chrf"] == pytest.approx(sacrebleu.corpus_chrf(srcs, refs).score)
    assert result["loss_pairs"] <= result["sentences"]  # the loss is on the sample too
    Path(result["translations"]).unlink()


def set_up_task(cfg, run_dir: Path):
    """The translation task set up on the CPU for `cfg` (its corpus read, tokenizers trained) in run_dir."""
    task = make_task("translation")
    task.setup(cfg, run_dir, torch.device("cpu"))
    return task


def test_the_model_config_has_positions_for_data_seq_len(dictionary_file: Path, tmp_path: Path) -> None:
    """data.seq_len above model.max_seq_len: the model gets positions for data.seq_len tokens."""
    cfg = small_config(dictionary_file)
    longer = cfg.model.max_seq_len + 16
    cfg = cfg.replace(data=cfg.data.replace(seq_len=longer))
    task = set_up_task(cfg, tmp_path)
    assert task.model_config(cfg).max_seq_len == longer


def test_the_manifest_counts_the_training_pairs_too_long_for_seq_len(
    dictionary_file: Path, tmp_path: Path
) -> None:
    """data.json's train_pairs_too_long: the training pairs whose source (+EOS) exceeds seq_len tokens or
    whose target exceeds seq_len - 1 tokens, counted here with the run's own tokenizer."""
    cfg = small_config(dictionary_file)
    n = 25  # the pairs are 17..29 source and 15..27 target tokens
    cfg = cfg.replace(data=cfg.data.replace(seq_len=n))
    with pytest.warns(
        UserWarning, match=r"of the [\d,]+ training pairs are longer than data.seq_len=25 tokens"
    ):
        task = set_up_task(cfg, tmp_path)  # said, not only recorded in data.json
    train = list(task.corpus["train"])
    tok = task.src_tok
    too_long = sum(
        len(tok.encode(p.src, add_eos=True)) > n or len(task.tgt_tok.encode(p.tgt)) > n - 1 for p in train
    )
    manifest = json.loads((tmp_path / "data.json").read_text())
    assert 0 < too_long < len(train)  # the premise: some fit, some do not
    assert manifest["train_pairs_too_long"] == too_long and manifest["train_pairs_used"] == len(train)


def test_eval_counts_cut_sources_and_takes_the_loss_on_every_fitting_pair(
    trained_run: Path, monkeypatch
) -> None:
    """evaluate_run with a short data.seq_len: sources_truncated counts the sources over it, loss_pairs
    the pairs that fit, and eval_loss is the loss per target token over all of those, computed here pair by
    pair (the sample of 100 pairs: more than one loss batch of 64); outputs_unfinished counts the
    translations the search cut at the length limit (max_len 3: a tiny model's often are)."""
    from tformer.tasks.translation import Translator

    found = []
    search = Translator.hypotheses

    def spy(self, *args, **kwargs):
        found.extend(out := search(self, *args, **kwargs))
        return out

    monkeypatch.setattr(Translator, "hypotheses", spy)
    run = load_run(trained_run)
    n = 26  # the test pairs are 18..29 source, 15..27 target tokens
    run = dataclasses.replace(
        run, train_config=run.train_config.replace(data=run.train_config.data.replace(seq_len=n))
    )
    cfg = SearchConfig(method="greedy", batch_size=50, max_len=3)
    result = evaluate_run(run, split="test", search_cfg=cfg, max_batches=2)
    pairs = spread_of(list(load_translation_corpus(run.train_config.data)["test"]), 100)
    tok = run.tokenizer
    src = [tok.encode(p.src, add_eos=True) for p in pairs]
    tgt = [tok.encode(p.tgt) for p in pairs]
    fits = [(s, t) for s, t in zip(src, tgt) if len(s) <= n and len(t) <= n - 1]
    assert result["sentences"] == 100
    assert result["sources_truncated"] == sum(len(s) > n for s in src) > 0
    assert len(found) == 100 and result["outputs_unfinished"] == sum(not h.finished for h in found) > 0
    assert all(len(h.tokens) == 3 for h in found if not h.finished)  # cut at max_len, the EOS not among them
    assert result["loss_pairs"] == len(fits) and 64 < len(fits) < 100
    model = run.model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for s, t in fits:
            logits = model(torch.tensor([s]), torch.tensor([[tok.bos_id] + t]), None, None)[0]
            total += float(F.cross_entropy(logits.float(), torch.tensor(t + [tok.eos_id]), reduction="sum"))
            count += len(t) + 1
    assert result["eval_loss"] == pytest.approx(total / count, rel=1e-4)
    Path(result["translations"]).unlink()


def test_train_loader_gives_each_rank_its_own_share(dictionary_file: Path, tmp_path: Path) -> None:
    """Two ranks' training batches in an epoch are disjoint and each is half the batches."""
    cfg = small_config(dictionary_file)
    task = set_up_task(cfg, tmp_path)
    loaders = [task.train_loader(cfg, rank, 2).loader for rank in (0, 1)]
    shares = [lo.batch_sampler.epoch_batches(0) for lo in loaders]
    whole = task.train_loader(cfg).loader.batch_sampler.epoch_batches(0)
    assert len(shares[0]) == len(shares[1]) == len(whole) // 2
    assert not {i for b in shares[0] for i in b} & {i for b in shares[1] for i in b}


def test_a_joint_vocabulary_is_trained_on_both_sides(dictionary_file: Path, tmp_path: Path) -> None:
    """The joint BPE spells the German sources in fewer tokens than one of the same size trained on the
    English side alone would (the joint one had been trained on the targets only)."""
    cfg = small_config(dictionary_file)
    task = set_up_task(cfg, tmp_path)
    train = list(task.corpus["train"])
    english_only = train_tokenizer([p.tgt for p in train], cfg.data.vocab_size)
    german = [p.src for p in task.corpus["val"]]
    assert task.src_tok is task.tgt_tok
    assert sum(len(task.src_tok.encode(t)) for t in german) < sum(len(english_only.encode(t)) for t in german)


def test_eval_of_a_checkpoint_copied_out_of_its_run_writes_beside_it(
    trained_run: Path, tmp_path: Path
) -> None:
    """A checkpoint directory outside a run's checkpoints/ folder is its own run directory: the
    translations go into it, not two levels up."""

    copy = tmp_path / "outside" / "kept"
    shutil.copytree(find_checkpoint(trained_run), copy)
    result = evaluate_run(
        copy, split="test", search_cfg=SearchConfig(method="greedy", max_len=2), max_batches=1
    )
    assert Path(result["translations"]).parent == copy


def test_the_training_evaluation_translates_sources_of_up_to_seq_len_tokens_uncut(
    dictionary_file: Path, tmp_path: Path
) -> None:
    """The task's translator keeps a source of exactly data.seq_len tokens (with EOS) and cuts one more."""
    cfg = small_config(dictionary_file)
    task = set_up_task(cfg, tmp_path)
    translator = task.translator(build_model(task.model_config(cfg)))
    n = cfg.data.seq_len
    texts = [text_of(task.src_tok, n, add_eos=True), text_of(task.src_tok, n + 1, add_eos=True)]
    ids, cut = translator.encode(texts)
    assert cut == [1] and ids[0] == task.src_tok.encode(texts[0], add_eos=True) and len(ids[1]) == n


def test_eval_scores_the_copy_baseline_with_the_directions_bleu_tokenizer(trained_run: Path) -> None:
    """An en-zh evaluation scores the copy-the-source baseline with sacrebleu's zh tokenizer, as it scores
    the translations (the de-en run's model stands in; only the plumbing of the scores is checked)."""

    run = load_run(trained_run)
    data = run.train_config.data.replace(corpus="libreoffice", direction="en-zh", path=None)
    run = dataclasses.replace(run, train_config=run.train_config.replace(data=data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the split differs from the run's recorded one: expected here
        result = evaluate_run(
            run,
            split="test",
            search_cfg=SearchConfig(method="greedy", batch_size=8, max_len=2),
            max_batches=1,
        )
    pairs = spread(list(load_translation_corpus(data)["test"]), 8)
    srcs, refs = [p.src for p in pairs], [[p.tgt for p in pairs]]
    zh = sacrebleu.corpus_bleu(srcs, refs, tokenize="zh").score
    assert zh != sacrebleu.corpus_bleu(srcs, refs).score  # the premise: 13a scores it otherwise
    assert result["copy_bleu"] == pytest.approx(zh)
    Path(result["translations"]).unlink()


def test_averaged_weights_write_their_own_translations(trained_run: Path, tmp_path: Path, capsys) -> None:
    """Two checkpoints of the same weights: the mean is those weights; eval names the steps and writes
    translations_<split>..._mean2.txt beside (never over) the newest checkpoint's own."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    newest = find_checkpoint(run)
    from tformer.train.checkpoint import checkpoint_meta, save_checkpoint

    save_checkpoint(run, 1, load_run(newest).model, meta=checkpoint_meta(newest))  # the same weights, step 1
    argv = ["eval", "--run", str(run), "--max-batches", "1", "--json"]
    assert main(argv) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main([*argv, "--average", "2"]) == 0
    out = capsys.readouterr()
    mean = json.loads(out.out)
    assert mean["averaged_steps"] == [1, alone["checkpoint_step"]] and alone["averaged_steps"] == []
    assert Path(mean["translations"]).name == "translations_test_sample_mean2.txt"
    assert Path(mean["translations"]).read_text() == Path(alone["translations"]).read_text()
    assert mean["bleu"] == alone["bleu"] and "weights: the mean of the checkpoints of steps 1, " in out.err
    from tformer.tasks.translation import format_result

    assert f"(step {alone['checkpoint_step']}, the mean of the 2 checkpoints of steps 1-" in format_result(
        mean
    )
    text = ["--text", "Der alte Hund sieht die Katze."]
    assert main(["translate", "--run", str(run), *text]) == 0
    once = capsys.readouterr().out
    assert main(["translate", "--run", str(run), *text, "--average", "2"]) == 0
    assert capsys.readouterr().out == once


def test_a_min_len_the_context_cannot_hold_is_an_error(trained_run: Path, capsys) -> None:
    """It had only warned that outputs stop at the context, then stopped them there without an end."""
    context = load_run(trained_run).model.cfg.max_seq_len
    argv = ["translate", "--run", str(trained_run), "--text", "Der Hund.", "--sample"]
    assert main([*argv, "--min-len", str(context), "--max-len", str(context + 50)]) == 2
    err = capsys.readouterr().err
    assert f"--min-len {context} leaves no room for the end within the model's context of {context}" in err
    assert main([*argv, "--min-len", str(context - 1), "--max-len", str(context + 50)]) == 0
