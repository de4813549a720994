"""No command cuts or replaces a user's file: every output path is checked before any work, and a path
the command does not own is refused in one line (exit 2) and left byte for byte as it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from selfdraft.inference.model import CHECKPOINTS_DIR
from selfdraft.scripts import cli

SHIPPED = CHECKPOINTS_DIR / "smollm2-135m-instruct-eagle"
RUN_CONFIG = "target: smollm2-135m-instruct\noutput_dir: runs/x\n"


def _user_file(folder: Path, name: str, data: bytes = b"the user's own file\n") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(data)
    return folder / name


def _heads_copy(tmp_path: Path) -> Path:
    heads = tmp_path / "heads"
    heads.mkdir()
    for name in ("config.json", "model.safetensors"):
        (heads / name).write_bytes((SHIPPED / name).read_bytes())
    return heads


def _tune(*out: str) -> list[str]:
    return ["tune", "--heads", str(SHIPPED), "--prompts", "sharegpt:2", *out]


def _bench(out: Path) -> list[str]:
    return ["bench", "--prompts", "sharegpt:1", "--methods", "baseline", "--output-dir", str(out)]


# name -> (argv, the user's file that must stay, words the one line says), built in tmp_path
CASES = {
    "tune --out a run config": lambda t: (
        _tune("--out", str(_user_file(t, "run.yaml", RUN_CONFIG.encode()))),
        t / "run.yaml",
        ["not a tree file", "left as it is"],
    ),
    "tune --out the heads' config.json": lambda t: (
        _tune("--out", str(_heads_copy(t) / "config.json")),
        t / "heads" / "config.json",
        ["ends in .yaml"],
    ),
    "tune --out the heads' weights": lambda t: (
        _tune("--out", str(_heads_copy(t) / "model.safetensors")),
        t / "heads" / "model.safetensors",
        ["ends in .yaml"],
    ),
    "tune --out a folder": lambda t: (
        _tune("--out", str(_user_file(t / "trees", "keep.txt").parent)),
        t / "trees" / "keep.txt",
        ["is a folder", "tree.yaml"],
    ),
    "bench --output-dir holding a user's bench.md": lambda t: (
        _bench(_user_file(t / "reports", "bench.md").parent),
        t / "reports" / "bench.md",
        ["already holds bench.md", "--overwrite"],
    ),
    "bench --output-dir holding a user's plot": lambda t: (
        _bench(_user_file(t / "reports", "acceptance_by_depth.png").parent),
        t / "reports" / "acceptance_by_depth.png",
        ["already holds", "--overwrite"],
    ),
    "compare --out holding a user's compare.md": lambda t: (
        ["compare", str(_user_file(t, "c.yaml", RUN_CONFIG.encode())), "--out", str(t / "cmp")],
        _user_file(t / "cmp", "compare.md"),
        ["already holds compare.md", "--overwrite"],
    ),
    "compare --out a file": lambda t: (
        ["compare", str(_user_file(t, "c.yaml", RUN_CONFIG.encode())), "--out", str(_user_file(t, "notes.md"))],
        t / "notes.md",
        ["is a file", "folder"],
    ),
}


@pytest.mark.parametrize("make", CASES.values(), ids=CASES.keys())
def test_an_output_the_command_does_not_own_is_refused_untouched(tmp_path, make, capsys):
    argv, kept, words = make(tmp_path)
    before = kept.read_bytes()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err
    assert kept.read_bytes() == before


def test_a_report_folder_keeps_the_users_other_files_and_overwrite_replaces_only_the_report(tmp_path):
    from selfdraft.destinations import BENCH_REPORT_NAMES, check_destination
    from selfdraft.errors import UserError

    folder = tmp_path / "reports"
    _user_file(folder, "notes.txt")
    check_destination(folder, owned=BENCH_REPORT_NAMES, option="--output-dir", shared_folder=True)  # fine
    _user_file(folder, "bench.json")
    with pytest.raises(UserError, match="bench.json"):
        check_destination(folder, owned=BENCH_REPORT_NAMES, option="--output-dir", shared_folder=True)
    check_destination(folder, overwrite=True, owned=BENCH_REPORT_NAMES, option="--output-dir", shared_folder=True)


def test_an_existing_tree_file_gains_an_entry_and_a_binary_one_is_refused(tmp_path):
    from selfdraft.errors import UserError
    from selfdraft.tree_syntax import check_tree_destination, read_tree_file, resolve_tree, write_tree_file

    tree = tmp_path / "tree.yaml"
    write_tree_file(tree, resolve_tree("chain-3"), dtype="float32")
    assert check_tree_destination(tree) == tree  # tune adds its dtype's entry to it
    write_tree_file(tree, resolve_tree("chain-2"), dtype="bfloat16")
    assert read_tree_file(tree, "float32").max_depth == 3 and read_tree_file(tree, "bfloat16").max_depth == 2
    binary = _user_file(tmp_path, "odd.yaml", bytes(range(256)))
    with pytest.raises(UserError, match="not a tree file"):
        check_tree_destination(binary)
    with pytest.raises(UserError, match="cannot read the tree file"):
        read_tree_file(binary)
