"""A 2-rank job whose rank 1 raises while rank 0 waits in a collective (kept free of heavy imports:
the test measures how fast torchrun tears the job down)."""

import datetime

import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
if dist.get_rank() == 1:
    raise RuntimeError("rank 1 fails on purpose")
dist.barrier()  # rank 0 would wait here until the timeout without torchrun stopping the job
