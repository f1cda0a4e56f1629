"""What nnui knows of nnU-Net's side of the shared tree: the files only nnU-Net writes, the
folder where nnU-Net finds nnui's trainer classes, and the classes nnU-Net scores
(docs/nnunet.md). Standard library only."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Any

# What nnU-Net 2.x writes, and nnui never does: a folder holding any of these is nnU-Net's.
NNUNET_FILE_PATTERNS = (
    "*.pkl",
    "*.pth",
    "training_log_*.txt",
    "progress.png",
    "debug.json",
    "nnUNet*Plans*.json",
    "dataset_fingerprint.json",
    "predict_from_raw_data_args.json",  # an nnUNetv2_predict output folder
)


def refuse_nnunet_output(folder: Path, flag: str = "-o") -> None:
    """ValueError (one line) when an output folder holds nnU-Net's files: writing CASE.nii.gz
    there would replace nnU-Net's own predictions of the same cases."""
    theirs = nnunet_files(folder)
    if theirs:
        raise ValueError(
            f"{flag} {folder} holds nnU-Net's files ({', '.join(theirs)}): nnui does not "
            "write there; choose another output folder"
        )


# The nnU-Net engine (docs/nnunet.md): nnU-Net finds nnui's trainer classes in this folder.
NNUNET_EXT_DIR = Path(__file__).resolve().parents[1] / "nnunet_ext"
NNUNET_EXT_ENV = "nnUNet_extTrainer"
NNUI_NNUNET_TRAINER = "nnUNetTrainer_nnui"  # nnU-Net's trainer + nnui's stop and events
NNUNET_WRAP_SUFFIX = "_nnui"  # `<AnyTrainer>_nnui` wraps any trainer nnU-Net can find


def with_nnunet_ext_dir(current: str | None) -> str:
    """A `nnUNet_extTrainer` value with nnui's folder first, the user's folders kept."""
    folders = [p for p in (current or "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys([str(NNUNET_EXT_DIR), *folders]))


def nnunet_files(folder: Path, limit: int = 3) -> list[str]:
    """Up to `limit` names of nnU-Net's own files directly in `folder` (none: [])."""
    found: list[str] = []
    try:
        names = sorted(entry.name for entry in os.scandir(folder) if entry.is_file())
    except OSError:
        return found
    for name in names:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in NNUNET_FILE_PATTERNS):
            found.append(name)
            if len(found) >= limit:
                break
    return found


def nnunet_classes(labels: dict[str, Any]) -> list[tuple[str, str]]:
    """(dataset.json name, nnU-Net's summary.json key) of what nnU-Net's pseudo Dice and
    validation are per, in nnU-Net's order. Regions (some entry lists several labels, as
    nnU-Net's label manager decides): every entry but `ignore` and background, in
    dataset.json's order (a single value is a region too: BraTS's "enhancing": 3); else
    the foreground labels by value, the ignore label left out. Unreadable entries: []."""
    try:
        ignore = labels.get("ignore")
        has_regions = any(isinstance(v, (list, tuple)) and len(v) > 1 for v in labels.values())
        out: list[tuple[str, str]] = []
        if has_regions:
            for name, value in labels.items():
                if name == "ignore":
                    continue
                listed = isinstance(value, (list, tuple))
                region: tuple[int, ...] | int = (
                    tuple(int(v) for v in value) if listed else int(value)
                )
                if region == 0 or (isinstance(region, tuple) and set(region) == {0}):
                    continue
                out.append((str(name), str(region)))  # str(): nnU-Net's summary.json key
            return out
        by_value: dict[int, str] = {}
        for name, value in labels.items():
            for v in value if isinstance(value, (list, tuple)) else [value]:
                by_value.setdefault(int(v), str(name))
        return [(by_value[v], str(v)) for v in sorted(by_value) if v != 0 and v != ignore]
    except (TypeError, ValueError, AttributeError):
        return []
