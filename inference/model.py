"""`SelfDraftModel`: a frozen target with draft heads attached, and its `generate`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import yaml

from selfdraft.heads import HeadsConfig, build_heads, check_compatible, load_heads
from selfdraft.inference.decoding import GenerationOutput, TreeShape, speculative_generate
from selfdraft.inference.dynamic_tree import DynamicTree
from selfdraft.inference.lookup import LookupTree, PromptLookup
from selfdraft.inference.precision import AUTO, parse_dtype, resolve_draft_dtype
from selfdraft.inference.sampling import SamplingParams
from selfdraft.inference.target import load_target
from selfdraft.inference.tree import NAMED_TREES, TreeSpec

logger = logging.getLogger(__name__)

SHIPPED = "shipped"
TREE_FILE = "tree.yaml"  # optional, next to a heads checkpoint: the tree shape chosen for it
DEFAULT_TREE = "small"  # heads= default: the checkpoint shipped for an embedded target, if any
CHECKPOINTS_DIR = Path(__file__).resolve().parent.parent / "checkpoints"

TreeLike = TreeShape | str | Sequence[Sequence[int]]
DYNAMIC_KEYS = {"depth", "top_k", "total_tokens"}
LOOKUP_KEYS = {"tokens", "max_ngram", "min_ngram"}
LOOKUP_SUFFIX = "+lookup"


def _parse_dynamic(text: str) -> DynamicTree:
    """`dynamic` or `dynamic:depth=5,top_k=4,total_tokens=16`."""
    _, _, args = text.partition(":")
    values = {}
    for item in filter(None, args.split(",")):
        key, _, value = item.partition("=")
        if key not in DYNAMIC_KEYS or not value.isdigit():
            raise ValueError(
                f"bad dynamic tree option {item!r}; use {sorted(DYNAMIC_KEYS)} with integer values"
            )
        values[key] = int(value)
    return DynamicTree(**values)


def read_tree_file(path: Path) -> TreeShape:
    """YAML with `paths:` (list of rank lists) or `dynamic: {depth, top_k, total_tokens}`, an optional
    `lookup: {tokens, max_ngram, min_ngram}` branch, and an optional `description:` / `measured:`
    block; anything else is rejected."""
    data = yaml.safe_load(path.read_text())
    allowed = {"paths", "dynamic", "lookup", "description", "measured"}
    if not isinstance(data, dict) or set(data) - allowed or ("paths" in data) == ("dynamic" in data):
        raise ValueError(
            f"{path}: a tree file holds exactly one of `paths:` or `dynamic:` (keys: {sorted(allowed)})"
        )
    if "dynamic" in data:
        options = data["dynamic"]
        if not isinstance(options, dict) or set(options) - DYNAMIC_KEYS:
            raise ValueError(f"{path}: `dynamic:` takes {sorted(DYNAMIC_KEYS)}")
        base: TreeSpec | DynamicTree = DynamicTree(**options)
    else:
        base = TreeSpec.from_paths(data["paths"])
    if "lookup" not in data:
        return base
    options = data["lookup"]
    if not isinstance(options, dict) or set(options) - LOOKUP_KEYS:
        raise ValueError(f"{path}: `lookup:` takes {sorted(LOOKUP_KEYS)}")
    return LookupTree(base, PromptLookup(**options))


def write_tree_file(path: Path, tree: TreeShape, description: str = "", measured: dict | None = None):
    data: dict = {"description": description} if description else {}
    base = tree.base if isinstance(tree, LookupTree) else tree
    if isinstance(base, DynamicTree):
        data["dynamic"] = {"depth": base.depth, "top_k": base.top_k, "total_tokens": base.total_tokens}
    else:
        data["paths"] = [list(p) for p in base.paths[1:]]
    if isinstance(tree, LookupTree):
        data["lookup"] = dataclasses.asdict(tree.lookup)
    if measured:
        data["measured"] = measured
    path.write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=None))


def resolve_tree(tree: TreeLike) -> TreeShape:
    """A TreeSpec, DynamicTree or LookupTree, a shipped tree name, `chain-N`, `dynamic[:k=v,...]`, a
    YAML file with `paths:`, or a list of rank paths; a name may end in `+lookup[=K]` to graft a
    prompt-lookup branch of up to K tokens on every drafted tree."""
    if isinstance(tree, TreeSpec | DynamicTree | LookupTree):
        return tree
    if isinstance(tree, str) and LOOKUP_SUFFIX in tree:
        name, _, rest = tree.partition(LOOKUP_SUFFIX)
        if rest and not (rest.startswith("=") and rest[1:].isdigit()):
            raise ValueError(f"bad lookup option {rest!r} in {tree!r}; use NAME+lookup or NAME+lookup=K")
        base = resolve_tree(name)
        if isinstance(base, LookupTree):
            raise ValueError(f"{tree!r} asks for two lookup branches")
        return LookupTree(base, PromptLookup(tokens=int(rest[1:])) if rest else PromptLookup())
    if isinstance(tree, str) and (tree == "dynamic" or tree.startswith("dynamic:")):
        return _parse_dynamic(tree)
    if isinstance(tree, str):
        if tree in NAMED_TREES:
            return NAMED_TREES[tree]
        if tree.startswith("chain-") and tree[6:].isdigit():
            return TreeSpec.chain(int(tree[6:]))
        path = Path(tree)
        if path.suffix in (".yaml", ".yml") and path.is_file():
            return read_tree_file(path)
        raise ValueError(
            f"unknown tree {tree!r}; use one of {sorted(NAMED_TREES)}, chain-N, dynamic:..., "
            "a YAML file, optionally followed by +lookup[=K]"
        )
    return TreeSpec.from_paths(tree)


def max_tree_tokens(tree: TreeShape) -> int:
    """The most tokens one verification pass of this shape can hold (root included)."""
    if isinstance(tree, LookupTree):
        return max_tree_tokens(tree.base) + tree.lookup.tokens
    if isinstance(tree, DynamicTree):
        return tree.total_tokens + 1  # total_tokens counts drafted nodes, the root comes on top
    return tree.size


def describe_tree(tree: TreeShape) -> str:
    """A short human description of a tree shape, e.g. for benchmark reports."""
    if isinstance(tree, LookupTree):
        return f"{describe_tree(tree.base)} + prompt-lookup branch of up to {tree.lookup.tokens} tokens"
    if isinstance(tree, DynamicTree):
        return f"dynamic (depth {tree.depth}, top-k {tree.top_k}, {tree.total_tokens} tokens)"
    if tree.parents == TreeSpec.chain(tree.max_depth).parents:
        return f"chain of {tree.max_depth}"
    return f"static tree of {tree.size - 1} nodes, depth {tree.max_depth}"


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
        raise NotImplementedError(
            f"input_ids of shape {tuple(ids.shape)}: selfdraft generates one sequence at a time"
        )
    if ids.shape[1] == 0:
        raise ValueError("input_ids is empty")
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
