"""Tree shapes as data: a frozen `TreeSpec` and pure functions deriving masks, positions and paths.

Node 0 is the root (the last token already chosen, not yet in the target's KV cache). Every other node
i has a parent `parents[i] < i` and a `rank`: which of the drafter's ranked candidates it takes at its
parent (rank 0 = most likely). Children of a node are ordered by node index, which is the order in
which acceptance tries them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class TreeSpec:
    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.parents or self.parents[0] != -1:
            raise ValueError("a tree needs a root at index 0 with parent -1")
        if len(self.ranks) != len(self.parents):
            raise ValueError("parents and ranks must have the same length")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}; parents must precede their children")
            if self.ranks[i] < 0:
                raise ValueError(f"node {i} has a negative rank")
        seen = set()
        for i in range(1, len(self.parents)):
            key = (self.parents[i], self.ranks[i])
            if key in seen:
                raise ValueError(f"node {i} repeats rank {self.ranks[i]} under parent {self.parents[i]}")
            seen.add(key)

    # ---- constructors -------------------------------------------------------------------------------
    @classmethod
    def chain(cls, depth: int) -> TreeSpec:
        """A single path of `depth` drafted tokens (plus the root)."""
        if depth < 0:
            raise ValueError("depth must be >= 0")
        return cls(parents=(-1, *range(depth)), ranks=(0,) + (0,) * depth)

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]]) -> TreeSpec:
        """Medusa `choices` style: each path lists candidate ranks from depth 1 down to the node.

        Missing prefixes are added, duplicates dropped; nodes are ordered by (depth, path) so that
        parents always precede children and siblings are tried best rank first.
        """
        full: set[tuple[int, ...]] = set()
        for path in paths:
            path = tuple(int(r) for r in path)
            if any(r < 0 for r in path):
                raise ValueError(f"negative rank in path {path}")
            for d in range(1, len(path) + 1):
                full.add(path[:d])
        ordered = sorted(full, key=lambda p: (len(p), p))
        index = {(): 0}
        parents, ranks = [-1], [0]
        for i, path in enumerate(ordered, start=1):
            index[path] = i
            parents.append(index[path[:-1]])
            ranks.append(path[-1])
        return cls(parents=tuple(parents), ranks=tuple(ranks))

    @classmethod
    def from_parents(cls, parents: Sequence[int], ranks: Sequence[int] | None = None) -> TreeSpec:
        if ranks is None:  # number siblings in order of appearance
            counts: dict[int, int] = {}
            ranks = [0]
            for p in parents[1:]:
                ranks.append(counts.get(p, 0))
                counts[p] = counts.get(p, 0) + 1
        return cls(parents=tuple(int(p) for p in parents), ranks=tuple(int(r) for r in ranks))

    # ---- derived structure --------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        d = [0] * self.size
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i in range(1, self.size):
            kids[self.parents[i]].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Root-to-node rank paths (node 0 -> ())."""
        out: list[tuple[int, ...]] = [()]
        for i in range(1, self.size):
            out.append(out[self.parents[i]] + (self.ranks[i],))
        return tuple(out)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        nodes = [node]
        while self.parents[nodes[-1]] != -1:
            nodes.append(self.parents[nodes[-1]])
        return nodes[::-1]

    def nodes_at_depth(self, depth: int) -> list[int]:
        return [i for i, d in enumerate(self.depths) if d == depth]


def ancestor_matrix(spec: TreeSpec) -> torch.Tensor:
    """A[i, j] = True iff node j is node i or one of its ancestors.  Returns bool [N, N]."""
    n = spec.size
    allowed = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        allowed[i] |= allowed[spec.parents[i]]
    return allowed


def tree_attention_mask(
    spec: TreeSpec, prefix_len: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Additive float mask [1, 1, N, prefix_len + N]: 0 where attention is allowed, finfo.min elsewhere.

    Every tree node sees the whole cached prefix plus its own ancestors. A float mask is used on
    purpose: boolean 4D masks are silently misread by some attention backends.
    """
    allowed = torch.cat(
        [torch.ones(spec.size, prefix_len, dtype=torch.bool), ancestor_matrix(spec)], dim=1
    ).to(device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def tree_position_ids(spec: TreeSpec, prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """position_ids [1, N] = prefix_len + depth."""
    return (torch.tensor(spec.depths, dtype=torch.long, device=device) + prefix_len)[None]


def retrieve_indices(spec: TreeSpec) -> torch.Tensor:
    """Root-to-leaf node paths [L, D+1], padded with -1 (one row per leaf)."""
    leaves = [i for i in range(spec.size) if not spec.children[i]]
    rows = [spec.path_to(leaf) for leaf in leaves]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)


def causal_mask(query_len: int, prefix_len: int, dtype: torch.dtype = torch.float32, device="cpu"):
    """Plain causal additive mask [1, 1, q, prefix_len + q] for a contiguous block after a prefix."""
    return tree_attention_mask(TreeSpec.chain(query_len - 1), prefix_len, dtype, device)


# Shapes shipped by name; `configs/trees/*.yaml` may define more.
NAMED_TREES: dict[str, TreeSpec] = {
    "chain-4": TreeSpec.chain(4),
    "small": TreeSpec.from_paths([(0, 0, 0), (0, 1), (1, 0), (2,), (0, 0, 1), (0, 0, 0, 0)]),
    "medium": TreeSpec.from_paths(
        [
            (0, 0, 0, 0, 0),
            (0, 1, 0),
            (1, 0, 0),
            (0, 0, 1),
            (2, 0),
            (0, 2),
            (1, 1),
            (3,),
            (0, 0, 0, 1),
            (0, 0, 2),
        ]
    ),
}
