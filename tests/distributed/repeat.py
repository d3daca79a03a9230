"""One short 2-rank job for the repeated-launch test (RELIABILITY F2): expert parallelism + FSDP2 (a
device mesh, sharded and rank-local parameters), one training step, an async DCP save, then everything
released in the order `Trainer.close` uses before the process group is destroyed."""

import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from tformer.config import MoEConfig
from tformer.distributed.checkpoint import DCPCheckpointer
from tformer.distributed.env import init_distributed
from tformer.distributed.parallelize import parallelize
from tformer.distributed.plans import make_plan
from tformer.model import build_model
from tformer.presets import tiny
from tformer.tasks.lm import lm_loss_sum
from tformer.train.config import OptimConfig, ParallelConfig
from tformer.train.optim import make_optimizer, make_scheduler
from tformer.train.step import train_step


class Batch:
    def __init__(self, ids, targets):
        self.ids, self.targets = ids, targets


env = init_distributed(ParallelConfig(timeout_s=60), "cpu")
torch.manual_seed(0)
moe = MoEConfig(n_experts=4, top_k=2, bias_update_rate=0.01)
model = build_model(tiny().replace(d_model=32, d_ff=32, n_heads=2, vocab_size=64, moe=moe))
par = parallelize(model, make_plan(ParallelConfig(data="fsdp", experts="shard"), 2), env, torch.device("cpu"))
ocfg = OptimConfig(lr=1e-2, fused=False, warmup_steps=0)
opt = par.adapt_optimizer(make_optimizer(model, ocfg))
sched = make_scheduler(opt, 2, ocfg)
ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(env.rank))
step = train_step(par.model, lm_loss_sum, [Batch(ids, ids)], lambda b: b.ids.numel(), opt, sched, 1.0,
                  nullcontext(), par.comm)  # fmt: skip
checkpointer = DCPCheckpointer(env, 0, async_save=True)
checkpointer.save(Path(sys.argv[1]), 1, model, opt, sched, {"step": 1}, {}, None)
checkpointer.close()  # waits for the async save, commits it, releases its group
par.release()
del model, opt, sched, par, checkpointer
env.shutdown()
