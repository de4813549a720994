"""Soft labels are the target's own logits: Gemma-2's final softcap, Cohere's logit_scale and Granite's
logits_scaling are applied; an output head that does anything else is refused before training."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig, LlamaConfig

from selfdraft.errors import UserError
from selfdraft.heads.objective import target_logits
from selfdraft.heads.vocab import DraftVocab
from selfdraft.training.output_head import OutputHead, check_output_head, output_head

from tiny_models import COMMON

TINY = {
    # softcap 2: the tiny model's logits reach past it, so the cap bends them
    "gemma2": lambda: Gemma2Config(**COMMON, head_dim=8, final_logit_softcapping=2.0, query_pre_attn_scalar=8),
    "cohere": lambda: CohereConfig(**COMMON, logit_scale=0.0625),
    "granite": lambda: GraniteConfig(**COMMON, logits_scaling=8.0),
}


def _target(config) -> nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)  # logits of a few units, as a trained model's
    return model.eval()


def _forward(target):
    ids = torch.randint(0, target.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return target(input_ids=ids, output_hidden_states=True)


@pytest.mark.parametrize("arch", sorted(TINY))
def test_labels_equal_the_targets_own_logits(arch):
    target = _target(TINY[arch]())
    out = _forward(target)
    last, theirs = out.hidden_states[-1], out.logits
    head = output_head(target)
    no_vocab = SimpleNamespace(draft_vocab=None)
    assert torch.allclose(target_logits(last, no_vocab, head), theirs, atol=1e-5, rtol=1e-5)
    plain = last @ target.get_output_embeddings().weight.T
    assert (plain - theirs).abs().max() > 0.1  # the matmul alone (the old labels) is another distribution
    # restricted to a draft vocabulary: the target's logits of those tokens
    vocab = DraftVocab(8, target.config.vocab_size)
    ids = torch.arange(3, 3 + 3 * 8, 3)
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    vocab.set_maps(ids - torch.arange(8), t2d)
    restricted = target_logits(last, SimpleNamespace(draft_vocab=vocab), head)
    assert torch.allclose(restricted, theirs[..., ids], atol=1e-5, rtol=1e-5)
    check_output_head(target, head)  # the probe agrees


def test_a_plain_head_stays_a_matmul():
    """No post-processing named: the labels are exactly the old matmul (the pinned runs rely on it)."""
    target = _target(LlamaConfig(**COMMON))
    head = output_head(target)
    assert (head.multiplier, head.divisor, head.softcap) == (None, None, None)
    last = _forward(target).hidden_states[-1]
    assert torch.equal(head.logits(last), last @ target.lm_head.weight.T)


def test_a_head_that_does_more_than_a_matmul_is_refused():
    """An lm_head with a bias (which the config does not announce) gives other logits than the
    matmul: refused in one line, naming the architecture."""
    target = _target(LlamaConfig(**COMMON))
    biased = nn.Linear(COMMON["hidden_size"], COMMON["vocab_size"], bias=True)
    with torch.no_grad():
        biased.weight.copy_(target.lm_head.weight)
        biased.bias.normal_(0, 1.0)
    target.lm_head = biased
    with pytest.raises(UserError, match=r"target llama: its logits are not its lm_head") as err:
        check_output_head(target, output_head(target))
    assert "\n" not in str(err.value)
    # and a head that forgets a known scale is caught too
    cohere = _target(TINY["cohere"]())
    with pytest.raises(UserError, match="soft labels would differ"):
        check_output_head(cohere, OutputHead(cohere.get_output_embeddings().weight))
