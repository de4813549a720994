"""The run config: typed dataclasses read from YAML; an unknown key is an error naming the key.

Paths in a run config (target, deepspeed, heads.init_from, data.sources, data.feature_cache,
output_dir): a relative path that exists from the current folder means that file, as it always did
(the configs in configs/train are written from the repository root); one that does not exist there
but exists beside the config file is read from there, so `selfdraft train --config elsewhere/run.yaml`
finds the files next to it from any folder; `configs/...` files shipped with selfdraft (the default
deepspeed JSON) are found in the installed package. What exists nowhere (a run folder or feature
cache still to be made) stays relative to the current folder. `check_paths` checks every path a run
reads before any work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from selfdraft.errors import MissingFileError
from selfdraft.heads.config import HEAD_KINDS, LEGACY_LAYOUT
from selfdraft.heads.registry import HEAD_TYPES, default_layout, head_type_named
from selfdraft.precision import cpu_has_native_bf16
from selfdraft.training.checkpoint import resumable_heads
from selfdraft.training.warm_start import source_run
from selfdraft.typed_config import (
    ConfigError,
    at_least,
    build_dataclass,
    count,
    fraction,
    positive,
    read_yaml,
)

PRECISIONS = ("auto", "bf16", "fp32")
LR_SCHEDULES = ("cosine", "constant")
# heads.layout: "selfdraft" = our EAGLE head (a 1-layer body of the target's own class); "eagle3" = the
# published EAGLE-3 architecture (heads/eagle3/module.py), which `selfdraft export --to vllm|sglang`
# writes for the engines. What each implies (defaults, checks) is its registry entry's.
LAYOUTS = ("selfdraft", "eagle3")
LAYOUT_TYPES = {name: HEAD_TYPES[name] for name in LAYOUTS}
# where the `configs/...` files shipped with selfdraft are (repository configs/ or the installed package)
PACKAGED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DATA_SUFFIXES = (".json", ".jsonl", ".txt", ".parquet", ".csv", ".arrow")
# how long a run trains: a resume may change them (extend a finished run); the rest of the config may not
BUDGET_KEYS = ("train.epochs", "train.max_steps", "train.max_minutes")
# keys added after runs began keeping their settings, at the value that computes what those runs did:
# left out of `settings()` and the fingerprint there, so an earlier run still resumes and publishes
ADDED_LATER = {"train.ttt_stride": 1}
# keys added while runs kept only a fingerprint (they are in every kept settings): the fingerprint
# leaves them out at these values, so those runs keep theirs
HASHED_BEFORE_SETTINGS = {"train.mask_out_of_vocab": False, "train.lr_schedule": "cosine", "train.max_minutes": None}
# heads.draft_vocab_size of an eagle3 run that leaves it unset (EAGLE-3's own default for Llama 3).
EAGLE3_DEFAULT_DRAFT_VOCAB = 32000
EAGLE3_FEATURE_LAYERS = 3  # the engines' EAGLE-3 drafters fuse exactly three target layers


@dataclass
class HeadsSection:
    kind: str = "eagle"  # "eagle" | "medusa"
    # "selfdraft" | "eagle3" (exportable to vLLM / SGLang; EAGLE only). See LAYOUTS. None: eagle3 for
    # EAGLE heads (what you train, you can serve), selfdraft (no meaning) for Medusa heads.
    layout: str | None = None
    # reduced draft vocabulary (most frequent training tokens); eagle3: None = min(32000, target vocab)
    draft_vocab_size: int | None = count(None)
    # indices into the target's output_hidden_states (-1 = last, post-norm). None: [-1] (selfdraft), or
    # EAGLE-3's {2, L//2, L-3} (eagle3; three distinct ascending layer inputs in 0..L-1).
    feature_layers: list[int] | None = None
    fc_bias: bool | None = None  # the EAGLE fc's bias; None: true (selfdraft), false (eagle3, required)
    medusa_num_heads: int = count(4)
    medusa_num_layers: int = count(1)
    medusa_own_lm_head: bool = False
    # a heads folder to continue from (fine-tuning, a fresh optimizer), or a run folder: its newest
    # checkpoint's heads and AdamW state, under this run's schedule and data (training/warm_start.py)
    init_from: str | None = None


@dataclass
class DataSection:
    sources: list[str] = field(
        default_factory=lambda: ["sharegpt"]
    )  # sharegpt | python-stdlib | path | hf name
    max_length: int = at_least(2, 512, fix="a length of at least 2 tokens, e.g. 512")
    limit_records: int | None = count(None)
    heldout_fraction: float = fraction(0.02)
    seed: int = at_least(0, 0)
    feature_cache: str | None = None  # folder for cached target features; None = computed online
    partial_cache: bool = False  # train on the shards cached so far (a staged, resumable data build)
    # cut each assistant turn before an 8-word phrase starts for the (n+1)-th time (generated loops);
    # None keeps the text as it is
    cut_repeats: int | None = count(None, fix="N >= 1 (keep a phrase's first N occurrences), or leave it out")
    # keep only the first rows of the shuffled training split up to this many tokens (data-size
    # studies); the held-out split is the same whatever the budget. None = every row
    train_tokens: int | None = count(None, fix="a budget of N >= 1 tokens, or leave it out")


@dataclass
class TrainSection:
    epochs: float = positive(1.0, fix="a positive number of passes over the data, e.g. 1")
    # overrides epochs when set
    max_steps: int | None = count(None, fix="N >= 1 steps, or leave it out to train `epochs`")
    # a wall-clock budget for the training loop (resumes add up): the run stops at the first step past
    # it, and the cosine runs on the larger of step and time progress, so a lease of N minutes ends on
    # a decayed lr whatever the hardware's speed; max_steps / epochs still cap it
    max_minutes: float | None = positive(None, fix="a positive number of minutes, or leave it out")
    micro_batch_size: int = count(4)
    gradient_accumulation_steps: int = count(1)
    lr: float = positive(3e-4, fix="a learning rate > 0, e.g. 0.0003")
    weight_decay: float = at_least(0, 0.0)
    warmup_steps: int = at_least(0, 20)
    # "cosine": down to a tenth of lr by the last step; "constant": lr after the warmup, so snapshots
    # taken along one run (schedule.snapshot_tokens) each stand for a run stopped there
    lr_schedule: str = "cosine"
    grad_clip: float = at_least(0, 1.0)
    # EAGLE "training-time test": unroll the head on its own features n times (step j trains draft depth
    # j+1 on the head's own earlier outputs, as tree drafting feeds it). 7 is EAGLE-3's; deeper drafts
    # need it: on SmolLM2 (configs/train/ablations/compare.md, 300 steps each) 4 steps instead of 2 raised
    # held-out top-1 at depths 3 / 4 from 0.085 / 0.108 to 0.262 / 0.255 for 13% more time. Each step
    # costs about one head forward; short CPU runs set 2.
    ttt_steps: int = count(7)
    ttt_decay: float = positive(0.8)  # weight of unroll step j: decay**j (EAGLE-3's 0.8)
    # k > 1: unroll steps after the first continue only every k-th position's chain (exactly, see
    # `heads/eagle/objective.py:ttt_bases`), so deeper depths cost ~1/k; evaluation scores them all
    ttt_stride: int = count(1)
    # SmoothL1 on predicted features (EAGLE-1); 0 disables. None: 0.1 (selfdraft), 0 (eagle3, which
    # drops the feature loss: its head's output is a pre-norm state, not the target's feature).
    # EAGLE-1 weighs them the other way (feature 1.0, CE 0.1); here the CE leads because acceptance
    # depends on the draft's token distribution only and the CE is against the target's full soft
    # distribution, while the feature term is a regulariser that the unrolled steps and EAGLE-3 drop
    # entirely (not ablated here: every shipped SmolLM2 stage trained with 0.1 / 1.0).
    feature_weight: float | None = at_least(0, None)
    ce_weight: float = at_least(0, 1.0)  # soft CE / forward KL against the target's distribution
    # EAGLE only, with a draft vocabulary: no loss where the target's greedy token is outside it (EAGLE-3)
    mask_out_of_vocab: bool = True
    medusa_decay: float = positive(0.8)
    medusa_hard_labels: bool = False  # CE on the text tokens (Medusa-1) instead of the target's distribution
    seed: int = at_least(0, 0)
    # 0: random micro-batches; W: micro-batches of similar lengths, sorted within windows of W steps'
    # examples (windows and batch order still random), so less compute goes to padding
    length_grouping: int = at_least(0, 0, fix="0 (random batches) or a window of N >= 1 steps")
    # auto | bf16 | fp32: the dtype of the frozen target, its features and the heads' compute (see
    # `resolve_precision`). bf16 keeps fp32 master weights in the optimizer (DeepSpeed's bf16 mode).
    precision: str = "auto"


@dataclass
class ScheduleSection:
    save_every: int = count(200)
    eval_every: int = count(200)
    log_every: int = count(10)
    eval_examples: int = count(64)
    eval_tree: str = "small"  # tree whose acceptance length evaluation simulates (besides a chain)
    keep_checkpoints: int = count(2)
    # token counts at which the heads are also kept, in snapshots/tokens-N: at the step whose tokens fed
    # (every rank's attention-mask ones) first reach N. A data-size curve from one run: with
    # train.lr_schedule constant and at most one epoch, the heads at N have seen N tokens of distinct data
    snapshot_tokens: list[int] = count(list, fix="token counts >= 1 at which to keep the heads")


@dataclass
class RunConfig:
    target: str = "smollm2-135m-instruct"
    output_dir: str = "runs/default"
    deepspeed: str = "configs/deepspeed/zero1.json"
    heads: HeadsSection = field(default_factory=HeadsSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)

    def __post_init__(self) -> None:
        """The layout-dependent defaults (None in the file) that do not need the target; eagle3's
        default feature layers and draft vocabulary do (`resolve_for_target`)."""
        h, t = self.heads, self.train
        if h.layout is None:
            h.layout = default_layout(h.kind)
        named = head_type_named(h.kind, h.layout) or LAYOUT_TYPES.get(h.layout)  # a bad pair: checked later
        if named is None:
            return
        if h.fc_bias is None:
            h.fc_bias = named.fc_bias
        if t.feature_weight is None:
            t.feature_weight = named.feature_weight
        if h.feature_layers is None and not named.fuses_layers:
            h.feature_layers = [-1]

    def settings(self) -> dict[str, object]:
        """Every key that changes what a step computes, flattened ("train.lr": 0.001): what a resumed
        run must share with its checkpoint. Not the budget (BUDGET_KEYS: a resume may extend it), where
        or how often the run saves, nor the output folder."""
        data = dataclasses.asdict(self)
        data.pop("schedule")
        data.pop("output_dir")
        flat = {
            f"{section}.{key}" if isinstance(values, dict) else section: value
            for section, values in data.items()
            for key, value in (values.items() if isinstance(values, dict) else [(None, values)])
        }
        return {
            key: value
            for key, value in flat.items()
            if key not in BUDGET_KEYS and not (key in ADDED_LATER and ADDED_LATER[key] == value)
        }

    def fingerprint(self) -> str:
        """Hash of everything that changes what a step computes (not where or how often it saves)."""
        data = dataclasses.asdict(self)
        data.pop("schedule")
        data.pop("output_dir")
        heads = data["heads"]
        if heads["layout"] == LEGACY_LAYOUT and heads["fc_bias"]:
            # the defaults of keys added later: runs started before them keep their fingerprint
            del heads["layout"], heads["fc_bias"]
        for key, value in {**HASHED_BEFORE_SETTINGS, **ADDED_LATER}.items():
            section, name = key.split(".")
            if data[section][name] == value:
                del data[section][name]
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _eagle3_layers_shaped(layers: list[int]) -> bool:
    """Three distinct ascending layer inputs; 0 is the embeddings, the input of layer 0, which vLLM and
    SGLang capture too (the depth is checked on the target)."""
    return len(layers) == EAGLE3_FEATURE_LAYERS and layers[0] >= 0 and layers == sorted(set(layers))


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision: {precision!r} is not one of {', '.join(PRECISIONS)}")


def _check_layout(config: RunConfig) -> None:
    """heads.layout and what it rules out, as far as the file alone tells (`resolve_for_target` does
    the rest once the target's depth is known)."""
    h = config.heads
    if h.layout not in LAYOUTS:
        raise ConfigError(f"heads.layout: {h.layout!r} is not one of {', '.join(LAYOUTS)}")
    layout = LAYOUT_TYPES[h.layout]
    if not layout.servable:
        return
    if h.kind != layout.kind:
        raise ConfigError(
            f"heads.layout: eagle3 is an EAGLE head architecture, but heads.kind is {h.kind!r}; set "
            "heads.kind: eagle or drop heads.layout"
        )
    if h.fc_bias:
        raise ConfigError(
            "heads.fc_bias: true cannot be exported: the EAGLE-3 fc of vLLM and SGLang has no bias; drop "
            "heads.fc_bias (layout eagle3 trains without one) or use heads.layout: selfdraft"
        )
    if config.train.feature_weight:
        raise ConfigError(
            f"train.feature_weight: {config.train.feature_weight} with heads.layout: eagle3, which trains "
            "without the feature loss (its head feeds back a pre-norm state, not the target's feature); "
            "drop train.feature_weight or set it to 0"
        )
    if h.feature_layers is not None:
        layers = h.feature_layers
        if not _eagle3_layers_shaped(layers):
            raise ConfigError(
                f"heads.feature_layers: {layers} with heads.layout: eagle3, whose heads fuse three distinct "
                "target layers, written as output_hidden_states indices in ascending order within 0..L-1 "
                "(what vLLM and SGLang capture); drop the key for EAGLE-3's default {2, L//2, L-3}"
            )
    if h.draft_vocab_size is not None and h.draft_vocab_size < 1:
        raise ConfigError(f"heads.draft_vocab_size: {h.draft_vocab_size} must be >= 1")


def _target_text_config(name_or_path: str):
    """The target's (text) config, read without loading its weights."""
    from transformers import AutoConfig

    from selfdraft.target import hub_kwargs, refuse_heads_folder, resolve_target_path

    path = Path(resolve_target_path(name_or_path))
    refuse_heads_folder(path, name_or_path)
    adapter = path / "adapter_config.json"
    if adapter.is_file():  # a PEFT adapter: the depth and vocabulary are its base model's
        path = Path(resolve_target_path(json.loads(adapter.read_text())["base_model_name_or_path"]))
    try:
        config = AutoConfig.from_pretrained(str(path), **hub_kwargs(name_or_path))
    except OSError as err:
        raise ConfigError(
            f"heads.layout: eagle3 (the default for EAGLE heads) needs the target's depth for its default "
            f"feature layers, but the config of target {name_or_path!r} cannot be read ({type(err).__name__}); "
            "set heads.feature_layers and heads.draft_vocab_size, or fix target"
        ) from err
    return getattr(config, "get_text_config", lambda: config)()


def resolve_for_target(config: RunConfig, target_config) -> RunConfig:
    """Fill eagle3's target-dependent defaults in place and check them against the target (its
    `.config`): feature_layers EAGLE-3's {2, L//2, L-3} (`eagle3_default_layers`), draft_vocab_size
    min(32000, V). Idempotent; a no-op for the selfdraft layout."""
    from selfdraft.heads.eagle3.module import eagle3_default_layers

    h = config.heads
    if not LAYOUT_TYPES[h.layout].fuses_layers:
        return config
    text = getattr(target_config, "get_text_config", lambda: target_config)()
    depth, vocab = text.num_hidden_layers, text.vocab_size
    given = h.feature_layers is not None
    layers = list(h.feature_layers) if given else eagle3_default_layers(depth)
    if not _eagle3_layers_shaped(layers):
        what = f"heads.feature_layers {layers}" if given else f"EAGLE-3's default {{2, L//2, L-3}} = {layers}"
        raise ConfigError(
            f"heads.layout: eagle3 on a target of {depth} layers: {what} are not three distinct ascending "
            f"layers; set heads.feature_layers to three of 0..{depth - 1}"
        )
    if layers[-1] > depth - 1:
        raise ConfigError(
            f"heads.feature_layers: {layers} with heads.layout: eagle3 on a target of {depth} layers: the "
            f"engines capture the inputs of layers 0..{depth - 1} (index {depth} is the final-norm output)"
        )
    h.feature_layers = layers
    if h.draft_vocab_size is None:
        h.draft_vocab_size = min(EAGLE3_DEFAULT_DRAFT_VOCAB, vocab)
    if h.draft_vocab_size > vocab:
        raise ConfigError(
            f"heads.draft_vocab_size: {h.draft_vocab_size} exceeds the target's vocabulary of {vocab} tokens"
        )
    return config


def _resolve_path(value: str | None, folder: Path) -> str | None:
    """A config path as the module docstring says: from the current folder, else beside the config
    file, else among the packaged configs, else as written."""
    if not value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute() or path.exists():
        return value
    candidates = [folder / path]
    if path.parts[0] == "configs" and len(path.parts) > 1:
        candidates.append(PACKAGED_CONFIGS / Path(*path.parts[1:]))
    return next((str(c) for c in candidates if c.exists()), value)


def resolve_paths(config: RunConfig, folder: Path) -> RunConfig:
    """Every path of `config` resolved against `folder` (the config file's) where needed, in place."""
    config.target = _resolve_path(config.target, folder)
    config.output_dir = _resolve_path(config.output_dir, folder)
    config.deepspeed = _resolve_path(config.deepspeed, folder)
    config.heads.init_from = _resolve_path(config.heads.init_from, folder)
    config.data.feature_cache = _resolve_path(config.data.feature_cache, folder)
    config.data.sources = [_resolve_path(source, folder) for source in config.data.sources]
    return config


def _looks_like_path(value: str) -> bool:
    """A data source or target written as a file path (not a corpus name or a hub id)."""
    return value.startswith(("/", "./", "../", "~")) or Path(value).suffix in DATA_SUFFIXES


def deepspeed_json_problem(path: Path) -> str | None:
    """Why `path` is not a DeepSpeed JSON config (a YAML file, a binary, a list...), or None."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return (
            f"deepspeed: {path} is not a DeepSpeed JSON config ({type(err).__name__}); name one, e.g. "
            "configs/deepspeed/zero1.json"
        )
    if not isinstance(data, dict):
        return f"deepspeed: {path} holds a JSON {type(data).__name__}, not a DeepSpeed config object"
    return None


def check_paths(config: RunConfig, reads_cache: bool = True) -> None:
    """Every file a run reads, checked before any work: one line per missing path, naming the key.
    reads_cache: the run reads data.feature_cache as it is (a partial cache trains on what is there)."""
    problems = []
    if not Path(config.deepspeed).is_file():
        problems.append(f"deepspeed: {config.deepspeed} is not a file; give the path of a DeepSpeed JSON")
    elif (problem := deepspeed_json_problem(Path(config.deepspeed))) is not None:
        problems.append(problem)
    init_from = config.heads.init_from
    if init_from and not Path(init_from).is_dir() and not resumable_heads(Path(config.output_dir)):
        problems.append(f"heads.init_from: {init_from} is not a heads folder")
    elif (run := source_run(init_from)) and not resumable_heads(run):
        problems.append(
            f"heads.init_from: run {init_from} holds no whole checkpoint to continue; point it at a heads "
            "folder, or resume that run first"
        )
    for source in config.data.sources:
        if _looks_like_path(source) and not Path(source).expanduser().exists():
            problems.append(f"data.sources: {source} does not exist")
    if _looks_like_path(config.target) and not Path(config.target).expanduser().is_dir():
        problems.append(f"target: {config.target} is not a model folder")
    cache = config.data.feature_cache
    if reads_cache and cache and config.data.partial_cache and not (Path(cache) / "index.json").is_file():
        problems.append(
            f"data.feature_cache: {cache} holds no cache yet (data.partial_cache trains on the shards "
            "finished so far); start `selfdraft prepare --config CONFIG` first, or set data.partial_cache: false"
        )
    if problems:
        where = "relative paths are read from the current folder or beside the config file"
        raise MissingFileError("\n".join(problems) + (f" ({where})" if len(problems) == 1 else f"\n({where})"))


def command_line_overrides(
    output_dir: str | None = None, max_steps: int | None = None, precision: str | None = None
) -> dict:
    """The command line's flags (`--output-dir`, `--max-steps`, `--precision`; None: not given) as
    the nested overrides `load_run_config` merges over the file."""
    overrides: dict = {"output_dir": output_dir} if output_dir else {}
    train = {k: v for k, v in (("max_steps", max_steps), ("precision", precision)) if v is not None}
    return overrides | ({"train": train} if train else {})


def load_run_config(path: str | Path, overrides: dict | None = None) -> RunConfig:
    """Read a run config; `overrides` is a nested dict merged over the file (CLI flags). Relative
    paths are resolved as the module docstring says (`check_paths` checks them)."""
    if not Path(path).exists():
        raise MissingFileError(f"run config {path} does not exist; pass the path of a YAML run config")
    raw = read_yaml(path, "run config")
    if raw is None:
        raise ConfigError(f"run config {path} is empty; a recipe names at least its target and output_dir")
    for key, value in (overrides or {}).items():
        raw.setdefault(key, {}).update(value) if isinstance(value, dict) else raw.__setitem__(key, value)
    config = resolve_paths(build_dataclass(RunConfig, raw), Path(path).resolve().parent)
    if config.heads.kind not in HEAD_KINDS:
        raise ConfigError(f"heads.kind: {config.heads.kind!r} is not one of {', '.join(HEAD_KINDS)}")
    _check_precision(config.train.precision)
    _check_layout(config)
    if config.train.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(
            f"train.lr_schedule: {config.train.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}"
        )
    if LAYOUT_TYPES[config.heads.layout].fuses_layers and config.heads.feature_layers is None:
        # what `selfdraft prepare` caches must already be these layers: resolve them from the target
        resolve_for_target(config, _target_text_config(config.target))
    return config


def resolve_precision(precision: str, device: torch.device | str) -> torch.dtype:
    """train.precision -> the run's compute dtype on `device`.

    auto: bfloat16 on CUDA GPUs that support it (Ampere and later) and on CPUs that multiply bf16
    natively (AVX512-BF16 / AMX / Arm BF16); float32 elsewhere (an AVX2-only CPU emulates bf16,
    slower than float32)."""
    _check_precision(precision)
    if precision == "auto":
        cuda = torch.device(device).type == "cuda"
        native = torch.cuda.is_bf16_supported() if cuda else cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    return torch.bfloat16 if precision == "bf16" else torch.float32
