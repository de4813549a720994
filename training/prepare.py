"""Everything a run needs before its first step: rendered data splits and the optional feature cache.

Preparation is idempotent and resumable: splits are saved under output_dir/data, the feature cache
under data.feature_cache, and both are reused by later runs and by every rank of a distributed job.
"""

from __future__ import annotations

from pathlib import Path

import datasets

from selfdraft.training.config import RunConfig
from selfdraft.training.dataset import build_dataset
from selfdraft.training.feature_cache import HiddenStateCache, cache_hidden_states, normalize_layers

DATA_DIR = "data"


def feature_layers(config: RunConfig, target) -> list[int]:
    """Hidden-state layers a run reads: the heads' inputs plus the last one (the target's logits)."""
    return normalize_layers(target, [*config.heads.feature_layers, -1])


def prepare_splits(config: RunConfig, tokenizer) -> tuple[datasets.Dataset, datasets.Dataset]:
    root = Path(config.output_dir) / DATA_DIR
    if (root / "train").is_dir() and (root / "heldout").is_dir():
        return datasets.load_from_disk(str(root / "train")), datasets.load_from_disk(str(root / "heldout"))
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
    )
    train.save_to_disk(str(root / "train.tmp"))
    heldout.save_to_disk(str(root / "heldout.tmp"))
    (root / "train.tmp").rename(root / "train")
    (root / "heldout.tmp").rename(root / "heldout")
    return train, heldout


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
    out = cache_hidden_states(
        target, train, config.data.feature_cache, layers, shard_tokens=SHARD_TOKENS, batch_size=batch_size
    )
    if heldout is not None and len(heldout) > 0:
        cache_hidden_states(
            target,
            heldout,
            heldout_cache_dir(config),
            layers,
            shard_tokens=SHARD_TOKENS,
            batch_size=batch_size,
        )
    return out
