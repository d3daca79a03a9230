"""`tformer train`: train a model from a preset or config file; prints evaluation and a sample at the end.

Under `torchrun --nproc_per_node N -m tformer train ...` every rank runs this; rank 0 prints and
writes the report (see docs/distributed.md).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from tformer.cli.options import parse_overrides, resolve_train_config


def run(args: argparse.Namespace) -> int:
    from tformer.tasks import make_task
    from tformer.train.config import replaced_model_settings
    from tformer.train.loop import Trainer

    if args.out is not None and not args.out.strip():
        raise ValueError("--out is empty: give a run directory (without --out: runs/<preset>)")
    out = (
        Path(args.out)
        if args.out
        else Path("runs") / (args.preset or (args.config.stem if args.config else "run"))
    )
    cfg = resolve_train_config(args, default_preset="shakespeare", resume_dir=out if args.resume else None)
    task = make_task(cfg.task)
    # a bar redrawn with carriage returns is for a terminal: into a log file (stderr not a terminal) the
    # run writes the plain lines of --no-progress instead
    lines = args.no_progress or not sys.stderr.isatty()
    trainer = Trainer(cfg, out, task, resume=args.resume, progress="lines" if lines else True)
    if not args.resume and trainer.env.is_main:  # a --set model size the task replaces is named
        given = parse_overrides(args.overrides).keys()
        for said in replaced_model_settings(trainer.cfg, trainer.model_cfg, given):
            warnings.warn(said, UserWarning, stacklevel=2)
    try:
        report = trainer.fit()
        if trainer.env.is_main:
            print(f"\nrun directory: {out}")
            print(task.describe_result(report))
            where = (
                "GPU memory allocated" if trainer.device.type == "cuda" else "the process's resident memory"
            )
            print(f"peak memory: {report['peak_memory_mib']:,.0f} MiB ({where})")
        if not args.no_sample and trainer.env.world_size == 1:
            print(trainer.sample())
    finally:
        trainer.close()
    return 0
