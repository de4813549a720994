"""Target features for head training: computed online, or cached once on disk and memory-mapped.

Both paths produce the same per-example dict, so a training loop cannot tell them apart:
  {"input_ids": LongTensor[T], "loss_mask": LongTensor[T], "features": {layer: FloatTensor[T, h]}}
`layer` indexes `output_hidden_states`: 0 is the embedding output, L (num_hidden_layers) the post-norm
last hidden state. The cache stores features in fp16, so the two paths agree up to fp16 rounding; a bf16
target's features convert to fp16 exactly within fp16's normal range (|x| in [6.1e-5, 65504]; larger
values are refused). Online features stay in the target's dtype on its device; the cache reader returns
features in the dtype it is asked for (the heads' compute dtype in training).

Layout of out_dir: index.json (the shard plan, written first) and one folder per shard with
input_ids.npy (int32 [N]), loss_mask.npy (uint8 [N]), offsets.npy (int64 [n+1]) and
features_{layer}.npy (fp16 [N, h]) for the n examples (N tokens) of that shard, concatenated.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch
from tqdm.auto import tqdm

from selfdraft import kv
from selfdraft.errors import MissingFileError, UserError
from selfdraft.heads.config import normalize_layers
from selfdraft.training import locks

INDEX_FILE = "index.json"
CACHE_VERSION = 2  # 2: no stored target top-k


@torch.no_grad()
def compute_features(
    model,
    input_ids: torch.Tensor,
    layers: Sequence[int],
    attention_mask: torch.Tensor | None = None,
) -> dict:
    """One frozen-target forward. input_ids: [B, T] -> {"features": {layer: [B, T, h]}}.

    Features keep the target's dtype and stay on its device (no copy: training feeds them to the heads
    there).
    """
    layers = normalize_layers(model, layers)
    device = next(model.parameters()).device
    out = model(
        input_ids=input_ids.to(device),
        attention_mask=None if attention_mask is None else attention_mask.to(device),
        output_hidden_states=True,
        use_cache=False,
        # the features are hidden states; the full [B, T, V] projection (V = 49k for SmolLM2) would be
        # about a fifth of the pass's multiply-adds
        **kv.last_logits_kwargs(model),
    )
    return {"features": {layer: out.hidden_states[layer] for layer in layers}}


def _plan_shards(lengths: list[int], shard_tokens: int) -> list[dict]:
    """Consecutive examples grouped until a shard holds >= shard_tokens tokens (deterministic)."""
    shards, start, tokens = [], 0, 0
    for i, length in enumerate(lengths):
        tokens += length
        if tokens >= shard_tokens or i == len(lengths) - 1:
            shards.append({"name": f"shard_{len(shards):05d}", "start": start, "count": i + 1 - start})
            shards[-1]["tokens"] = tokens
            start, tokens = i + 1, 0
    return shards


def _token_arrays(dataset) -> Iterator[np.ndarray]:
    """input_ids of each row as int32 arrays; a `datasets.Dataset` is read through Arrow in batches
    (a Python list per token would cost GBs on a full training set)."""
    if hasattr(dataset, "with_format"):
        for table in dataset.with_format("arrow").iter(batch_size=4096):
            column = table.column("input_ids").combine_chunks()
            flat = column.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
            yield from np.split(flat, np.cumsum(pc.list_value_length(column).to_numpy())[:-1])
    else:
        for row in dataset:
            yield np.asarray(row["input_ids"], dtype=np.int32)


def _lengths_and_fingerprint(dataset) -> tuple[list[int], str]:
    lengths, digest = [], hashlib.sha256()
    for ids in _token_arrays(dataset):
        lengths.append(int(ids.size))
        digest.update(np.int64(ids.size).tobytes())
        digest.update(ids.tobytes())
    return lengths, digest.hexdigest()


def _write_shard(model, rows: list[dict], layers: list[int], dest: Path, batch_size: int):
    """Compute one shard in memory and write it to dest via a temporary folder (atomic rename)."""
    per_row: list[dict[str, np.ndarray]] = [{} for _ in rows]
    # batches of similar lengths waste little compute on padding; results go back to dataset order
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    for b in range(0, len(order), batch_size):
        batch = order[b : b + batch_size]
        width = max(len(rows[i]["input_ids"]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for j, i in enumerate(batch):  # right padding: causal attention leaves real positions untouched
            ids[j, : len(rows[i]["input_ids"])] = torch.as_tensor(rows[i]["input_ids"])
            attention[j, : len(rows[i]["input_ids"])] = 1
        computed = compute_features(model, ids, layers, attention)
        for j, i in enumerate(batch):
            n, out = len(rows[i]["input_ids"]), per_row[i]
            for layer, feats in computed["features"].items():
                half = feats[j, :n].to("cpu", torch.float16)
                if not torch.isfinite(half).all():
                    raise OverflowError(f"layer {layer} features overflow fp16; cache another layer")
                out[f"features_{layer}"] = half.numpy()
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lengths = [len(r["input_ids"]) for r in rows]
    np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    np.save(tmp / "input_ids.npy", np.concatenate([np.asarray(r["input_ids"], dtype=np.int32) for r in rows]))
    np.save(tmp / "loss_mask.npy", np.concatenate([np.asarray(r["loss_mask"], dtype=np.uint8) for r in rows]))
    for name in per_row[0]:
        np.save(tmp / f"{name}.npy", np.concatenate([out[name] for out in per_row], axis=0))
    tmp.rename(dest)  # a shard folder exists only once every file in it is complete


def cache_hidden_states(
    model,
    dataset,
    out_dir: str | Path,
    layers: Sequence[int],
    shard_tokens: int = 1 << 17,
    batch_size: int = 8,
    data: dict | None = None,
) -> Path:
    """Run the frozen target over `dataset` (rows with input_ids, loss_mask) and cache its features.

    A shard is built in memory: shard_tokens x len(layers) x hidden_size fp16 values (the default 131k
    tokens is ~0.45 GB for SmolLM2 with 3 layers, ~3.2 GB for an 8B target). Resumable: the shard plan
    is fixed in index.json before any work, finished shards are skipped, and a rerun over a different
    dataset or layer set refuses to mix caches. data: what the dataset was built from (the run's
    split fingerprint), kept in the index so a cache read for other data can say what differs.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    layers = normalize_layers(model, layers)
    lengths, fingerprint = _lengths_and_fingerprint(dataset)
    index = {
        "version": CACHE_VERSION,
        "layers": layers,
        "hidden_size": model.config.hidden_size,
        "num_examples": len(lengths),
        "dataset_fingerprint": fingerprint,
        "target": getattr(model.config, "_name_or_path", ""),
        "shards": _plan_shards(lengths, shard_tokens),
    } | ({"data": data} if data is not None else {})
    index_path = out_dir / INDEX_FILE
    if index_path.exists():
        old = json.loads(index_path.read_text())
        if "data" not in old or "data" not in index:  # a cache from before the index kept its data
            old.pop("data", None)
            index.pop("data", None)
        if old != index:
            changed = ", ".join(sorted(k for k in old.keys() | index.keys() if old.get(k) != index.get(k)))
            raise UserError(
                f"{out_dir} holds a cache of other data or layers ({changed} differ); use a new "
                "feature_cache folder"
            )
    else:
        index_path.write_text(json.dumps(index, indent=1))
    with locks.held(out_dir / "writer.lock", wait=False, what=str(out_dir)):  # one filler per cache
        return _fill_shards(model, dataset, out_dir, index, lengths, layers, batch_size)


def _fill_shards(model, dataset, out_dir: Path, index: dict, lengths, layers, batch_size):
    for stale in out_dir.glob("*.tmp"):  # half-written shards of a killed writer
        shutil.rmtree(stale, ignore_errors=True)
    todo = [s for s in index["shards"] if not (out_dir / s["name"]).is_dir()]
    with tqdm(total=sum(lengths), desc="cache features", unit="tok", unit_scale=True) as bar:
        bar.update(sum(lengths) - sum(s["tokens"] for s in todo))
        for shard in todo:
            rows = [dataset[i] for i in range(shard["start"], shard["start"] + shard["count"])]
            _write_shard(model, rows, layers, out_dir / shard["name"], batch_size)
            bar.update(shard["tokens"])
    return out_dir


class HiddenStateCache(torch.utils.data.Dataset):
    """Map-style reader of a cache; each item is the per-example dict of the module docstring.

    allow_partial: read only the shards finished so far (the dataset was shuffled before caching, so
    any set of shards is a random subset). Otherwise a missing shard is an error.
    dtype: the dtype features are returned in (stored fp16; training asks for the heads' compute dtype).
    """

    def __init__(
        self,
        out_dir: str | Path,
        allow_partial: bool = False,
        dtype: torch.dtype = torch.float32,
        only: Sequence[str] | None = None,
    ):
        self.root = Path(out_dir)
        self.dtype = dtype
        index_path = self.root / INDEX_FILE
        if not index_path.is_file():
            raise MissingFileError(f"{self.root} holds no feature cache ({INDEX_FILE} missing)")
        self.index = json.loads(index_path.read_text())
        shards = self.index["shards"]
        missing = [s["name"] for s in shards if not (self.root / s["name"]).is_dir()]
        if missing and not allow_partial:
            raise MissingFileError(
                f"{self.root}: {len(missing)} shards not written yet; rerun cache_hidden_states to resume"
            )
        if only is not None:  # a resumed partial-cache run reads the shards it started with, no more
            gone = sorted(set(only) & set(missing) | set(only) - {s["name"] for s in shards})
            if gone:
                raise MissingFileError(
                    f"{self.root}: shards {', '.join(gone)}, which this run trained on, are gone; restore "
                    "them or start a new output_dir"
                )
            missing = [s["name"] for s in shards if s["name"] not in set(only)]
        self._shards = [k for k, s in enumerate(shards) if s["name"] not in set(missing)]
        if not self._shards:
            raise MissingFileError(f"{self.root}: no finished shard yet")
        self.layers: list[int] = self.index["layers"]
        # global index over the finished shards only: shard k's examples start at _starts[pos]
        counts = [shards[k]["count"] for k in self._shards]
        self._starts = [sum(counts[:pos]) for pos in range(len(counts))]
        self._length = sum(counts)
        self.num_tokens = sum(shards[k]["tokens"] for k in self._shards)
        self._open: dict[int, dict[str, np.ndarray]] = {}

    def __len__(self) -> int:
        return self._length

    @property
    def shard_names(self) -> list[str]:
        """The shards this reader serves (a partial cache: those finished when it was opened)."""
        return [self.index["shards"][k]["name"] for k in self._shards]

    def holds(self, dataset) -> bool:
        """Whether this cache was computed from exactly `dataset`'s token rows, in its order."""
        return self.index["dataset_fingerprint"] == _lengths_and_fingerprint(dataset)[1]

    def differences(self, dataset, data: dict | None = None) -> list[str]:
        """What sets this cache apart from `dataset` (data: what that split was built from, as the
        index's "data"); empty when the cache was computed from exactly its token rows, in order."""
        lengths, fingerprint = _lengths_and_fingerprint(dataset)
        if fingerprint == self.index["dataset_fingerprint"]:
            return []
        theirs = self.index.get("data") or {}
        out = [
            f"data.{key}: {theirs.get(key)!r} in the cache, {data.get(key)!r} in this run"
            for key in sorted(theirs.keys() | (data or {}).keys())
            if theirs and data is not None and theirs.get(key) != data.get(key)
        ]
        count = self.index["num_examples"]
        if count != len(lengths):
            return out + [f"{count} examples in the cache, {len(lengths)} in this run's training split"]
        return out + [f"the cache's {count} examples hold other tokens than this run's training split"]

    def _shard(self, k: int) -> dict[str, np.ndarray]:
        if k not in self._open:  # mmap: only the pages an example touches are read
            folder = self.root / self.index["shards"][k]["name"]
            self._open[k] = {p.stem: np.load(p, mmap_mode="r") for p in folder.glob("*.npy")}
        return self._open[k]

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(i)
        pos = bisect.bisect_right(self._starts, i) - 1
        arrays = self._shard(self._shards[pos])
        local = i - self._starts[pos]
        lo, hi = int(arrays["offsets"][local]), int(arrays["offsets"][local + 1])

        def take(name: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.array(arrays[name][lo:hi])).to(dtype)

        item = {
            "input_ids": take("input_ids", torch.long),
            "loss_mask": take("loss_mask", torch.long),
            "features": {layer: take(f"features_{layer}", self.dtype) for layer in self.layers},
        }
        return item
