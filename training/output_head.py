"""The target's output head as training reads it: the soft labels are the target's own logits.

Training computes the target's logits from its cached last hidden state instead of running the target
again, so it must apply what the target's own forward applies after the lm_head matmul: Gemma-2/3's
final logit softcap, Cohere's `logit_scale`, Granite's `logits_scaling`. Without them the labels are
another distribution (a Cohere target's scale of 1/16 makes the unscaled labels 16 times too sharp).
`check_output_head` verifies on a short probe that these logits equal the target's own, and refuses
an architecture whose head does something else, rather than train towards wrong labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfdraft.errors import UserError

PROBE_TOKENS = 8
# max |ours - theirs| allowed, relative to 1 + max |theirs|, by the target's dtype: the same math in
# another kernel order (the target's nn.Linear vs a matmul) differs by a few ulps
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class OutputHead:
    """logits = softcap(scale(features @ weight^T)), the order of the targets' own forwards.

    weight: [V, h] (the target's lm_head, borrowed, never trained); multiplier: Cohere's logit_scale;
    divisor: Granite's logits_scaling; softcap: Gemma's final_logit_softcapping (c tanh(z / c))."""

    weight: torch.Tensor
    multiplier: float | None = None
    divisor: float | None = None
    softcap: float | None = None

    def logits(self, features: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """features: [..., h] post-norm last hidden states -> [..., V] (or [..., len(rows)] for the
        vocabulary rows `rows`, e.g. a draft vocabulary's target ids)."""
        weight = self.weight if rows is None else self.weight[rows]
        z = features @ weight.T
        if self.multiplier is not None:
            z = z * self.multiplier
        if self.divisor is not None:
            z = z / self.divisor
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


def output_head(target) -> OutputHead:
    """The target's output head from its lm_head and the post-processing its config names."""
    config = target.config
    text = getattr(config, "get_text_config", lambda: config)()

    def setting(name: str, neutral: float) -> float | None:
        value = getattr(text, name, None)
        return None if value is None or value == neutral else float(value)

    return OutputHead(
        weight=target.get_output_embeddings().weight,
        multiplier=setting("logit_scale", 1.0),
        divisor=setting("logits_scaling", 1.0),
        softcap=setting("final_logit_softcapping", 0.0),
    )


@torch.no_grad()
def check_output_head(target, head: OutputHead) -> None:
    """Refuse a target whose logits are not `head.logits` of its last hidden state (one probe forward
    of a few tokens): its soft labels would silently be another distribution."""
    weight = head.weight
    vocab = weight.shape[0]
    ids = (torch.arange(PROBE_TOKENS, device=weight.device) * 7919 + 11) % vocab  # any tokens do
    out = target(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    theirs = out.logits[0].float()
    ours = head.logits(out.hidden_states[-1][0]).float()
    error = float((ours - theirs).abs().max())
    allowed = TOLERANCE.get(weight.dtype, 2e-2) * (1.0 + float(theirs.abs().max()))
    if not error <= allowed:
        kind = getattr(target.config, "model_type", type(target).__name__)
        raise UserError(
            f"target {kind}: its logits are not its lm_head applied to its last hidden state (max error "
            f"{error:.3g} on a probe), so selfdraft's soft labels would differ from the target's own; this "
            "architecture's output head is not supported for training yet (supported: a plain lm_head, "
            "with logit_scale, logits_scaling or final_logit_softcapping)"
        )
