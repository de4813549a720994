"""`SelfDraftModel`: a frozen target with draft heads attached, and its `generate`."""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from selfdraft.errors import UserError
from selfdraft.heads import HeadsConfig, build_heads, check_compatible, load_heads
from selfdraft.heads.config import HEAD_KINDS
from selfdraft.heads.int8 import int8_weights
from selfdraft.heads.registry import check_kind
from selfdraft.inference.acceptance import SamplingParams
from selfdraft.inference.decoding import GenerationOutput, speculative_generate
from selfdraft.inference.requests import row_seeds
from selfdraft.inference.tree_choice import TreeChoice
from selfdraft.precision import (
    AUTO,
    draft_weights_int8,
    dtype_name,
    machine_kind,
    parse_dtype,
    resolve_draft_dtype,
)
from selfdraft.target import load_target
from selfdraft.tree import TreeShape
from selfdraft.tree_syntax import TreeLike, resolve_tree

logger = logging.getLogger(__name__)

SHIPPED = "shipped"
TREE_FILE = "tree.yaml"  # optional, next to a heads checkpoint: the tree shape chosen for it
CHECKPOINTS_DIR = Path(__file__).resolve().parent.parent / "checkpoints"

# generation_config settings that make `target.generate` emit other tokens and that selfdraft does not
# apply, with the value that turns each off. Outputs equal `target.generate` with these off.
UNAPPLIED_GENERATION_SETTINGS = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "min_length": 0,
    "min_new_tokens": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "exponential_decay_length_penalty": None,
}


def unapplied_generation_settings(generation_config) -> dict[str, object]:
    """The settings of `generation_config` that selfdraft does not apply, with their values."""
    out = {}
    for name, off in UNAPPLIED_GENERATION_SETTINGS.items():
        value = getattr(generation_config, name, off)
        if value not in (off, None) and value != [] and value != {}:
            out[name] = value
    return out


def warn_unapplied_generation_config(target) -> None:
    found = unapplied_generation_settings(target.generation_config)
    if found:
        settings = ", ".join(f"{k}={v!r}" for k, v in found.items())
        logger.warning(
            "the target's generation_config sets %s, which selfdraft does not apply: outputs equal "
            "target.generate with them off (set model.target.generation_config.<name> to %s to compare)",
            settings,
            ", ".join(repr(UNAPPLIED_GENERATION_SETTINGS[k]) for k in found),
        )


def shipped_heads_path(target_name: str, head_kind: str) -> Path:
    """Where selfdraft keeps (or would keep) the default heads of this kind for a target."""
    return CHECKPOINTS_DIR / f"{target_name.lower()}-{head_kind}"


def shipped_heads_dir(target_name: str, head_kind: str | None = None) -> Path | None:
    kinds = [head_kind] if head_kind else list(HEAD_KINDS)
    for kind in kinds:
        path = shipped_heads_path(target_name, kind)
        if (path / "config.json").is_file():
            return path
    return None


def is_batch(input_ids) -> bool:
    """True for a list/tuple of prompts (each a 1-D list or tensor); False for one sequence (a tensor
    [T] or [1, T], or a flat list of ints)."""
    if not isinstance(input_ids, list | tuple):
        return False
    if not input_ids:
        raise UserError("generate got an empty list; pass token ids, or a list of prompts' token ids")
    nested = [not isinstance(x, int) and not (torch.is_tensor(x) and x.dim() == 0) for x in input_ids]
    if any(nested) and not all(nested):
        raise UserError(
            "generate got a list mixing token ids and sequences; pass one flat list of ids, "
            "or a list whose every item is one prompt's ids"
        )
    return all(nested)


def _is_whole(value) -> bool:
    """An int (Python or numpy/torch integer scalar), not a bool (True would silently mean 1) nor a
    float (2.5 would silently mean 2)."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_budget(max_new_tokens) -> int:
    if not _is_whole(max_new_tokens):
        raise UserError(
            f"max_new_tokens must be a whole number of tokens, got {max_new_tokens!r} "
            f"({type(max_new_tokens).__name__}); pass e.g. max_new_tokens=64"
        )
    return int(max_new_tokens)


def check_stop_ids(stop_token_ids, vocab_size: int) -> list[int]:
    """stop_token_ids as a list of ids inside the vocabulary; one id, floats, negative or out-of-vocabulary
    ids are refused (they could never match, so generation would silently run on)."""
    given = stop_token_ids.tolist() if isinstance(stop_token_ids, torch.Tensor) else stop_token_ids
    if isinstance(given, str | bytes | dict) or not hasattr(given, "__iter__"):
        raise UserError(
            f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}; pass e.g. [{given!r}]"
        )
    ids = list(given)
    bad = [t for t in ids if not _is_whole(t) or not 0 <= int(t) < vocab_size]
    if bad:
        raise UserError(
            f"stop_token_ids holds {bad[0]!r}, not a token id of this target (0..{vocab_size - 1}); "
            "pass ids from its tokenizer, e.g. tokenizer.eos_token_id"
        )
    return [int(t) for t in ids]


def _as_prompt_ids(input_ids, device, vocab_size: int) -> torch.Tensor:
    if isinstance(input_ids, str | bytes):
        raise UserError("generate takes token ids, not text; encode it first, e.g. model.chat_ids(text)")
    given = input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(input_ids)
    # an empty list reads as float32; it is refused below as empty
    if given.numel() and (given.is_floating_point() or given.is_complex() or given.dtype == torch.bool):
        raise UserError(
            f"input_ids are {given.dtype}, not integer token ids; pass the tokenizer's ids (torch.long)"
        )
    ids = torch.as_tensor(given, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise UserError(
            f"input_ids of shape {tuple(ids.shape)}: pass one sequence ([T] or [1, T]), "
            "or a list of 1-D prompts for a batch"
        )
    if ids.shape[1] == 0:
        raise UserError("input_ids is empty; pass at least one prompt token")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise UserError(
            f"token id {int(bad[0])} is outside the target's vocabulary (0..{vocab_size - 1}); "
            "encode the prompt with this target's tokenizer"
        )
    return ids


def _batch_row(given, i: int, batch: bool, device, vocab_size: int) -> torch.Tensor:
    """One prompt's ids [T]; in a batch a bad one is named by its 1-based row."""
    try:
        return _as_prompt_ids(given, device, vocab_size)[0]
    except UserError as err:
        if not batch:
            raise
        raise UserError(f"prompt {i + 1} of the batch: {err}") from None


def prompt_text(prompt: str | bytes) -> str:
    """The prompt as text: bytes are decoded as UTF-8; text that cannot be UTF-8 is refused."""
    if not isinstance(prompt, str | bytes):
        raise UserError(f"the prompt must be text (str) or UTF-8 bytes, got {type(prompt).__name__} {prompt!r}")
    try:
        text = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
        text.encode("utf-8")
    except UnicodeError as err:
        raise UserError(
            f"the prompt is not valid UTF-8 text ({err.reason} at byte {err.start}); re-encode it as UTF-8"
        ) from err
    return text


class SelfDraftModel:
    """Holds a target, its tokenizer and heads; `generate` decodes speculatively and losslessly."""

    def __init__(
        self,
        target,
        tokenizer,
        heads,
        tree: TreeLike | None = None,
        sampling_tree: TreeLike | None = None,
        trained: bool = True,
    ) -> None:
        """tree: None = the default shape, cut to what the heads can draft (Medusa: one head per depth).
        sampling_tree: the shape for temperature > 0 (None: a tree file's `sampling:` tree, else `tree`).
        trained: False for fresh heads, which draft almost nothing that is accepted: with no tree asked
        for, `generate` then runs no head (`self.plain`): each pass verifies the root and a prompt-lookup
        branch (`HEADS_FREE`), at least the target's own speed, unless a call names a tree."""
        check_compatible(heads.config, target.config)
        self.target = target
        self.tokenizer = tokenizer
        self.heads = heads.attach(target).to(target.device).eval()
        # the tree of each call, by the target's dtype, this kind of machine, sampling and batch size
        self.trees = TreeChoice.build(
            tree,
            sampling_tree,
            dtype=dtype_name(target.dtype),
            machine=machine_kind(target.device),
            depth_limit=getattr(self.heads, "max_draft_depth", None),
            trained=trained,
        )
        warn_unapplied_generation_config(target)

    @property
    def tree(self) -> TreeShape:
        """The greedy tree of a single prompt (no tree asked for in the call)."""
        return self.trees.greedy

    @property
    def sampling_tree(self) -> TreeShape:
        return self.trees.sampling

    @property
    def batch_trees(self) -> dict[int, TreeShape]:
        return self.trees.batch

    @property
    def plain(self) -> bool:
        """Untrained heads and no tree asked for: generate runs no head, only prompt lookup."""
        return self.trees.plain

    @classmethod
    def from_pretrained(
        cls,
        target: str,
        heads: str | Path | HeadsConfig | None = SHIPPED,
        *,
        tree: TreeLike | None = None,
        head_kind: str | None = None,
        attn_implementation: str = "sdpa",
        dtype: str | torch.dtype = torch.float32,
        draft_dtype: str | torch.dtype | None = AUTO,
        **target_kwargs,
    ) -> SelfDraftModel:
        """Load `target` (embedded name, folder or hub id) and attach heads.

        heads: a checkpoint folder; None for fresh, untrained heads of `head_kind`; a HeadsConfig to
        build fresh heads of that shape; omitted -> the checkpoint shipped for this target, or fresh
        heads if none is shipped. Fresh heads draft almost nothing that is accepted, so without a `tree`
        such a model runs no head (`plain` is True; it says so once): prompt lookup alone, at least as
        fast as `target.generate`; with a `tree` (here or per call) they draft it, still losslessly.
        head_kind: "eagle" or "medusa": fresh heads' kind (default eagle) or the shipped ones'; with a
        heads folder, one of another kind is refused (the folder says its own kind).
        dtype: the target's; greedy output is token-identical to the target's own `generate` in float32;
        in bfloat16 it can part at near-ties of the target's own logits (`selfdraft.bench.divergence`).
        draft_dtype: the heads' dtype; None = the target's; "auto" (default) = bfloat16 for a float32
        target on a CPU with native bf16 (AVX512-BF16, AMX), else the target's, and where the heads then
        compute in bfloat16 on such a CPU, int8 weights too. Heads only change speed, so bfloat16 heads
        on a float32 target keep the output exact and draft about twice as fast. "int8": the heads'
        linear layers hold int8 weights (per-channel scales, `selfdraft.heads.int8`) and compute in the
        dtype "auto" picks: fewer bytes streamed per draft step; still lossless.
        """
        if tree is not None:
            resolve_tree(tree, dtype_name(parse_dtype(dtype)))  # a bad tree fails before a long target load
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
        head_kind: str | None = None,
        draft_dtype: str | torch.dtype | None = AUTO,
    ) -> SelfDraftModel:
        """Attach heads (same meaning of `heads` and `draft_dtype` as in `from_pretrained`) to an
        already loaded target; several models can share one target this way."""
        int8 = draft_weights_int8(draft_dtype, target)
        dtype = resolve_draft_dtype(AUTO if int8 else draft_dtype, target)
        if heads == SHIPPED:
            heads = shipped_heads_dir(target_name, head_kind)
        trained = heads is not None and not isinstance(heads, HeadsConfig)
        if not trained and tree is None:
            logger.warning(
                "no trained heads for %s: generate runs no head, only prompt lookup (lossless, at least "
                "the target's own speed); train heads for it (`selfdraft train`) to draft",
                target_name or "this target",
            )
        if heads is None:
            heads = HeadsConfig.for_target(target.config, head_kind=head_kind or HEAD_KINDS[0])
        if isinstance(heads, HeadsConfig):
            module = build_heads(heads).to(dtype).attach(target)
            module.init_projection_from_target()
        else:
            module = load_heads(heads, target, dtype=dtype)
            check_kind(module.config, head_kind, heads)
            if tree is None and (Path(heads) / TREE_FILE).is_file():
                tree = str(Path(heads) / TREE_FILE)  # the shape tuned for these heads
        if int8:  # "auto" falls back to float weights where int8 cannot apply; "int8" says why not
            module = int8_weights(module, dtype, strict=str(draft_dtype).lower() != AUTO)
        return cls(target, tokenizer, module, tree=tree, trained=trained)

    def default_stop_ids(self) -> list[int]:
        """The target's own stop ids (its generation_config's eos_token_id), as `target.generate` uses."""
        ids = self.target.generation_config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        return sorted(set(ids))

    def generate(
        self,
        input_ids,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | Sequence[int | None] | None = None,
        stop_token_ids: Iterable[int] | None = None,
        tree: TreeLike | None = None,
        acceptance: str = "rejection",
        streamer=None,
        profile: bool = False,
    ) -> GenerationOutput | list[GenerationOutput]:
        """Decode after `input_ids` ([T] or [1, T]); temperature 0 is greedy and token-identical to the
        target's own greedy decoding. `acceptance="typical"` is Medusa's lossy typical acceptance.

        A batch: `input_ids` a list of prompts (each an id list, a [T] or a [1, T] tensor; any lengths) returns a
        list of GenerationOutput in the same order; every step verifies all rows' trees in one shared
        target pass (see `inference/decoding.py`; one prompt runs the same loop as a batch of one).
        seed: one int s (row i uses s + i), one seed per row, or None. No streamer with a batch.
        profile: time each phase of the loop into the outputs' stats (`draft_time`, `verify_time`, ...).

        What holds for a batch, exactly: a row draws random numbers only from its own generator, and
        acceptance is lossless for whatever the heads drafted, so each row's output follows the
        target's own sampling law for its prompt whatever its neighbours are (the law of the target's
        batched pass: its logits round like a single prompt's up to float error), and greedy rows are
        the target's greedy text. Token for token, row i equals `generate(prompt_i, seed=s + i)` when
        its drafts are the same as alone: the heads' batched pass rounds with the other rows in it,
        which float32 heads almost never turn into another draft, but bfloat16 heads (the "auto" draft
        dtype on bf16 CPUs) often do, and a different draft consumes the generator differently.
        """
        batch = is_batch(input_ids)
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        spec = self.trees.for_call(tree, temperature, len(input_ids) if batch else None)
        vocab = self.target.get_input_embeddings().num_embeddings
        max_new_tokens = check_budget(max_new_tokens)
        stops = self.default_stop_ids() if stop_token_ids is None else check_stop_ids(stop_token_ids, vocab)
        if batch and streamer is not None:
            raise UserError("streamer= works with one prompt only; generate a batch without it")
        # a single prompt is a batch of one
        given = input_ids if batch else [input_ids]
        prompts = [_batch_row(p, i, batch, self.target.device, vocab) for i, p in enumerate(given)]
        outs = speculative_generate(
            self.target,
            None if spec.draft_depth == 0 else self.heads,  # a tree the heads add nothing to: none runs
            prompts,
            spec=spec,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            seeds=row_seeds(seed, len(prompts)),
            stop_token_ids=stops,
            acceptance=acceptance,
            streamer=streamer,
            profile=profile,
        )
        return outs if batch else outs[0]

    def chat_ids(self, prompt: str | bytes) -> torch.Tensor:
        """Token ids [1, T] of `prompt` as one user turn in the target's chat template (plain text
        without one). Bytes must be UTF-8."""
        if not getattr(self.tokenizer, "chat_template", None):
            return self.prompt_ids(prompt, chat=False)
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt_text(prompt)}], tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids

    def prompt_ids(self, prompt: str | bytes, chat: bool = True) -> torch.Tensor:
        """Token ids [1, T]: a chat turn (`chat_ids`), or the raw text (e.g. code to complete)."""
        if chat:
            return self.chat_ids(prompt)
        return self.tokenizer(prompt_text(prompt), return_tensors="pt").input_ids
