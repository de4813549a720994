"""An append-only JSONL file of rows that survives a kill: plain text, or gzip when the name ends in .gz.

Each append is one flush (plain: whole lines; gzip: one whole gzip member, which `gzip` readers read as
one stream with the others). Opening cuts a torn tail - a half-written line or member - so a resumed
writer appends after the last complete append and a reader never sees half a row.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from pathlib import Path


def _complete_length(data: bytes, gz: bool) -> int:
    """Bytes of `data` made of complete appends."""
    if not gz:
        return data.rfind(b"\n") + 1
    end = 0
    while end < len(data):
        inflate = zlib.decompressobj(wbits=31)  # one gzip member
        try:
            inflate.decompress(data[end:])
        except zlib.error:
            break
        if not inflate.eof:
            break  # the member stops mid-stream: a torn append
        end = len(data) - len(inflate.unused_data)
    return end


def read_rows(path: str | Path) -> list[dict]:
    """The complete rows of `path` (none when it does not exist), cutting a torn tail off the file."""
    path = Path(path)
    if not path.exists():
        return []
    gz = path.name.endswith(".gz")
    data = path.read_bytes()
    keep = _complete_length(data, gz)
    if keep < len(data):
        with path.open("r+b") as fh:
            fh.truncate(keep)
    text = gzip.decompress(data[:keep]) if gz and keep else data[:keep]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


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
