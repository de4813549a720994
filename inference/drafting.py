"""Drafters: heads propose the tokens of a tree; the target verifies them afterwards.

A drafter is created per `generate` call and owns that call's draft state (the EAGLE head's own KV
cache); nothing is stored on the heads or the target. It drafts for B rows (a single prompt is a batch
of one) through three calls:

    observe(row, next_tokens [P], hidden_states, positions [P])
        the target's features at P positions of that row whose next token is now known (prefill or
        accepted path)
    propose(shapes, roots) -> one (TreeSpec, tokens [N], q) `Draft` per row
        each row's tree under its root token, as its shape says (`selfdraft.tree.grow_trees`)
    retire(keep)
        only the rows `keep` go on

`EagleRows` runs the EAGLE head once per tree depth over every row's frontier; `PerRow` serves each
row with its own single-row drafter (Medusa, test drafters), which answers one call,
`children(frontier) -> (target ids [n, k], draft log q [n, k])`. Children are the head's top-k by draft
probability (deterministic picks, see `selfdraft.tree`), or drawn from it (`EagleRows.draw_with`).
`draft_trees` adds what a shape grafts without heads (a prompt-lookup branch).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from selfdraft import kv
from selfdraft.errors import UserError
from selfdraft.heads.eagle import EagleHead
from selfdraft.heads.foreign.modules import ForeignEagleHead
from selfdraft.heads.int8 import has_int8_weights
from selfdraft.heads.medusa import MedusaHeads
from selfdraft.precision import dtype_name
from selfdraft.tree import Frontier, TreeShape, TreeSpec, float_mask, grow_trees


@dataclass(frozen=True)
class Draft:
    """One row's drafted tree: its shape `spec`, tokens [N] (node 0 the root) and, when its children
    were drawn from the heads' q instead of ranked, q [N, V] (rows of nodes that drew nothing are 0)."""

    spec: TreeSpec
    tokens: torch.Tensor
    q: torch.Tensor | None = None


def draft_trees(
    drafter, shapes: Sequence[TreeShape], roots: Sequence[int], contexts: Sequence[list[int]]
) -> list[Draft]:
    """Row b's tree: the drafter's part of shapes[b] under roots[b], completed with what the shape adds
    from contexts[b] alone (a looked-up branch; drawn children come only from static trees, which add
    nothing, so q stays aligned)."""
    drafts = drafter.propose(shapes, roots)
    return [
        Draft(*shape.complete(d.spec, d.tokens, context), d.q)
        for shape, d, context in zip(shapes, drafts, contexts, strict=True)
    ]


def ranked_children(logits: torch.Tensor, k: int, heads) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [n, V'] -> (k best target ids [n, k], their draft log-probabilities [n, k]), best first."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logq, k, dim=-1)
    vocab = getattr(heads, "draft_vocab", None)
    ids = vocab.to_target(top.indices) if vocab is not None else top.indices
    return ids, top.values


# Mass spread uniformly over the draft vocabulary in a drawing drafter's q: every token keeps q > 0,
# so a row always has k distinct tokens to draw; q is ours to choose, and acceptance uses this exact q.
DRAW_FLOOR = 1e-6


def drawn_children(
    logits: torch.Tensor, k: int, temperature: float, generator: torch.Generator | None, heads
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k children per node drawn without replacement from q = softmax(logits / T) (floored, see
    DRAW_FLOOR), in draw order: the Gumbel top-k of log q is exactly such a draw.

    logits: [n, V'] -> (target ids [n, k], log q of each draw [n, k], q [n, V'] float32)."""
    q = torch.softmax(logits.float() / temperature, dim=-1)
    q = q * (1.0 - DRAW_FLOOR) + DRAW_FLOOR / q.shape[-1]
    logq = q.log()
    u = torch.rand(q.shape, generator=generator, device=q.device).clamp_(min=torch.finfo(torch.float32).tiny)
    draws = torch.topk(logq - torch.log(-torch.log(u)), k, dim=-1).indices
    vocab = getattr(heads, "draft_vocab", None)
    ids = vocab.to_target(draws) if vocab is not None else draws
    return ids, logq.gather(-1, draws), q


def heads_dtype(heads: torch.nn.Module) -> torch.dtype:
    """The floating dtype the heads compute in; it may differ from the target's (see `draft_dtype`).
    Buffers count too: heads with int8 weights keep their scales there (`selfdraft.heads.int8`)."""
    for t in itertools.chain(heads.parameters(), heads.buffers()):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def heads_precision(heads: torch.nn.Module) -> str:
    """How the heads draft, for reports: their compute dtype, and whether they hold int8 weights."""
    return dtype_name(heads_dtype(heads)) + (" (int8 weights)" if has_int8_weights(heads) else "")


class MedusaDrafter:
    """Head d (0-based) on the last accepted feature proposes the tokens at tree depth d+1."""

    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads
        self.dtype = heads_dtype(heads)
        self.last_feature: torch.Tensor | None = None
        self.ranked: tuple[torch.Tensor, torch.Tensor] | None = None

    def observe(
        self, next_tokens: torch.Tensor, hidden_states: Sequence[torch.Tensor], positions: torch.Tensor
    ) -> None:
        feature = hidden_states[self.heads.config.feature_layers[-1]][0, positions[-1]]
        self.last_feature = feature.to(self.dtype)

    @torch.no_grad()
    def children(self, frontier: Frontier) -> tuple[torch.Tensor, torch.Tensor]:
        # every node at one depth gets the same proposals: Medusa heads see only the last feature
        if frontier.depth == 0:  # a new tree: every depth's logits from one projection
            if frontier.max_depth > self.heads.num_heads:
                raise UserError(
                    f"tree depth {frontier.max_depth} exceeds the {self.heads.num_heads} Medusa heads; "
                    f"choose a tree at most {self.heads.num_heads} deep (e.g. chain-{self.heads.num_heads})"
                )
            self.logits = self.heads.logits(self.last_feature, slice(0, frontier.max_depth))  # [D, V']
            self.ranked = None
        k, n = frontier.k, len(frontier.nodes)
        if self.ranked is None or self.ranked[0].shape[-1] < k:
            self.ranked = ranked_children(self.logits, k, self.heads)  # [D, k]
        ids, logq = self.ranked[0][frontier.depth, :k], self.ranked[1][frontier.depth, :k]
        return ids.expand(n, -1), logq.expand(n, -1)


class EagleRows:
    """The EAGLE head drafting B rows' trees at once: one head pass per tree depth over all frontiers.

    The head consumes pairs (x_{i+1}, f_i) at position i. A row's pending pairs (known tokens with the
    target's features, from `observe`) are consumed when its tree begins; tree nodes are then fed
    their parent's predicted feature under an ancestor mask, and cropped when the trees are drafted.

    Head cache layout, an invariant between trees: row b's pairs fill physical slots [0, lengths[b])
    of the head's cache [B, H, L, d], L = max lengths; slots past lengths[b] hold filler no real query
    sees. Pending pairs and tree nodes are appended in blocks padded to the widest row; a pad query
    sees only its own slot (a finite softmax, output unused). After the pending pairs the cache is
    re-packed (one gather) so the invariant holds again.
    """

    def __init__(self, heads: EagleHead | ForeignEagleHead, rows: int) -> None:
        self.heads = heads
        self.dtype = heads_dtype(heads)
        self.cache = kv.new_cache()
        self.lengths = [0] * rows
        self.pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(rows)]
        self.tree_start: int | None = None  # cache length before the current trees' nodes
        self.slots: list[dict[int, int]] = []  # per row: tree node -> physical slot
        self.features: list[dict[int, torch.Tensor]] = []  # per row: tree node -> predicted feature [h]
        # drawing children (see `draw_with`) instead of taking the top-k
        self.temperature = 0.0
        self.generators: list[torch.Generator | None] = [None] * rows
        self.dists: list[dict[int, torch.Tensor]] = [{} for _ in range(rows)]  # node -> q [V'] it drew from

    def draw_with(self, temperature: float, generators: list[torch.Generator | None]) -> None:
        """From now on children are drawn without replacement from q = softmax(logits / temperature),
        row b with generators[b]; each `Draft` then carries the q that acceptance needs
        (`accept_rejection(variant="without_replacement")`)."""
        if temperature <= 0 or len(generators) != len(self.lengths):
            raise ValueError("drawing needs a temperature > 0 and one generator per row")
        self.temperature, self.generators = temperature, list(generators)

    @torch.no_grad()
    def propose(self, shapes: Sequence[TreeShape], roots: Sequence[int]) -> list[Draft]:
        """Every row drafts its tree together, a head pass per depth for all rows (see the class)."""
        if len(shapes) != len(self.lengths):
            raise ValueError(f"every one of the {len(self.lengths)} rows must draft a tree together")
        self._begin()
        try:
            trees = grow_trees([shape.start(root) for shape, root in zip(shapes, roots, strict=True)], self._expand)
        finally:
            kv.crop(self.cache, self.tree_start)  # tree entries never outlive the draft
            self.slots, self.features = [], []
        if not self.temperature:
            return [Draft(spec, tokens) for spec, tokens in trees]
        return [Draft(spec, tokens, self._tree_q(b, spec.size)) for b, (spec, tokens) in enumerate(trees)]

    def _tree_q(self, row: int, size: int) -> torch.Tensor | None:
        """q [size, V] over the target vocabulary for the last tree row `row` drew (node order of the
        tree its growth returned); rows of nodes that drew nothing are zero. None when no node drew:
        the tree is its root alone (cut so at the context's end), with no children to verify."""
        if not self.dists[row]:
            return None
        vocab = self.heads.draft_vocab
        some = next(iter(self.dists[row].values()))
        width = vocab.t2d.numel() if vocab is not None else some.shape[-1]
        out = some.new_zeros(size, width)
        for node, q in self.dists[row].items():
            out[node] = vocab.scatter_to_target(q) if vocab is not None else q
        return out

    def observe(
        self,
        row: int,
        next_tokens: torch.Tensor,
        hidden_states: Sequence[torch.Tensor],
        positions: torch.Tensor,
    ) -> None:
        """The target's features of batch row `row` (hidden_states: that row's, each [1, n, h]) at
        `positions` [P], whose next tokens `next_tokens` [P] are now known (prefill or accepted path)."""
        # Slice only the layers the head reads; the others stay untouched (None).
        sliced: list[torch.Tensor | None] = [None] * len(hidden_states)
        for layer in self.heads.config.feature_layers:
            sliced[layer] = hidden_states[layer][:, positions].to(self.dtype)
        self.pending[row].append((next_tokens.reshape(-1), self.heads.fuse_features(sliced)[0]))

    def _append(
        self,
        tokens: list[torch.Tensor],
        inputs: list[torch.Tensor | None],
        positions: list[int],
        causal: bool,
        ancestors: list[tuple[int, int, int]] = (),
    ) -> torch.Tensor:
        """One head pass over a block of per-row queries padded to the widest row; returns [B, m, h].

        tokens[b]: row b's query tokens [n_b]; inputs[b]: their input features [n_b, h] (None: no query).
        Real query i of row b sees its row's pairs [0, lengths[b]), its own new slot, with `causal` its
        row's earlier queries in the block, and the cached slot s of every (b, i, s) in `ancestors`.
        positions[b]: the position of row b's first query (causal) or of all its queries."""
        rows, width = len(tokens), kv.cache_length(self.cache)
        m = max(t.numel() for t in tokens)
        first = next(v for v in inputs if v is not None)
        ids = torch.zeros(rows, m, dtype=torch.long)
        x = first.new_zeros(rows, m, first.shape[-1])
        step = torch.arange(m) if causal else torch.zeros(m, dtype=torch.long)
        pos = torch.tensor(positions)[:, None] + step
        allowed = torch.zeros(rows, m, width + m, dtype=torch.bool)
        allowed[:, :, width:] = torch.eye(m, dtype=torch.bool)  # own slot (a pad query's only one)
        for b in range(rows):
            n = tokens[b].numel()
            if not n:
                continue
            ids[b, :n] = tokens[b]
            x[b, :n] = inputs[b]
            allowed[b, :n, : self.lengths[b]] = True
            if causal:
                allowed[b, :n, width : width + n] = torch.ones(n, n, dtype=torch.bool).tril()
        for b, i, slot in ancestors:
            allowed[b, i, slot] = True
        with kv.masked_gqa(first.device, m):
            return self.heads(
                ids.to(first.device),
                x,
                position_ids=pos.to(first.device),
                attention_mask=float_mask(allowed.to(first.device), self.dtype)[:, None],
                cache=self.cache,
            )

    def _begin(self) -> None:
        """Every row begins a tree together: its pending pairs are fed causally after its cached
        pairs, and the last one predicts the feature of its root."""
        rows = len(self.lengths)
        tokens = [torch.cat([t for t, _ in p]) for p in self.pending]
        feats: list[torch.Tensor | None] = [torch.cat([f for _, f in p]) for p in self.pending]
        self.pending = [[] for _ in range(rows)]
        start = kv.cache_length(self.cache)
        counts = [t.numel() for t in tokens]
        out = self._append(tokens, feats, self.lengths, causal=True)
        new = [length + count for length, count in zip(self.lengths, counts, strict=True)]
        if any(length != start for length in self.lengths) or len(set(counts)) > 1:
            # re-pack in place: row b's new pairs move down to [lengths[b], new[b])
            batch = torch.cat([torch.full((c,), b, dtype=torch.long) for b, c in enumerate(counts)])
            src = torch.cat([torch.arange(start, start + c) for c in counts])
            dst = torch.cat([torch.arange(length, n) for length, n in zip(self.lengths, new, strict=True)])
            kv.compact_rows(self.cache, None, batch, src, dst, max(new))
        self.lengths = new
        self.tree_start = kv.cache_length(self.cache)
        self.slots = [{} for _ in range(rows)]
        self.features = [{0: out[b, counts[b] - 1]} for b in range(rows)]
        self.dists = [{} for _ in range(rows)]

    def _expand(self, asks: dict[int, Frontier]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """One depth of every row's tree: below the root the frontier nodes are fed first (a head pass),
        then their children are ranked or drawn from the features they predict."""
        if next(iter(asks.values())).depth:
            self._feed(asks)
        return self._children(asks)

    def _children(self, requests: dict[int, Frontier]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """One head projection over all requested rows' nodes (grouped by k, so each row's ranking is
        exactly what it would be alone)."""
        by_k: dict[int, list[int]] = defaultdict(list)
        for b, r in requests.items():
            by_k[r.k].append(b)
        answers = {}
        for k, rows in by_k.items():
            feats = torch.stack([self.features[b][u] for b in rows for u in requests[b].nodes])
            logits = self.heads.logits(feats)
            if not self.temperature:
                ids, logq = ranked_children(logits, k, self.heads)
            at = 0
            for b in rows:
                nodes = requests[b].nodes
                if self.temperature:  # each row draws with its own generator
                    drawn = drawn_children(
                        logits[at : at + len(nodes)], k, self.temperature, self.generators[b], self.heads
                    )
                    answers[b] = drawn[:2]
                    self.dists[b].update(zip(nodes, drawn[2], strict=True))
                else:
                    answers[b] = (ids[at : at + len(nodes)], logq[at : at + len(nodes)])
                at += len(nodes)
        return answers

    def _feed(self, requests: dict[int, Frontier]) -> None:
        """One head pass over every row's depth-d nodes: each is fed its parent's predicted feature and
        sees its row's pairs plus its tree ancestors (the root's pair is the row's last one)."""
        rows = len(self.lengths)
        width = kv.cache_length(self.cache)
        tokens = [torch.empty(0, dtype=torch.long)] * rows
        inputs: list[torch.Tensor | None] = [None] * rows
        positions, ancestors = [0] * rows, []
        for b, r in requests.items():
            grown = r.grown
            positions[b] = self.lengths[b] + r.depth - 1
            tokens[b] = grown.tokens[r.nodes]
            inputs[b] = torch.stack([self.features[b][grown.parents[u]] for u in r.nodes])
            for i, u in enumerate(r.nodes):
                a = grown.parents[u]
                while a > 0:
                    if a in self.slots[b]:
                        ancestors.append((b, i, self.slots[b][a]))
                    a = grown.parents[a]
        out = self._append(tokens, inputs, positions, causal=False, ancestors=ancestors)
        for b, r in requests.items():
            for i, u in enumerate(r.nodes):
                self.slots[b][u] = width + i
                self.features[b][u] = out[b, i]

    def retire(self, keep: list[int]) -> None:
        """Only batch rows `keep` (in this order) go on; the others leave the head cache."""
        if keep == list(range(len(self.lengths))):
            return
        self.lengths = [self.lengths[b] for b in keep]
        self.pending = [self.pending[b] for b in keep]
        self.generators = [self.generators[b] for b in keep]
        self.dists = [self.dists[b] for b in keep]
        if not keep:
            self.cache = kv.new_cache()
        elif kv.cache_length(self.cache):
            none = torch.empty(0, dtype=torch.long)
            kv.compact_rows(
                self.cache, torch.tensor(keep, dtype=torch.long), none, none, none, max(self.lengths)
            )


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

    heads: EAGLE heads (`EagleRows`: one head pass per tree depth for every row), Medusa heads (one
    `MedusaDrafter` per row: their drafting has no head pass to share), a list of one drafter object
    per prompt (tests), or one drafter object, which holds state and so serves one row only; None
    drafts nothing (plain decoding, `NoDrafter`)."""
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
    if isinstance(heads, EagleHead | ForeignEagleHead):
        return EagleRows(heads, rows)
    if isinstance(heads, MedusaHeads):
        return PerRow([MedusaDrafter(heads) for _ in range(rows)])
    raise TypeError(f"no drafter for {type(heads).__name__}")
