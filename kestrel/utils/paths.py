"""Checks of the paths a user gives, made before a long run rather than at its end."""

from __future__ import annotations

import os
from pathlib import Path

from kestrel.utils.errors import KestrelError


def check_writable(path: Path | None, flag: str, overwrite: bool = True) -> None:
    """Before a long run: a file the run will write can be written (a bad --out failed after the run, which was
    lost); with overwrite False, a file already there is refused (its earlier result kept)."""
    if path is None:
        return
    if path.is_dir():
        raise KestrelError(f"{flag} {path}: is a folder; give a file name")
    if path.exists() and not overwrite:
        raise KestrelError(f"{flag} {path} already exists; give --overwrite to replace it, or another file")
    parent = path.parent
    if not parent.is_dir():
        what = "is not a folder" if parent.exists() else "does not exist"
        raise KestrelError(f"{flag} {path}: {parent} {what}")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise KestrelError(f"{flag} {path}: not writable")
