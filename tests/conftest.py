import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
# The shared helpers (helpers.py, multirank.py) and every test folder, importable by module name
# from the first test on: multirank's worker processes import test functions by module name and
# keep the sys.path they started with.
for folder in [HERE, *sorted(p for p in HERE.iterdir() if p.is_dir() and p.name.isidentifier())]:
    sys.path.insert(0, str(folder))
SHARED = HERE.parent.parent / "shared"
MNIST_DIR = SHARED / "data" / "mnist"
BRAIN_DIR = SHARED / "data" / "brain"


@pytest.fixture
def mnist_dir():
    if not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").exists():
        pytest.skip(f"the real MNIST test set is not at {MNIST_DIR}")
    return MNIST_DIR


@pytest.fixture
def brain_dir():
    if not BRAIN_DIR.is_dir():
        pytest.skip(f"the MNI152 brain volumes are not at {BRAIN_DIR}")
    return BRAIN_DIR


@pytest.fixture(scope="session", autouse=True)
def launcher_logs(tmp_path_factory):
    """The workers' log folders of the suite's launches, in one folder removed at the end (issue 32: failed jobs
    keep theirs, named in their message, and the suite left about a hundred ddtrain-logs-* in $TMPDIR)."""
    if "DDTRAIN_LOG_DIR" in os.environ:
        yield
        return
    folder = tmp_path_factory.mktemp("launcher-logs")
    os.environ["DDTRAIN_LOG_DIR"] = str(folder)
    yield
    os.environ.pop("DDTRAIN_LOG_DIR", None)
    shutil.rmtree(folder, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    import multirank
    multirank.close_all()


@pytest.fixture
def one_thread():
    """Tiny models train faster on one thread, and much faster when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
