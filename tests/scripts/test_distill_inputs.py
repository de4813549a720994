"""`selfdraft distill` with bad flags and sources: one line naming the flag or file and the fix, exit 2,
before any model loads (the target named here does not exist, so reaching the load would say so)."""

from __future__ import annotations

import gzip

import pytest

from selfdraft.scripts import cli


def _bad_files(tmp_path):
    binary = tmp_path / "binary.jsonl.gz"
    binary.write_bytes(b"garbage\x00\x01\x02")
    truncated = tmp_path / "truncated.jsonl.gz"
    whole = gzip.compress(b'{"messages": [{"role": "user", "content": "hi"}]}\n' * 200)
    truncated.write_bytes(whole[: len(whole) // 2])
    return binary, truncated


# flags -> words of the one line
FLAGS = {
    "--batch-size 0": (["--batch-size", "0"], ["--batch-size 0", "at least 1"]),
    "--max-new-tokens 0": (["--max-new-tokens", "0"], ["--max-new-tokens 0", "at least 1"]),
    "--max-prompt-tokens -5": (["--max-prompt-tokens", "-5"], ["--max-prompt-tokens -5", "at least 1"]),
    "--temperature nan": (["--temperature", "nan"], ["--temperature nan", "finite"]),
    "--temperature -1": (["--temperature", "-1"], ["--temperature -1.0", "positive"]),
    "--answer-temperatures without --synthesize": (["--answer-temperatures", "0.5"], ["--synthesize"]),
    "--synth-top-p without --synthesize": (["--synth-top-p", "0.5"], ["--synth-top-p", "--synthesize"]),
    "--synthesize with --synth-chunk 0": (["--synthesize", "5", "--synth-chunk", "0"], ["--synth-chunk 0"]),
    "--device cuda without CUDA": (["--device", "cuda"], ["--device cuda", "no CUDA GPU"]),
    "--device banana": (["--device", "banana"], ["--device 'banana'", "cpu"]),
    "--source sharegpt:-1": (["--source", "sharegpt:-1"], ["sharegpt:N with N >= 1"]),
    "--source sharegpt:abc": (["--source", "sharegpt:abc"], ["sharegpt:N with N >= 1"]),
    "--source a missing file": (["--source", "missing.jsonl.gz"], ["does not exist"]),
}


@pytest.mark.parametrize("flags, words", FLAGS.values(), ids=FLAGS.keys())
def test_a_bad_flag_is_one_line_before_any_work(tmp_path, capsys, flags, words, monkeypatch):
    import torch

    if "cuda" in flags and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU, so --device cuda is valid here")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "rows.jsonl"
    argv = ["distill", "--target", str(tmp_path / "no-model"), "--source", "sharegpt:2", "--out", str(out)]
    assert cli.main([*argv, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert "no-model" not in err  # refused before the target was looked for
    assert not out.exists()


def test_a_damaged_gzip_source_is_one_line(tmp_path, capsys):
    from selfdraft.corpora.sources import load_source
    from selfdraft.errors import UserError

    for path in _bad_files(tmp_path):
        with pytest.raises(UserError, match="cannot be read as UTF-8 JSON lines") as err:
            load_source(str(path))
        assert str(path) in str(err.value)


def test_a_gzip_source_reads_like_the_plain_one(tmp_path):
    from selfdraft.corpora.sources import load_source

    text = '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n{"id": "b", "text": "plain"}\n'
    (tmp_path / "rows.jsonl").write_text(text)
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    assert load_source(str(tmp_path / "rows.jsonl.gz")) == load_source(str(tmp_path / "rows.jsonl"))
    assert [r["id"] for r in load_source(str(tmp_path / "rows.jsonl.gz"))] == ["a", "b"]
