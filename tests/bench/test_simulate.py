"""Simulated acceptance from logits, against hand-worked examples."""

import pytest
import torch

from selfdraft.heads.objective import MISS, DepthRanks, label_ranks
from selfdraft.heads.vocab import DraftVocab
from selfdraft.training.simulate import simulated_tau
from selfdraft.tree import TreeSpec


def test_label_ranks_with_and_without_draft_vocab():
    logits = torch.tensor([[[0.1, 0.9, 0.5, 0.2]]])  # order: 1, 2, 3, 0
    assert label_ranks(logits, torch.tensor([[1]])).item() == 0
    assert label_ranks(logits, torch.tensor([[3]])).item() == 2
    vocab = DraftVocab(4, 10)  # draft ids 0..3 <-> target ids 0, 2, 4, 6
    vocab.set_maps(torch.tensor([0, 1, 2, 3]), torch.tensor([i in (0, 2, 4, 6) for i in range(10)]))
    assert label_ranks(logits, torch.tensor([[2]]), vocab).item() == 0  # target 2 = draft 1
    assert label_ranks(logits, torch.tensor([[5]]), vocab).item() == MISS  # not in the draft vocab


def _depth(ranks, offset, valid=None):
    r = torch.tensor([ranks])
    return DepthRanks(
        r, torch.ones_like(r, dtype=torch.bool) if valid is None else torch.tensor([valid]), offset
    )


def test_chain_and_tree_walks():
    # EAGLE alignment: depth j of base b sits at index b + j. Three base positions (T = 3).
    d0 = _depth([0, 1, 0], 0)
    d1 = _depth([5, 0, 0], 1)  # index 1 -> base 0 depth 2: rank 0; index 2 -> base 1: rank 0
    accs, tau_chain = simulated_tau([d0, d1], TreeSpec.chain(2))
    # base 0: depth1 rank0 ok, depth2 (index 1) rank 0 ok -> 2 ; base 1: rank 1 -> 0 ; base 2: ok, no depth2 -> 1
    assert abs(tau_chain - (1 + (2 + 0 + 1) / 3)) < 1e-6
    assert accs == pytest.approx([2 / 3, 2 / 3])
    tree = TreeSpec.from_paths([(0, 0), (1, 0)])  # two branches: ranks 0 and 1 at depth 1
    _, tau_tree = simulated_tau([d0, d1], tree)
    # base 1 now enters branch (1,) and its depth-2 rank 0 (index 2) is accepted -> 2
    assert abs(tau_tree - (1 + (2 + 2 + 1) / 3)) < 1e-6


def test_invalid_positions_stop_the_walk_and_medusa_offsets():
    d0 = _depth([0, 0], 0, valid=[True, False])
    d1 = _depth([0, 0], 0)  # Medusa: every head reads the base position
    _, tau = simulated_tau([d0, d1], TreeSpec.chain(2))
    assert tau == 1 + 2  # only base 0 counts, and both its heads are right


def test_depths_of_different_lengths():
    d0 = _depth([0, 0, 0], 0)
    d1 = _depth([0, 1], 0)  # a later Medusa head has fewer positions
    _, tau = simulated_tau([d0, d1], TreeSpec.chain(2))
    assert abs(tau - (1 + (2 + 1 + 1) / 3)) < 1e-6


def test_ties_and_nan_are_misses():
    """Heads destroyed by a huge learning rate give equal or NaN logits: never counted as top-1."""
    target = torch.tensor([[2, 0]])
    flat = torch.zeros(1, 2, 5)  # every logit equal
    assert label_ranks(flat, target).tolist() == [[4, 4]]
    nan = torch.full((1, 2, 5), float("nan"))
    assert label_ranks(nan, target).tolist() == [[MISS, MISS]]
    sharp = torch.tensor([[[0.0, 0.0, 5.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0, 0.0]]])
    assert label_ranks(sharp, target).tolist() == [[0, 1]]  # a tie with another token costs a rank
