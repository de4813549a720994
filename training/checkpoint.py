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
import shutil
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


def run_meta(fingerprint: str, world_size: int, precision: str | None = None) -> dict:
    """precision: the dtype train.precision resolved to (`auto` may resolve differently elsewhere)."""
    meta = {"fingerprint": fingerprint, "world_size": world_size}
    return meta if precision is None else {**meta, "precision": precision}


def check_meta(output_dir: Path, meta: dict, resume: bool) -> None:
    """On resume the stored run must match; a fresh run refuses to overwrite another run's checkpoints.

    Read-only, so every rank runs it and fails the same way before any collective call."""
    path = output_dir / RUN_FILE
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
        elif stored["fingerprint"] != meta["fingerprint"]:
            raise ResumeError(
                f"checkpoint in {output_dir} was trained with a different config (fingerprint "
                f"{stored['fingerprint']} != {meta['fingerprint']}); restore that config or use a new output_dir"
            )
        elif stored.get("precision", meta.get("precision")) != meta.get("precision"):
            raise ResumeError(
                f"checkpoint in {output_dir} was trained in {stored['precision']}, but train.precision resolves "
                f"to {meta['precision']} here; set train.precision to match it or use a new output_dir"
            )


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


def latest_tag(output_dir: Path) -> str | None:
    latest = output_dir / "checkpoints" / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    return tag if (output_dir / "checkpoints" / tag).is_dir() else None


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
