"""Loading a torch.distributed.checkpoint (DCP) checkpoint never unpickles arbitrary objects: DCP's
`.metadata` index is checked against the COMMITTED manifest and read by a restricted unpickler."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest

from tests.train.helpers import small_config
from tformer.tasks import make_task
from tformer.train.checkpoint import MARKER, CheckpointError
from tformer.train.config import ParallelConfig
from tformer.train.loop import Trainer


class Payload:
    """Unpickling this runs os.system (here: creates a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def dcp_run(corpus_dir: Path, tmp_path: Path):
    cfg = small_config(
        corpus_dir, steps=2, save_every=2, eval_every=2, parallel=ParallelConfig(checkpoint="dcp")
    )
    Trainer(cfg, tmp_path / "d", make_task("lm"), progress=False).fit()
    return cfg, tmp_path / "d", tmp_path / "d" / "checkpoints" / "step_000002"


def resume(cfg, run: Path) -> Trainer:
    return Trainer(cfg.replace(steps=3), run, make_task("lm"), resume=True, progress=False)


def test_the_manifest_covers_dcp_index_and_shards_and_resume_reads_them(dcp_run) -> None:
    cfg, run, ckpt = dcp_run
    files = json.loads((ckpt / MARKER).read_text())["files"]
    assert ".metadata" in files and any(name.endswith(".distcp") for name in files)
    trainer = resume(cfg, run)  # the restricted reader loads a genuine index
    assert trainer.state.step == 2
    trainer.close()


def test_a_tampered_index_is_refused_by_its_checksum(dcp_run, tmp_path: Path) -> None:
    cfg, run, ckpt = dcp_run
    marker = tmp_path / "code-ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata: .*(sha256|bytes)"):
        resume(cfg, run)
    assert not marker.exists()


def test_an_index_naming_other_code_is_refused_even_with_a_matching_manifest(dcp_run, tmp_path: Path) -> None:
    cfg, run, ckpt = dcp_run
    marker = tmp_path / "code-ran"
    data = pickle.dumps(Payload(marker))
    (ckpt / ".metadata").write_bytes(data)
    manifest = json.loads((ckpt / MARKER).read_text())
    manifest["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / MARKER).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"posix.system is not part of a DCP index|system is not part"):
        resume(cfg, run)
    assert not marker.exists()


def _global(module: str, name: str) -> bytes:
    """A pickle (protocol 4) of one global looked up by module and (possibly dotted) name."""
    enc = [s.encode() for s in (module, name)]
    return b"\x80\x04" + b"".join(b"\x8c" + bytes([len(e)]) + e for e in enc) + b"\x93."


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch.distributed.checkpoint.filesystem", "io.FileIO"),  # dotted: an attribute of an allowed module
        ("torch.distributed.checkpoint.metadata", "torch.ctypes.CDLL"),
        ("torch", "load"),
        ("builtins", "eval"),
    ],
)
def test_the_index_unpickler_resolves_only_listed_names(module: str, name: str) -> None:
    import io

    from tformer.distributed.checkpoint import _IndexUnpickler

    assert pickle.loads(_global("builtins", "len")) is len  # the hand-made pickle is well formed
    with pytest.raises(pickle.UnpicklingError, match="is not part of a DCP index"):
        _IndexUnpickler(io.BytesIO(_global(module, name))).load()


def test_an_index_that_declares_bytes_is_refused(dcp_run) -> None:
    """DCP reads a bytes entry back with torch.load(weights_only=False): tformer's checkpoints hold none."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    from tformer.distributed.checkpoint import SafeIndexReader

    _, _, ckpt = dcp_run
    index = ckpt / ".metadata"
    index.write_bytes(pickle.dumps(Metadata(state_dict_metadata={"model.x": BytesStorageMetadata()})))
    with pytest.raises(CheckpointError, match="declares entries that are not tensors"):
        SafeIndexReader(ckpt).read_metadata()
