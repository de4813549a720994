"""One registry maps a heads config to its module and what a run of it defaults to; outside `heads/`,
nothing asks which kind or layout it holds (no isinstance on a heads class, no comparison with a kind
or layout name)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from selfdraft.heads import HeadsConfig, build_heads, head_type, load_heads, save_heads
from selfdraft.heads.registry import HEAD_TYPES, layout_of

from tiny_models import tiny_target

ROOT = Path(__file__).resolve().parents[2]
HEAD_CLASSES = {"EagleHead", "MedusaHeads", "PublishedEagleHead"}
KINDS = {"medusa", "eagle", "eagle1", "eagle3"}  # "selfdraft" also names a bench method and a generator
KIND_ATTRS = {"head_kind", "eagle_layout", "layout"}
# Every package but heads/ itself. scripts/check_vllm.py runs under the system Python, before any
# environment with selfdraft exists, and reads config.json itself.
SCANNED = ["selfdraft", "corpora", "inference", "bench", "training", "scripts"]
UNSCANNED = {"scripts/check_vllm.py"}


def kind_branches(source: str) -> list[str]:
    """'line N: ...' for each isinstance on a heads class or comparison with a kind/layout name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            constants = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
            named = {getattr(n, "attr", getattr(n, "id", None)) for n in ast.walk(node)}
            if constants & KINDS or (named & KIND_ATTRS and "selfdraft" in constants):
                found.append(f"line {node.lineno}: compares with {sorted(constants & (KINDS | {'selfdraft'}))}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            classes = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            found += [f"line {node.lineno}: isinstance on {c}" for c in classes & HEAD_CLASSES]
    return found


def test_nothing_outside_heads_asks_which_kind_it_holds():
    assert not (ROOT / "heads" / "foreign").exists()
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if str(path.relative_to(ROOT)) not in UNSCANNED:
                found += [f"{path.relative_to(ROOT)} {f}" for f in kind_branches(path.read_text())]
    assert not found, "\n".join(found)


def test_the_scan_catches_a_branch_on_the_kind():
    assert kind_branches("if heads.config.head_kind == 'medusa':\n    pass\n")
    assert kind_branches("if config.eagle_layout != 'selfdraft':\n    pass\n")
    assert kind_branches("if isinstance(heads, EagleHead | PublishedEagleHead):\n    pass\n")
    assert not kind_branches("if method.kind == 'selfdraft':\n    pass\n")  # a bench method's name


@pytest.mark.parametrize("layout", sorted(HEAD_TYPES))
def test_every_layout_builds_saves_and_loads_bit_identically(tmp_path, layout):
    """Each registered layout builds its module, which drafts through its own drafter, and a saved folder
    loads back to the same tensors under the same type."""
    target = tiny_target("llama")
    kind = HEAD_TYPES[layout].kind
    config = HeadsConfig.for_target(
        target.config, head_kind=kind, eagle_layout=None if kind == "medusa" else layout
    )
    assert layout_of(config) == layout and head_type(config) is HEAD_TYPES[layout]
    torch.manual_seed(0)
    heads = build_heads(config)
    assert type(heads) is HEAD_TYPES[layout].module and callable(heads.attach(target).drafter)
    loaded = load_heads(save_heads(heads, tmp_path / layout), target)
    assert type(loaded) is type(heads)
    mine, theirs = heads.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_fresh_eagle_heads_take_the_default_layout_and_old_folders_keep_theirs(tmp_path):
    target = tiny_target("llama")
    assert HeadsConfig.for_target(target.config).eagle_layout == "eagle3"
    assert HeadsConfig.for_target(target.config, head_kind="medusa").eagle_layout is None
    old = build_heads(HeadsConfig.for_target(target.config, eagle_layout="selfdraft"))
    folder = save_heads(old, tmp_path / "old")
    data = json.loads((folder / "config.json").read_text())
    del data["eagle_layout"]  # written before the key existed
    (folder / "config.json").write_text(json.dumps(data))
    assert load_heads(folder).config.eagle_layout == "selfdraft"
