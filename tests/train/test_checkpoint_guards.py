"""What a checkpoint load refuses before it changes anything, and what a save promises beyond the round
trip: retention at any step count, deletion that never leaves a listed half, fsync of every file."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.train import test_checkpoint
from tests.train.helpers import edit_checkpoint_json
from tests.train.test_checkpoint import TinyLM, make, params, same
from tformer.train import checkpoint as ckpt
from tformer.train.checkpoint import (
    CheckpointError,
    capture_rng_state,
    checkpoint_meta,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    refuse_unfinished,
    save_checkpoint,
)

trained = test_checkpoint.trained  # the fixture: a TinyLM, its AdamW and schedule after 3 steps


def untouched(model, opt):
    """A snapshot of model and optimizer; calling it checks neither changed."""
    before, opt_before = params(model), opt.state_dict()

    def check() -> None:
        assert same(params(model), before)
        assert opt.state_dict() == opt_before

    return check


def test_an_optimizer_of_another_layout_is_refused_before_the_model_changes(tmp_path, trained):
    """torch's own load_state_dict would raise only after the model's weights had been replaced."""
    path = save_checkpoint(tmp_path, 3, *trained)
    model, _, _ = make(seed=9)
    split = torch.optim.AdamW(
        [{"params": [model.ffn.weight]}, {"params": [model.ffn.bias, model.tok_embed.weight]}]
    )
    check = untouched(model, split)
    with pytest.raises(CheckpointError, match=r"optimizer\.json: 1 param groups saved, 2 in the optimizer"):
        load_checkpoint(path, model, split)
    check()
    fewer = torch.optim.AdamW([model.ffn.weight, model.tok_embed.weight])  # the bias left out
    check = untouched(model, fewer)
    with pytest.raises(CheckpointError, match="param group 0 has 3 parameters in the checkpoint, 2 in the"):
        load_checkpoint(path, model, fewer)
    check()


def test_optimizer_state_of_another_shape_or_dtype_is_refused_before_anything_loads(tmp_path, trained):
    """Same group sizes, but each state tensor must fit its parameter: torch would load a mismatch and the
    fused update would then write out of bounds (a native crash)."""
    model, opt, sched = trained
    path = save_checkpoint(tmp_path, 3, model, opt, sched)
    fresh, _, _ = make(seed=9)
    order = [p for p in fresh.parameters()]  # the same parameters in another order: shapes swap places
    reordered = torch.optim.AdamW([order[1], order[0], *order[2:]])
    assert order[0].shape != order[1].shape
    check = untouched(fresh, reordered)
    with pytest.raises(
        CheckpointError, match=r"optimizer\.json: state\.0\.exp_avg is \(.*\), its parameter \("
    ):
        load_checkpoint(path, fresh, reordered)
    check()
    first = next(iter(opt.state.values()))  # another floating dtype: torch casts it to the parameter's
    first["exp_avg_sq"] = first["exp_avg_sq"].double()
    doubled = save_checkpoint(tmp_path, 4, model, opt, sched)
    fresh, fresh_opt, fresh_sched = make(seed=9)
    load_checkpoint(doubled, fresh, fresh_opt, fresh_sched)
    assert next(iter(fresh_opt.state.values()))["exp_avg_sq"].dtype == torch.float32


@pytest.mark.parametrize("kind", ["Adafactor", "LBFGS", "SGD"])
def test_other_optimizers_state_of_their_own_shapes_round_trips(tmp_path, kind):
    """Adafactor's factored rows and LBFGS's history are not parameter-shaped: still loaded."""
    model, _, _ = make(seed=1)
    make_opt = {"Adafactor": lambda p: torch.optim.Adafactor(p), "LBFGS": lambda p: torch.optim.LBFGS(p),
                "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}[kind]  # fmt: skip
    opt = make_opt(model.parameters())
    tokens = torch.randint(0, 16, (2, 8))

    def closure():
        opt.zero_grad()
        loss = model(tokens).float().pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)
    path = save_checkpoint(tmp_path, 1, model, opt)
    fresh, _, _ = make(seed=9)
    fresh_opt = make_opt(fresh.parameters())
    load_checkpoint(path, fresh, fresh_opt)
    assert same(params(fresh), params(model))
    assert str(fresh_opt.state_dict()["state"]) == str(opt.state_dict()["state"])


def test_a_save_refuses_counters_a_load_would_refuse(tmp_path, trained):
    for kwargs, error in (({"tokens_seen": 1e6}, "tokens_seen must be a whole number >= 0, got 1000000.0"),
                          ({"step": -1}, "step must be a whole number >= 0, got -1")):  # fmt: skip
        with pytest.raises(CheckpointError, match=error):
            save_checkpoint(tmp_path, **{"step": 1, **kwargs}, model=trained[0])
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(("key", "value", "error"), [
    ("step", -3, r"step must be a whole number >= 0, got -3"),
    ("step", 5, r"step 5, but its COMMITTED manifest says 3"),
    ("step", "abc", r"step must be a whole number >= 0, got 'abc'"),
    ("tokens_seen", 1.5, r"tokens_seen must be a whole number >= 0, got 1.5"),
    ("trainer_state.step", -3, r"trainer_state.step is -3, the checkpoint's step 3"),
    ("trainer_state.tokens_seen", 1.5, r"trainer_state.tokens_seen is 1.5, the checkpoint's tokens_seen"),
])  # fmt: skip
def test_a_trainer_json_whose_counters_were_edited_is_refused(tmp_path, trained, key, value, error):
    """Edited with its manifest entry rewritten to match: a resume had started at step -3 and rewritten
    the run's metrics from there (a resume starts from trainer_state, as the Trainer saves it)."""
    path = save_checkpoint(
        tmp_path, 3, *trained, tokens_seen=96, trainer_state={"step": 3, "tokens_seen": 96}
    )
    where, _, name = key.rpartition(".")
    edit_checkpoint_json(
        path, "trainer.json", lambda trainer: (trainer[where] if where else trainer).update({name: value})
    )
    fresh = make(seed=9)
    check = untouched(*fresh[:2])
    with pytest.raises(CheckpointError, match=r"trainer\.json: " + error):
        load_checkpoint(path, *fresh)
    check()


def test_a_scheduler_the_checkpoint_lacks_is_refused_before_anything_loads(tmp_path, trained):
    model, opt, _ = trained
    path = save_checkpoint(tmp_path, 3, model, opt)  # no scheduler
    fresh, fresh_opt, fresh_sched = make(seed=9)
    check = untouched(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=r"trainer\.json: holds no scheduler state"):
        load_checkpoint(path, fresh, fresh_opt, fresh_sched)
    check()


def test_strict_loading_refuses_keys_the_model_lacks(tmp_path):
    class Wider(TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.extra_proj = nn.Linear(8, 8)

    path = save_checkpoint(tmp_path, 1, Wider())
    model = TinyLM()
    before = params(model)
    with pytest.raises(
        CheckpointError, match=r"unexpected key 'extra_proj.bias' \(0 missing, 2 unexpected\)"
    ):
        load_checkpoint(path, model)
    assert same(params(model), before)
    loaded = load_checkpoint(path, model, strict=False)
    assert loaded.unexpected_keys == ["extra_proj.bias", "extra_proj.weight"] and loaded.missing_keys == []


def test_tied_weights_with_different_values_in_the_checkpoint_are_refused(tmp_path):
    class Untied(TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head.weight = nn.Parameter(torch.randn_like(self.tok_embed.weight))

    path = save_checkpoint(tmp_path, 1, Untied())
    model = TinyLM()
    before = params(model)
    with pytest.raises(
        CheckpointError, match="ties 'tok_embed.weight' and 'lm_head.weight' but the checkpoint"
    ):
        load_checkpoint(path, model)
    assert same(params(model), before)


def test_a_newer_format_is_refused(tmp_path, trained):
    path = save_checkpoint(tmp_path, 1, *trained)
    commit = json.loads((path / "COMMITTED").read_text())
    commit["format_version"] = ckpt.FORMAT_VERSION + 1
    (path / "COMMITTED").write_text(json.dumps(commit))
    with pytest.raises(
        CheckpointError, match=f"format_version {ckpt.FORMAT_VERSION + 1} > {ckpt.FORMAT_VERSION}"
    ):
        load_checkpoint(path, TinyLM())
    assert list_checkpoints(tmp_path) == []  # not listed as a checkpoint this version can resume


def test_one_rng_state_per_rank(tmp_path):
    with pytest.raises(CheckpointError, match=r"rng_state holds ranks \[0, 0\]; each rank must appear once"):
        save_checkpoint(tmp_path, 1, TinyLM(), rng_state=[capture_rng_state(0), capture_rng_state(0)])
    assert not (tmp_path / "checkpoints" / "step_000001").exists()


def test_sizes_are_checked_without_verify_and_metadata_with_its_digest(tmp_path, trained):
    path = save_checkpoint(tmp_path, 1, *trained, meta={"tokenizer": "abc"})
    trainer = (path / "trainer.json").read_bytes()
    (path / "trainer.json").write_bytes(trainer + b"\n\n")  # still valid JSON, two bytes longer
    model, opt, sched = make(seed=9)
    check = untouched(model, opt)
    with pytest.raises(
        CheckpointError,
        match=r"trainer\.json: \d+ bytes, manifest says \d+ \(written to since it was saved\?\)",
    ):  # longer than recorded: it had been called truncated
        load_checkpoint(path, model, opt, sched, verify=False)
    check()
    (path / "trainer.json").write_bytes(trainer[:-1])
    with pytest.raises(CheckpointError, match=r"trainer\.json: \d+ bytes, manifest says \d+ \(truncated\?\)"):
        load_checkpoint(path, model, opt, sched, verify=False)
    (path / "trainer.json").write_bytes(trainer)
    meta = (path / "meta.json").read_bytes()
    (path / "meta.json").write_bytes(meta.replace(b'"abc"', b'"abd"'))  # same size, other content
    with pytest.raises(CheckpointError, match=r"meta\.json: sha256 differs from the manifest"):
        checkpoint_meta(path)


def test_retention_orders_steps_by_number_past_six_digits(tmp_path):
    model = TinyLM()
    save_checkpoint(tmp_path, 999_999, model)
    newest = save_checkpoint(tmp_path, 1_000_000, model, keep_last=1)  # step_1000000 < step_999999 as text
    assert latest_checkpoint(tmp_path) == newest
    assert list_checkpoints(tmp_path) == [newest]


def test_a_damaged_directory_blocks_only_the_steps_a_run_will_write(tmp_path, trained):
    model = trained[0]
    save_checkpoint(tmp_path, 2, model)
    four = save_checkpoint(tmp_path, 4, model)
    (tmp_path / "checkpoints" / "step_000001").mkdir()  # damaged, behind the resume point
    refuse_unfinished(tmp_path, four)  # a resume from step 4 never writes step 1
    with pytest.raises(CheckpointError, match="step_000001 is not a committed checkpoint.*to start afresh"):
        refuse_unfinished(tmp_path, None)
    (tmp_path / "checkpoints" / "step_000006").mkdir()  # ahead of it: a later save would meet it
    with pytest.raises(CheckpointError, match="move step_000006 out of .* to resume from step_000004"):
        refuse_unfinished(tmp_path, four)


def test_retention_killed_mid_delete_never_leaves_a_listed_half(tmp_path, monkeypatch):
    """The old checkpoint leaves the step_* names before its files are deleted; the next save clears
    what a killed deletion left."""
    model = TinyLM()
    save_checkpoint(tmp_path, 1, model)
    real = ckpt.shutil.rmtree

    def killed(path, ignore_errors=False):  # the process dies after deleting one file
        (Path(path) / "model.safetensors").unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, model, keep_last=1)
    monkeypatch.setattr(ckpt.shutil, "rmtree", real)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002"]
    load_checkpoint(latest_checkpoint(tmp_path), TinyLM())
    save_checkpoint(tmp_path, 3, model, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003"]


def test_every_file_and_both_directories_are_synced(tmp_path, trained, monkeypatch):
    """B3: every file and the temporary directory are synced before the rename that commits the step, the
    checkpoints directory (which records the rename) after it."""
    events, real_fsync, real_rename = [], os.fsync, os.rename

    def recording(fd):
        events.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def renaming(src, dst, *args, **kwargs):
        events.append("<rename>")
        real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", recording)
    monkeypatch.setattr(os, "rename", renaming)
    path = save_checkpoint(tmp_path, 1, *trained)
    monkeypatch.undo()
    commit = events.index("<rename>")
    before, after = set(events[:commit]), events[commit + 1 :]
    assert {p.name for p in path.iterdir()} <= before  # COMMITTED among them
    assert any(s.startswith(".tmp-step_000001") for s in before)
    assert after == ["checkpoints"]


def test_trainer_state_that_looks_like_a_marker_comes_back_as_stored(tmp_path):
    state = {"x": {"__tuple__": [1, 2]}, "y": {"__tensor__": "a"}, "z": (3, {"__items__": []})}
    path = save_checkpoint(tmp_path, 1, TinyLM(), trainer_state=state)
    assert load_checkpoint(path, TinyLM()).trainer_state == state


def test_exported_and_checkpoint_headers_keep_8_byte_alignment(tmp_path, trained):
    from tformer.train.weights import save_weights

    save_weights(trained[0], tmp_path / "w.safetensors")
    path = save_checkpoint(tmp_path, 1, *trained)
    for file in (tmp_path / "w.safetensors", path / "model.safetensors", path / "optimizer.safetensors"):
        assert int.from_bytes(file.read_bytes()[:8], "little") % 8 == 0, file


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
def test_signals_the_process_ignores_stay_ignored(monkeypatch):
    """A run under nohup (SIGHUP ignored) goes on when its terminal closes."""
    from tformer.train.interrupt import SIGNALS, StopRequests

    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with StopRequests(announce=False):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not previous[signal.SIGTERM]  # the others are caught
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
