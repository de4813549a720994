"""Prompt synthesis (pre-query template): filters, de-duplication, the row log, and kill/resume."""

import gzip
import json

import pytest
import torch

from selfdraft.corpora.mtbench import mtbench_questions
from selfdraft.training.data import synthesize as synth
from selfdraft.training.data.rowlog import append_rows, read_rows
from selfdraft.training.data.synthesize import Deduper, SynthesisConfig, pre_query_ids, rejection, synthesize


def test_rejection_filters():
    assert rejection("  \n ", True, 100) == "empty"
    assert rejection("How do I sort a list", False, 100) == "unfinished"
    assert rejection("Why? " * 50, True, 100) == "overlong"
    assert rejection("Sure! Here is a poem about cats.", True, 100) == "answer"
    assert rejection("The weather was nice today.", True, 100) == "not a request"
    assert rejection("Write a poem about cats.", True, 100) is None
    assert rejection("my code fails with KeyError, any idea", True, 100) is None
    assert rejection("The code below fails. Any idea why?", True, 100) is None


def test_deduper_exact_near_and_mtbench():
    d = Deduper()
    d.ban([mtbench_questions()[0]["turns"][0]])
    first = "Can you explain how photosynthesis works in plants, step by step, for a school project?"
    assert d.duplicate(first) is None
    d.add(first)
    assert d.duplicate(first.upper() + "  ") == "duplicate"  # case and spacing do not make it new
    near = first.replace("school project", "school project please")
    assert d.duplicate(near) == "near-duplicate"
    assert d.duplicate("Can you explain how a jet engine works, for a physics class?") is None
    assert d.duplicate(mtbench_questions()[0]["turns"][0].replace(".", "!")) in ("duplicate", "mtbench")


def test_row_log_cuts_a_torn_gzip_append(tmp_path):
    path = tmp_path / "rows.jsonl.gz"
    append_rows(path, [{"id": "a"}, {"id": "b"}])
    append_rows(path, [{"id": "c"}])
    good = path.read_bytes()
    torn = gzip.compress(b'{"id": "d"}\n{"id": "e"}\n', mtime=0)
    path.write_bytes(good + torn[: len(torn) // 2])  # killed mid-append
    assert [r["id"] for r in read_rows(path)] == ["a", "b", "c"]
    assert path.read_bytes() == good  # the torn tail is gone, so the next append follows "c"
    append_rows(path, [{"id": "d"}])
    with gzip.open(path, "rt") as fh:  # any gzip reader sees one stream
        assert [json.loads(line)["id"] for line in fh] == ["a", "b", "c", "d"]


def test_pre_query_ids_end_where_the_user_text_begins(smollm):
    _, tok = smollm
    text = tok.decode(pre_query_ids(tok))
    full = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False)
    assert full.startswith(text) and full[len(text) :].startswith("Hi there")
    assert text.endswith("user\n")


def test_synthesis_resumes_after_a_kill_without_duplicates(smollm, tmp_path, monkeypatch):
    """A build killed between a chunk's prompts and its sampled answers, then killed mid-append, and
    resumed twice, writes exactly the rows of an uninterrupted build, each once."""
    target, tok = smollm
    torch.set_num_threads(1)  # sampling short rows: one thread is many times faster on a busy machine
    config = SynthesisConfig(
        prompts=3, chunk=2, max_prompt_tokens=32, max_new_tokens=4, batch_size=4, heldout_fraction=0.0
    )
    whole = tmp_path / "whole.jsonl.gz"
    stats = synthesize(target, tok, whole, config)
    assert stats["kept"] >= 3 and stats["chunks"] >= 2
    rows = read_rows(whole)
    prompts = read_rows(synth.prompts_path(whole), key="chunk")
    kept = [r for r in prompts if "messages" in r]
    assert len(rows) == 2 * len(kept) == 2 * stats["kept"]  # a greedy and a sampled answer each
    assert all(r["messages"][0]["role"] == "user" and r["messages"][1]["role"] == "assistant" for r in rows)
    assert all(r["messages"][1]["content"] for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)

    calls = {"n": 0}
    real = synth.regenerate_assistant_turns

    def killed_on_second_chunk(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # chunk 1's prompts and greedy answers are written, its sampled ones not
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    part = tmp_path / "part.jsonl.gz"
    monkeypatch.setattr(synth, "regenerate_assistant_turns", killed_on_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        synthesize(target, tok, part, config)
    monkeypatch.setattr(synth, "regenerate_assistant_turns", real)
    with part.open("ab") as fh:  # and a second kill tore an append of the answers file
        fh.write(gzip.compress(b'{"id": "torn", "messages": []}\n', mtime=0)[:20])
    assert synthesize(target, tok, part, config) == stats
    assert read_rows(part) == rows
    assert read_rows(synth.prompts_path(part), key="chunk") == prompts
    before = part.read_bytes()
    assert synthesize(target, tok, part, config) == stats  # a finished build resumed adds nothing
    assert part.read_bytes() == before


def test_multi_turn_keeps_conversations_with_later_turns(capsys):
    from selfdraft.scripts import cli
    from selfdraft.scripts.distill import user_turns

    one = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    two = {"messages": [*one["messages"], {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    assert [user_turns(r) for r in (one, two)] == [1, 2]
    assert cli.main(["distill", "--multi-turn", "--first-turns", "--out", "x.jsonl"]) == 2
    assert "contradict" in capsys.readouterr().err


def test_distill_with_vllm_but_without_it_is_one_line_naming_the_install(tmp_path, capsys, monkeypatch):
    from selfdraft.bench import vllm_engine
    from selfdraft.scripts import cli

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    out = tmp_path / "rows.jsonl"
    assert cli.main(["distill", "--engine", "vllm", "--source", "sharegpt:2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "vLLM" in err and "make check-vllm" in err
    assert not out.exists()


def test_a_target_that_writes_no_prompt_stops_with_one_line(tiny_target_dir, tmp_path, capsys):
    """A random tiny model writes blank lines: the build stops after MAX_BARREN_CHUNKS chunks, each
    recorded as done (a rerun does not sample them again), with one line saying why."""
    from selfdraft.scripts import cli

    out = tmp_path / "s.jsonl.gz"
    argv = ["distill", "--target", str(tiny_target_dir), "--generator", "target", "--precision", "fp32",
            "--synthesize", "2", "--synth-chunk", "2", "--synth-max-tokens", "3", "--out", str(out)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("selfdraft distill: ") and "kept no prompt" in err[-1]
    assert not any("Traceback" in line for line in err)
    markers = [r for r in read_rows(synth.prompts_path(out), key="chunk") if r.get("done")]
    assert [m["chunk"] for m in markers] == list(range(synth.MAX_BARREN_CHUNKS))
    assert all(m["kept"] == 0 and sum(m["rejected"].values()) == 2 for m in markers)
    assert not out.exists()


def test_a_system_turn_gives_its_build_record_ids_of_its_own():
    plain = SynthesisConfig(prompts=1, seed=1)
    coding = SynthesisConfig(prompts=1, seed=1, system="You help people write and debug Python.")
    other = SynthesisConfig(prompts=1, seed=1, system="You answer questions about history.")
    ids = {synth._id_prefix(c) for c in (plain, coding, other)}
    assert len(ids) == 3 and synth._id_prefix(plain) == "synth:s1"  # builds without one keep their ids
