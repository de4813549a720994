"""The `selfdraft` console entry: subcommands exist and the thin ones run end to end."""

import json
import subprocess
import sys

from selfdraft.scripts.cli import COMMANDS, build_parser


def test_every_subcommand_parses_its_help():
    parser = build_parser()
    for name in COMMANDS:
        sub = parser._subparsers._group_actions[0].choices[name]
        assert sub.format_help().startswith("usage: selfdraft " + name)


def _cli(*args, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "selfdraft.scripts.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_distill_writes_resumable_jsonl(tmp_path, tiny_target_dir):
    source = tmp_path / "chats.jsonl"
    rows = [
        {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": "old answer"},
            ],
        }
        for i in range(3)
    ]
    source.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "distilled.jsonl"
    args = [
        "distill",
        "--target",
        str(tiny_target_dir),
        "--source",
        str(source),
        "--out",
        str(out),
        "--max-new-tokens",
        "4",
        "--batch-size",
        "2",
    ]
    first = _cli(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    again = _cli(*args)  # a rerun resumes: nothing is written twice
    assert again.returncode == 0, again.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == ["c0", "c1", "c2"]
    assert all(
        r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] != "old answer"
        for r in records
    )


def test_generate_streams_and_reports(tiny_target_dir):
    proc = _cli(
        "generate",
        "--target",
        str(tiny_target_dir),
        "--heads",
        "none",
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "6",
        "--tree",
        "chain-2",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tau" in proc.stderr and "tokens/s" in proc.stderr


def test_prepare_passes_num_proc_to_the_renderer(tmp_path, text_run):
    """--num-proc reaches the split builder: 0 is a one-line error, 2 builds the splits."""
    config = text_run()
    cmd = [sys.executable, "-m", "selfdraft.scripts.cli", "prepare", "--config", str(config)]
    bad = subprocess.run(cmd + ["--num-proc", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--num-proc 0: pass a count of at least 1" in bad.stderr
    assert "Traceback" not in bad.stderr
    ok = subprocess.run(cmd + ["--num-proc", "2"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "run" / "data" / "train").is_dir()
