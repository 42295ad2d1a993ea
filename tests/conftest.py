"""On machines without CUDA, Triton kernels run in the interpreter: set it before gem_lp imports triton. The
first-use self-checks of the kernels (child processes) are off unless a test turns them on: the GPU tests check the
kernels themselves. Tests marked `slow` run with `--slow` (`make test-all`)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("GEM_LP_SELFCHECK", "off")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (tuning spaces, long runs)")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="slow: run with --slow (make test-all)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--slow"):
            item.add_marker(skip_slow)
