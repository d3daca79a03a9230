"""Scale-out on PyTorch's distributed engine: process group and roles (env), parallel plans as data
(plans), DDP / FSDP2 / expert parallelism applied from outside the model (parallelize,
expert_parallel) and sharded DCP checkpoints (checkpoint). See docs/distributed.md."""

from tformer.distributed.env import Local, ProcessGroup, init_distributed
from tformer.distributed.expert_parallel import ExpertParallelDispatch, apply_expert_parallel
from tformer.distributed.parallelize import Parallelized, parallelize
from tformer.distributed.plans import ParallelPlan, make_plan

__all__ = [
    "ExpertParallelDispatch",
    "Local",
    "ParallelPlan",
    "Parallelized",
    "ProcessGroup",
    "apply_expert_parallel",
    "init_distributed",
    "make_plan",
    "parallelize",
]
