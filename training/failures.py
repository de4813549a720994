"""What `selfdraft train` shows when a rank stops: one line saying what happened and how to resume.

torchrun answers a failed worker with a `ChildFailedError` traceback and a table of failures, after
each surviving rank's own gloo "Connection reset by peer" traceback; none of it tells a user what to do.
`TorchrunOutput` passes the workers' output through as it comes (progress bars included) but keeps
torchrun's failure report (and its traceback of a signal it was sent) back, reading from it which rank
failed and how; `explain_failure` turns that into the line to print.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

USER_ERROR_EXIT = 2  # a worker's `UserError`: it printed its one line already

# torchrun's own log lines (glog style: "W1206 01:02:03.456000 123 torch/distributed/...] ..."): its
# per-worker failure notices and the SIGTERMs it sends the other ranks
TORCHRUN_LOG = re.compile(r"^[WEI]\d{4} .*torch/distributed/")
FAILED_ERROR = "ChildFailedError"
# what torchrun raises when it gets SIGINT / SIGTERM (the launcher passes a user's Ctrl-C on to it): it
# stops its workers, then lets the exception end it with a traceback that only repeats the signal
SIGNAL_ERROR = "SignalException"


@dataclass
class Failure:
    """The first failure torchrun observed: which rank, and its exit code (negative: a signal)."""

    rank: int | None = None
    exitcode: int | None = None


class TorchrunOutput:
    """A streaming filter of torchrun's stderr (workers' and its own, one stream): `feed` returns the
    text to show now, `close` the rest; `failure` holds what torchrun reported."""

    def __init__(self) -> None:
        self.failure = Failure()
        self._partial = ""  # an unfinished line (a progress bar's \r updates show at once)
        self._traceback: list[str] | None = None  # a traceback being read, shown unless torchrun's
        self._report = 0  # inside torchrun's failure table: the "=====" rules seen so far

    def feed(self, text: str) -> str:
        out = []
        self._partial += text
        while "\n" in self._partial:
            line, self._partial = self._partial.split("\n", 1)
            out.append(self._line(line + "\n"))
        if self._partial and self._traceback is None and not self._report and not self._may_hide(self._partial):
            out.append(self._partial)
            self._partial = ""
        return "".join(out)

    def close(self) -> str:
        rest = self.feed("\n") if self._partial else ""
        if self._traceback:  # cut off mid-way: show it
            rest += "".join(self._traceback)
        self._traceback = None
        return rest.rstrip("\n") + "\n" if rest.strip() else ""

    @staticmethod
    def _may_hide(partial: str) -> bool:
        """A line start that could still turn into something hidden (wait for its end)."""
        return any(mark.startswith(partial[: len(mark)]) for mark in ("Traceback", "[W", "[E", "W1", "E1", "I1"))

    def _line(self, line: str) -> str:
        if self._report:
            self._read_report(line)
            return ""
        if self._traceback is not None:
            return self._traceback_line(line)
        if line.startswith("Traceback (most recent call last)"):
            self._traceback = [line]
            return ""
        return "" if TORCHRUN_LOG.match(line) else line

    def _traceback_line(self, line: str) -> str:
        assert self._traceback is not None
        self._traceback.append(line)
        if line[:1] in (" ", "\t") or not line.strip() or line.startswith("Traceback"):
            return ""
        block, self._traceback = self._traceback, None  # its last line names the exception
        if FAILED_ERROR in line:
            self._report = 1
            return ""
        return "" if SIGNAL_ERROR in line else "".join(block)

    def _read_report(self, line: str) -> None:
        if line.startswith("====="):
            self._report += 1
            if self._report > 2:  # the table ends with its second rule
                self._report = 0
            return
        if line.startswith("Root Cause"):  # the first observed failure: the others followed it
            self.failure = Failure()
            return
        rank = re.match(r"\s*rank\s*:\s*(\d+)", line)
        code = re.match(r"\s*exitcode\s*:\s*(-?\d+)", line)
        if rank and (self.failure.rank is None):
            self.failure.rank = int(rank.group(1))
        if code and self.failure.exitcode is None:
            self.failure.exitcode = int(code.group(1))


def _what(failure: Failure) -> str:
    who = f"rank {failure.rank}" if failure.rank is not None else "a rank"
    code = failure.exitcode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"{who} was killed ({name})"
    return f"{who} stopped with an error (exit status {code}, see above)" if code is not None else f"{who} stopped"


def explain_failure(returncode: int, failure: Failure, interrupted: bool, last_tag: str | None, resume: str):
    """The line to print after torchrun exits with `returncode`, or None (success, or a user error the
    worker explained itself). resume: the command that continues the run."""
    if returncode == 0 or failure.exitcode == USER_ERROR_EXIT:
        return None
    what = "training was interrupted" if interrupted else _what(failure)
    if last_tag:
        return f"selfdraft train: {what}; the last checkpoint is {last_tag}; continue with: {resume}"
    # nothing saved: the same command without --resume starts the run over
    start = resume.removesuffix(" --resume")
    return f"selfdraft train: {what}; no checkpoint was written yet; start it again with: {start}"
