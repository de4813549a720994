"""Where a command writes: never over its own inputs, never over a user's files, never half-written.

Every command that writes a folder or a file (publish, convert, export, generate --out, bench and
compare reports, distill's row log, tune's tree file) goes through
here, so the rules are the same everywhere and are checked before any model loads:

- a destination equal to or inside one of the command's sources is refused (publishing into the run
  folder would replace its checkpoints; exporting a heads folder onto itself would replace its weights);
- a destination that exists and is not empty is refused unless the user passed --overwrite; then the
  command replaces only the names it owns (a heads folder's config, weights, card...), never the
  user's other files;
- the output is written into a temporary folder (or file) beside the destination and renamed into
  place, so an interrupted or failed command (Ctrl-C, a full disk) leaves the destination as it was
  and no temporary left behind;
- a folder that cannot be written (read-only, a file where a folder should be) is named up front.

Files written are mode 0644 and folders 0755, like any checkpoint one downloads (safetensors and
`tempfile` create 0600 / 0700).
"""

from __future__ import annotations

import errno
import fnmatch
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from selfdraft.errors import UserError

FILE_MODE = 0o644
FOLDER_MODE = 0o755

# What a heads folder (ours: `save_heads` + `publish`) may hold: a command writing one owns these names.
HEADS_FOLDER_NAMES = (
    "config.json",
    "model.safetensors",
    "tree.yaml",
    "README.md",
    "stages.json",
    "training_config.yaml",
    "training_config.stage*.yaml",
    "studies",
)
# What `export` writes for vLLM / SGLang.
ENGINE_FOLDER_NAMES = ("config.json", "model.safetensors")
# What `bench` and `compare` write into a report folder, which may hold the user's other files.
BENCH_REPORT_NAMES = ("bench.json", "bench.md", "*.png", "vllm-drafts")
COMPARE_REPORT_NAMES = ("compare.md", "compare.png", "scaling.png")

OVERWRITE_HINT = "pass --overwrite to replace its {what} (other files stay)"


def _resolved(path: str | Path) -> Path:
    return Path(os.path.abspath(os.path.expanduser(str(path)))).resolve()


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _writable_ancestor(path: Path, option: str) -> Path:
    """The nearest existing folder above `path`; refused when it is a file or cannot be written."""
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"{option} {path}: {folder} is a file, not a folder; choose another destination")
    check_writable(folder, option)
    return folder


def check_writable(folder: Path, option: str) -> None:
    """Refuse a folder this process cannot create files in (read-only file system or permissions).

    Tries it (a temporary file, removed at once): permission bits alone say nothing for root, and a
    read-only mount shows in no permission bit."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".selfdraft-probe-")
    except OSError as err:
        raise UserError(
            f"{option}: cannot write into {folder} ({err.strerror}); choose a writable folder"
        ) from err
    os.close(fd)
    os.unlink(probe)


def check_destination(
    dest: str | Path,
    sources: Sequence[str | Path] = (),
    *,
    overwrite: bool = False,
    owned: Sequence[str] = HEADS_FOLDER_NAMES,
    option: str = "--dest",
    is_file: bool = False,
    creates_folder: bool = False,
    shared_folder: bool = False,
) -> Path:
    """Check `dest` before any work; return it resolved. Refused (UserError, naming the fix) when it is
    or lies inside a source, exists and is not empty (unless `overwrite`), is the wrong kind (a file
    where a folder goes, or the reverse), or cannot be written. A file destination's folder must exist
    (a typo in it should not create folders); a folder destination's missing parents are created later.

    sources: the command's inputs (files or folders); owned: the names an overwrite may replace;
    creates_folder: the command creates a file destination's missing folders itself;
    shared_folder: the folder may hold the user's other files (a report folder): only one of the
    `owned` names already there is refused without `overwrite`."""
    path = _resolved(dest)
    for source in sources:
        src = _resolved(source)
        if path == src or (src.is_dir() and _inside(path, src)):
            where = "is" if path == src else "lies inside"
            raise UserError(
                f"{option} {dest} {where} the input {source}, which writing it would destroy; "
                "choose a destination outside the inputs"
            )
    if is_file:
        if path.is_dir():
            raise UserError(f"{option} {dest} is a folder; name a file to write")
        if path.exists() and path.stat().st_size > 0 and not overwrite:
            raise UserError(f"{option} {dest} exists; choose a new file, or pass --overwrite to replace it")
        if path.parent.is_dir():
            check_writable(path.parent, option)
        elif creates_folder:
            _writable_ancestor(path.parent, option)
        else:
            raise UserError(f"{option} {dest}: the folder {path.parent} does not exist; create it first")
        return path
    if path.exists() and not path.is_dir():
        raise UserError(f"{option} {dest} is a file; name a folder to write")
    clashes = sorted(p.name for p in path.iterdir() if _owned(p.name, owned)) if path.is_dir() else []
    if shared_folder and clashes and not overwrite:
        raise UserError(
            f"{option} {dest} already holds {', '.join(clashes)}, which this command writes; choose "
            "another folder, or pass --overwrite to replace them (other files stay)"
        )
    if not shared_folder and path.is_dir() and any(path.iterdir()) and not overwrite:
        raise UserError(
            f"{option} {dest} is not empty; choose a new folder, or "
            + OVERWRITE_HINT.format(what=", ".join(owned))
        )
    if path.is_dir():
        check_writable(path, option)
    _writable_ancestor(path, option)
    return path


def _owned(name: str, owned: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in owned)


def _readable_modes(root: Path) -> None:
    """0755 folders, 0644 files under (and including) root."""
    root.chmod(FOLDER_MODE)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            Path(folder, name).chmod(FOLDER_MODE)
        for name in files:
            Path(folder, name).chmod(FILE_MODE)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _commit(tmp: Path, dest: Path, owned: Sequence[str]) -> None:
    """Move the finished `tmp` folder to `dest`: a rename when dest is absent or empty; else replace
    the owned names (those the new output lacks are removed: no stale card beside new weights)."""
    if dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()
    if not dest.exists():
        tmp.rename(dest)
        return
    written = {p.name for p in tmp.iterdir()}
    for old in dest.iterdir():
        if _owned(old.name, owned) and old.name not in written:
            _remove(old)
    for new in tmp.iterdir():
        target = dest / new.name
        if new.is_dir():
            _remove(target)
        os.replace(new, target)  # atomic per name
    tmp.rmdir()


def _user_error(err: Exception, where: Path, option: str) -> UserError | None:
    """A full disk or a folder that refuses writes, as a UserError; None for anything else. Writers
    that are not Python (safetensors) report the OS error only in their message."""
    code = getattr(err, "errno", None)
    text = str(err)
    if code == errno.ENOSPC or "No space left on device" in text or "os error 28" in text:
        return UserError(
            f"{option} {where}: no space left on its device; nothing was written, free some space and rerun"
        )
    if code in (errno.EROFS, errno.EACCES, errno.EPERM) or "Read-only file system" in text:
        reason = getattr(err, "strerror", None) or text
        return UserError(f"{option} {where}: cannot write there ({reason}); choose a writable folder")
    return None


def _reraise(err: Exception, where: Path, option: str) -> None:
    user = _user_error(err, where, option)
    if user is None:
        raise err
    raise user from err


@contextmanager
def staged_folder(
    dest: str | Path, *, owned: Sequence[str] = HEADS_FOLDER_NAMES, option: str = "--dest"
) -> Iterator[Path]:
    """Yield an empty temporary folder beside `dest`; when the block ends normally, move its content to
    `dest` (see `_commit`). On any error or interrupt the temporary folder is removed and `dest` is
    untouched; a full disk or a read-only folder becomes a UserError."""
    dest = _resolved(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp"))
    except OSError as err:
        _reraise(err, dest, option)
    try:
        yield tmp
        _readable_modes(tmp)
        _commit(tmp, dest, owned)
    except Exception as err:  # noqa: BLE001 - re-raised unless a full disk or a refused write
        _reraise(err, dest, option)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def staged_file(dest: str | Path, *, option: str = "--out", mode: str = "w") -> Iterator:
    """Yield an open temporary file beside `dest`, renamed to `dest` (mode 0644) when the block ends
    normally; removed on any error or interrupt, so an input that is also `dest`, or an earlier output,
    is never truncated."""
    dest = _resolved(dest)
    try:
        fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    except OSError as err:
        _reraise(err, dest, option)
    tmp = Path(name)
    try:
        with os.fdopen(fd, mode) as fh:
            yield fh
        tmp.chmod(FILE_MODE)
        os.replace(tmp, dest)
    except OSError as err:
        _reraise(err, dest, option)
    finally:
        tmp.unlink(missing_ok=True)
