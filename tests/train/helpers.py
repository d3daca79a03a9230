"""A tiny LM run config and its bit-exact losses, shared by the trainer, resume and interrupt tests."""

from __future__ import annotations

import json
from pathlib import Path

from tformer.train.config import DataConfig, OptimConfig, TrainConfig
from tformer.train.presets import tiny_lm


def small_config(corpus_dir: Path, **changes) -> TrainConfig:
    base = tiny_lm()
    cfg = base.replace(
        model=base.model.replace(vocab_size=300, d_model=32, d_ff=64, n_heads=2, dropout=0.1, max_seq_len=32),
        data=DataConfig(corpus=f"text:{corpus_dir}", vocab_size=300, seq_len=32),
        optim=OptimConfig(lr=1e-2, warmup_steps=2, fused=False),
        steps=8,
        batch_size=4,
        eval_every=4,
        eval_batches=2,
        save_every=4,
        log_every=1,
    )
    return cfg.replace(**changes)


def losses(run_dir: Path) -> list[str]:
    """Every step's loss and gradient norm, bit for bit."""
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        f"{float(r['loss']).hex()} {float(r['grad_norm']).hex()}" for r in records if r["kind"] == "train"
    ]


def edit_checkpoint_json(checkpoint: Path, name: str, edit) -> None:
    """`edit(obj)` on a checkpoint's JSON file `name`, in place, with its COMMITTED entry rewritten to
    match: what a hand edit that knows the manifest looks like (the size and hash checks pass)."""
    from tformer.train.checkpoint import file_entry

    obj = json.loads((checkpoint / name).read_text())
    edit(obj)
    (checkpoint / name).write_text(json.dumps(obj))
    commit = json.loads((checkpoint / "COMMITTED").read_text())
    commit["files"][name] = file_entry(checkpoint / name)
    (checkpoint / "COMMITTED").write_text(json.dumps(commit))
