"""The training and held-out datasets of a run: sources rendered, split by `selfdraft.splits`, and the
held-out ids written next to the run. Rows: {"id": str, "input_ids": list[int], "loss_mask": list[int]}."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import datasets
from tqdm.auto import tqdm

from selfdraft.corpora import load_source
from selfdraft.splits import is_heldout
from selfdraft.training.rendering import render_records

logger = logging.getLogger(__name__)

HELDOUT_FILE = "heldout_ids.json"


def _load_sources(sources: Sequence[str | Iterable[dict]]) -> list[dict]:
    records = []
    for source in sources:
        records.extend(load_source(source) if isinstance(source, str) else source)
    return records


def rows_to_dataset(rows: list[dict]) -> datasets.Dataset:
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
        }
    )
    columns = {name: [row[name] for row in rows] for name in features}
    return datasets.Dataset.from_dict(columns, features=features)


def build_dataset(
    sources: Sequence[str | Iterable[dict]],
    tokenizer,
    max_length: int,
    seed: int,
    heldout_fraction: float,
    run_dir: str | Path,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Render every source record and split it into (train, heldout) datasets.

    sources: source spec strings (see `load_source`) or iterables of records. The held-out ids go to
    run_dir/heldout_ids.json so evaluation can check it never scores text the heads trained on. Rows
    with no loss token (e.g. an answer truncated away) are dropped; records the template cannot render
    are skipped with a warning.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    records = _load_sources(sources)
    train_rows, heldout_rows, heldout_ids = [], [], set()
    skipped: dict[str, int] = {}
    chunk = 256
    with tqdm(total=len(records), desc="render", unit="rec", mininterval=2.0) as bar:
        for at in range(0, len(records), chunk):
            batch = records[at : at + chunk]
            for record, rows in zip(batch, render_records(tokenizer, batch, max_length), strict=True):
                if isinstance(rows, str):
                    skipped[rows[:100]] = skipped.get(rows[:100], 0) + 1
                    continue
                heldout = is_heldout(record, heldout_fraction)
                if heldout:
                    heldout_ids.add(record["id"])
                # the first token is never a label, so a row needs a masked token after it
                kept = [{"id": record["id"], **row} for row in rows if any(row["loss_mask"][1:])]
                (heldout_rows if heldout else train_rows).extend(kept)
            bar.update(len(batch))
    for reason, count in skipped.items():
        logger.warning("skipped %d records: %s", count, reason)
    if not train_rows:
        raise ValueError(f"no trainable rows out of {len(records)} records")
    clash = heldout_ids & {row["id"] for row in train_rows}
    if clash:  # the id list would then name training text as held-out
        raise ValueError(
            f"{len(clash)} ids name records with different prompts, e.g. {sorted(clash)[:3]}; "
            "record ids must be unique across sources"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = {"heldout_fraction": heldout_fraction, "rule": "sha256(split_key) < fraction"}
    payload["ids"] = sorted(heldout_ids)
    tmp = run_dir / (HELDOUT_FILE + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, ensure_ascii=False))
    tmp.replace(run_dir / HELDOUT_FILE)  # atomic: a reader never sees a half-written id list
    train = rows_to_dataset(train_rows).shuffle(seed=seed).flatten_indices()
    return train, rows_to_dataset(heldout_rows)
