"""How EAGLE heads draft (every layout: ours, EAGLE-1, EAGLE-3): B rows' trees at once, one head pass
per tree depth over every row's frontier, with one head KV cache holding every row."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from selfdraft import kv
from selfdraft.heads.int8 import heads_dtype
from selfdraft.heads.vocab import drawn_children, ranked_children
from selfdraft.tree import Draft, Frontier, TreeShape, float_mask, grow_trees


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

    def __init__(self, heads, rows: int) -> None:
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
