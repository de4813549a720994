"""The distill row log: only its own torn last append is ever cut; any other file is refused untouched."""

from __future__ import annotations

import gzip
import json

import pytest

from selfdraft.errors import UserError
from selfdraft.training.data.rowlog import append_rows, check_row_log, read_rows


def _rows(*ids: str) -> list[dict]:
    return [{"id": i, "messages": [{"role": "user", "content": f"question {i}"}]} for i in ids]


def _gzip_log(path, appends: int = 4, per_append: int = 9) -> list[bytes]:
    """A .jsonl.gz log of `appends` members; returns each member's bytes."""
    members = []
    for a in range(appends):
        before = path.read_bytes() if path.exists() else b""
        append_rows(path, _rows(*(f"{a}-{j}" for j in range(per_append))))
        members.append(path.read_bytes()[len(before) :])
    return members


def _plain(tmp_path, text: bytes):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(text)
    return path


def _damaged_member_3(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    members = _gzip_log(path)
    data = bytearray(path.read_bytes())
    at = len(members[0]) + len(members[1]) + len(members[2]) // 2
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))
    return path


def _damaged_first_member(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    members = _gzip_log(path, appends=2)
    data = bytearray(path.read_bytes())
    data[len(members[0]) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def _text_named_gz(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    path.write_text("not gzip at all\n")
    return path


# (what a user had, why it is not a row log): each is refused and left byte for byte as it was
NOT_ROW_LOGS = {
    "a text file": lambda t: _plain(t, b"my notes\nline two\nand a last line without newline"),
    "a JSONL of rows without ids": lambda t: _plain(t, b'{"messages": []}\n{"messages": []}\n'),
    "JSON that is not an object per line": lambda t: _plain(t, b"[1, 2, 3]\n"),
    "a gzip log damaged in member 3": _damaged_member_3,
    "a gzip log damaged in its first member": _damaged_first_member,
    "a text file named .gz": _text_named_gz,
}


@pytest.mark.parametrize("make", NOT_ROW_LOGS.values(), ids=NOT_ROW_LOGS.keys())
def test_a_file_that_is_not_a_row_log_is_refused_and_left_as_it_was(tmp_path, make):
    path = make(tmp_path)
    before = path.read_bytes()
    with pytest.raises(UserError, match="nothing was changed"):
        read_rows(path)
    with pytest.raises(UserError):
        check_row_log(path)
    assert path.read_bytes() == before


def test_a_whole_last_row_without_its_newline_is_kept(tmp_path):
    rows = _rows("a", "b")
    path = _plain(tmp_path, (json.dumps(rows[0]) + "\n" + json.dumps(rows[1])).encode())
    assert read_rows(path) == rows
    append_rows(path, _rows("c"))
    assert [r["id"] for r in read_rows(path)] == ["a", "b", "c"]


def test_a_torn_plain_append_is_cut_and_nothing_else(tmp_path):
    path = tmp_path / "rows.jsonl"
    append_rows(path, _rows("a", "b"))
    good = path.read_bytes()
    path.write_bytes(good + json.dumps(_rows("c")[0]).encode()[:17])  # killed mid-line
    assert check_row_log(path) == 2
    assert [r["id"] for r in read_rows(path)] == ["a", "b"]
    assert path.read_bytes() == good


def test_a_torn_last_gzip_member_is_cut_and_nothing_else(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    members = _gzip_log(path, appends=3)
    good = path.read_bytes()
    torn = gzip.compress("".join(json.dumps(r) + "\n" for r in _rows("x", "y")).encode(), mtime=0)
    path.write_bytes(good + torn[: len(torn) // 2])
    assert len(read_rows(path)) == 27
    assert path.read_bytes() == good and len(good) == sum(map(len, members))


def test_distill_refuses_a_users_file_as_out_before_loading_anything(tmp_path, capsys):
    from selfdraft.scripts import cli

    notes = _plain(tmp_path, b"my notes\nare here\n")
    argv = ["distill", "--target", str(tmp_path / "no-such-model"), "--source", "sharegpt:2"]
    assert cli.main([*argv, "--out", str(notes)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a distill row log" in err and "line 1" in err
    assert notes.read_bytes() == b"my notes\nare here\n"
