"""Checkpoint save / load / retention: round trips, atomicity, corruption, pickle safety."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from torch import nn

from tformer.train import checkpoint as ckpt
from tformer.train.checkpoint import (
    CheckpointError,
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from tformer.train.weights import import_torch_weights, load_weights, save_weights

V, D = 16, 8


class TinyLM(nn.Module):
    """Embedding and head share one weight; a buffer counts the tokens seen; dropout uses the RNG."""

    def __init__(self, d_model: int = D) -> None:
        super().__init__()
        self.tok_embed = nn.Embedding(V, d_model)
        self.ffn = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(0.3)
        self.lm_head = nn.Linear(d_model, V, bias=False)
        self.lm_head.weight = self.tok_embed.weight
        self.register_buffer("token_counts", torch.zeros(V, dtype=torch.long))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.token_counts += torch.bincount(ids.flatten(), minlength=V)
        return self.lm_head(self.drop(torch.relu(self.ffn(self.tok_embed(ids)))))


def make(seed: int = 0, d_model: int = D):
    torch.manual_seed(seed)
    model = TinyLM(d_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def train_step(model, opt, sched, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (4, 6), generator=gen)
    loss = nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, V), ids[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def trained():
    model, opt, sched = make()
    for s in range(3):
        train_step(model, opt, sched, s)
    return model, opt, sched


def test_resume_is_bit_identical(tmp_path, trained):
    model, opt, sched = trained
    path = save_checkpoint(
        tmp_path,
        3,
        model,
        opt,
        sched,
        tokens_seen=72,
        data_state={"epoch": 1, "index": (5, 7)},
        trainer_state={"best": 1.5, "ids": {0: "a"}},
        meta={"model": {"d_model": D}, "tokenizer": "{}"},
    )
    train_step(model, opt, sched, 3)  # the uninterrupted run (dropout draws from the saved RNG state)

    fresh, fresh_opt, fresh_sched = make(seed=123)
    torch.rand(5)  # move the RNG away from the saved state
    state = load_checkpoint(path, fresh, fresh_opt, fresh_sched)
    assert fresh.lm_head.weight is fresh.tok_embed.weight  # still tied
    train_step(fresh, fresh_opt, fresh_sched, 3)
    assert same(params(fresh), params(model))
    assert fresh_sched.state_dict() == sched.state_dict()
    assert (state.step, state.tokens_seen, state.data_state) == (3, 72, {"epoch": 1, "index": (5, 7)})
    assert state.trainer_state == {"best": 1.5, "ids": {0: "a"}}
    assert state.meta == {"model": {"d_model": D}, "tokenizer": "{}"}


def test_resume_without_rng_diverges(tmp_path, trained):
    """Negative control: the dropout in the step makes the resume test sensitive to the RNG."""
    model, opt, sched = trained
    path = save_checkpoint(tmp_path, 3, model, opt, sched)
    train_step(model, opt, sched, 3)
    fresh, fresh_opt, fresh_sched = make(seed=123)
    load_checkpoint(path, fresh, fresh_opt, fresh_sched, restore_rng=False)
    train_step(fresh, fresh_opt, fresh_sched, 3)
    assert not same(params(fresh), params(model))


def test_layout_and_tied_weight_saved_once(tmp_path, trained):
    path = save_checkpoint(tmp_path, 7, *trained)
    assert path == tmp_path / "checkpoints" / "step_000007"
    names = {p.name for p in path.iterdir()}
    assert {
        "model.safetensors",
        "optimizer.safetensors",
        "optimizer.json",
        "trainer.json",
        "rng.json",
        "rng.safetensors",
        "meta.json",
        "COMMITTED",
    } <= names
    assert not any(p.suffix in (".pt", ".pkl", ".bin") for p in path.iterdir())
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        stored = set(f.keys())
    assert {"tok_embed.weight", "token_counts"} <= stored and "lm_head.weight" not in stored
    assert json.loads((path / "meta.json").read_text())["format_version"] == ckpt.FORMAT_VERSION


def test_rng_round_trip(tmp_path):
    state = capture_rng_state()
    expected = (torch.rand(3), random.random(), np.random.rand(), np.random.randn())
    restore_rng_state(state)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert np.random.rand() == expected[2] and np.random.randn() == expected[3]

    model, fresh = TinyLM(), TinyLM()
    saved = capture_rng_state()
    path = save_checkpoint(tmp_path, 1, model)  # captures the same state as `saved`
    expected = (torch.rand(3), random.random(), np.random.rand())
    loaded = load_checkpoint(path, fresh)
    assert torch.equal(loaded.rng_state["torch_cpu"], saved["torch_cpu"])
    assert loaded.rng_state["python"] == saved["python"] and loaded.rng_state["rank"] == 0
    assert np.array_equal(loaded.rng_state["numpy"]["state"]["key"], saved["numpy"]["state"]["key"])
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert np.random.rand() == expected[2]


def test_per_rank_rng_keys(tmp_path):
    states = []
    for rank in (0, 1):
        torch.manual_seed(rank)
        states.append(capture_rng_state(rank))
    path = save_checkpoint(tmp_path, 1, TinyLM(), rng_state=states)
    draws = []
    for rank in (0, 1):
        load_checkpoint(path, TinyLM(), rank=rank)
        draws.append(torch.rand(4))
    assert not torch.equal(draws[0], draws[1])
    torch.manual_seed(1)
    assert torch.equal(torch.rand(4), draws[1])
    with pytest.raises(CheckpointError, match="rank2"):
        load_checkpoint(path, TinyLM(), rank=2)


def test_uncommitted_dir_is_skipped_and_refused(tmp_path, trained):
    first = save_checkpoint(tmp_path, 1, *trained)
    second = save_checkpoint(tmp_path, 2, *trained)
    (second / "COMMITTED").unlink()  # the writer "died" before the marker
    assert latest_checkpoint(tmp_path) == first
    with pytest.raises(CheckpointError, match="COMMITTED"):
        load_checkpoint(second, TinyLM())
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "checkpoints" / "step_000999", TinyLM())
    assert latest_checkpoint(tmp_path / "elsewhere") is None


def test_crash_during_second_save(tmp_path, trained, monkeypatch):
    first = save_checkpoint(tmp_path, 1, *trained)
    real, calls = ckpt._write_file, []

    def crashing(directory, name, data, manifest):
        calls.append(name)
        if len(calls) == 3:  # after model and optimizer tensors, mid-checkpoint
            real(directory, name, data[: len(data) // 2], manifest)
            raise OSError("disk full")
        real(directory, name, data, manifest)

    monkeypatch.setattr(ckpt, "_write_file", crashing)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, *trained)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == first
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]
    load_checkpoint(first, *make(seed=5))

    stale = tmp_path / "checkpoints" / ".tmp-step_000002-99999-deadbeef"  # a writer killed outright
    stale.mkdir()
    save_checkpoint(tmp_path, 2, *trained)
    assert not stale.exists()


def test_refuses_to_overwrite(tmp_path, trained):
    path = save_checkpoint(tmp_path, 4, *trained)
    before = (path / "model.safetensors").read_bytes()
    with pytest.raises(CheckpointError, match="exists already"):
        save_checkpoint(tmp_path, 4, TinyLM())
    assert (path / "model.safetensors").read_bytes() == before


def test_keep_last(tmp_path):
    model = TinyLM()
    for step in range(1, 6):
        save_checkpoint(tmp_path, step * 10, model, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000040", "step_000050"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000040", "step_000050"]
    with pytest.raises(CheckpointError, match="keep_last"):
        save_checkpoint(tmp_path, 60, model, keep_last=0)


def test_keep_last_never_deletes_the_new_one(tmp_path):
    model = TinyLM()
    save_checkpoint(tmp_path, 100, model)
    new = save_checkpoint(tmp_path, 5, model, keep_last=1)  # older step written later
    assert new.exists() and (new / "COMMITTED").exists()


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "trainer.json"])
@pytest.mark.parametrize("verify", [True, False])
def test_truncated_file_fails_without_partial_load(tmp_path, trained, name, verify):
    path = save_checkpoint(tmp_path, 1, *trained)
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[: len(data) - 7])
    if not verify:  # make the manifest agree, so the parser itself must catch it
        commit = json.loads((path / "COMMITTED").read_text())
        commit["files"][name]["bytes"] = len(data) - 7
        (path / "COMMITTED").write_text(json.dumps(commit))
    model, opt, sched = make(seed=9)
    before, opt_before = params(model), opt.state_dict()
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")) as err:
        load_checkpoint(path, model, opt, sched, verify=verify)
    assert "\n" not in str(err.value)
    assert same(params(model), before) and opt.state_dict() == opt_before


def test_corrupted_bytes_detected(tmp_path, trained):
    path = save_checkpoint(tmp_path, 1, *trained)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        load_checkpoint(path, TinyLM())


def test_shape_mismatch_names_key(tmp_path, trained):
    path = save_checkpoint(tmp_path, 1, *trained)
    model = TinyLM(d_model=D * 2)
    before = params(model)
    with pytest.raises(CheckpointError, match=r"'tok_embed.weight'.*\(16, 8\).*\(16, 16\)") as err:
        load_checkpoint(path, model)
    assert "\n" not in str(err.value)
    assert same(params(model), before)


def test_missing_and_unexpected_keys(tmp_path, trained):
    path = save_checkpoint(tmp_path, 1, *trained)

    class Wider(TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.extra_proj = nn.Linear(D, D)

    model = Wider()
    before = params(model)
    with pytest.raises(CheckpointError, match="extra_proj"):
        load_checkpoint(path, model)
    assert same(params(model), before)
    state = load_checkpoint(path, model, strict=False)
    assert state.missing_keys == ["extra_proj.weight", "extra_proj.bias"]
    assert torch.equal(model.ffn.weight, trained[0].ffn.weight)


def test_export_import_weights(tmp_path, trained):
    model = trained[0]
    save_weights(model, tmp_path / "w.safetensors")
    fresh = TinyLM()
    load_weights(fresh, tmp_path / "w.safetensors")
    assert same(params(fresh), params(model)) and fresh.lm_head.weight is fresh.tok_embed.weight

    class Untied(TinyLM):  # tied in the file, separate in the model: both get the shared value
        def __init__(self) -> None:
            super().__init__()
            self.lm_head.weight = nn.Parameter(torch.zeros(V, D))

    untied = Untied()
    load_weights(untied, tmp_path / "w.safetensors")
    assert torch.equal(untied.lm_head.weight, model.tok_embed.weight)

    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-3])
    with pytest.raises(CheckpointError, match="cut.safetensors"):
        load_weights(TinyLM(), tmp_path / "cut.safetensors")


def test_a_tied_weight_holding_nan_loads_back_and_a_meta_model_is_named(tmp_path, trained):
    """NaN != NaN had made a tied model's own export read as two different tied values; a meta model
    (every tensor at data_ptr 0, all looking tied) is named instead of a false tie."""
    model = TinyLM()
    model.load_state_dict(trained[0].state_dict())
    with torch.no_grad():
        model.tok_embed.weight[0, 0] = float("nan")
    save_weights(model, tmp_path / "nan.safetensors")
    fresh = TinyLM()
    with pytest.warns(UserWarning, match="NaN"):
        load_weights(fresh, tmp_path / "nan.safetensors")
    assert fresh.tok_embed.weight[0, 0].isnan() and fresh.lm_head.weight is fresh.tok_embed.weight
    with torch.device("meta"):
        ghost = TinyLM()
    with pytest.raises(CheckpointError, match=r"the model is on the meta device \('[\w.]+' holds no data\)"):
        load_weights(ghost, tmp_path / "nan.safetensors")


def test_exported_weights_carry_a_checksum(tmp_path, trained):
    """B7 outside checkpoint directories: a flipped byte in an exported file's tensors is refused before
    anything is copied; the file stays plain safetensors (other readers open it), and files exported by
    other tools (no checksum) load."""
    model = trained[0]
    path = tmp_path / "w.safetensors"
    save_weights(model, path)
    with safetensors.safe_open(str(path), "pt") as f:
        assert len(f.metadata()["tformer.sha256"]) == 64
        assert torch.equal(f.get_tensor("ffn.weight"), model.ffn.weight)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # a mantissa bit of the last tensor: still a well-formed file
    (tmp_path / "flipped.safetensors").write_bytes(bytes(data))
    fresh = TinyLM()
    before = params(fresh)
    with pytest.raises(CheckpointError, match="flipped.safetensors: the tensor bytes' sha256 differs"):
        load_weights(fresh, tmp_path / "flipped.safetensors")
    assert same(params(fresh), before)
    safetensors.torch.save_file(
        {k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "plain.safetensors"
    )
    load_weights(fresh, tmp_path / "plain.safetensors")
    assert same(params(fresh), params(model))


def test_weights_are_read_by_content_and_odd_values_named(tmp_path, trained):
    """A safetensors file named .pt loads as safetensors (it had been refused as pickled); integer values
    for a float weight are refused by name; NaN weights load with a warning naming them; a missing
    folder or a directory as the target is named as the user gave it."""
    model = trained[0]
    save_weights(model, tmp_path / "w.pt")
    fresh = TinyLM()
    load_weights(fresh, tmp_path / "w.pt")
    assert same(params(fresh), params(model))

    state = {k: v.clone() for k, v in model.state_dict().items()}
    ints = {**state, "ffn.weight": state["ffn.weight"].long()}
    torch.save(ints, tmp_path / "ints.pt")
    with pytest.raises(
        CheckpointError, match=r"'ffn.weight' holds torch.int64 values .* torch.float32 in the model"
    ):
        load_weights(TinyLM(), tmp_path / "ints.pt")
    state["ffn.weight"][0, 0] = float("nan")
    safetensors.torch.save_file(state, tmp_path / "nan.safetensors")
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) hold NaN or infinite values \(ffn.weight\)"):
        load_weights(TinyLM(), tmp_path / "nan.safetensors")

    with pytest.raises(
        FileNotFoundError, match=r"cannot write .*w.safetensors: the folder .*no/dir does not exist"
    ):
        save_weights(model, tmp_path / "no" / "dir" / "w.safetensors")
    with pytest.raises(IsADirectoryError, match="is a directory: give a file name"):
        save_weights(model, tmp_path)


class _Payload:
    def __init__(self, target: Path) -> None:
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_pickle_payload_is_rejected(tmp_path):
    target = tmp_path / "pwned"
    torch.save({"weight": torch.zeros(2), "evil": _Payload(target)}, tmp_path / "evil.pt")
    assert not target.exists()
    with pytest.raises(CheckpointError, match="refused"):
        import_torch_weights(tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="refused"):
        load_weights(TinyLM(), tmp_path / "evil.pt")
    assert not target.exists()


class LegacyArgs:
    """Stands for the training-arguments object old scripts pickled next to their weights."""

    def __init__(self, lr: float) -> None:
        self.lr = lr


def test_trusted_legacy_pickle_needs_the_opt_in(tmp_path, trained):
    model = trained[0]
    torch.save({"model": model.state_dict(), "args": LegacyArgs(3e-4)}, tmp_path / "legacy.pt")
    with pytest.raises(CheckpointError, match="refused.*pass trust_pickle=True"):
        load_weights(TinyLM(), tmp_path / "legacy.pt", key="model")
    fresh = TinyLM()
    with pytest.warns(UserWarning, match="trust_pickle=True"):
        load_weights(fresh, tmp_path / "legacy.pt", key="model", trust_pickle=True)
    assert same(params(fresh), params(model))


def test_plain_torch_weights_import(tmp_path, trained):
    model = trained[0]
    torch.save({"model": model.state_dict(), "step": 3}, tmp_path / "ok.pt")
    fresh = TinyLM()
    fresh.load_state_dict(import_torch_weights(tmp_path / "ok.pt", key="model"))
    assert same(params(fresh), params(model))
    with pytest.raises(CheckpointError, match="entry 'model' is OrderedDict, not a tensor"):
        import_torch_weights(tmp_path / "ok.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "ok.pt").read_bytes()[:200])
    with pytest.raises(CheckpointError, match="cut.pt"):
        import_torch_weights(tmp_path / "cut.pt")


def test_json_decode_error_and_unstorable_values(tmp_path, trained):
    path = save_checkpoint(tmp_path, 1, *trained)
    (path / "COMMITTED").write_text("{not json")
    with pytest.raises(CheckpointError, match="COMMITTED: invalid JSON"):
        load_checkpoint(path, TinyLM())
    for damage, named in (
        ({"files": {"meta.json": {"sha": "x"}}}, "its entry for 'meta.json'"),
        ({"files": {}, "format_version": "1"}, "its format_version"),
    ):
        (path / "COMMITTED").write_text(json.dumps(damage))  # valid JSON, not a manifest's content
        with pytest.raises(CheckpointError, match=f"COMMITTED: {named} is damaged"):
            load_checkpoint(path, TinyLM())
    with pytest.raises(CheckpointError, match="cannot store object value at 'trainer_state.f'"):
        save_checkpoint(tmp_path, 2, TinyLM(), trainer_state={"f": object()})
    with pytest.raises(CheckpointError, match="meta"):
        save_checkpoint(tmp_path, 3, TinyLM(), meta={"x": object()})
    assert not (path.parent / "step_000002").exists() and not (path.parent / "step_000003").exists()
