"""A 2-rank job whose rank 1 raises while rank 0 waits in a collective. The process group comes from
tformer's own `init_distributed` with a configured collective timeout (parallel.timeout_s), as in a
`tformer train` run; the test measures how fast the job is torn down."""

from tformer.distributed.env import init_distributed
from tformer.train.config import ParallelConfig

env = init_distributed(ParallelConfig(timeout_s=60), "cpu")
if env.rank == 1:
    raise RuntimeError("rank 1 fails on purpose")
env.barrier()  # rank 0 would wait here until the timeout without torchrun stopping the job
