"""Tree shapes written as text: names and strings (`small`, `chain-4`, `dynamic:depth=5,...`,
`NAME+lookup=K[,extend=E]`), rank-path lists, and `tree.yaml` files.

A tree file holds one tree, or one tree per target dtype (`bfloat16:` / `float32:` / `float16:`
entries, each a one-tree block): the best tree depends on what verification costs, and a bf16 pass
over 32 tokens costs about what one token does on a CPU with bf16 matrix units, while fp32 pays for
every token. `selfdraft tune` writes the entry of the dtype it ran in and keeps the others.

How much a bigger block costs also depends on the machine (a CPU with AMX tiles verifies 32 bf16
tokens for about the price of one; one with AVX512-BF16 alone pays ~1.9x), so a dtype may also have
entries for one kind of machine, keyed `DTYPE@KIND` (`bfloat16@cpu-avx512bf16`, see
`selfdraft.precision.machine_kind`): on that kind it replaces the dtype's entry, whose `sampling:`
and `batch:` trees it inherits unless it has its own (`selfdraft tune --this-machine` writes it).

A tree may carry a `sampling:` block, itself a one-tree block: the tree for temperature > 0, where
drawn children on a static tree (see `decoding.draws_children`) can beat the greedy choice
(`selfdraft tune --temperature T` writes it).

A tree may also carry a `batch:` block mapping batch sizes to one-tree blocks: the greedy tree for a
batch of at least that many prompts (`selfdraft tune --batch B` writes it). One shared pass verifies
B trees, so its cost grows with B x tree tokens and a batch wants a smaller tree than one prompt.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from pathlib import Path

import yaml

from selfdraft.destinations import check_writable, staged_file
from selfdraft.errors import UserError
from selfdraft.tree import NAMED_TREES, DynamicTree, LookupTree, PromptLookup, TreeShape, TreeSpec

TreeLike = TreeShape | str | Sequence[Sequence[int]]
DYNAMIC_KEYS = {"depth", "top_k", "total_tokens"}
LOOKUP_KEYS = {"tokens", "max_ngram", "min_ngram", "extend"}
LOOKUP_SUFFIX = "+lookup"
FILE_KEYS = {"paths", "dynamic", "lookup", "description", "measured", "sampling", "batch"}
DTYPE_KEYS = ("bfloat16", "float32", "float16")  # a per-dtype tree file's entries
MACHINE_SEP = "@"  # `bfloat16@cpu-amx`: the bfloat16 entry for one kind of machine
SUBTREE_KEYS = ("sampling", "batch")

logger = logging.getLogger(__name__)


def _parse_lookup(rest: str, tree: str) -> PromptLookup:
    """What follows `+lookup`: nothing, `=K` or `=K,extend=E`."""
    if not rest:
        return PromptLookup()
    found = re.fullmatch(r"=(\d+)(?:,extend=(\d+))?", rest)
    if found is None:
        raise UserError(
            f"bad lookup option {rest!r} in {tree!r}; use NAME+lookup, NAME+lookup=K or NAME+lookup=K,extend=E"
        )
    return PromptLookup(tokens=int(found[1]), extend=int(found[2] or 0))


def _parse_dynamic(text: str) -> DynamicTree:
    """`dynamic` or `dynamic:depth=5,top_k=4,total_tokens=16`."""
    _, _, args = text.partition(":")
    values = {}
    for item in filter(None, args.split(",")):
        key, _, value = item.partition("=")
        if key not in DYNAMIC_KEYS or not value.isdigit():
            raise UserError(
                f"bad dynamic tree option {item!r}; use {sorted(DYNAMIC_KEYS)} with integer values"
            )
        values[key] = int(value)
    return DynamicTree(**values)


def _load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise UserError(f"{path}: cannot read the tree file ({err}); fix or remove it") from err
    if not isinstance(data, dict):
        raise UserError(f"{path}: a tree file is a YAML mapping (keys: {sorted(FILE_KEYS)})")
    return data


def entry_key(dtype: str, machine: str | None = None) -> str:
    """The key of a per-dtype file's entry: `dtype`, or `dtype@machine` for one kind of machine."""
    return f"{dtype}{MACHINE_SEP}{machine}" if machine else dtype


def _is_entry_key(key) -> bool:
    dtype, sep, machine = str(key).partition(MACHINE_SEP)
    return dtype in DTYPE_KEYS and (not sep or bool(machine) and MACHINE_SEP not in machine)


def _entry_order(key: str) -> tuple:
    dtype, _, machine = key.partition(MACHINE_SEP)
    return DTYPE_KEYS.index(dtype), machine


def _per_dtype(data: dict) -> bool:
    return bool(data) and all(_is_entry_key(k) for k in data)


def _dtype_entry(path: Path, dtype: str | None, machine: str | None = None) -> tuple[str, dict]:
    """(where, block): the file's tree block for `dtype` on `machine` (see `read_tree_file`)."""
    data = _load_yaml(path)
    if not _per_dtype(data):
        return str(path), data
    generic = [k for k in data if MACHINE_SEP not in k]
    name = dtype if dtype in data else (generic or list(data))[0]
    specific = entry_key(dtype, machine) if dtype and machine else None
    if specific in data:
        block, base = data[specific], data.get(dtype, {})
        if isinstance(block, dict) and isinstance(base, dict):
            block = {**{k: base[k] for k in SUBTREE_KEYS if k in base}, **block}
        return f"{path} [{specific}]", block
    if dtype != name:
        logger.warning("%s has no tree for %s; using its %s tree", path, dtype or "this dtype", name)
    return f"{path} [{name}]", data[name]


def read_tree_file(
    path: Path, dtype: str | None = None, sampling: bool = False, machine: str | None = None
) -> TreeShape:
    """YAML with `paths:` (list of rank lists) or `dynamic: {depth, top_k, total_tokens}`, an optional
    `lookup: {tokens, max_ngram, min_ngram, extend}` branch, optional `sampling:` (T > 0) and `batch:` trees,
    and an optional `description:` / `measured:` block; anything else is rejected. Or such blocks
    under dtype keys (see the module docstring): `dtype` ("bfloat16", "float32", ...) picks one;
    without an entry for it (or without `dtype`) the first entry serves, with a warning, since any
    tree stays lossless. machine: this machine's kind; its `dtype@machine` entry, if the file has one,
    serves instead of the dtype's. sampling: the block's `sampling:` tree if it has one, else its own
    tree."""
    where, data = _dtype_entry(path, dtype, machine)
    batch_trees(where, data)  # a bad `batch:` block fails when the file is read, not mid-batch
    if sampling and isinstance(data, dict) and "sampling" in data:
        where, data = f"{where} [sampling]", data["sampling"]
        if isinstance(data, dict) and {"sampling", "batch"} & set(data):
            raise UserError(f"{where}: a `sampling:` tree cannot hold `sampling:` or `batch:` trees")
    return _tree_block(where, data)


def read_batch_trees(path: Path, dtype: str | None = None, machine: str | None = None) -> dict[int, TreeShape]:
    """The `batch:` trees of the file's `dtype` block (on `machine`): {batch size: greedy tree}, maybe
    empty."""
    return batch_trees(*_dtype_entry(path, dtype, machine))


def batch_trees(where: str, data) -> dict[int, TreeShape]:
    block = data.get("batch", {}) if isinstance(data, dict) else {}
    if not isinstance(block, dict) or not all(isinstance(k, int) and k >= 2 for k in block):
        raise UserError(f"{where}: `batch:` maps batch sizes (integers >= 2) to trees")
    out = {}
    for size, entry in sorted(block.items()):
        if isinstance(entry, dict) and {"sampling", "batch"} & set(entry):
            raise UserError(f"{where} [batch {size}]: a batch tree cannot hold `sampling:` or `batch:` trees")
        out[size] = _tree_block(f"{where} [batch {size}]", entry)
    return out


def tree_for_batch(trees: dict[int, TreeShape], rows: int, default: TreeShape) -> TreeShape:
    """The tree tuned for the largest batch size <= rows, else `default`."""
    sizes = [size for size in trees if size <= rows]
    return trees[max(sizes)] if sizes else default


def _tree_block(where: str, data) -> TreeShape:
    if not isinstance(data, dict) or set(data) - FILE_KEYS or ("paths" in data) == ("dynamic" in data):
        raise UserError(
            f"{where}: a tree holds exactly one of `paths:` or `dynamic:` (keys: {sorted(FILE_KEYS)}); a "
            f"file of one tree per dtype has only {', '.join(DTYPE_KEYS)} (or DTYPE{MACHINE_SEP}KIND) entries"
        )
    if "dynamic" in data:
        options = data["dynamic"]
        if not isinstance(options, dict) or set(options) - DYNAMIC_KEYS:
            raise UserError(f"{where}: `dynamic:` takes {sorted(DYNAMIC_KEYS)}")
    try:
        base: TreeSpec | DynamicTree = (
            DynamicTree(**data["dynamic"]) if "dynamic" in data else TreeSpec.from_paths(data["paths"])
        )
        if "lookup" not in data:
            return base
        options = data["lookup"]
        if not isinstance(options, dict) or set(options) - LOOKUP_KEYS:
            raise UserError(f"`lookup:` takes {sorted(LOOKUP_KEYS)}")
        return LookupTree(base, PromptLookup(**options))
    except (TypeError, ValueError) as err:
        raise UserError(f"{where}: {err}") from err


def _shape_fields(tree: TreeShape) -> dict:
    if isinstance(tree, LookupTree):
        lookup = dataclasses.asdict(tree.lookup)
        if not lookup["extend"]:  # files written before extensions existed read the same
            del lookup["extend"]
        return {**_shape_fields(tree.base), "lookup": lookup}
    if isinstance(tree, DynamicTree):
        return {"dynamic": dataclasses.asdict(tree)}
    return {"paths": [list(p) for p in tree.paths[1:]]}


def write_tree_file(
    path: Path,
    tree: TreeShape,
    description: str = "",
    measured: dict | None = None,
    dtype: str | None = None,
    sampling: bool = False,
    batch: int = 1,
    machine: str | None = None,
):
    """Write one tree; with `dtype`, as that dtype's entry of a per-dtype file, keeping the file's
    other dtypes' entries (a one-tree file it replaces). sampling: write it as the entry's `sampling:`
    tree (for T > 0); batch > 1: as the entry's greedy tree for batches of `batch` prompts; either way
    the entry's other trees stay (writing the entry's own greedy tree keeps its `sampling:` and
    `batch:` trees). machine: write the `dtype@machine` entry (for that kind of machine only)."""
    data: dict = {"description": description} if description else {}
    data.update(_shape_fields(tree))
    if measured:
        data["measured"] = measured
    if dtype is not None and dtype not in DTYPE_KEYS:
        raise UserError(f"no tree entry for dtype {dtype!r}; use one of {', '.join(DTYPE_KEYS)}")
    if machine is not None and (dtype is None or not _is_entry_key(entry_key(dtype, machine))):
        raise UserError(f"a machine entry needs a dtype and a kind without {MACHINE_SEP!r} (got {machine!r})")
    key = entry_key(dtype, machine) if dtype is not None else None
    if sampling and batch > 1:
        raise UserError("a batch tree is a greedy tree; tune it at temperature 0")
    old = _load_yaml(path) if Path(path).is_file() else {}
    entries = dict(old) if _per_dtype(old) else {}
    previous = entries.get(key, {}) if key is not None else old
    if (sampling or batch > 1) and not previous:
        raise UserError(f"{path}: write the single-prompt greedy tree (tune at temperature 0) first")
    if sampling:
        data = {**previous, "sampling": data}
    elif batch > 1:
        data = {**previous, "batch": {**previous.get("batch", {}), batch: data}}
        data["batch"] = dict(sorted(data["batch"].items()))
    else:
        data.update({k: previous[k] for k in SUBTREE_KEYS if k in previous})
    if key is not None:
        merged = {**entries, key: data}
        data = {k: merged[k] for k in sorted(merged, key=_entry_order)}
    with staged_file(path) as fh:  # a failed write leaves the old file whole
        fh.write(yaml.safe_dump(data, sort_keys=False, default_flow_style=None))


def check_tree_file(path: Path) -> None:
    """Every tree of the file parses (each entry's own, `sampling:` and `batch:` trees), or UserError."""
    data = _load_yaml(path)
    entries = [(f"{path} [{k}]", v) for k, v in data.items()] if _per_dtype(data) else [(str(path), data)]
    for where, block in entries:
        batch_trees(where, block)
        if isinstance(block, dict) and "sampling" in block:
            _tree_block(f"{where} [sampling]", block["sampling"])
        _tree_block(where, block)


def check_tree_destination(path: str | Path, option: str = "--out") -> Path:
    """A tree file to write an entry into, checked before any work: a new .yaml file in a writable
    folder, or an existing tree file (its other entries stay); anything else is refused untouched."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{option} {path} is a folder; name a tree file in it, e.g. {path / 'tree.yaml'}")
    if path.suffix not in (".yaml", ".yml"):
        raise UserError(f"{option} {path}: a tree file's name ends in .yaml; name one, e.g. tree.yaml")
    if path.exists():
        try:
            check_tree_file(path)
        except UserError as err:
            raise UserError(
                f"{option} {path} exists and is not a tree file, so it is left as it is ({err}); name a "
                "new file, or a tree file to add this entry to"
            ) from err
    if not path.parent.is_dir():
        raise UserError(f"{option} {path}: the folder {path.parent} does not exist; create it first")
    check_writable(path.parent, option)
    return path


def is_tree_file(tree: TreeLike) -> bool:
    return isinstance(tree, str | Path) and Path(tree).suffix in (".yaml", ".yml") and Path(tree).is_file()


def resolve_tree(
    tree: TreeLike, dtype: str | None = None, sampling: bool = False, machine: str | None = None
) -> TreeShape:
    """A TreeSpec, DynamicTree or LookupTree, a shipped tree name, `chain-N`, `dynamic[:k=v,...]`, a
    tree YAML file (its `dtype` entry if it has one per dtype; with `sampling` its tree for T > 0 if
    it has one; its `dtype@machine` entry on that kind of machine), or a list of rank paths; a name
    may end in `+lookup[=K]` to graft a prompt-lookup branch of up to K tokens on every drafted tree,
    and `+lookup=K,extend=E` also to continue the heads' first-choice path by up to E looked-up tokens."""
    if isinstance(tree, TreeSpec | DynamicTree | LookupTree):
        return tree
    if not isinstance(tree, str):
        if not isinstance(tree, Sequence) or not all(isinstance(p, Sequence) for p in tree):
            raise UserError(
                f"tree {tree!r}: pass a tree name (e.g. small, chain-4, dynamic), a tree YAML file or a list "
                "of rank paths such as [[0], [0, 0], [1]]"
            )
        return TreeSpec.from_paths(tree)
    if LOOKUP_SUFFIX in tree:
        name, _, rest = tree.partition(LOOKUP_SUFFIX)
        base = resolve_tree(name)
        if isinstance(base, LookupTree):
            raise UserError(f"{tree!r} asks for two lookup branches")
        return LookupTree(base, _parse_lookup(rest, tree))
    if tree == "dynamic" or tree.startswith("dynamic:"):
        return _parse_dynamic(tree)
    if tree in NAMED_TREES:
        return NAMED_TREES[tree]
    if tree.startswith("chain-") and tree[6:].isdigit():
        return TreeSpec.chain(int(tree[6:]))
    if is_tree_file(tree):
        return read_tree_file(Path(tree), dtype, sampling, machine)
    if Path(tree).suffix in (".yaml", ".yml"):
        what = "is a folder" if Path(tree).is_dir() else "does not exist"
        raise UserError(f"tree file {tree} {what}; pass a tree YAML file (e.g. HEADS/tree.yaml) or a tree name")
    raise UserError(
        f"unknown tree {tree!r}; use one of {sorted(NAMED_TREES)}, chain-N, dynamic:..., "
        "a YAML file, optionally followed by +lookup[=K]"
    )
