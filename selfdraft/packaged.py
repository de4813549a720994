"""Files that ship inside installed pip packages (models, data sets, benchmarks): located through
`importlib.metadata`, never by importing the package (some import heavy dependencies)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from selfdraft.errors import MissingFileError


def packaged_file(dist: str, relpath: str, *, missing: str, reinstall: str | None = None) -> Path:
    """`relpath` inside the installed distribution `dist`. missing: the one-line message when `dist`
    is not installed (it names the install command); reinstall: the command a damaged install needs."""
    try:
        path = Path(str(metadata.distribution(dist).locate_file(relpath)))
    except metadata.PackageNotFoundError as err:
        raise MissingFileError(missing) from err
    if not path.is_file():
        fix = f"; reinstall: {reinstall}" if reinstall else ""
        raise MissingFileError(f"{dist} is installed but {relpath} is missing{fix}")
    return path
