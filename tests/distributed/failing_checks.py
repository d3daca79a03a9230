"""`tformer train` under torchrun whose checks (`checked_together`) fail on the ranks named in argv[1]
("0,1"), in the same words ("same") or in each rank's own (anything else): what the command line says."""

import sys

import tformer.cli.train
from tformer.cli.main import main
from tformer.distributed.env import init_distributed
from tformer.train.config import ParallelConfig

failing = {int(r) for r in sys.argv[1].split(",")}


def run(args) -> int:
    env = init_distributed(ParallelConfig(timeout_s=60), "cpu")
    try:
        with env.checked_together():
            if env.rank in failing:
                raise ValueError(
                    "the run directory fails a check" if sys.argv[2] == "same" else f"rank {env.rank}'s own"
                )
        return 0
    finally:
        env.shutdown()


tformer.cli.train.run = run  # the command line's handling of what `run` raises, around these checks
sys.exit(main(["train"]))
