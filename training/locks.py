"""Run-folder locks: one live writer per folder, released with its process (flock), holder named.

A lock file records "pid P on HOST" of its holder; the kernel drops the lock when that process dies, so
a killed writer never leaves a stale lock behind. The lock is only as wide as the filesystem's flock:
on a shared filesystem it serialises nodes too where the filesystem supports it.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from selfdraft.errors import UserError


def acquire(path: Path, *, wait: bool, what: str) -> IO:
    """Hold the lock at `path` until the returned file is closed (or the process exits).

    wait: block until the holder is gone; otherwise refuse at once, naming the holder and `what` it
    writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(path, "a+")  # noqa: SIM115 - the caller holds it open as long as it writes
    try:
        fcntl.flock(fh, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise UserError(
            f"{what} is being written by {holder}; stop that process first, or use another folder"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"pid {os.getpid()} on {socket.gethostname()}")
    fh.flush()
    return fh


@contextmanager
def held(path: Path, *, wait: bool, what: str) -> Iterator[None]:
    fh = acquire(path, wait=wait, what=what)
    try:
        yield
    finally:
        fh.close()
