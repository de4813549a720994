"""`SelfDraftModel`: a frozen target with draft heads attached, and its `generate`."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from selfdraft.errors import UserError
from selfdraft.heads import HeadsConfig, build_heads, check_compatible, load_heads
from selfdraft.inference.acceptance import SamplingParams
from selfdraft.inference.decoding import GenerationOutput, speculative_generate
from selfdraft.precision import AUTO, parse_dtype, resolve_draft_dtype
from selfdraft.target import load_target
from selfdraft.tree_syntax import TreeLike, resolve_tree

logger = logging.getLogger(__name__)

SHIPPED = "shipped"
TREE_FILE = "tree.yaml"  # optional, next to a heads checkpoint: the tree shape chosen for it
DEFAULT_TREE = "small"  # heads= default: the checkpoint shipped for an embedded target, if any
CHECKPOINTS_DIR = Path(__file__).resolve().parent.parent / "checkpoints"

def shipped_heads_dir(target_name: str, head_kind: str | None = None) -> Path | None:
    kinds = [head_kind] if head_kind else ["eagle", "medusa"]
    for kind in kinds:
        path = CHECKPOINTS_DIR / f"{target_name.lower()}-{kind}"
        if (path / "config.json").is_file():
            return path
    return None


def _as_prompt_ids(input_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise UserError(
            f"input_ids of shape {tuple(ids.shape)}: selfdraft generates one sequence at a time"
        )
    if ids.shape[1] == 0:
        raise UserError("input_ids is empty; pass at least one prompt token")
    return ids


class SelfDraftModel:
    """Holds a target, its tokenizer and heads; `generate` decodes speculatively and losslessly."""

    def __init__(self, target, tokenizer, heads, tree: TreeLike = DEFAULT_TREE) -> None:
        check_compatible(heads.config, target.config)
        self.target = target
        self.tokenizer = tokenizer
        self.heads = heads.attach(target).to(target.device).eval()
        self.tree = resolve_tree(tree)

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        heads: str | Path | HeadsConfig | None = SHIPPED,
        *,
        tree: TreeLike | None = None,
        head_kind: str = "eagle",
        attn_implementation: str = "sdpa",
        dtype: str | torch.dtype = torch.float32,
        draft_dtype: str | torch.dtype | None = AUTO,
        **target_kwargs,
    ) -> SelfDraftModel:
        """Load `target` (embedded name, folder or hub id) and attach heads.

        heads: a checkpoint folder; None for fresh, untrained heads of `head_kind` (still lossless,
        just slower); a HeadsConfig to build fresh heads of that shape; omitted -> the checkpoint
        shipped for this target, or fresh heads if none is shipped.
        dtype: the target's; greedy output is token-identical to the target's own `generate` in float32.
        In bfloat16 the target's own argmax depends on how many tokens one forward holds (a
        near-tie can flip between a 1-token and a 13-token pass), so outputs can part at such ties.
        draft_dtype: the heads' dtype; None = the target's; "auto" (default) = bfloat16 for a float32
        target on a CPU with native bf16 (AVX512-BF16, AMX), else the target's. Heads only change
        speed, so bfloat16 heads on a float32 target keep the output exact and draft about twice as fast.
        """
        model, tokenizer = load_target(
            target, attn_implementation=attn_implementation, dtype=parse_dtype(dtype), **target_kwargs
        )
        return cls.with_heads(
            model,
            tokenizer,
            heads,
            target_name=str(target),
            tree=tree,
            head_kind=head_kind,
            draft_dtype=draft_dtype,
        )

    @classmethod
    def with_heads(
        cls,
        target,
        tokenizer,
        heads: str | Path | HeadsConfig | None = SHIPPED,
        *,
        target_name: str = "",
        tree: TreeLike | None = None,
        head_kind: str = "eagle",
        draft_dtype: str | torch.dtype | None = AUTO,
    ) -> SelfDraftModel:
        """Attach heads (same meaning of `heads` and `draft_dtype` as in `from_pretrained`) to an
        already loaded target; several models can share one target this way."""
        dtype = resolve_draft_dtype(draft_dtype, target)
        if heads == SHIPPED:
            heads = shipped_heads_dir(target_name)
            if heads is None:
                logger.warning("no heads are shipped for %s: using fresh, untrained heads", target_name)
        if heads is None:
            heads = HeadsConfig.for_target(target.config, head_kind=head_kind)
        if isinstance(heads, HeadsConfig):
            module = build_heads(heads).to(dtype).attach(target)
            module.init_projection_from_target()
        else:
            module = load_heads(heads, target, dtype=dtype)
            if tree is None and (Path(heads) / TREE_FILE).is_file():
                tree = str(Path(heads) / TREE_FILE)  # the shape tuned for these heads
        return cls(target, tokenizer, module, tree=tree or DEFAULT_TREE)

    def default_stop_ids(self) -> list[int]:
        ids = self.target.generation_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))

    def generate(
        self,
        input_ids,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_token_ids: Iterable[int] | None = None,
        tree: TreeLike | None = None,
        acceptance: str = "rejection",
        streamer=None,
    ) -> GenerationOutput:
        """Decode after `input_ids` ([T] or [1, T]); temperature 0 is greedy and token-identical to the
        target's own greedy decoding. `acceptance="typical"` is Medusa's lossy typical acceptance."""
        return speculative_generate(
            self.target,
            self.heads,
            _as_prompt_ids(input_ids, self.target.device),
            spec=resolve_tree(tree) if tree is not None else self.tree,
            max_new_tokens=max_new_tokens,
            sampling=SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
            stop_token_ids=self.default_stop_ids() if stop_token_ids is None else stop_token_ids,
            acceptance=acceptance,
            streamer=streamer,
        )

    def chat_ids(self, prompt: str) -> torch.Tensor:
        """Token ids of `prompt` as one user turn in the target's chat template (plain text without one)."""
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            return self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        return self.tokenizer(prompt, return_tensors="pt").input_ids
