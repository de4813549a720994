"""Draft trees as data: the verified tree, the shapes that say how a drafter fills one, and masks.

`TreeSpec` is a concrete tree. Node 0 is the root (the last token already chosen, not yet in the
target's KV cache). Every other node i has a parent `parents[i] < i` and a `rank`: which of the
drafter's ranked candidates it takes at its parent (rank 0 = most likely). Children of a node are
ordered by node index, which is the order in which acceptance tries them.

A *tree shape* says how a drafter fills a tree each step. Every shape has the same interface, so
neither drafters nor the decoding loop ask which kind they hold:

    shape.max_depth            the deepest node any drafted tree can have
    shape.draft_depth          the deepest node the drafter itself proposes (a looked-up branch can be deeper)
    shape.max_tokens           the most tokens one verification pass can hold (root included)
    shape.limited(depth)       the same kind of shape whose drafter part is at most `depth` deep
    shape.start(root_token)    a `Growth`: the drafter's part of one tree, filled a depth at a time
    shape.complete(spec, tokens, context) -> (TreeSpec, tokens [N]): what the shape adds without a
                               drafter (a prompt-lookup branch); the drafted tree itself otherwise
    shape.describe()           a short human description

A growth is plain state: `frontier()` names the nodes that get children next (a `Frontier`), `take`
adds the drafter's answer, `result()` is the drafted tree. `grow_trees` fills B rows' trees in
lockstep, one depth a round, so an EAGLE head runs once per depth for the whole batch.

Shapes: a `TreeSpec` itself (static: the same tree every step, Medusa `choices` style), a
`DynamicTree` (EAGLE-2: grow by cumulative draft log-probability, keep the best nodes) and a
`LookupTree` (any shape plus a prompt-lookup branch). Children are always a drafter's deterministic
top-k picks (or draws, see `drafting.drawn_children`), and a looked-up branch is a deterministic
function of the context, so the exact acceptance rule for deterministic children
(`acceptance.accept_rejection(variant="deterministic")`) keeps every shape lossless.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Protocol

import torch

from selfdraft.errors import UserError


# ---- growing trees: the drafter answers one frontier per depth ----------------------------------------
@dataclass(frozen=True)
class Frontier:
    """What a growing tree asks its drafter at one depth: the k best children of each of `nodes`
    (indices into `grown`, all `depth` deep; a tree at most `max_depth` deep). Answer: (target ids
    [n, k], draft log q [n, k]), best first."""

    grown: Grown
    nodes: list[int]
    depth: int
    k: int
    max_depth: int


class Growth(Protocol):
    """The drafter's part of one tree while it is filled (see `StaticGrowth`, `DynamicGrowth`)."""

    def frontier(self) -> Frontier | None:
        """The nodes that get children next; None when the tree is complete."""

    def take(self, ids: torch.Tensor, logq: torch.Tensor) -> None:
        """Add the frontier's children: the drafter's answer (ids [n, k], log q [n, k])."""

    def result(self) -> tuple[TreeSpec, torch.Tensor]:
        """The drafted (TreeSpec, tokens [N])."""


Expand = Callable[[dict[int, Frontier]], dict[int, tuple[torch.Tensor, torch.Tensor]]]


def grow_trees(growths: Sequence[Growth], expand: Expand) -> list[tuple[TreeSpec, torch.Tensor]]:
    """Fill B trees in lockstep, a depth a round: `expand` gets every unfinished row's frontier (by row)
    and answers each row's children. Returns row b's (TreeSpec, tokens [N_b]) at index b."""
    while asks := {b: f for b, g in enumerate(growths) if (f := g.frontier()) is not None}:
        for b, (ids, logq) in expand(asks).items():
            growths[b].take(ids, logq)
    return [g.result() for g in growths]


# ---- the concrete tree ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeSpec:
    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.parents or self.parents[0] != -1:
            raise UserError("a tree needs a root at index 0 with parent -1")
        if len(self.ranks) != len(self.parents):
            raise UserError("parents and ranks must have the same length")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise UserError(f"node {i} has parent {p}; parents must precede their children")
            if self.ranks[i] < 0:
                raise UserError(f"node {i} has a negative rank")
        seen = set()
        for i in range(1, len(self.parents)):
            key = (self.parents[i], self.ranks[i])
            if key in seen:
                raise UserError(f"node {i} repeats rank {self.ranks[i]} under parent {self.parents[i]}")
            seen.add(key)

    @classmethod
    def chain(cls, depth: int) -> TreeSpec:
        """A single path of `depth` drafted tokens (plus the root)."""
        if depth < 0:
            raise UserError("depth must be >= 0")
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
                raise UserError(f"negative rank in path {path}")
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

    @property
    def draft_depth(self) -> int:
        return self.max_depth

    @property
    def max_tokens(self) -> int:
        return self.size

    def limited(self, depth: int) -> TreeSpec:
        """This tree without its nodes deeper than `depth`."""
        keep = [i for i in range(self.size) if self.depths[i] <= depth]
        index = {old: new for new, old in enumerate(keep)}
        return TreeSpec(
            parents=tuple(index[self.parents[i]] if i else -1 for i in keep),
            ranks=tuple(self.ranks[i] for i in keep),
        )

    @cached_property
    def ranks_in_order(self) -> bool:
        """Every node's children take ranks 0..c-1 in node order: the first c of its drafter's candidates,
        tried in the order they were drawn, as a tree of drawn children needs (keeping a later draw
        but not an earlier one, or trying them out of order, would bias acceptance)."""
        return all([self.ranks[c] for c in kids] == list(range(len(kids))) for kids in self.children)

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

    def describe(self) -> str:
        if self.size == 1:
            return "plain decoding (nothing drafted)"
        if self.parents == TreeSpec.chain(self.max_depth).parents:
            return f"chain of {self.max_depth}"
        return f"static tree of {self.size - 1} nodes, depth {self.max_depth}"

    @cached_property
    def levels(self) -> tuple[tuple[tuple[int, ...], int, tuple[int, ...], torch.Tensor, torch.Tensor], ...]:
        """How `grow` fills this tree, per depth d: (the depth-d nodes that have children, k = how many
        candidates each must rank, those children in node order, each child's row among the nodes
        [m], its rank [m]). Computed once per tree, so a step only indexes the drafter's answer."""
        out = []
        frontier = [0] if self.size > 1 else []
        while frontier:
            kids = [c for u in frontier for c in self.children[u]]
            rows = [i for i, u in enumerate(frontier) for _ in self.children[u]]
            ranks = [self.ranks[c] for c in kids]
            out.append((tuple(frontier), 1 + max(ranks), tuple(kids), torch.tensor(rows), torch.tensor(ranks)))
            frontier = [c for c in kids if self.children[c]]
        return tuple(out)

    def start(self, root_token: int) -> StaticGrowth:
        return StaticGrowth(self, Grown.rooted(root_token))

    def complete(self, spec: TreeSpec, tokens: torch.Tensor, context: Sequence[int]) -> tuple[TreeSpec, torch.Tensor]:
        return spec, tokens


@dataclass
class StaticGrowth:
    """Fills a fixed tree a level at a time: node i takes its parent's rank-`ranks[i]` child."""

    spec: TreeSpec
    grown: Grown
    depth: int = 0
    node_of: dict[int, int] = field(default_factory=lambda: {0: 0})  # the spec's node -> index in `grown`

    def frontier(self) -> Frontier | None:
        if self.depth == len(self.spec.levels):
            return None
        frontier, k, *_ = self.spec.levels[self.depth]
        return Frontier(self.grown, [self.node_of[u] for u in frontier], self.depth, k, self.spec.max_depth)

    def take(self, ids: torch.Tensor, logq: torch.Tensor) -> None:
        _, _, kids, rows, ranks = self.spec.levels[self.depth]
        parents = [self.node_of[self.spec.parents[c]] for c in kids]
        new = self.grown.add(parents, [self.spec.ranks[c] for c in kids], ids[rows, ranks], logq[rows, ranks])
        self.node_of.update(zip(kids, new, strict=True))
        self.depth += 1

    def result(self) -> tuple[TreeSpec, torch.Tensor]:
        # nodes in the order they were drafted, so a drafter's per-node records (the q a node's children
        # were drawn from) index the result; for trees built by from_paths that is the spec's own order,
        # and returning the spec keeps its cached properties instead of rebuilding a tree every step
        grown = self.grown
        if tuple(grown.parents) == self.spec.parents and tuple(grown.ranks) == self.spec.ranks:
            return self.spec, grown.tokens
        return TreeSpec.from_parents(grown.parents, grown.ranks), grown.tokens


# ---- a tree while it is drafted ---------------------------------------------------------------------
@dataclass
class Grown:
    """Nodes drafted so far (index 0 = root): the structure as lists (parents, depths, ranks: the
    growth's own bookkeeping), the drafted values as tensors as the drafter answered them (tokens [n]
    long, scores [n] float64, the cumulative draft log q), so no answer goes through Python lists."""

    parents: list[int]
    depths: list[int]
    ranks: list[int]
    tokens: torch.Tensor
    scores: torch.Tensor

    @classmethod
    def rooted(cls, root_token: int) -> Grown:
        return cls([-1], [0], [0], torch.tensor([int(root_token)]), torch.zeros(1, dtype=torch.float64))

    def __len__(self) -> int:
        return len(self.parents)

    def add(self, parents: Sequence[int], ranks: Sequence[int], tokens: torch.Tensor, logq: torch.Tensor) -> range:
        """Append m children: parents[i] gets tokens[i] (its rank-ranks[i] candidate, draft log q logq[i]).
        tokens, logq: [m]. Returns the new nodes' indices."""
        start = len(self.parents)
        self.parents.extend(parents)
        self.ranks.extend(ranks)
        self.depths.extend(self.depths[p] + 1 for p in parents)
        self.tokens = torch.cat([self.tokens, tokens.to(self.tokens.device, torch.long)])
        # float64 sums, as Python floats were: rankings and ties do not depend on how scores are kept
        gained = self.scores[list(parents)] + logq.to(self.scores.device, torch.float64)
        self.scores = torch.cat([self.scores, gained])
        return range(start, len(self.parents))

    def ancestors(self, nodes: list[int], columns: list[int]) -> torch.Tensor:
        """allowed[i, j] = columns[j] is nodes[i] or one of its ancestors (root excluded). bool [n, m]."""
        position = {c: j for j, c in enumerate(columns)}
        allowed = torch.zeros(len(nodes), len(columns), dtype=torch.bool)
        for i, u in enumerate(nodes):
            while u > 0:
                if u in position:
                    allowed[i, position[u]] = True
                u = self.parents[u]
        return allowed

    def best(self, total_tokens: int) -> tuple[TreeSpec, torch.Tensor]:
        """The `total_tokens` best-scoring nodes (plus any missing ancestor) -> (TreeSpec, tokens [N]).
        Equal scores keep node order (a stable sort)."""
        ranked = torch.sort(self.scores[1:], descending=True, stable=True).indices[:total_tokens]
        best = (ranked + 1).tolist()
        keep = set(best)
        for i in best:  # ties can rank a child level with its parent; never keep an orphan
            while self.parents[i] > 0 and self.parents[i] not in keep:
                keep.add(self.parents[i])
                i = self.parents[i]
        order = [0] + sorted(keep, key=lambda i: (self.depths[i], i))
        index = {c: n for n, c in enumerate(order)}
        parents = [-1] + [index[self.parents[c]] for c in order[1:]]
        ranks = [0] + [self.ranks[c] for c in order[1:]]
        return TreeSpec.from_parents(parents, ranks), self.tokens[torch.tensor(order)]


# ---- shapes that grow a different tree each step ----------------------------------------------------
@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2: at each depth the `top_k` frontier nodes with the highest cumulative log q expand into
    their `top_k` most likely children; after `depth` levels the `total_tokens` best candidates (an
    ancestor-closed set, since a child never scores above its parent) are verified."""

    depth: int = 4
    top_k: int = 4
    total_tokens: int = 12  # drafted nodes verified (root excluded)

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 1:
            raise UserError("DynamicTree needs depth, top_k and total_tokens >= 1")

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def draft_depth(self) -> int:
        return self.depth

    @property
    def max_tokens(self) -> int:
        return self.total_tokens + 1  # total_tokens counts drafted nodes, the root comes on top

    def limited(self, depth: int) -> DynamicTree:
        return DynamicTree(min(self.depth, depth), self.top_k, self.total_tokens)

    def describe(self) -> str:
        return f"dynamic (depth {self.depth}, top-k {self.top_k}, {self.total_tokens} tokens)"

    def start(self, root_token: int) -> DynamicGrowth:
        return DynamicGrowth(self, Grown.rooted(root_token))

    def complete(self, spec: TreeSpec, tokens: torch.Tensor, context: Sequence[int]) -> tuple[TreeSpec, torch.Tensor]:
        return spec, tokens


@dataclass
class DynamicGrowth:
    """Grows a `DynamicTree`: the root, then at each depth the `top_k` best new nodes, expand."""

    tree: DynamicTree
    grown: Grown
    depth: int = 0
    nodes: list[int] = field(default_factory=lambda: [0])

    def frontier(self) -> Frontier | None:
        if self.depth == self.tree.depth:
            return None
        return Frontier(self.grown, self.nodes, self.depth, self.tree.top_k, self.tree.depth)

    def take(self, ids: torch.Tensor, logq: torch.Tensor) -> None:
        n, k = ids.shape
        parents = [u for u in self.nodes for _ in range(k)]
        new = self.grown.add(parents, list(range(k)) * n, ids.reshape(-1), logq.reshape(-1))
        self.depth += 1
        if self.depth < self.tree.depth:
            # the best-scoring new nodes expand; equal scores keep node order (a stable sort)
            order = torch.sort(self.grown.scores[new.start :], descending=True, stable=True).indices
            self.nodes = [new.start + i for i in order[: self.tree.top_k].tolist()]

    def result(self) -> tuple[TreeSpec, torch.Tensor]:
        return self.grown.best(self.tree.total_tokens)


@dataclass(frozen=True)
class PromptLookup:
    """tokens: the longest continuation grafted from the root; n-grams of max_ngram..min_ngram tokens
    are matched. extend: the longest continuation grafted after the heads' first-choice path (0: none).
    """

    tokens: int = 5
    max_ngram: int = 3
    min_ngram: int = 1
    extend: int = 0

    def __post_init__(self) -> None:
        if self.tokens < 1 or not 1 <= self.min_ngram <= self.max_ngram or self.extend < 0:
            raise UserError(
                f"bad prompt lookup {self}: need tokens >= 1, 1 <= min_ngram <= max_ngram and extend >= 0"
            )


# The extension's key ends in drafted tokens; one of them alone matches too often to predict: on 20
# held-out ShareGPT prompts (fp32, 4/4/10 + lookup 5, extend 3) 1-gram keys added 1.9 tokens a pass for
# +0.20 tau, 2-grams and longer 0.9 tokens for +0.18.
EXTEND_MIN_NGRAM = 2


@dataclass(frozen=True)
class LookupTree:
    """A heads' tree shape plus a prompt-lookup branch: small models repeat their context (code
    identifiers, lists, quoted text), so the tokens that followed the latest earlier occurrence of the
    current n-gram are grafted on every drafted tree as one more path from the root.

    With `lookup.extend`, the heads' first-choice path (each node's best-ranked child, from the root
    down) is continued the same way: the context followed by that path is looked up (n-grams of at
    least EXTEND_MIN_NGRAM tokens), and up to `extend` tokens are grafted below its last node. The
    heads stop at their depth; where the text repeats, the lookup carries a path they got right
    further, for a few verified tokens and no head pass."""

    base: TreeSpec | DynamicTree
    lookup: PromptLookup

    @property
    def max_depth(self) -> int:
        # The root's branch (up to lookup.tokens deep) may follow the heads' whole first-choice path and
        # run past its leaf: its new nodes take rank 0 there, so the first-choice path then ends at the
        # branch's end, and the extension hangs below whichever of the two is deeper.
        return max(self.base.max_depth, self.lookup.tokens) + self.lookup.extend

    @property
    def draft_depth(self) -> int:
        return self.base.draft_depth

    @property
    def max_tokens(self) -> int:
        return self.base.max_tokens + self.lookup.tokens + self.lookup.extend

    def limited(self, depth: int) -> LookupTree:
        return LookupTree(self.base.limited(depth), self.lookup)

    def describe(self) -> str:
        if self.base.max_tokens == 1:
            return f"prompt lookup alone (no heads): a branch of up to {self.lookup.tokens} looked-up tokens"
        text = f"{self.base.describe()} + prompt-lookup branch of up to {self.lookup.tokens} tokens"
        if self.lookup.extend:
            text += f", and up to {self.lookup.extend} looked-up tokens after the heads' first-choice path"
        return text

    def start(self, root_token: int) -> Growth:
        return self.base.start(root_token)

    def complete(self, spec: TreeSpec, tokens: torch.Tensor, context: Sequence[int]) -> tuple[TreeSpec, torch.Tensor]:
        """The drafted tree (spec, tokens [N]) plus the looked-up branch (and extension)."""
        spec, tokens = graft_chain(spec, tokens, lookup_continuation(context, self.lookup))
        if not self.lookup.extend:
            return spec, tokens
        path = first_choice_path(spec)
        if not path:
            return spec, tokens
        shortest = max(EXTEND_MIN_NGRAM, self.lookup.min_ngram)
        key = replace(
            self.lookup,
            tokens=self.lookup.extend,
            min_ngram=shortest,
            max_ngram=max(shortest, self.lookup.max_ngram),
        )
        found = lookup_continuation([*context, *tokens[path].tolist()], key)
        return graft_chain(spec, tokens, found, below=path[-1])


TreeShape = TreeSpec | DynamicTree | LookupTree


def lookup_continuation(context: Sequence[int], lookup: PromptLookup) -> list[int]:
    """The tokens that followed the latest earlier occurrence of context's last n-gram.

    Longer n-grams are tried first (they predict better); [] when nothing matches.
    """
    length = len(context)
    for n in range(min(lookup.max_ngram, length - 1), lookup.min_ngram - 1, -1):
        pattern = list(context[length - n :])
        for start in range(length - n - 1, -1, -1):  # latest first; the n-gram itself is excluded
            if list(context[start : start + n]) == pattern:
                return list(context[start + n : start + n + lookup.tokens])
    return []


def first_choice_path(spec: TreeSpec) -> list[int]:
    """The nodes of the heads' first-choice path below the root: from the root, each node's child of
    the lowest rank (the heads' most likely token among those the tree kept), to a leaf. [] for a
    root alone."""
    path, node = [], 0
    while spec.children[node]:
        node = min(spec.children[node], key=lambda c: spec.ranks[c])
        path.append(node)
    return path


def graft_chain(
    spec: TreeSpec, tokens: torch.Tensor, chain: Sequence[int], below: int = 0
) -> tuple[TreeSpec, torch.Tensor]:
    """Add `chain` as a path below node `below` (the root by default) of a drafted tree.

    spec, tokens [N]: the drafted tree. The chain follows existing children whose token matches and
    appends new nodes from the first mismatch on (rank = one past the parent's highest), so siblings
    keep distinct tokens. Returns the grown (spec, tokens [N + added]).
    """
    parents, ranks, values = list(spec.parents), list(spec.ranks), tokens.tolist()
    children = [list(c) for c in spec.children]
    node = below
    for token in chain:
        match = next((c for c in children[node] if values[c] == token), None)
        if match is None:
            parents.append(node)
            ranks.append(1 + max((ranks[c] for c in children[node]), default=-1))
            values.append(int(token))
            children[node].append(len(values) - 1)
            children.append([])
            match = len(values) - 1
        node = match
    if len(values) == spec.size:
        return spec, tokens
    added = torch.tensor(values[spec.size :], dtype=tokens.dtype, device=tokens.device)
    return TreeSpec(parents=tuple(parents), ranks=tuple(ranks)), torch.cat([tokens, added])


# ---- what the target (and an EAGLE head) sees -------------------------------------------------------
def ancestor_matrix(spec: TreeSpec) -> torch.Tensor:
    """A[i, j] = True iff node j is node i or one of its ancestors.  Returns bool [N, N]."""
    n = spec.size
    allowed = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        allowed[i] |= allowed[spec.parents[i]]
    return allowed


def additive_mask(
    allowed: torch.Tensor, prefix_len: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """allowed: bool [q, k] among new entries -> additive mask [1, 1, q, prefix_len + k], prefix visible.

    0 where attention is allowed, finfo.min elsewhere. Float on purpose: boolean 4D masks are silently
    misread by some attention backends (eager attention adds them as 0/1).
    """
    full = torch.cat([torch.ones(allowed.shape[0], prefix_len, dtype=torch.bool), allowed.cpu()], dim=1)
    return float_mask(full, dtype).to(device)[None, None]


def float_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [..., q, k] -> additive float mask of the same shape: 0 allowed, finfo.min elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


def block_causal_mask(
    query_len: int, prefix_len: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Plain causal additive mask [1, 1, q, prefix_len + q] for a contiguous block after a prefix."""
    return additive_mask(torch.tril(torch.ones(query_len, query_len, dtype=torch.bool)), prefix_len, dtype, device)


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


# ---- what a drafter returns -------------------------------------------------------------------------
@dataclass(frozen=True)
class Draft:
    """One row's drafted tree: its shape `spec`, tokens [N] (node 0 the root) and, when its children
    were drawn from the heads' q instead of ranked, q [N, V] (rows of nodes that drew nothing are 0)."""

    spec: TreeSpec
    tokens: torch.Tensor
    q: torch.Tensor | None = None


class PerRow:
    """B single-row drafters (one per row) behind the batch calls: each row grows its own tree with
    its drafter's `children` (no pass is shared, so the rows' trees need not grow in lockstep)."""

    def __init__(self, drafters: list) -> None:
        self.drafters = drafters

    def observe(self, row: int, next_tokens, hidden_states, positions) -> None:
        self.drafters[row].observe(next_tokens, hidden_states, positions)

    def propose(self, shapes: Sequence[TreeShape], roots: Sequence[int]) -> list[Draft]:
        out = []
        for drafter, shape, root in zip(self.drafters, shapes, roots, strict=True):
            ((spec, tokens),) = grow_trees([shape.start(root)], lambda asks, d=drafter: {0: d.children(asks[0])})
            out.append(Draft(spec, tokens))
        return out

    def retire(self, keep: list[int]) -> None:
        self.drafters = [self.drafters[b] for b in keep]
