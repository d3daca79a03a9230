"""The models here are tiny: one intra-op thread is several times faster on a busy machine (the
torchrun workers get OMP_NUM_THREADS=1 from torchrun)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
