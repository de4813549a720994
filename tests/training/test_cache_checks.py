"""A run reads only the feature cache of its own training split: a cache of other data is refused
naming what differs (partial caches too), a resumed partial-cache run reads the shards it started
with, and `selfdraft train` does not load the target only to find the cache complete."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

from selfdraft.errors import UserError


def _cached_run(text_run, tmp_path, name: str, **data):
    """A run config of the tiny target whose data.feature_cache is tmp_path/features."""
    path = text_run(data={"feature_cache": str(tmp_path / "features"), **data})
    config = yaml.safe_load(path.read_text())
    config["output_dir"] = str(tmp_path / name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _examples(path, stored=None):
    """What the worker trains on for the config at `path` (its splits built as the worker builds them)."""
    from selfdraft.target import load_target
    from selfdraft.training.config import load_run_config
    from selfdraft.training.data.prepare import feature_layers, prepare_splits
    from selfdraft.training.train import training_examples

    config = load_run_config(path)
    target, tokenizer = load_target(config.target)
    train, _ = prepare_splits(config, tokenizer)
    return training_examples(config, train, feature_layers(config, target), torch.float32, stored)


@pytest.mark.parametrize("partial", [False, True])
def test_a_cache_of_another_split_is_refused_naming_what_differs(tmp_path, text_run, partial):
    from selfdraft.training.data.prepare import prepare_from_config

    first = _cached_run(text_run, tmp_path, "first", heldout_fraction=0.1)
    prepare_from_config(str(first))
    own = len(_examples(first))  # its own cache is read

    # same cache, another held-out fraction: most of its held-out rows are in the cache's training rows
    second = _cached_run(text_run, tmp_path, "second", heldout_fraction=0.3, partial_cache=partial)
    with pytest.raises(UserError, match=r"was built from other data") as err:
        _examples(second)
    message = str(err.value)
    assert "data.heldout_fraction: 0.1 in the cache, 0.3 in this run" in message
    counts = re.search(r"(\d+) examples in the cache, (\d+) in this run's training split", message)
    assert counts and int(counts.group(1)) == own > int(counts.group(2))
    assert "\n" not in message


def test_a_resumed_partial_cache_run_reads_the_shards_it_started_with(tmp_path, text_run):
    """More shards finish while a partial-cache run trains; its resume must draw the same sample
    order, so it reads the shards recorded in run.json, not the larger set now on disk."""
    from selfdraft.target import load_target
    from selfdraft.training.config import load_run_config
    from selfdraft.training.data.feature_cache import cache_hidden_states
    from selfdraft.training.data.prepare import feature_layers, prepare_splits, split_data
    from selfdraft.training.train import record_run

    path = _cached_run(text_run, tmp_path, "run", partial_cache=True)
    config = load_run_config(path)
    target, tokenizer = load_target(config.target)
    train, _ = prepare_splits(config, tokenizer)
    folder = tmp_path / "features"
    layers = feature_layers(config, target)
    cache_hidden_states(target, train, folder, layers, shard_tokens=300, data=split_data(config))
    shards = sorted(p.name for p in folder.glob("shard_*"))
    assert len(shards) >= 3
    parked = tmp_path / "parked"
    parked.mkdir()
    for name in shards[2:]:  # only two shards finished when the run started
        (folder / name).rename(parked / name)
    started = _examples(path)
    assert started.shard_names == shards[:2]
    record_run(config, {"fingerprint": "f", "world_size": 1}, started, rank=0)  # what the worker keeps
    stored = json.loads((tmp_path / "run" / "run.json").read_text())
    for name in shards[2:]:  # then the others finished
        (parked / name).rename(folder / name)
    assert len(_examples(path)) > len(started)  # a new run reads them all
    resumed = _examples(path, stored=stored)
    assert resumed.shard_names == started.shard_names and len(resumed) == len(started)
    assert all(torch.equal(resumed[i]["input_ids"], started[i]["input_ids"]) for i in range(len(started)))
    (folder / shards[0]).rename(parked / shards[0])
    with pytest.raises(UserError, match=rf"shards {shards[0]}, which this run trained on, are gone"):
        _examples(path, stored=stored)


def test_train_does_not_load_the_target_to_find_the_cache_complete(tmp_path, text_run, monkeypatch):
    """The launcher prepares before torchrun starts: with the cache already complete for these splits
    it needs the tokenizer only; a cache still to fill does load the target."""
    import selfdraft.target
    from selfdraft.training.data.prepare import prepare_from_config

    path = _cached_run(text_run, tmp_path, "run")
    loads = []
    real = selfdraft.target.load_target
    monkeypatch.setattr(selfdraft.target, "load_target", lambda *a, **k: loads.append(a) or real(*a, **k))
    prepare_from_config(str(path))
    assert len(loads) == 1 and (tmp_path / "features" / "index.json").is_file()
    prepare_from_config(str(path))
    assert len(loads) == 1  # complete and of these rows: not loaded again
    for shard in (tmp_path / "features").glob("shard_*"):  # a shard lost: the target must fill it
        shard.rename(tmp_path / shard.name)
        break
    prepare_from_config(str(path))
    assert len(loads) == 2
