import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def smollm():
    """The embedded real target (SmolLM2-135M-Instruct), loaded once per test session."""
    from selfdraft.inference.target import load_target

    return load_target("smollm2-135m-instruct")
