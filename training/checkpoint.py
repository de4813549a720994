"""Checkpoints of a training run: DeepSpeed state for resume plus a consolidated heads export.

Layout of output_dir:
  run.json            what the run is (config fingerprint, world size) - resume refuses a mismatch
  checkpoints/<tag>/  DeepSpeed engine state (written by engine.save_checkpoint; `latest` names the tag)
  heads/              the latest consolidated heads in `save_heads` format (loads in SelfDraftModel),
                      always float32 safetensors: a bf16 run's bf16 working weights, upcast exactly
  log.jsonl           one JSON record per logged step / evaluation
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import torch

from selfdraft.errors import UserError
from selfdraft.heads.folder import save_heads
from selfdraft.training import locks

RUN_FILE = "run.json"


class ResumeError(UserError, RuntimeError):
    """A run folder that cannot be resumed as asked (another config, world size or precision)."""


def run_meta(
    fingerprint: str, world_size: int, precision: str | None = None, settings: dict | None = None
) -> dict:
    """precision: the dtype train.precision resolved to (`auto` may resolve differently elsewhere);
    settings: `RunConfig.settings()`, what a resume must share (runs started before it was kept
    compare the fingerprint, which also covers the budget)."""
    meta = {"fingerprint": fingerprint, "world_size": world_size}
    if precision is not None:
        meta["precision"] = precision
    if settings is not None:
        meta["settings"] = settings
    return meta


def changed_settings(stored: dict, now: dict) -> list[str]:
    """`key: then -> now` for each setting that differs between a run's checkpoint and this config."""
    return [
        f"{key}: {stored.get(key)!r} -> {now.get(key)!r}"
        for key in sorted(stored.keys() | now.keys())
        if stored.get(key) != now.get(key)
    ]


def check_resumable(output_dir: Path) -> None:
    """--resume needs a run in `output_dir` (its run.json), or it is refused naming the folder."""
    if not (output_dir / RUN_FILE).is_file():
        raise ResumeError(
            f"--resume: {output_dir} holds no run to continue (no {RUN_FILE}); drop --resume to start it, "
            "or pass the output_dir of the run to continue"
        )


def check_meta(output_dir: Path, meta: dict, resume: bool) -> None:
    """On resume the stored run must match; a fresh run refuses to overwrite another run's checkpoints.

    Read-only, so every rank runs it and fails the same way before any collective call."""
    path = output_dir / RUN_FILE
    if resume:
        check_resumable(output_dir)
    if path.is_file():
        stored = json.loads(path.read_text())
        if not resume:
            if latest_tag(output_dir):
                raise ResumeError(
                    f"{output_dir} already holds checkpoints; pass --resume to continue it or use a new output_dir"
                )
        elif stored["world_size"] != meta["world_size"]:
            raise ResumeError(
                f"checkpoint in {output_dir} was written by {stored['world_size']} processes, this job has "
                f"{meta['world_size']}; resume with --nproc {stored['world_size']} or start a new output_dir"
            )
        elif "settings" in stored and "settings" in meta and stored["settings"] != meta["settings"]:
            changed = "; ".join(changed_settings(stored["settings"], meta["settings"]))
            raise ResumeError(
                f"checkpoint in {output_dir} was trained with a different config ({changed}); restore "
                "it or use a new output_dir (a resume may change only train.max_steps, epochs and max_minutes)"
            )
        elif "settings" not in stored and stored["fingerprint"] != meta["fingerprint"]:
            raise ResumeError(
                f"checkpoint in {output_dir} was trained with a different config (fingerprint "
                f"{stored['fingerprint']} != {meta['fingerprint']}; a run started before selfdraft kept its "
                "settings cannot change its budget either); restore that config or use a new output_dir"
            )
        elif stored.get("precision", meta.get("precision")) != meta.get("precision"):
            raise ResumeError(
                f"checkpoint in {output_dir} was trained in {stored['precision']}, but train.precision resolves "
                f"to {meta['precision']} here; set train.precision to match it or use a new output_dir"
            )


def read_meta(output_dir: Path) -> dict | None:
    path = output_dir / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_meta(output_dir: Path, meta: dict) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / RUN_FILE).write_text(json.dumps(meta, indent=1))


def write_rank_report(output_dir: Path, rank: int, world: int, step: int, heads, zero_stage: int = 0) -> None:
    """Each rank's view at the end of a run: world size, step, and a digest of its head parameters
    (equal digests on every rank = the data-parallel replicas stayed in sync). Collective under ZeRO-3
    (the digest is of the gathered parameters)."""
    digest = hashlib.sha256()
    with gathered(heads, zero_stage):
        for name, tensor in sorted(heads.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor_bytes(tensor))
    folder = output_dir / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    report = {"rank": rank, "world_size": world, "step": step, "params_sha256": digest.hexdigest()}
    (folder / f"rank{rank}.json").write_text(json.dumps(report))


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's raw bytes in its own dtype (numpy has no bfloat16, so 16-bit floats go as int16)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


@contextmanager
def gathered(heads, zero_stage: int):
    """Full parameters inside the block on every rank (ZeRO-3 partitions them; a collective call)."""
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(heads.parameters()), modifier_rank=None):
            yield
    else:
        yield


LATEST = "latest"  # DeepSpeed's file naming the newest tag; selfdraft writes it itself (`mark_latest`)


def _stored_world(output_dir: Path) -> int | None:
    meta = read_meta(output_dir)
    return int(meta["world_size"]) if meta else None


def checkpoint_whole(folder: Path, world: int | None) -> bool:
    """Whether a DeepSpeed tag folder holds a finished save of every rank: each `*.pt` file a complete
    zip (torch.save's format; a write cut short lacks the zip's closing directory), the model states,
    and one file per rank (`world`) of each per-rank kind (ZeRO's `..._zero_pp_rank_R_...` files).

    DeepSpeed writes `latest` on rank 0 before its final barrier, so a kill in that window leaves
    `latest` naming a tag whose other ranks' files are missing or half written."""
    files = list(folder.glob("*.pt")) if folder.is_dir() else []
    if not any(f.name.endswith("_model_states.pt") for f in files):  # ZeRO-3: one per rank
        return False
    if not all(zipfile.is_zipfile(f) for f in files):
        return False
    kinds: dict[str, set[int]] = {}
    for f in files:
        match = re.match(r"(.*zero_pp_rank_)(\d+)(_.*)", f.name)
        if match:
            kinds.setdefault(match.group(1) + "R" + match.group(3), set()).add(int(match.group(2)))
    return world is None or all(ranks == set(range(world)) for ranks in kinds.values())


def latest_tag(output_dir: Path) -> str | None:
    """The tag a resume loads: the one `latest` names when that save is whole (`checkpoint_whole`),
    else the newest whole one; None without any."""
    root = output_dir / "checkpoints"
    world = _stored_world(output_dir)
    latest = root / LATEST
    named = latest.read_text().strip() if latest.is_file() else None
    if named and checkpoint_whole(root / named, world):
        return named
    whole = [p.name for p in sorted(root.glob("step-*")) if checkpoint_whole(p, world)]
    return whole[-1] if whole else None


def resumable_heads(output_dir: Path) -> Path | None:
    """The run's own heads export when its folder holds a whole checkpoint to resume: a resume builds
    its heads from it (their shape; the checkpoint brings the weights), so it no longer needs the
    heads.init_from folder the run started from (a published stage may have replaced it)."""
    heads = Path(output_dir) / "heads"
    return heads if latest_tag(Path(output_dir)) and (heads / "config.json").is_file() else None


def mark_latest(output_dir: Path, tag: str) -> None:
    """Name `tag` in `latest` (atomically), once every rank has finished writing it."""
    root = output_dir / "checkpoints"
    tmp = root / f"{LATEST}.tmp"
    tmp.write_text(tag)
    tmp.replace(root / LATEST)


def prune_checkpoints(output_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoint tags (never the one `latest` names)."""
    root = output_dir / "checkpoints"
    current = latest_tag(output_dir)
    tags = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in tags[:-keep] if keep > 0 else []:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)


def export_heads(
    engine, heads, output_dir: Path, rank: int, zero_stage: int, dest: Path | None = None
) -> Path | None:
    """Write the consolidated heads to `dest` (default: the run's heads/; every rank joins the gather
    under ZeRO-3, rank 0 writes)."""
    dest = dest or output_dir / "heads"
    with gathered(heads, zero_stage):
        if rank == 0:
            _atomic_save(heads, dest)
    return dest if rank == 0 else None


def _atomic_save(heads, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_heads(heads, tmp, dtype=torch.float32)  # one format whatever the run's precision
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)


# A checkpoint holds, per head parameter, the 16-bit or fp32 weight, fp32 master weights and Adam's two
# fp32 moments; the heads/ export adds one fp32 copy. 20 bytes per parameter bounds both from above.
CHECKPOINT_BYTES_PER_PARAM = 20


def checkpoint_bytes(heads) -> int:
    """Upper bound of the disk space one save (checkpoint tag + heads/ export) needs."""
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in heads.parameters())  # ZeRO-3: full size
    return CHECKPOINT_BYTES_PER_PARAM * numel


def _no_space(needed: int, folder: Path, free: int) -> UserError:
    return UserError(
        f"no space left on the device of {folder}: a checkpoint needs ~{needed / 1e6:.0f} MB, "
        f"{free / 1e6:.0f} MB are free; free some space (or lower schedule.keep_checkpoints) and resume"
    )


def save_with_space_check(save, output_dir: Path, tag: str, needed: int) -> None:
    """Run `save()` (DeepSpeed's save_checkpoint + the heads export) only if `needed` bytes are free;
    if the disk fills up anyway, remove the partial tag so `--resume` never meets a truncated file."""
    free = shutil.disk_usage(output_dir).free
    if free < needed:
        raise _no_space(needed, output_dir, free)
    try:
        save()
    except (OSError, RuntimeError) as err:
        message = str(err)
        if getattr(err, "errno", None) != errno.ENOSPC and "No space" not in message and "iostream" not in message:
            raise
        shutil.rmtree(output_dir / "checkpoints" / tag, ignore_errors=True)
        raise _no_space(needed, output_dir, shutil.disk_usage(output_dir).free) from err


WRITER_LOCK = "writer.lock"


def hold_run_lock(output_dir: Path) -> IO:
    """Make this process the run folder's only writer for as long as it lives; returns the open lock
    file (keep a reference). A second live writer (a `--resume` while the first run still trains) is
    refused with the holder named."""
    return locks.acquire(output_dir / WRITER_LOCK, wait=False, what=str(output_dir))
