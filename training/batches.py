"""Deterministic sample order and padding: a resumed run sees exactly the batches it would have seen."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class SampleStream:
    """An endless stream of example indices: epoch e is a permutation seeded by (seed, e).

    Micro-batch m of rank r takes stream positions ((m * world + r) * B + i) for i < B, so the
    batches depend only on (seed, world, m): resuming at step s recomputes them exactly.

    With `lengths` [n] and window W > 0, each epoch's permutation is cut into windows of W steps'
    examples (W * B * world), each window sorted by length and its steps' blocks shuffled: a
    micro-batch then holds examples of similar lengths while the order stays random (on lengths
    uniform in 10-500, micro-batches of 4: padding 54% of the tokens -> 2%, a test).
    """

    def __init__(
        self,
        num_examples: int,
        seed: int,
        world: int,
        rank: int,
        micro_batch_size: int,
        lengths: Sequence[int] | None = None,
        window: int = 0,
    ) -> None:
        if num_examples < 1:
            raise ValueError("no training examples")
        if window and (lengths is None or len(lengths) != num_examples):
            raise ValueError("grouping by length needs the length of every example")
        self.n, self.seed, self.world, self.rank, self.batch = (
            num_examples,
            seed,
            world,
            rank,
            micro_batch_size,
        )
        self.lengths = torch.as_tensor(lengths, dtype=torch.long) if window else None
        self.window = window
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.n, generator=gen)
            if self.lengths is not None:
                perm = self._grouped(perm, gen)
            self._perms = {epoch: perm}
        return self._perms[epoch]

    def _grouped(self, perm: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        step = self.batch * self.world
        out = []
        for window in perm.split(self.window * step):
            ordered = window[torch.sort(-self.lengths[window], stable=True).indices]
            blocks = ordered.split(step)
            out.extend(blocks[i] for i in torch.randperm(len(blocks), generator=gen).tolist())
        return torch.cat(out)

    def micro_batch(self, m: int) -> list[int]:
        start = (m * self.world + self.rank) * self.batch
        return [int(self._perm(s // self.n)[s % self.n]) for s in range(start, start + self.batch)]

    def steps_per_epoch(self, accumulation: int) -> int:
        return max(1, self.n // (self.batch * self.world * accumulation))


def split_lengths(dataset) -> list[int]:
    """The token count of every row of a tokenized `datasets.Dataset` (in its row order, any index
    mapping applied), read from its Arrow column."""
    import pyarrow.compute as pc

    column = dataset.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"]
    return pc.list_value_length(column).to_pylist()


def collate(rows: list[dict]) -> dict:
    """Right-pad examples to the longest: input_ids, loss_mask, attention_mask [B, T]; features per layer
    [B, T, h] when the rows carry cached features."""
    longest = max(len(r["input_ids"]) for r in rows)
    B = len(rows)
    input_ids = torch.zeros(B, longest, dtype=torch.long)
    loss_mask = torch.zeros(B, longest, dtype=torch.long)
    attention = torch.zeros(B, longest, dtype=torch.long)
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        input_ids[b, :n] = torch.as_tensor(row["input_ids"])
        loss_mask[b, :n] = torch.as_tensor(row["loss_mask"])
        attention[b, :n] = 1
    batch = {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention}
    if "features" in rows[0]:
        batch["features"] = {}
        for layer in rows[0]["features"]:
            first = rows[0]["features"][layer]
            out = torch.zeros(B, longest, first.shape[-1], dtype=first.dtype)
            for b, row in enumerate(rows):
                out[b, : len(row["input_ids"])] = row["features"][layer]
            batch["features"][layer] = out
    return batch
