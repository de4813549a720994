"""The CPU training worker keeps freed memory in its heap: steps that allocate and free the same large
blocks stop faulting their pages in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A step like training's loss: a 32 MiB block and another while it lives, past glibc's mmap threshold.
PROBE = """
import resource, sys
import torch
if sys.argv[1] == "keep":
    from selfdraft.training.allocator import keep_freed_memory
    assert keep_freed_memory()
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(4, 512, 4096)
    y = torch.log_softmax(x, -1)
    del x, y
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]), min(faults[1:]))
"""


def _faults(mode: str) -> tuple[int, int]:
    """(page faults of steps 2-20, fewest of one step) in a fresh process: the policy is process-wide."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, check=True
    )
    total, fewest = out.stdout.split()[-2:]
    return int(total), int(fewest)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the policy is glibc's mallopt")
def test_freed_blocks_are_reused_without_page_faults():
    default, default_fewest = _faults("default")
    kept, kept_fewest = _faults("keep")
    # glibc's default maps both blocks afresh every step: 16,384 pages of 4 KiB; with the policy the
    # heap reuses them once it has grown to the step's peak (a few steps, depending on fragmentation)
    assert default_fewest >= 16000
    assert kept_fewest == 0 and kept < default / 2, (kept, default)


def test_a_user_allocator_setting_wins(monkeypatch):
    from selfdraft.training.allocator import keep_freed_memory

    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")
    assert keep_freed_memory() is False
