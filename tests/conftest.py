import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny models run fastest on one thread (per-op overhead dominates); the real target uses two."""
    torch.set_num_threads(2 if "smollm" in request.fixturenames else 1)


@pytest.fixture(scope="session")
def smollm():
    """The embedded real target (SmolLM2-135M-Instruct), loaded once per test session."""
    from selfdraft.inference.target import load_target

    return load_target("smollm2-135m-instruct")
