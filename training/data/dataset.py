"""The training and held-out datasets of a run: sources rendered, split by `selfdraft.corpora.splits`, and the
held-out ids written next to the run. Rows: {"id": str, "input_ids": list[int], "loss_mask": list[int]}.

Rendering runs as `datasets.map` over an Arrow table of the records, in `num_proc` processes, so the
rendered corpus lives in Arrow (on disk when a `work_dir` is given) and never as Python lists.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import datasets
import pyarrow.compute as pc

from selfdraft.corpora.sources import load_source
from selfdraft.corpora.splits import heldout_flags, opens_heldout, split_key
from selfdraft.errors import UserError
from selfdraft.interrupts import quiet_in_workers
from selfdraft.training.data.rendering import render_records
from selfdraft.training.data.repetition import cut_record_repeats

logger = logging.getLogger(__name__)

HELDOUT_FILE = "heldout_ids.json"
NUM_PROC_ENV = "SELFDRAFT_NUM_PROC"  # the render processes when no num_proc is passed
RENDER_BATCH = 256  # records per batched tokenizer call
# Auto num_proc: a worker process costs about a second to start and receive its shard, which pays off
# only from a few thousand records on; more than 8 rarely help the tokenizer-bound render.
RECORDS_PER_PROC = 2000
MAX_AUTO_PROCS = 8

ROW_FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
    }
)
# One schema for both record shapes: the absent one of `messages` / `text` is null.
RECORD_FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "text": datasets.Value("string"),
    }
)
# One row per record: its kept token rows, its side of the split, or why it could not be rendered.
RENDERED_FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "heldout": datasets.Value("bool"),
        "skipped": datasets.Value("string"),
        "input_ids": datasets.List(datasets.List(datasets.Value("int32"))),
        "loss_mask": datasets.List(datasets.List(datasets.Value("int8"))),
    }
)


def rows_to_dataset(rows: list[dict]) -> datasets.Dataset:
    columns = {name: [row[name] for row in rows] for name in ROW_FEATURES}
    return datasets.Dataset.from_dict(columns, features=ROW_FEATURES)


def _records_dataset(
    sources: Sequence[str | Iterable[dict]], cut_repeats: int | None = None
) -> datasets.Dataset:
    """The records of every source as one Arrow table, converted source by source so only one
    source's Python records are alive at a time; with `cut_repeats`, answers lose their loops
    (`repetition.cut_record_repeats`)."""
    parts = []
    for source in sources:
        records = load_source(source) if isinstance(source, str) else list(source)
        if cut_repeats is not None:
            records = [cut_record_repeats(r, cut_repeats) for r in records]
        columns = {
            "id": [str(r["id"]) for r in records],
            "messages": [r.get("messages") for r in records],
            "text": [r.get("text") for r in records],
        }
        del records
        parts.append(datasets.Dataset.from_dict(columns, features=RECORD_FEATURES))
    if not parts:
        return datasets.Dataset.from_dict({name: [] for name in RECORD_FEATURES}, features=RECORD_FEATURES)
    return datasets.concatenate_datasets(parts)


def _heldout_keys(records: datasets.Dataset, heldout_fraction: float) -> frozenset[str]:
    """Split keys of the held-out records: the near-duplicate-free split over every source at once
    (`splits.heldout_flags`), so a copy in one source cannot sit across the split from another's."""
    rows = records.select_columns(["id", "messages", "text"]).to_list() if len(records) else []
    rows = [
        {"id": r["id"], "messages": r["messages"]}
        if r["messages"] is not None
        else {"id": r["id"], "text": r["text"]}
        for r in rows
    ]
    flags = heldout_flags(rows, heldout_fraction)
    return frozenset(split_key(r) for r, held in zip(rows, flags, strict=True) if held)


def resolve_num_proc(num_proc: int | None, records: int) -> int:
    """Render processes: `num_proc`, else $SELFDRAFT_NUM_PROC, else one per RECORDS_PER_PROC records
    up to min(usable CPUs, MAX_AUTO_PROCS). Never more than there are records."""
    if num_proc is None and os.environ.get(NUM_PROC_ENV):
        raw = os.environ[NUM_PROC_ENV]
        if not raw.isdigit():
            raise UserError(
                f"{NUM_PROC_ENV}={raw!r} is not a whole number; set it to the render processes, e.g. 4"
            )
        num_proc = int(raw)
    if num_proc is not None:
        if num_proc < 1:
            raise UserError(f"num_proc must be at least 1, got {num_proc}; pass 1 to render in this process")
        return max(1, min(num_proc, records))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, MAX_AUTO_PROCS, records // RECORDS_PER_PROC))


def _render_batch(
    batch: dict, tokenizer, max_length: int, heldout_fraction: float, heldout_keys: frozenset[str]
) -> dict:
    quiet_in_workers()
    records = [
        {"id": i, "messages": m} if m is not None else {"id": i, "text": t}
        for i, m, t in zip(batch["id"], batch["messages"], batch["text"], strict=True)
    ]
    out: dict[str, list] = {name: [] for name in RENDERED_FEATURES}
    for record, rows in zip(records, render_records(tokenizer, records, max_length), strict=True):
        held = split_key(record) in heldout_keys
        if not held and opens_heldout(record, heldout_fraction):
            # (a one-turn copy of the conversation, e.g. a self-distilled one, would be held out)
            rows = "their first exchange alone is in the held-out split; training on it would leak held-out text"
        skipped = isinstance(rows, str)
        # the first token is never a label, so a row needs a masked token after it
        kept = [] if skipped else [row for row in rows if any(row["loss_mask"][1:])]
        out["id"].append(record["id"])
        out["heldout"].append(not skipped and held)
        out["skipped"].append(rows[:100] if skipped else None)
        out["input_ids"].append([row["input_ids"] for row in kept])
        out["loss_mask"].append([row["loss_mask"] for row in kept])
    return out


def _explode(ids: list[str], input_ids: list[list], loss_mask: list[list]) -> dict:
    quiet_in_workers()
    out: dict[str, list] = {name: [] for name in ROW_FEATURES}
    for record_id, rows, masks in zip(ids, input_ids, loss_mask, strict=True):
        out["id"].extend([record_id] * len(rows))
        out["input_ids"].extend(rows)
        out["loss_mask"].extend(masks)
    return out


def _arrow_file(work_dir: Path | None, name: str) -> str | None:
    return None if work_dir is None else str(work_dir / f"{name}.arrow")


@contextmanager
def without_bars() -> Iterator[None]:
    """`datasets` progress bars off for a quick step (filters, saving), back as they were after."""
    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


def _split_rows(
    rendered: datasets.Dataset, heldout: bool, num_proc: int, work_dir: Path | None
) -> datasets.Dataset:
    """The token rows of one side of the split, in record order."""
    name = "heldout" if heldout else "train"
    with without_bars():  # a quick flag filter: its bar only adds noise to the render's
        side = rendered.filter(
            lambda flags: [flag == heldout for flag in flags],
            input_columns="heldout",
            batched=True,
            cache_file_name=_arrow_file(work_dir, f"{name}-records"),
            load_from_cache_file=False,
            new_fingerprint=f"{name}-records",
        )
    if len(side) == 0:  # `map` of an empty table would drop the columns along with the inputs
        return rows_to_dataset([])
    return side.map(
        _explode,
        batched=True,
        input_columns=["id", "input_ids", "loss_mask"],
        remove_columns=side.column_names,
        features=ROW_FEATURES,
        num_proc=num_proc if num_proc > 1 else None,
        cache_file_name=_arrow_file(work_dir, f"{name}-rows"),
        load_from_cache_file=False,
        new_fingerprint=f"{name}-rows",
        desc=f"{name} rows",
    )


def build_dataset(
    sources: Sequence[str | Iterable[dict]],
    tokenizer,
    max_length: int,
    seed: int,
    heldout_fraction: float,
    run_dir: str | Path,
    num_proc: int | None = None,
    work_dir: str | Path | None = None,
    cut_repeats: int | None = None,
    train_tokens: int | None = None,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Render every source record and split it into (train, heldout) datasets.

    sources: source spec strings (see `load_source`) or iterables of records. The held-out ids go to
    run_dir/heldout_ids.json so evaluation can check it never scores text the heads trained on. Rows
    with no loss token (e.g. an answer truncated away) are dropped; records the template cannot render
    are skipped with a warning. num_proc: render processes (see `resolve_num_proc`); the result does
    not depend on it. work_dir: an empty folder for the Arrow files of the rendered data (kept in
    memory when None); the returned datasets read from it, so keep it until they are saved.
    cut_repeats: cut generated loops out of assistant turns (see `repetition.cut_repeats`).
    train_tokens: keep the shuffled training rows that fit this token budget (`rows_within`); the
    held-out split does not depend on it.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    records = _records_dataset(sources, cut_repeats)
    procs = resolve_num_proc(num_proc, len(records))
    work = Path(work_dir) if work_dir is not None else None
    if work is not None:
        work.mkdir(parents=True, exist_ok=True)
    rendered = records.map(
        _render_batch,
        batched=True,
        batch_size=RENDER_BATCH,
        num_proc=procs if procs > 1 else None,
        remove_columns=records.column_names,
        features=RENDERED_FEATURES,
        fn_kwargs={
            "tokenizer": tokenizer,
            "max_length": max_length,
            "heldout_fraction": heldout_fraction,
            "heldout_keys": _heldout_keys(records, heldout_fraction),
        },
        cache_file_name=_arrow_file(work, "rendered"),
        load_from_cache_file=False,
        new_fingerprint="rendered",  # a given fingerprint spares hashing the tokenizer
        desc="render",
    )
    status = rendered.select_columns(["id", "heldout", "skipped"]).to_dict()
    row_counts = pc.list_value_length(rendered.data.column("input_ids")).to_pylist() if len(rendered) else []
    for reason, count in Counter(r for r in status["skipped"] if r is not None).items():
        logger.warning("skipped %d records: %s", count, reason)
    heldout_ids = {i for i, held in zip(status["id"], status["heldout"], strict=True) if held}
    trained_ids = {
        i
        for i, held, reason, n in zip(
            status["id"], status["heldout"], status["skipped"], row_counts, strict=True
        )
        if not held and reason is None and n > 0
    }
    if not trained_ids:
        raise ValueError(f"no trainable rows out of {len(records)} records")
    clash = heldout_ids & trained_ids
    if clash:  # the id list would then name training text as held-out
        raise ValueError(
            f"{len(clash)} ids name records with different prompts, e.g. {sorted(clash)[:3]}; "
            "record ids must be unique across sources"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "heldout_fraction": heldout_fraction,
        "rule": "sha256(split_key) < fraction, unless a near-duplicate (first user turn) is trained on",
    }
    payload["ids"] = sorted(heldout_ids)
    tmp = run_dir / (HELDOUT_FILE + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, ensure_ascii=False))
    tmp.replace(run_dir / HELDOUT_FILE)  # atomic: a reader never sees a half-written id list
    train = _split_rows(rendered, False, procs, work)
    train = train.shuffle(seed=seed, indices_cache_file_name=_arrow_file(work, "train-order"))
    with without_bars():
        train = train.flatten_indices(cache_file_name=_arrow_file(work, "train-shuffled"))
    if train_tokens is not None:  # after flattening, the table's row order is the shuffled order
        lengths = pc.list_value_length(train.data.column("input_ids")).to_pylist()
        train = train.select(range(rows_within(lengths, train_tokens)))  # a contiguous slice, no copy
    return train, _split_rows(rendered, True, procs, work)


def rows_within(lengths: Sequence[int], budget: int) -> int:
    """How many leading rows fit `budget` tokens: n with sum(lengths[:n]) <= budget, at least one
    row so that a budget smaller than the first row still trains."""
    total = 0
    for n, length in enumerate(lengths):
        total += length
        if total > budget:
            return max(n, 1)
    return len(lengths)
