"""Which drafter serves a generate call; heads draft through their own package (`heads/<kind>/drafter.py`).

A drafter is created per `generate` call and owns that call's draft state (the EAGLE head's own KV
cache); nothing is stored on the heads or the target. It drafts for B rows (a single prompt is a batch
of one) through three calls:

    observe(row, next_tokens [P], hidden_states, positions [P])
        the target's features at P positions of that row whose next token is now known (prefill or
        accepted path)
    propose(shapes, roots) -> one (TreeSpec, tokens [N], q) `selfdraft.tree.Draft` per row
        each row's tree under its root token, as its shape says (`selfdraft.tree.grow_trees`)
    retire(keep)
        only the rows `keep` go on

A single-row drafter (Medusa's, test drafters) answers one call, `children(frontier) -> (target ids
[n, k], draft log q [n, k])`, behind `selfdraft.tree.PerRow`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfdraft.errors import UserError
from selfdraft.tree import Draft, PerRow, TreeShape, TreeSpec


class NoDrafter:
    """Drafts nothing, for plain decoding (the tree is the root alone): no head runs, so a model
    without trained heads decodes at the target's own speed."""

    def observe(self, row: int, next_tokens, hidden_states, positions) -> None:
        pass

    def propose(self, shapes: Sequence[TreeShape], roots: Sequence[int]) -> list[Draft]:
        if any(shape.draft_depth for shape in shapes):
            raise UserError("plain decoding drafts no children; pass heads to draft a tree")
        return [Draft(TreeSpec.chain(0), torch.tensor([int(root)])) for root in roots]

    def retire(self, keep: list[int]) -> None:
        pass


def is_drafter(obj) -> bool:
    """A single-row drafter object: `observe(next_tokens, hidden_states, positions)` and
    `children(frontier) -> (target ids [n, k], draft log q [n, k])` (see `selfdraft.tree.Frontier`)."""
    return all(callable(getattr(obj, name, None)) for name in ("observe", "children"))


def make_drafter(heads, rows: int):
    """The drafter for `rows` rows (one per prompt) of one generate call.

    heads: heads of any kind (their own `drafter(rows)`: EAGLE heads run one head pass per tree depth
    for every row, Medusa heads one drafter per row), a list of one drafter object per prompt
    (tests), or one drafter object, which holds state and so serves one row only; None drafts nothing
    (plain decoding, `NoDrafter`)."""
    if heads is None:
        return NoDrafter()
    if isinstance(heads, list | tuple):
        if len(heads) != rows:
            raise UserError(f"{len(heads)} drafters for {rows} prompts; pass one drafter per prompt")
        return PerRow(list(heads))
    if is_drafter(heads):
        if rows > 1:
            raise UserError(
                "one drafter object cannot draft for several rows; pass a list of one drafter per prompt"
            )
        return PerRow([heads])
    if callable(getattr(heads, "drafter", None)):
        return heads.drafter(rows)
    raise TypeError(f"no drafter for {type(heads).__name__}")
