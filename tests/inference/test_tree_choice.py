"""`TreeChoice`: the one place that picks a call's tree from the target's dtype, the kind of machine,
greedy or sampled decoding and the batch size (no model or target needed)."""

from __future__ import annotations

import pytest

from selfdraft.errors import UserError
from selfdraft.inference.tree_choice import HEADS_FREE, TreeChoice
from selfdraft.tree_syntax import resolve_tree, write_tree_file

AMX = "cpu-amx"


@pytest.fixture
def tree_file(tmp_path):
    """float32: chain-2, sampled small, batches of 4+ chain-1; float32 on AMX CPUs: chain-3 (the
    dtype's sampling and batch trees still apply); bfloat16: chain-4."""
    path = tmp_path / "tree.yaml"
    write_tree_file(path, resolve_tree("chain-2"), dtype="float32")
    write_tree_file(path, resolve_tree("small"), dtype="float32", sampling=True)
    write_tree_file(path, resolve_tree("chain-1"), dtype="float32", batch=4)
    write_tree_file(path, resolve_tree("chain-3"), dtype="float32", machine=AMX)
    write_tree_file(path, resolve_tree("chain-4"), dtype="bfloat16")
    return str(path)


@pytest.mark.parametrize(
    ("dtype", "machine", "temperature", "rows", "want"),
    [
        ("float32", "cpu", 0.0, None, "chain-2"),
        ("float32", AMX, 0.0, None, "chain-3"),
        ("bfloat16", AMX, 0.0, None, "chain-4"),
        ("float32", "cpu", 0.7, None, "small"),
        ("float32", AMX, 0.7, 8, "small"),  # sampling before batch size
        ("float32", "cpu", 0.0, 4, "chain-1"),
        ("float32", "cpu", 0.0, 9, "chain-1"),  # batches of at least the tuned size
        ("float32", "cpu", 0.0, 3, "chain-2"),
        ("bfloat16", "cpu", 0.7, None, "chain-4"),  # no sampling tree for the dtype: its greedy one
    ],
)
def test_each_call_gets_the_tree_of_its_dtype_machine_sampling_and_batch(
    tree_file, dtype, machine, temperature, rows, want
):
    choice = TreeChoice.build(tree_file, None, dtype=dtype, machine=machine, depth_limit=None)
    assert choice.for_call(None, temperature, rows) == resolve_tree(want)
    assert choice.for_call("chain-1", temperature, rows) == resolve_tree("chain-1")  # the call's own wins


def test_the_default_tree_is_cut_to_the_heads_depth_and_a_deeper_one_asked_for_is_refused():
    choice = TreeChoice.build(None, None, dtype="float32", machine="cpu", depth_limit=2)
    assert choice.greedy.draft_depth == 2 and resolve_tree("small").draft_depth > 2
    with pytest.raises(UserError, match="at most 2 levels.*chain-2"):
        choice.for_call("chain-3", 0.0, None)
    with pytest.raises(UserError, match="at most 2 levels"):
        TreeChoice.build("chain-3", None, dtype="float32", machine="cpu", depth_limit=2)


def test_untrained_heads_run_no_head_unless_a_tree_is_asked_for():
    fresh = TreeChoice.build(None, None, dtype="float32", machine="cpu", depth_limit=None, trained=False)
    assert fresh.plain and fresh.greedy == HEADS_FREE and fresh.sampling == HEADS_FREE
    assert fresh.for_call("chain-2", 0.0, None) == resolve_tree("chain-2")
    asked = TreeChoice.build("chain-2", None, dtype="float32", machine="cpu", depth_limit=None, trained=False)
    assert not asked.plain and asked.greedy == resolve_tree("chain-2")
