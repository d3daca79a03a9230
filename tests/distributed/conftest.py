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


@pytest.fixture(autouse=True, scope="session")
def _launch_tmpdir(tmp_path_factory):
    """torchrun makes a torchelastic_* folder in the temporary directory at each launch and leaves it
    there: every launch of these tests (test_distributed.torchrun) makes its own under pytest's
    temporary folders, which pytest prunes."""
    import os

    folder = tmp_path_factory.mktemp("torchrun")
    before = os.environ.get(LAUNCH_TMPDIR)
    os.environ[LAUNCH_TMPDIR] = str(folder)
    yield
    if before is None:
        os.environ.pop(LAUNCH_TMPDIR, None)
    else:
        os.environ[LAUNCH_TMPDIR] = before


LAUNCH_TMPDIR = "TFORMER_TEST_LAUNCH_TMPDIR"  # read by test_distributed.torchrun
