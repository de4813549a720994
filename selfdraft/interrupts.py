"""Ctrl-C in a command that works in several processes: one line, no tracebacks.

A terminal's Ctrl-C sends SIGINT to the whole process group, so every `datasets.map(num_proc=N)`
worker used to print its own KeyboardInterrupt traceback, and `datasets` then replaced the main
process's KeyboardInterrupt with a `TimeoutError` from its pool cleanup. Workers now leave SIGINT to
the main process (which stops the pool), and the command line treats any error raised while handling
a KeyboardInterrupt as the interruption it is.
"""

from __future__ import annotations

import os
import signal

# The process that imported selfdraft; `datasets` forks its workers from it, so they inherit this value.
_MAIN_PID = os.getpid()


def quiet_in_workers() -> None:
    """Call at the start of a function that `datasets.map` may run in worker processes: in a forked
    worker it ignores SIGINT from then on (the main process handles Ctrl-C and terminates the pool);
    in the main process it does nothing."""
    if os.getpid() != _MAIN_PID and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def was_interrupted(err: BaseException | None) -> bool:
    """Whether `err` is a KeyboardInterrupt or was raised while one was being handled (its
    `__context__` chain holds one), as a library's cleanup after Ctrl-C can do."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__context__
    return False
