import sys
from pathlib import Path

# tests import their helpers (exhaustive.py) directly
sys.path.insert(0, str(Path(__file__).parent))

import pytest


def pytest_configure(config):
    """torchvision made importable before any test imports transformers (which imports it)."""
    try:
        from remat.frontends import vision
    except ImportError:     # no torch: the torch-free tests run alone
        return
    vision.prepare()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a test module: CPU kernels on this shared 2-core machine run 10-100x
    slower when several threads contend with other jobs."""
    torch = pytest.importorskip("torch")
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture
def no_chain_bound(monkeypatch):
    """Without revolve's bound for chains (griewank.chain_bound proves most chain cases before any
    search), for tests of the search itself on chain graphs."""
    from remat.solvers import griewank
    monkeypatch.setattr(griewank, "chain_bound", lambda *a, **k: None)
