"""The shared nnU-Net tree: the roots, dataset names, run folders and the file names in them,
nnui's own identifiers beside nnU-Net's (docs/contract.md, docs/nnunet.md). Standard library
only."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# Run-folder file names.
EVENTS_FILE = "events.jsonl"
STATUS_FILE = "status.json"
CONFIG_FILE = "config.json"
CONSOLE_FILE = "console.log"
VALIDATION_DIR = "validation"
SUMMARY_FILE = "summary.json"
OWNER_LOCK_FILE = "owner.lock"  # held by the fold's writer (trainer.training.fold_lock)
CHECKPOINT_KINDS = ("latest", "best", "final")
FOLDS = ("0", "1", "2", "3", "4", "all")
# The image files the trainer reads (trainer.data.image_io.SUPPORTED_ENDINGS, tested equal),
# for the app's up-front check of a prediction's input folder.
IMAGE_ENDINGS = (".nii.gz", ".nii", ".nrrd", ".mha", ".mhd", ".gipl", ".png", ".bmp", ".tif",
                 ".tiff", ".npy", ".npz")  # fmt: skip

# ---- one tree, two tools (docs/nnunet.md) ------------------------------------------------
# nnui's own identifiers never collide with nnU-Net's, so both tools share one
# nnUNet_raw/preprocessed/results tree: nnuiPlans_3d_fullres/, nnuiTrainer__nnuiPlans__2d/.
DEFAULT_TRAINER = "nnuiTrainer"
DEFAULT_PLANS = "nnuiPlans"
NNUI_PREFIX = "nnui"
# nnui 0.1 trained under nnU-Net's own names. Such run folders are still continued
# (`-tr nnUNetTrainer -p nnUNetPlans --c`) but nothing new is ever started under them.
LEGACY_TRAINER = "nnUNetTrainer"
LEGACY_PLANS = "nnUNetPlans"
LEGACY_PLANS_FILE = "plans.json"  # nnui 0.1's name for its nnUNetPlans
FINGERPRINT_FILE = "nnui_fingerprint.json"
LEGACY_FINGERPRINT_FILE = "dataset_fingerprint.json"  # nnU-Net's name (nnui 0.1 used it too)


def plans_file_name(plans_name: str) -> str:
    """nnui's plans file for a plans identifier: `nnuiPlans.json` (0.1's is `plans.json`)."""
    return LEGACY_PLANS_FILE if plans_name == LEGACY_PLANS else f"{plans_name}.json"


def is_legacy_identifier(trainer: str, plans: str) -> bool:
    return trainer == LEGACY_TRAINER or plans == LEGACY_PLANS


# Environment variables shared by both parts.
JOB_ID_ENV = "NNUI_JOB_ID"
ROOT_ENVS = {
    "raw": "nnUNet_raw",
    "preprocessed": "nnUNet_preprocessed",
    "results": "nnUNet_results",
}


def checkpoint_file(kind: str) -> str:
    assert kind in CHECKPOINT_KINDS, kind
    return f"checkpoint_{kind}.safetensors"


# ---- folder layout (nnU-Net conventions) -------------------------------------------------


@dataclass(frozen=True)
class Roots:
    raw: Path
    preprocessed: Path
    results: Path


def resolve_roots(
    raw: str | None = None, preprocessed: str | None = None, results: str | None = None
) -> Roots:
    """Flags win, then nnU-Net's environment variables, then ./nnui_data/*."""
    given = {"raw": raw, "preprocessed": preprocessed, "results": results}
    chosen = {}
    for name, flag in given.items():
        value = flag or os.environ.get(ROOT_ENVS[name]) or os.path.join("nnui_data", name)
        chosen[name] = Path(value).expanduser().absolute()
    return Roots(**chosen)


_DATASET_NAME = re.compile(r"^Dataset(\d{3})_[A-Za-z0-9_\-]+$")


class DatasetNotFound(ValueError):
    pass


def find_dataset(root: Path, dataset: str) -> str:
    """`4`, `004` or `Dataset004_Name` -> `Dataset004_Name`, looked up under root."""
    if _DATASET_NAME.match(dataset):
        if (root / dataset).is_dir():
            return dataset
        raise DatasetNotFound(f"dataset {dataset} not found in {root}")
    if not dataset.isdigit():
        raise DatasetNotFound(
            f"dataset {dataset!r} is neither an id (e.g. 4 or 004) nor DatasetNNN_Name"
        )
    prefix = f"Dataset{int(dataset):03d}_"
    matches = sorted(p.name for p in root.glob(prefix + "*") if p.is_dir()) if root.is_dir() else []
    if not matches:
        raise DatasetNotFound(f"no dataset with id {int(dataset):03d} in {root}")
    if len(matches) > 1:
        raise DatasetNotFound(f"several datasets with id {int(dataset):03d} in {root}: {matches}")
    return matches[0]


def list_datasets(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and _DATASET_NAME.match(p.name))


def run_dir(
    results_root: Path,
    dataset_name: str,
    configuration: str,
    fold: str | int,
    trainer: str = DEFAULT_TRAINER,
    plans: str = DEFAULT_PLANS,
) -> Path:
    return results_root / dataset_name / f"{trainer}__{plans}__{configuration}" / f"fold_{fold}"
