"""Objectives against values computed by hand or by explicit loops."""

from __future__ import annotations

import math

import datasets
import pytest
import torch

from selfdraft.heads.eagle.objective import eagle_loss, ttt_weights
from selfdraft.heads.medusa.objective import medusa_loss, medusa_targets
from selfdraft.heads.objective import forward_kl
from selfdraft.heads.vocab import build_draft_vocab, count_tokens

# ------------------------------------------------------------------------------------------------ Medusa


def test_medusa_targets_shift_by_k_plus_2():
    input_ids = torch.tensor([[10, 11, 12, 13, 14]])
    loss_mask = torch.tensor([[1, 1, 1, 0, 1]])
    labels, valid = medusa_targets(input_ids, loss_mask, num_heads=3)
    # head 0 at t predicts x[t+2]; x[3] is masked, t >= 3 has no label
    assert labels[0, 0].tolist() == [12, 13, 14, 0, 0]
    assert valid[0, 0].tolist() == [True, False, True, False, False]
    # head 1 at t predicts x[t+3]
    assert labels[1, 0].tolist() == [13, 14, 0, 0, 0]
    assert valid[1, 0].tolist() == [False, True, False, False, False]
    # head 2 at t predicts x[t+4]
    assert labels[2, 0].tolist() == [14, 0, 0, 0, 0]
    assert valid[2, 0].tolist() == [True, False, False, False, False]


def test_medusa_loss_is_zero_only_for_the_right_shift():
    V, T, K = 8, 6, 2
    input_ids = torch.arange(T)[None]  # token at position t is t
    mask = torch.ones(1, T, dtype=torch.long)
    right = torch.full((K, 1, T, V), -30.0)
    off_by_one = torch.full((K, 1, T, V), -30.0)
    for k in range(K):
        for t in range(T):
            right[k, 0, t, min(t + k + 2, V - 1)] = 30.0  # head k+1: k+1 tokens past the next token
            off_by_one[k, 0, t, min(t + k + 1, V - 1)] = 30.0
    loss, per_head = medusa_loss(right, input_ids, mask)
    assert loss.item() < 1e-6 and per_head.max().item() < 1e-6
    _, per_head_wrong = medusa_loss(off_by_one, input_ids, mask)
    assert (per_head_wrong > 50).all()


def test_medusa_loss_matches_explicit_loops():
    g = torch.Generator().manual_seed(0)
    K, B, T, V = 3, 2, 7, 5
    logits = torch.randn(K, B, T, V, generator=g)
    input_ids = torch.randint(0, V, (B, T), generator=g)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1, 1]])
    decay = 0.7
    expected_ce = []
    for k in range(K):
        terms = []
        for b in range(B):
            for t in range(T):
                j = t + k + 2
                if j < T and loss_mask[b, j]:
                    row = logits[k, b, t]
                    terms.append(-(row[input_ids[b, j]] - math.log(sum(math.exp(v) for v in row.tolist()))))
        expected_ce.append(sum(terms) / len(terms))
    expected_loss = sum(decay**k * ce for k, ce in enumerate(expected_ce))
    loss, per_head = medusa_loss(logits, input_ids, loss_mask, decay=decay)
    torch.testing.assert_close(per_head, torch.tensor(expected_ce))
    assert loss.item() == pytest.approx(float(expected_loss), rel=1e-5)


def test_medusa_uniform_logits_and_empty_mask():
    V = 4
    logits = torch.zeros(2, 1, 5, V)
    loss, per_head = medusa_loss(logits, torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5))
    torch.testing.assert_close(per_head, torch.full((2,), math.log(V)))
    assert loss.item() == pytest.approx(math.log(V) * (1 + 0.8))
    loss, per_head = medusa_loss(logits, torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 5))
    assert loss.item() == 0.0 and not per_head.isnan().any()


# ------------------------------------------------------------------------------------------------- EAGLE


def test_eagle_loss_by_hand():
    pred = torch.tensor([[[0.0, 0.0], [2.0, 0.5]]])  # [B=1, T=2, h=2]
    target = torch.zeros(1, 2, 2)
    # SmoothL1 (beta 1): |2| -> 2 - 0.5 = 1.5, |0.5| -> 0.5 * 0.5**2 = 0.125; mean over h
    per_position = [0.0, (1.5 + 0.125) / 2]
    draft_logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])  # q = [.5, .5], [.75, .25]
    target_probs = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])
    ce = [-math.log(0.5), -(0.5 * math.log(0.75) + 0.5 * math.log(0.25))]
    out = eagle_loss(pred, target, draft_logits, target_probs, torch.tensor([[1, 1]]))
    assert out.feature.item() == pytest.approx(sum(per_position) / 2)
    assert out.ce.item() == pytest.approx(sum(ce) / 2)
    assert out.loss.item() == pytest.approx(sum(per_position) / 2 + 0.1 * sum(ce) / 2)
    only_second = eagle_loss(pred, target, draft_logits, target_probs, torch.tensor([[0, 1]]), 2.0, 0.5)
    assert only_second.loss.item() == pytest.approx(2.0 * per_position[1] + 0.5 * ce[1])


def test_forward_kl_on_the_heads_vocab():
    target_logits = torch.tensor([[[0.5, 2.0, 1.0], [1.0, 1.0, 1.0]]])  # [1, 2, V'=3]
    draft_logits = torch.tensor([[[1.0, 0.0, -1.0], [0.0, 0.0, 0.0]]])
    z = [math.exp(0.5), math.exp(2.0), math.exp(1.0)]
    p = [v / sum(z) for v in z]
    zq = [math.exp(1.0), 1.0, math.exp(-1.0)]
    q = [v / sum(zq) for v in zq]
    expected = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q, strict=True))
    only_first = torch.tensor([[1, 0]])
    assert forward_kl(draft_logits, target_logits, only_first).item() == pytest.approx(expected, rel=1e-5)
    # KL 0 when the draft matches up to a constant; the second position (uniform both) adds 0
    assert forward_kl(target_logits + 3.0, target_logits, torch.ones(1, 2)).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="vocab"):
        forward_kl(draft_logits[..., :2], target_logits, only_first)


def test_ttt_weights():
    torch.testing.assert_close(ttt_weights(4), torch.tensor([1.0, 0.8, 0.64, 0.512]))
    torch.testing.assert_close(ttt_weights(2, decay=0.5), torch.tensor([1.0, 0.5]))


# ------------------------------------------------------------------------------------------- draft vocab


def test_build_draft_vocab_keeps_most_frequent_and_round_trips():
    counts = torch.tensor([5, 0, 9, 1, 9, 3])
    d2t, t2d = build_draft_vocab(counts, 3)
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool
    assert t2d.tolist() == [True, False, True, False, True, False]
    assert d2t.tolist() == [0, 1, 2]  # draft ids 0, 1, 2 -> target ids 0, 2, 4
    target_ids = torch.arange(3) + d2t
    assert target_ids.tolist() == t2d.nonzero().flatten().tolist()
    assert torch.equal(t2d[target_ids], torch.ones(3, dtype=torch.bool))

    g = torch.Generator().manual_seed(0)
    big = torch.randint(0, 1000, (500,), generator=g)
    d2t, t2d = build_draft_vocab(big, 64)
    kept = torch.arange(64) + d2t
    assert int(t2d.sum()) == 64 and torch.equal(kept, t2d.nonzero().flatten())
    assert big[kept].min() >= big[~t2d].max()  # nothing dropped is more frequent than what is kept

    # fewer seen tokens than the draft vocab: filled with the lowest unseen ids, always exactly Vd
    d2t, t2d = build_draft_vocab(torch.tensor([0, 0, 0, 7, 0]), 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 3]
    with pytest.raises(ValueError):
        build_draft_vocab(counts, 7)


def test_count_tokens_counts_loss_masked_tokens_only():
    rows = [
        {"input_ids": [1, 2, 2, 3], "loss_mask": [0, 1, 1, 0]},
        {"input_ids": [3, 3, 0], "loss_mask": [1, 1, 1]},
    ]
    assert count_tokens(rows, 5).tolist() == [1, 0, 2, 2, 0]
    assert count_tokens(datasets.Dataset.from_list(rows), 5).tolist() == [1, 0, 2, 2, 0]
    assert count_tokens(datasets.Dataset.from_list(rows).select([]), 5).tolist() == [0] * 5


# ------------------------------------------------------------------------- EAGLE-3 out-of-vocab mask


def test_out_of_draft_vocab_positions_get_no_loss_but_count_as_misses():
    """With mask_out_of_vocab, a position whose target greedy token the draft vocabulary lacks adds
    nothing to the loss (same loss as masking it out of the data by hand) and still scores as a miss."""
    from selfdraft.heads import HeadsConfig, build_heads
    from selfdraft.heads.eagle.objective import eagle_step
    from selfdraft.training.output_head import output_head

    from tiny_models import tiny_target

    torch.manual_seed(0)
    target = tiny_target()
    V = target.config.vocab_size
    heads = build_heads(HeadsConfig.for_target(target.config, head_kind="eagle", draft_vocab_size=V // 2))
    heads.attach(target)
    ids = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        hidden = list(target(ids, output_hidden_states=True).hidden_states)
        greedy = (hidden[-1][:, 1:] @ target.lm_head.weight.T).argmax(-1)  # [B, n] predicts x_{i+2}
    # a draft vocabulary holding exactly the odd target ids
    d2t = torch.arange(1, V, 2)[: V // 2] - torch.arange(V // 2)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[1::2] = True
    heads.draft_vocab.set_maps(d2t, t2d)
    oov = greedy % 2 == 0
    assert 0 < int(oov[:, :-1].sum()) < oov[:, :-1].numel()
    kwargs = dict(ttt_steps=2, ttt_decay=0.8, feature_weight=0.1, ce_weight=1.0)
    masked = eagle_step(heads, ids, torch.ones_like(ids), hidden, output_head(target),
                        mask_out_of_vocab=True, **kwargs)  # fmt: skip
    by_hand_mask = torch.ones_like(ids)
    by_hand_mask[:, 2:] = (~oov[:, :-1]).long()
    by_hand = eagle_step(heads, ids, by_hand_mask, hidden, output_head(target), **kwargs)
    unmasked = eagle_step(heads, ids, torch.ones_like(ids), hidden, output_head(target), **kwargs)
    assert masked.loss.item() == pytest.approx(by_hand.loss.item(), rel=1e-5)
    assert masked.loss.item() != pytest.approx(unmasked.loss.item(), rel=1e-3)
    assert masked.metrics["out_of_vocab"] == pytest.approx(oov[:, :-1].float().mean().item())
    # accuracy keeps every position; an out-of-vocabulary greedy token can never rank first
    depth1 = masked.depths[0]
    assert depth1.valid[:, :-1].all()
    assert (depth1.ranks[oov] > 0).all()


def test_exact_greedy_ids_only_where_asked():
    """The full-vocabulary argmax runs only at the asked positions and equals the full one there; the
    others keep the free argmax over the heads' vocabulary."""
    from types import SimpleNamespace

    from selfdraft.heads.objective import greedy_target_ids
    from selfdraft.heads.vocab import DraftVocab
    from selfdraft.training.output_head import OutputHead

    torch.manual_seed(0)
    V, Vd, h = 32, 8, 6
    weight, features = torch.randn(V, h), torch.randn(2, 5, h)
    vocab = DraftVocab(Vd, V)
    vocab.set_maps(torch.arange(0, 2 * Vd, 2) - torch.arange(Vd), torch.arange(V) % 2 == 0)  # even ids
    heads = SimpleNamespace(draft_vocab=vocab)
    labels = features @ weight[vocab.target_ids()].T
    where = torch.tensor([[1, 0, 1, 0, 0], [0, 1, 1, 1, 0]], dtype=torch.bool)
    full = (features @ weight.T).argmax(-1)
    free = vocab.to_target(labels.argmax(-1))
    assert (full != free).any()  # some greedy tokens are odd: outside the draft vocabulary
    ids = greedy_target_ids(labels, features, heads, OutputHead(weight), exact=True, where=where)
    assert torch.equal(ids[where], full[where]) and torch.equal(ids[~where], free[~where])
    assert torch.equal(greedy_target_ids(labels, features, heads, OutputHead(weight), exact=True), full)


# ------------------------------------------------------------------------- training-time test chains


def test_ttt_bases_take_every_kth_position_from_the_salts_offset():
    from selfdraft.heads.eagle.objective import ttt_bases

    assert ttt_bases(10, 3, salt=4).tolist() == [1, 4, 7]
    assert ttt_bases(10, 3, salt=6).tolist() == [0, 3, 6, 9]
    assert ttt_bases(5, 1, salt=7).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("layout", ["eagle3", "selfdraft"])
def test_ttt_stride_chains_rank_exactly_as_the_full_unroll(layout):
    """With ttt_stride k, depth 1 scores every position and depth j+1 only the chains of every k-th
    base; there the ranks equal the full unroll's (the chain mask shows each chain the keys the full
    mask shows its position), and evaluation options keep the full unroll."""
    from types import SimpleNamespace

    from selfdraft.heads import HeadsConfig, build_heads
    from selfdraft.heads.eagle.objective import EagleObjective, eagle_step, ttt_bases
    from selfdraft.training.output_head import output_head

    from tiny_models import tiny_target

    torch.manual_seed(0)
    target = tiny_target()
    V = target.config.vocab_size
    heads = build_heads(HeadsConfig.for_target(target.config, head_kind="eagle", eagle_layout=layout))
    heads.attach(target)
    ids = torch.randint(0, V, (2, 24))
    loss_mask = torch.ones_like(ids)
    loss_mask[1, 18:] = 0  # a padded row
    with torch.no_grad():
        hidden = list(target(ids, output_hidden_states=True).hidden_states)
    kwargs = dict(ttt_steps=4, ttt_decay=0.8, feature_weight=0.1, ce_weight=1.0)
    full = eagle_step(heads, ids, loss_mask, hidden, output_head(target), **kwargs)
    strided = eagle_step(heads, ids, loss_mask, hidden, output_head(target), ttt_stride=3, **kwargs)
    n = ids.shape[1] - 1
    chains = ttt_bases(n, 3, int(ids.sum()))
    assert torch.equal(strided.depths[0].valid, full.depths[0].valid)
    assert torch.equal(strided.depths[0].ranks, full.depths[0].ranks)
    for j in range(1, 4):
        s, f = strided.depths[j], full.depths[j]
        on_chain = torch.zeros(n, dtype=torch.bool)
        on_chain[(chains + j)[chains + j < n]] = True
        assert torch.equal(s.valid, f.valid & on_chain)
        assert s.valid.sum() > 2
        assert torch.equal(s.ranks[s.valid], f.ranks[s.valid])
    assert strided.loss.requires_grad and torch.isfinite(strided.loss)
    section = SimpleNamespace(ttt_steps=4, ttt_decay=0.8, feature_weight=0.1, ce_weight=1.0,
                              mask_out_of_vocab=True, ttt_stride=3)  # fmt: skip
    assert EagleObjective().step_options(section)["ttt_stride"] == 3
    assert EagleObjective().step_options(section, depth=5)["ttt_stride"] == 1
