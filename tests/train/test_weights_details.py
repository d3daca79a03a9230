"""Exported weights (tformer/train/weights.py): durable writes, the file format, what import accepts."""

from __future__ import annotations

import errno
import json
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from tformer.train.checkpoint import CheckpointError
from tformer.train.weights import import_torch_weights, load_weights, save_weights


class Small(nn.Module):
    def __init__(self, n: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(n))


def test_an_export_is_flushed_to_disk_file_and_folder(tmp_path: Path, monkeypatch) -> None:
    synced = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    save_weights(Small(), tmp_path / "w.safetensors")
    assert synced == [False, True]  # the file's bytes before the rename, the folder's entry after


def test_a_failed_export_leaves_the_old_file_and_no_temporary_one(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "w.safetensors"
    old = Small()
    save_weights(old, path)
    before = path.read_bytes()

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_weights(Small(), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"] and path.read_bytes() == before


def test_the_header_keeps_the_formats_8_byte_alignment(tmp_path: Path) -> None:
    for n in range(1, 9):  # header lengths of every remainder
        path = tmp_path / f"w{n}.safetensors"
        save_weights(Small(n), path)
        data = path.read_bytes()
        size = int.from_bytes(data[:8], "little")
        assert size % 8 == 0, n
        header = json.loads(data[8 : 8 + size])
        assert "tformer.sha256" in header["__metadata__"]


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
def test_torch_weights_load_under_each_usual_name(tmp_path: Path, suffix: str) -> None:
    model = Small()
    torch.save(model.state_dict(), tmp_path / f"w{suffix}")
    fresh = Small()
    load_weights(fresh, tmp_path / f"w{suffix}")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


@pytest.mark.parametrize("n_bad", [1, 3, 4])
def test_non_finite_weights_are_named_three_at_most(tmp_path: Path, n_bad: int) -> None:
    model = Small()
    names = [f"layers.{i}.weight" for i in range(n_bad)]
    with torch.no_grad():
        for name in names:
            model.get_parameter(name)[0, 1] = float("nan")  # one value of the tensor is enough
    save_weights(model, tmp_path / "w.safetensors")
    with pytest.warns(UserWarning, match="NaN or infinite") as caught:
        load_weights(Small(), tmp_path / "w.safetensors")
    (message,) = [str(w.message) for w in caught if "NaN" in str(w.message)]
    assert f"{n_bad} tensor(s)" in message
    assert len([name for name in names if name in message]) == min(n_bad, 3)  # which three: file order
    assert "bias" not in message and all(f"layers.{i}." not in message for i in range(n_bad, 5))
    assert message.count("...") == (1 if n_bad > 3 else 0)


def test_finite_weights_load_without_a_warning(tmp_path: Path) -> None:
    model = Small()
    save_weights(model, tmp_path / "w.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_weights(Small(), tmp_path / "w.safetensors")


def test_a_torch_file_needs_string_names_and_the_key_it_is_asked_for(tmp_path: Path) -> None:
    torch.save({0: torch.zeros(2)}, tmp_path / "ints.pt")
    with pytest.raises(CheckpointError, match="entry 0 is named by int, not by a string"):
        import_torch_weights(tmp_path / "ints.pt")
    torch.save({"w": [1.0, 2.0]}, tmp_path / "list_value.pt")
    with pytest.raises(CheckpointError, match="entry 'w' is list, not a tensor"):
        import_torch_weights(tmp_path / "list_value.pt")
    torch.save({"model": {"w": torch.zeros(2)}}, tmp_path / "nested.pt")
    with pytest.raises(CheckpointError, match="no entry 'weights' at the top level"):
        import_torch_weights(tmp_path / "nested.pt", key="weights")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="no entry 'model' at the top level"):
        import_torch_weights(tmp_path / "list.pt", key="model")
    assert list(import_torch_weights(tmp_path / "nested.pt", key="model")) == ["w"]


def test_trusting_a_pickle_is_warned_about(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "w.pt")
    with pytest.warns(UserWarning, match="trust_pickle=True"):
        import_torch_weights(tmp_path / "w.pt", trust_pickle=True)


def test_a_damaged_empty_or_foreign_torch_file_is_named_and_nothing_loads(tmp_path: Path) -> None:
    """A byte flipped inside a tensor of a torch.save file had loaded as weights without a word (the zip
    records each member's CRC-32, which is now checked); an empty file had raised IndexError from the error
    handler itself, and zero bytes or text were called pickled objects or "(101)"."""
    torch.manual_seed(0)
    saved = Small(2)
    torch.save(saved.state_dict(), tmp_path / "ok.pt")
    raw = bytearray((tmp_path / "ok.pt").read_bytes())
    at = raw.index(saved.layers[0].weight.detach().numpy().tobytes())  # the first tensor's stored bytes
    raw[at + 5] ^= 0x40
    (tmp_path / "flipped.pt").write_bytes(raw)
    model = Small(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=r"flipped\.pt: damaged, its member '.*data/0' fails the CRC-32"
    ):
        load_weights(model, tmp_path / "flipped.pt")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was loaded
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "zeros.pt").write_bytes(bytes(100))
    (tmp_path / "notes.pt").write_text("not a checkpoint\n")
    for name, reason in (
        ("empty.pt", "the file is empty, 0 bytes"),
        ("zeros.pt", "not a torch.save file"),
        ("notes.pt", "not a torch.save file"),
    ):
        with pytest.raises(CheckpointError, match=rf"{name}: cannot be read as torch weights \({reason}"):
            import_torch_weights(tmp_path / name)
    (tmp_path / "cut.pt").write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(CheckpointError, match=r"cut\.pt: cannot be read as torch weights \(a zip cut short"):
        import_torch_weights(tmp_path / "cut.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert torch.equal(import_torch_weights(tmp_path / "old.pt")["w"], torch.ones(2))  # the pre-1.6 format
    from torch.utils.serialization import config  # torch may save without CRCs (each written as 0)

    config.save.compute_crc32 = False
    try:
        torch.save({"w": torch.ones(2)}, tmp_path / "no_crc.pt")
    finally:
        config.save.compute_crc32 = True
    assert torch.equal(
        import_torch_weights(tmp_path / "no_crc.pt")["w"], torch.ones(2)
    )  # none recorded: loads
    load_weights(model, tmp_path / "ok.pt")
    assert all(torch.equal(saved.state_dict()[k], v) for k, v in model.state_dict().items())
