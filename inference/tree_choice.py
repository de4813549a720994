"""Which tree a generate call verifies: one object that holds the whole choice.

The choice depends on four things: the target's dtype and the kind of machine (a tree file has an
entry per `dtype` or `dtype@machine`, since the verify cost that tuning trades against differs), greedy
or sampled decoding (a tree file's `sampling:` tree), and the batch size (its `batch:` block). A model
builds a `TreeChoice` once; each call asks it `for_call(...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from selfdraft.errors import UserError
from selfdraft.tree import LookupTree, PromptLookup, TreeShape, TreeSpec
from selfdraft.tree_syntax import TreeLike, is_tree_file, read_batch_trees, resolve_tree, tree_for_batch

DEFAULT_TREE = "small"
# With no trained heads: the root plus a prompt-lookup branch, no head runs. Measured on sharegpt:8 (64
# tokens, T=0, against target.generate, this 2-core AVX512-BF16 CPU): fp32 plain decoding 0.96x, this
# 1.07x (tau 1.46); bf16 plain 1.05x, this 1.35x (tau 1.69).
HEADS_FREE = LookupTree(TreeSpec.chain(0), PromptLookup(tokens=5))


@dataclass(frozen=True)
class TreeChoice:
    """dtype: the target's dtype name; machine: `precision.machine_kind` of its device; depth_limit:
    the deepest level the heads can draft (Medusa: their head count), None for no limit."""

    dtype: str
    machine: str
    depth_limit: int | None
    greedy: TreeShape
    sampling: TreeShape
    batch: dict[int, TreeShape] = field(default_factory=dict)  # greedy trees by batch size
    plain: bool = False  # untrained heads, no tree asked for: no head runs (`HEADS_FREE`)

    @classmethod
    def build(
        cls,
        tree: TreeLike | None,
        sampling_tree: TreeLike | None,
        *,
        dtype: str,
        machine: str,
        depth_limit: int | None,
        trained: bool = True,
    ) -> TreeChoice:
        """tree: None = the default shape, cut to what the heads can draft. sampling_tree: the shape for
        temperature > 0 (None: a tree file's `sampling:` tree, else `tree`). trained: False for fresh
        heads, which draft almost nothing that is accepted: with no tree asked for, no head runs."""
        probe = cls(dtype, machine, depth_limit, HEADS_FREE, HEADS_FREE)
        plain = not trained and tree is None and sampling_tree is None
        greedy = HEADS_FREE if plain else probe.fit(tree)
        given = tree if sampling_tree is None else sampling_tree
        sampling = probe.fit(given, sampling=True) if given is not None else greedy
        sizes = read_batch_trees(Path(tree), dtype, machine) if is_tree_file(tree) else {}
        batch = {size: probe.fit(shape) for size, shape in sizes.items()}
        return cls(dtype, machine, depth_limit, greedy, sampling, batch, plain)

    def fit(self, tree: TreeLike | None, sampling: bool = False) -> TreeShape:
        """`tree` resolved for this dtype and machine; the default is cut to the heads' depth, a tree
        asked for that is deeper than the heads draft is refused."""
        shape = resolve_tree(DEFAULT_TREE if tree is None else tree, self.dtype, sampling, self.machine)
        limit = self.depth_limit
        if limit is None or shape.draft_depth <= limit:
            return shape
        if tree is None:
            return shape.limited(limit)
        raise UserError(
            f"tree {shape.describe()} drafts {shape.draft_depth} deep but these heads propose at most "
            f"{limit} levels; choose a tree at most {limit} deep (e.g. chain-{limit})"
        )

    def for_call(self, tree: TreeLike | None, temperature: float, rows: int | None) -> TreeShape:
        """The tree of one generate call: the call's own `tree`, else the sampling tree for T > 0, else
        the greedy tree tuned for `rows` prompts (rows: None for a single prompt)."""
        if tree is not None:
            return self.fit(tree, sampling=temperature > 0)
        if temperature > 0:
            return self.sampling
        if rows is not None:
            return tree_for_batch(self.batch, rows, self.greedy)
        return self.greedy
