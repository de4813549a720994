"""An append-only JSONL file of rows that survives a kill: plain text, or gzip when the name ends in .gz.

Each append is one flush (plain: whole lines; gzip: one whole gzip member, which `gzip` readers read as
one stream with the others). A kill can tear only the last append, so opening a log cuts exactly that:
a half-written last line, or a last gzip member that stops mid-stream. Anything else that is wrong - a
line that is not a row, a damaged member before the end, a file that is not gzip - means the file is not
(or no longer) such a log, and it is refused untouched: a user's file is never cut to make it fit.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from selfdraft.errors import UserError

GZIP_MAGIC = b"\x1f\x8b"
# the header of every member `append_rows` writes (deflate, no flags, mtime 0): a torn tail never holds
# another one, so one found inside it means damage across members, not a torn append
_MEMBER_HEADER = gzip.compress(b"", mtime=0)[:8]


@dataclass(frozen=True)
class _Scan:
    rows: list[dict]
    keep: int  # bytes of complete appends: the file is cut to this length
    newline: bool = False  # a plain log's last row is whole but lacks its newline: add one before appending


def _rows(text: bytes, path: Path, key: str, what: str) -> list[dict]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            row = None
        if not isinstance(row, dict) or key not in row:
            raise UserError(
                f"{path} is not a {what}: line {number} is not one of its rows (a JSON object with "
                f"{key!r}); nothing was changed: pass a new file"
            )
        rows.append(row)
    return rows


def _scan_plain(data: bytes, path: Path, key: str, what: str) -> _Scan:
    keep = data.rfind(b"\n") + 1
    tail = data[keep:]
    rows = _rows(data[:keep], path, key, what)
    if not tail.strip():
        return _Scan(rows, len(data) if not tail else keep)
    try:
        last = json.loads(tail)
    except (json.JSONDecodeError, UnicodeDecodeError):
        last = None
    if isinstance(last, dict) and key in last:
        return _Scan([*rows, last], len(data), newline=True)  # a whole row: keep it
    if not tail.lstrip().startswith(b"{"):
        _rows(tail, path, key, what)  # raises, naming the line
    return _Scan(rows, keep)  # a half-written row: the torn last append


def _scan_gzip(data: bytes, path: Path, key: str, what: str) -> _Scan:
    if data and not data.startswith(GZIP_MAGIC):
        raise UserError(f"{path} is not gzip although its name ends in .gz; nothing was changed: pass a new file")
    end, member, text = 0, 0, b""
    while end < len(data):
        inflate = zlib.decompressobj(wbits=31)  # one gzip member
        try:
            part = inflate.decompress(data[end:])
        except zlib.error as err:
            raise UserError(
                f"{path} is damaged in gzip member {member + 1} (from byte {end}): not a torn last append "
                f"({err}); nothing was changed: restore it from a copy, or pass a new file"
            ) from err
        if not inflate.eof:
            if _MEMBER_HEADER in data[end + 1 :]:
                raise UserError(
                    f"{path} is damaged in gzip member {member + 1} (from byte {end}), which runs into the "
                    "members after it: not a torn last append; nothing was changed: restore it from a "
                    "copy, or pass a new file"
                )
            break  # the last member stops mid-stream: a torn append
        text += part
        end = len(data) - len(inflate.unused_data)
        member += 1
    return _Scan(_rows(text, path, key, what), end)


def _scan(path: Path, key: str, what: str) -> _Scan | None:
    if not path.exists():
        return None
    if path.is_dir():
        raise UserError(f"{path} is a folder; name a file")
    data = path.read_bytes()
    scan = _scan_gzip if path.name.endswith(".gz") else _scan_plain
    return scan(data, path, key, what)


def check_row_log(path: str | Path, key: str = "id", what: str = "row log") -> int:
    """Rows in `path` (0 when it does not exist), or a UserError when it is not such a log. Changes
    nothing: commands call it before any work."""
    scan = _scan(Path(path), key, what)
    return len(scan.rows) if scan else 0


def read_rows(path: str | Path, key: str = "id", what: str = "row log") -> list[dict]:
    """The rows of `path` (none when it does not exist); a torn last append is cut off the file so the
    next append follows the last whole one. Every row must be a JSON object holding `key`; a file that
    is not such a log is refused (UserError) and left as it was."""
    path = Path(path)
    scan = _scan(path, key, what)
    if scan is None:
        return []
    size = path.stat().st_size
    if scan.keep < size:
        with path.open("r+b") as fh:
            fh.truncate(scan.keep)
    elif scan.newline:
        with path.open("ab") as fh:
            fh.write(b"\n")
    return scan.rows


def append_rows(path: str | Path, rows: list[dict]) -> None:
    """Append `rows` as one durable append (nothing is written for no rows)."""
    if not rows:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    if path.name.endswith(".gz"):
        payload = gzip.compress(payload, mtime=0)  # mtime 0: the same rows give the same bytes
    with path.open("ab") as fh:
        fh.write(payload)
        fh.flush()
        os.fsync(fh.fileno())
