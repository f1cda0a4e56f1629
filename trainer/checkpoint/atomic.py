"""Files in a run folder that must survive a kill or a full disk (rank 0 only).

`write_atomically` is the checkpoint writer: tmp in the same folder, fsync, os.replace, and
on any failure the partial tmp is removed and the older file stays. `remove_stale_tmp`
deletes what a killed write left behind, by nnui's own tmp names only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

from trainer.schema.atomic import atomic_write_bytes
from trainer.schema.tree import (
    CHECKPOINT_KINDS,
    CONFIG_FILE,
    STATUS_FILE,
    SUMMARY_FILE,
    VALIDATION_DIR,
    checkpoint_file,
)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (full disk, ...); its partial file is removed."""


_TMP_NAMES = {
    "": "|".join(
        re.escape(n) for n in (*map(checkpoint_file, CHECKPOINT_KINDS), STATUS_FILE, CONFIG_FILE)
    ),
    # summary, probabilities and the segmentations in the raw files' formats
    VALIDATION_DIR: rf"{re.escape(SUMMARY_FILE)}|[^/]+\.(?:npz|nii\.gz|nii|npy|nrrd|mha)",
}


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # nothing of ours is being written yet when this runs
    proc = Path("/proc")
    return (proc / str(pid)).exists() if (proc / "self").exists() else False


def remove_stale_tmp(run_dir: Path) -> list[str]:
    """Delete the temporary files a killed nnui write left in a run folder (rank 0, at start).

    Only nnui's own names (`.checkpoint_latest.safetensors.PID.tmp`, status, config,
    validation summary and probabilities), and only when their writer PID is gone.
    """
    removed = []
    for sub, names in _TMP_NAMES.items():
        folder = Path(run_dir) / sub
        pattern = re.compile(rf"^\.(?:{names})\.(\d+)\.tmp$")
        try:
            entries = list(folder.iterdir()) if folder.is_dir() else []
        except OSError:
            continue
        for entry in entries:
            match = pattern.match(entry.name)
            if match is None or _pid_alive(int(match.group(1))) or not entry.is_file():
                continue
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(str(entry.relative_to(run_dir)))
    return removed


def write_atomically(path: Path, data: bytes) -> None:
    """schema.atomic_write_bytes (its tmp removed on any failure, the old file kept), with a
    failure told as one CheckpointWriteError line."""
    path = Path(path)
    try:
        atomic_write_bytes(path, data)
    except OSError as error:
        reason = "no space left on device" if error.errno == errno.ENOSPC else error.strerror
        raise CheckpointWriteError(
            f"could not write {path.name} in {path.parent}: {reason or error}; the older "
            "checkpoints are kept: free the disk, then continue with --c"
        ) from error
