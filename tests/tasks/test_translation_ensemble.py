"""Ensembles of translation runs through the task and the CLI: `ensemble_of`, `translate --ensemble`,
`eval --ensemble` (its loss and files), and the runs an ensemble refuses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tformer.cli.main import main
from tformer.model.ensemble import Ensemble
from tformer.runs import load_run
from tformer.tasks.translation import ensemble_of, evaluate_run


def train(dictionary_file: Path, out: Path, *sets: str) -> Path:
    argv = ["train", "--preset", "tiny-translation", "--set", f"data.path={dictionary_file}"]
    assert main([*argv, *(x for kv in sets for x in ("--set", kv)), "--out", str(out), "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def runs(dictionary_file: Path, tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny runs of one vocabulary (the same data settings), other seeds and dropout."""
    root = tmp_path_factory.mktemp("ensemble")
    a = train(dictionary_file, root / "a")
    b = train(dictionary_file, root / "b", "seed=1", "model.dropout=0.1")
    return a, b


def test_the_ensembles_loss_is_below_its_members_mean_and_its_files_are_its_own(runs, capsys) -> None:
    """-log of a mean probability is at most the mean of the -logs (Jensen): the ensemble's test loss lies
    below the mean of its members' (computed here from the members' own results), and its translations
    file carries _ens2 and a digest of the other members (another 2-run ensemble writes its own)."""
    a, b = runs
    alone = [evaluate_run(load_run(r), max_batches=1) for r in runs]
    both = evaluate_run(ensemble_of(load_run(a), [load_run(b)]), max_batches=1)
    assert both["eval_loss"] < sum(r["eval_loss"] for r in alone) / 2
    assert both["ensemble"] == [str(load_run(b).checkpoint)] and alone[0]["ensemble"] == []
    assert re.fullmatch(r"translations_test_sample_ens2-[0-9a-f]{8}\.txt", Path(both["translations"]).name)
    itself = evaluate_run(ensemble_of(load_run(a), [load_run(a)]), max_batches=1)  # another 2-run ensemble
    assert Path(itself["translations"]).name != Path(both["translations"]).name
    assert main(["eval", "--run", str(a), "--ensemble", str(b), "--max-batches", "1"]) == 0
    captured = capsys.readouterr()
    assert "(step 4, in an ensemble with 1 more run, 32 of the split's" in captured.out
    assert (
        f"an ensemble of 2 runs' models: {load_run(a).checkpoint}, {load_run(b).checkpoint}\n" in captured.err
    )


def test_translate_with_an_ensemble_searches_the_averaged_models(runs, capsys, monkeypatch) -> None:
    a, b = runs
    seen = []
    from tformer.tasks.translation import Translator

    search = Translator.hypotheses
    monkeypatch.setattr(
        Translator, "hypotheses", lambda self, *x, **k: seen.append(self.model) or search(self, *x, **k)
    )
    assert main(["translate", "--run", str(a), "--ensemble", str(b), str(a), "--text", "Der Hund."]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    assert isinstance(seen[0], Ensemble) and len(seen[0]) == 3
    ensemble = ensemble_of(load_run(a), [load_run(b)])
    assert all(not m.training for m in ensemble.model.members)
    torch.testing.assert_close(  # the members are the runs' own weights
        ensemble.model.members[1].lm_head.weight, load_run(b).model.lm_head.weight
    )


def test_runs_an_ensemble_cannot_join_are_named(
    runs, dictionary_file: Path, bbc_root: Path, tmp_path, capsys
) -> None:
    a, _ = runs
    other = train(dictionary_file, tmp_path / "other", "data.vocab_size=280", "model.vocab_size=280")
    assert main(["translate", "--run", str(a), "--ensemble", str(other), "--text", "Der Hund."]) == 2
    err = capsys.readouterr().err
    assert "has other vocabularies than" in err and "the runs of an ensemble share their tokenizers" in err
    cls = tmp_path / "cls"
    argv = ["train", "--preset", "tiny-classification", "--set", f"data.path={bbc_root}", "--set", "steps=2"]
    assert main([*argv, "--out", str(cls), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["eval", "--run", str(cls), "--ensemble", str(a)]) == 2
    assert (
        capsys.readouterr().err
        == "tformer eval: error: --ensemble is for translation runs; this is a classification run\n"
    )
    assert main(["eval", "--run", str(a), "--ensemble", str(cls)]) == 2
    assert "step_000002 is a classification run, not a translation run" in capsys.readouterr().err
    png = str(tmp_path / "a.png")
    assert (
        main(["translate", "--run", str(a), "--ensemble", str(a), "--text", "Hund", "--plot-attention", png])
        == 2
    )
    assert capsys.readouterr().err == (
        "tformer translate: error: --plot-attention draws one model's attention: leave out --ensemble\n"
    )
    with pytest.raises(TypeError, match="others must be a list of runs"):
        ensemble_of(a, a)


def test_runs_of_another_context_join_and_the_loss_takes_the_shortest(
    runs, dictionary_file: Path, tmp_path
) -> None:
    """A member of a shorter context (data.seq_len and model.max_seq_len 22): the ensemble reads what every
    member can, in the search and in the loss (which had been built at the first run's 32 and failed)."""
    a, _ = runs
    short = train(dictionary_file, tmp_path / "short", "data.seq_len=22", "model.max_seq_len=22")
    result = evaluate_run(ensemble_of(load_run(a), [load_run(short)]), max_batches=1)
    assert result["seq_len"] == 22 and result["eval_loss"] is not None and result["sentences"] == 32


def test_the_other_direction_an_empty_list_and_an_ensemble_are_refused(
    runs, dictionary_file: Path, tmp_path
) -> None:
    a, b = runs
    back = train(dictionary_file, tmp_path / "back", "data.direction=en-de")
    assert load_run(back).tokenizer == load_run(a).tokenizer  # the premise: one joint vocabulary
    with pytest.raises(
        ValueError, match="has data.direction 'en-de', .* 'de-en': the runs of an ensemble translate"
    ):
        ensemble_of(load_run(a), [load_run(back)])
    with pytest.raises(ValueError, match="an ensemble needs at least one other run"):
        ensemble_of(load_run(a), [])
    with pytest.raises(ValueError, match="is already an ensemble: give all the runs in one call"):
        ensemble_of(ensemble_of(load_run(a), [load_run(b)]), [load_run(b)])


def test_every_member_gets_the_notes_run_gets(runs, dictionary_file: Path, tmp_path, capsys) -> None:
    """A member named by an older checkpoint, or averaged, is said as --run would be."""
    _, b = runs
    c = train(dictionary_file, tmp_path / "c", "save_every=2")  # checkpoints of steps 2 and 4
    older = c / "checkpoints" / "step_000002"
    capsys.readouterr()
    assert main(["translate", "--run", str(b), "--ensemble", str(older), "--text", "Der Hund."]) == 0
    assert (
        f"tformer translate: note: {older}: the weights of step 2 of the run's 4\n" in capsys.readouterr().err
    )
    again = f"{c}/."  # the same run as a member, named another way
    argv = ["translate", "--run", str(c), "--ensemble", again, "--average", "2", "--text", "Der Hund."]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "tformer translate: weights: the mean of the checkpoints of steps 2, 4\n" in err
    assert f"tformer translate: weights of {again}: the mean of the checkpoints of steps 2, 4\n" in err
