"""A 2-rank DDP run with async DCP saves whose rank 1 raises in step 3, while the save of step 2 is in
flight and rank 0 waits in step 3's gradient all-reduce. Rank 1's `Trainer.close()` must not wait for
rank 0 (a barrier there hung both ranks until parallel.timeout_s); the test measures the teardown.
argv: the run directory, the text corpus folder."""

import os
import sys

from tformer.tasks import make_task
from tformer.train.config import DataConfig, OptimConfig, ParallelConfig
from tformer.train.loop import Trainer
from tformer.train.presets import tiny_lm

out, corpus = sys.argv[1], sys.argv[2]
base = tiny_lm()
cfg = base.replace(
    model=base.model.replace(d_model=32, d_ff=64, n_heads=2, max_seq_len=32),
    data=DataConfig(corpus=f"text:{corpus}", vocab_size=300, seq_len=32),
    optim=OptimConfig(lr=1e-2, warmup_steps=2, fused=False),
    steps=8,
    batch_size=2,
    eval_every=100,
    save_every=2,
    parallel=ParallelConfig(data="ddp", async_save=True, timeout_s=60),
)
task = make_task("lm")
loss, calls = task.loss, []


def failing_loss(model, batch):
    calls.append(1)
    if int(os.environ["RANK"]) == 1 and len(calls) == 3:
        raise ValueError("rank 1 fails in step 3")
    return loss(model, batch)


task.loss = failing_loss
trainer = Trainer(cfg, out, task, progress=False)
try:
    trainer.fit()
finally:
    trainer.close()
