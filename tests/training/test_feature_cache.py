"""The offline hidden-state cache gives the same examples as the online computation."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from selfdraft.training.data.feature_cache import (
    HiddenStateCache,
    cache_hidden_states,
    compute_features,
    normalize_layers,
)

LAYERS = [0, 1, -1]


def online_features(model, example: dict) -> dict:
    """The online path for one dataset row, as the per-example dict the cache returns."""
    input_ids = torch.as_tensor(example["input_ids"], dtype=torch.long)
    computed = compute_features(model, input_ids[None], LAYERS)
    return {
        "input_ids": input_ids,
        "loss_mask": torch.as_tensor(example["loss_mask"], dtype=torch.long),
        "features": {layer: f[0] for layer, f in computed["features"].items()},
    }


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def dataset():
    g = torch.Generator().manual_seed(1)
    rows = []
    for i, length in enumerate([5, 17, 9, 30, 2, 12, 21]):
        rows.append(
            {
                "id": f"r{i}",
                "input_ids": torch.randint(0, 128, (length,), generator=g).tolist(),
                "loss_mask": torch.randint(0, 2, (length,), generator=g).tolist(),
            }
        )
    return datasets.Dataset.from_list(rows)


def _assert_same(cached: dict, online: dict):
    assert torch.equal(cached["input_ids"], online["input_ids"])
    assert torch.equal(cached["loss_mask"], online["loss_mask"])
    assert cached["features"].keys() == online["features"].keys()
    for layer, feats in online["features"].items():
        assert cached["features"][layer].dtype == torch.float32
        # fp16 storage: relative error <= 2**-11, plus padding/batching noise of the forward
        torch.testing.assert_close(cached["features"][layer], feats, rtol=2e-3, atol=2e-3)


def test_offline_cache_equals_online_features(model, dataset, tmp_path):
    cache_hidden_states(model, dataset, tmp_path, LAYERS, shard_tokens=25, batch_size=3)
    cache = HiddenStateCache(tmp_path)
    assert len(cache) == len(dataset) and cache.layers == [0, 1, 2] == normalize_layers(model, LAYERS)
    assert len(cache.index["shards"]) > 2  # several shards, batches with right padding
    for i in range(len(dataset)):
        _assert_same(cache[i], online_features(model, dataset[i]))
    # the last layer is the post-norm hidden state the lm_head reads
    logits = model(torch.tensor([dataset[3]["input_ids"]])).logits[0]
    torch.testing.assert_close(model.lm_head(cache[3]["features"][2]), logits, rtol=1e-2, atol=1e-2)
    stored = np.load(tmp_path / "shard_00000" / "features_1.npy", mmap_mode="r")
    assert isinstance(stored, np.memmap) and stored.dtype == np.float16
    with pytest.raises(IndexError):
        cache[len(dataset)]


def test_cache_resumes_skipping_finished_shards(model, dataset, tmp_path):
    cache_hidden_states(model, dataset, tmp_path, LAYERS, shard_tokens=25)
    before = [HiddenStateCache(tmp_path)[i] for i in range(len(dataset))]
    victim = tmp_path / "shard_00001"
    for f in victim.iterdir():
        f.unlink()
    victim.rmdir()
    (tmp_path / "shard_00001.tmp").mkdir()  # debris of a run killed mid-shard is replaced
    (tmp_path / "shard_00001.tmp" / "features_0.npy").write_bytes(b"garbage")
    with pytest.raises(FileNotFoundError, match="resume"):
        HiddenStateCache(tmp_path)

    calls = []
    handle = model.register_forward_hook(lambda m, args, out: calls.append(1))
    try:
        cache_hidden_states(model, dataset, tmp_path, LAYERS, shard_tokens=25)
    finally:
        handle.remove()
    assert len(calls) == 1  # only the missing shard (one batch) was recomputed
    after = HiddenStateCache(tmp_path)
    for i, item in enumerate(before):
        for layer in item["features"]:
            assert torch.equal(after[i]["features"][layer], item["features"][layer])

    with pytest.raises(ValueError, match="new feature_cache folder"):
        cache_hidden_states(model, dataset, tmp_path, [0], shard_tokens=25)
    with pytest.raises(ValueError, match="new feature_cache folder"):
        cache_hidden_states(model, dataset.select(range(3)), tmp_path, LAYERS, shard_tokens=25)


def test_layer_indices_are_checked(model):
    assert normalize_layers(model, [-1, 0, 2, 2]) == [0, 2]
    with pytest.raises(ValueError):
        normalize_layers(model, [3])


def test_dataset_fingerprint_reads_rows_in_dataset_order(dataset):
    from selfdraft.training.data.feature_cache import _lengths_and_fingerprint

    as_list = [dict(row) for row in dataset]
    assert _lengths_and_fingerprint(dataset) == _lengths_and_fingerprint(as_list)
    shuffled = dataset.shuffle(seed=3)  # an indices mapping over the same Arrow table
    lengths, fingerprint = _lengths_and_fingerprint(shuffled)
    assert lengths == [len(row["input_ids"]) for row in shuffled]
    assert (lengths, fingerprint) == _lengths_and_fingerprint([dict(row) for row in shuffled])
    assert fingerprint != _lengths_and_fingerprint(dataset)[1]


def test_online_features_skip_the_full_vocabulary_projection(model):
    """The heads train on hidden states: the target's lm_head runs on the last position only, and the
    features are those of a plain full forward."""
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    ids = torch.arange(2, 12)[None].repeat(2, 1)
    try:
        computed = compute_features(model, ids, LAYERS)["features"]
    finally:
        hook.remove()
    assert seen == [torch.Size([2, 1, 32])]
    with torch.no_grad():
        full = model(input_ids=ids, output_hidden_states=True).hidden_states
    for layer in normalize_layers(model, LAYERS):
        torch.testing.assert_close(computed[layer], full[layer], rtol=0, atol=0)
