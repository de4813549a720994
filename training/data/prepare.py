"""Everything a run needs before its first step: rendered data splits and the optional feature cache.

Preparation is idempotent and resumable: splits are saved under output_dir/data, the feature cache
under data.feature_cache, and both are reused by later runs and by every rank of a distributed job.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import datasets

from selfdraft.errors import UserError
from selfdraft.heads.config import normalize_layers
from selfdraft.training import locks
from selfdraft.training.config import RunConfig
from selfdraft.training.data.dataset import build_dataset, rows_to_dataset, without_bars
from selfdraft.training.data.feature_cache import HiddenStateCache, cache_hidden_states

DATA_DIR = "data"
SPLIT_FINGERPRINT = "splits.json"


def feature_layers(config: RunConfig, target) -> list[int]:
    """Hidden-state layers a run reads: the heads' inputs plus the last one (the target's logits)."""
    normalize_layers(target, config.heads.feature_layers)  # a bad one is named as the config wrote it
    return normalize_layers(target, [*config.heads.feature_layers, -1])


def _split_fingerprint(config: RunConfig, tokenizer) -> dict:
    """What decides the splits' contents: the data section and the tokenizer's vocabulary size."""
    data = config.data
    return {
        "sources": data.sources,
        "max_length": data.max_length,
        "limit_records": data.limit_records,
        "heldout_fraction": data.heldout_fraction,
        "seed": data.seed,
        "vocab_size": len(tokenizer),
        # splits built before held-out near-duplicates of training prompts moved to training differ
        "split_rule": "near-duplicate-free",
    } | {
        key: value
        for key, value in (("cut_repeats", data.cut_repeats), ("train_tokens", data.train_tokens))
        if value is not None  # absent when unset: splits built before the key existed stay valid
    }


def _load_split(folder: Path) -> datasets.Dataset:
    if not any(folder.glob("*.arrow")):  # `datasets` cannot read back a saved empty split
        return rows_to_dataset([])
    return datasets.load_from_disk(str(folder))


def prepare_splits(
    config: RunConfig, tokenizer, num_proc: int | None = None
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The run's (train, heldout) splits, built once under output_dir/data and reused.

    Both splits and their fingerprint are written into one temporary folder that is renamed into place
    (a killed build leaves only debris that the next build replaces); concurrent builders are
    serialised by a lock; a folder built from another data config is refused, not silently reused.
    num_proc: render processes (default: see `dataset.resolve_num_proc`); the splits do not depend on
    it, so it is not part of the fingerprint.
    """
    root = Path(config.output_dir) / DATA_DIR
    fingerprint = _split_fingerprint(config, tokenizer)
    # one builder at a time per run folder: a second waits, then reuses what the first built
    with locks.held(Path(config.output_dir) / (DATA_DIR + ".lock"), wait=True, what=str(root)):
        if (root / SPLIT_FINGERPRINT).is_file():
            _check_fingerprint(root, fingerprint)
            return _load_split(root / "train"), _load_split(root / "heldout")
        if root.exists():  # debris of a build killed mid-way, or of a version without a fingerprint
            shutil.rmtree(root)
        tmp = root.with_name(f"{DATA_DIR}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        train, heldout = build_dataset(
            config.data.sources
            if config.data.limit_records is None
            else [
                f"{s}:{config.data.limit_records}" if s in ("sharegpt", "python-stdlib") else s
                for s in config.data.sources
            ],
            tokenizer,
            max_length=config.data.max_length,
            seed=config.data.seed,
            heldout_fraction=config.data.heldout_fraction,
            run_dir=Path(config.output_dir),
            num_proc=num_proc,
            work_dir=tmp / "work",  # rendered Arrow files on disk, not in memory
            cut_repeats=config.data.cut_repeats,
            train_tokens=config.data.train_tokens,
        )
        with without_bars():  # the render's bars showed the work; saving is quick
            train.save_to_disk(str(tmp / "train"))
            heldout.save_to_disk(str(tmp / "heldout"))
        del train, heldout  # they read from work/, deleted next
        shutil.rmtree(tmp / "work")
        (tmp / SPLIT_FINGERPRINT).write_text(json.dumps(fingerprint, indent=1))
        tmp.rename(root)  # atomic: data/ exists only complete
    return _load_split(root / "train"), _load_split(root / "heldout")


def _check_fingerprint(root: Path, fingerprint: dict) -> None:
    """Refuse splits under `root` built from another data config, naming the keys that changed."""
    found = json.loads((root / SPLIT_FINGERPRINT).read_text())
    if found != fingerprint:
        changed = sorted(k for k in found.keys() | fingerprint.keys() if found.get(k) != fingerprint.get(k))
        raise UserError(
            f"{root} was built from another data config ({', '.join(changed)} changed); "
            "use a new output_dir, or delete that folder to rebuild the splits"
        )


def load_prepared_splits(config: RunConfig, tokenizer) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The (train, heldout) splits `prepare_splits` built for this run, read as they are: a training
    worker never builds them (the launcher prepared them once, before the workers started)."""
    root = Path(config.output_dir) / DATA_DIR
    if not (root / SPLIT_FINGERPRINT).is_file():
        raise UserError(
            f"{root} holds no prepared data splits; run `selfdraft prepare --config CONFIG` first, or "
            "launch with `selfdraft train`, which prepares them"
        )
    _check_fingerprint(root, _split_fingerprint(config, tokenizer))
    return _load_split(root / "train"), _load_split(root / "heldout")


def split_data(config: RunConfig) -> dict | None:
    """What the run's splits were built from (the fingerprint `prepare_splits` wrote), or None."""
    path = Path(config.output_dir) / DATA_DIR / SPLIT_FINGERPRINT
    return json.loads(path.read_text()) if path.is_file() else None


def check_cache_matches(config: RunConfig, cache: HiddenStateCache, train) -> None:
    """Refuse a feature cache computed from other rows than the run's training split (other data, or
    another held-out fraction whose held-out rows it would train on), saying what differs."""
    problems = cache.differences(train, split_data(config))
    if problems:
        raise UserError(
            f"feature cache {config.data.feature_cache} was built from other data than this run's "
            f"training split ({'; '.join(problems)}); set data.feature_cache to a new folder (or delete "
            "that one) and run `selfdraft prepare --config CONFIG`"
        )


def features_ready(config: RunConfig, train, heldout) -> bool:
    """Whether the feature caches of both splits are complete, of the run's layers and of exactly
    these rows: then there is nothing for the target to compute (it need not even load)."""
    from transformers import AutoConfig

    from selfdraft.target import resolve_target_path

    if not cache_ready(config):
        return False
    try:
        text = AutoConfig.from_pretrained(resolve_target_path(config.target))
    except (OSError, ValueError):
        return False  # loading the target will say what is wrong
    depth = SimpleNamespace(config=getattr(text, "get_text_config", lambda: text)())
    layers = feature_layers(config, depth)
    folders = [(config.data.feature_cache, train), (heldout_cache_dir(config), heldout)]
    for folder, split in folders[: 2 if len(heldout) else 1]:
        try:
            cache = HiddenStateCache(folder)
        except (FileNotFoundError, ValueError):
            return False
        if cache.layers != layers or not cache.holds(split):
            return False
    return True


def cache_ready(config: RunConfig) -> bool:
    if not config.data.feature_cache:
        return False
    try:
        HiddenStateCache(config.data.feature_cache)
    except (FileNotFoundError, ValueError):
        return False
    return True


# Small shards: progress is visible and a killed preparation loses at most one shard of work.
SHARD_TOKENS = 1 << 16
HELDOUT_CACHE = "heldout"  # sub-folder of data.feature_cache holding the held-out split's features


def heldout_cache_dir(config: RunConfig) -> Path | None:
    return Path(config.data.feature_cache) / HELDOUT_CACHE if config.data.feature_cache else None


def prepare_features(
    config: RunConfig,
    target,
    train: datasets.Dataset,
    batch_size: int = 8,
    heldout: datasets.Dataset | None = None,
) -> Path | None:
    """Cache the target's features of the training split, then of `heldout` (evaluation reads them
    instead of running the target); both resumable."""
    if not config.data.feature_cache:
        return None
    layers = feature_layers(config, target)
    data = split_data(config)
    out = cache_hidden_states(
        target,
        train,
        config.data.feature_cache,
        layers,
        shard_tokens=SHARD_TOKENS,
        batch_size=batch_size,
        data=data,
    )
    if heldout is not None and len(heldout) > 0:
        cache_hidden_states(
            target,
            heldout,
            heldout_cache_dir(config),
            layers,
            shard_tokens=SHARD_TOKENS,
            batch_size=batch_size,
            data=data,
        )
    return out


def prepare_run(
    config: RunConfig,
    source: str | Path,
    batch_size: int = 8,
    fill_cache: bool = True,
    device: str = "cpu",
    num_proc: int | None = None,
) -> Path:
    """Everything a run's workers read, once: the data splits, the resolved config (from the recipe
    `source`, OUTPUT_DIR/resolved.yaml) and the feature cache of both splits (unless `fill_cache` is
    False, e.g. a partial-cache run). The target runs on `device` in the run's train.precision (auto:
    bf16 on bf16 GPUs and on CPUs that multiply bf16 natively), in batches of `batch_size`. Returns the
    resolved config's path."""
    from transformers import AutoTokenizer

    from selfdraft.target import load_target, resolve_target_path
    from selfdraft.training.config import check_paths, resolve_precision
    from selfdraft.training.resolved import write_resolved

    check_paths(config, reads_cache=False)
    # the splits need the tokenizer only; the target loads only if it has features to compute
    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_folder(resolve_target_path(config.target)))
    train, heldout = prepare_splits(config, tokenizer, num_proc)
    resolved = write_resolved(config, source)
    if not (fill_cache and config.data.feature_cache) or features_ready(config, train, heldout):
        return resolved
    dtype = resolve_precision(config.train.precision, device)
    target, _ = load_target(config.target, dtype=dtype, device=device)
    prepare_features(config, target, train, batch_size=batch_size, heldout=heldout)  # resumable
    return resolved


def prepare_from_config(config_path: str | Path, overrides: dict | None = None, **options) -> Path:
    """`selfdraft prepare`: the recipe read (the one parse of this run's YAML, with the command
    line's `overrides`), then `prepare_run` with `options`. Returns the resolved config's path."""
    from selfdraft.training.config import load_run_config

    return prepare_run(load_run_config(config_path, overrides), config_path, **options)


def _tokenizer_folder(path: str) -> str:
    """Where the target's tokenizer is: its folder, or a PEFT adapter's base model when the adapter
    has none (as `load_target` reads it)."""
    from selfdraft.target import resolve_target_path

    adapter = Path(path) / "adapter_config.json"
    if adapter.is_file() and not (Path(path) / "tokenizer_config.json").is_file():
        return resolve_target_path(json.loads(adapter.read_text())["base_model_name_or_path"])
    return path
