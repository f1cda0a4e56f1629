"""Atomic file writes: readers see the old or the new content, never a mix, and a crash
leaves at most a hidden `.NAME.PID.tmp` (docs/contract.md). Standard library only."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO


def atomic_tmp_path(path: Path) -> Path:
    """The one temporary name of every nnui atomic write: `.NAME.PID.tmp` in the same folder
    (hidden, and its writer's pid says whether a leftover may be removed)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _write_all(handle: BinaryIO, data: bytes) -> None:
    """One seam for the write itself (tests make it fail half way, as a full disk does)."""
    handle.write(data)


def atomic_write_bytes(
    path: Path, data: bytes, mode: int | None = None, exclusive: bool = False
) -> None:
    """Write a whole file so readers see the old or the new content, never a mix.

    tmp in the same folder, fsync, os.replace, then fsync of the folder so the rename
    itself survives a crash (best effort: some file systems refuse a directory fsync).
    `mode` sets the file's permission bits before it appears under its name; `exclusive`
    creates it only where no file has that name (FileExistsError otherwise).
    """
    path = Path(path)
    tmp = atomic_tmp_path(path)
    try:
        with open(tmp, "wb") as handle:
            _write_all(handle, data)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        if not exclusive:
            os.replace(tmp, path)
        else:  # os.link is atomic and fails when the name exists: a create, never a replace
            os.link(tmp, path)
            tmp.unlink()
    except BaseException:  # e.g. a full disk: no half file left, the old one stays
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """fsync a folder so a rename in it survives a crash (best effort: some file systems
    refuse a directory fsync)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(
    path: Path, text: str, mode: int | None = None, exclusive: bool = False
) -> None:
    """atomic_write_bytes for text (UTF-8)."""
    atomic_write_bytes(path, text.encode("utf-8"), mode, exclusive)
