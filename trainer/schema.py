"""The files-and-signals contract between the trainer and the app (DESIGN §2-§3).

Standard library only: this is the one trainer module `app/` may import, so importing it
must stay cheap (no torch, no numpy).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

# Run-folder file names.
EVENTS_FILE = "events.jsonl"
STATUS_FILE = "status.json"
CONFIG_FILE = "config.json"
CONSOLE_FILE = "console.log"
VALIDATION_DIR = "validation"
SUMMARY_FILE = "summary.json"
CHECKPOINT_KINDS = ("latest", "best", "final")
FOLDS = ("0", "1", "2", "3", "4", "all")

# ---- one tree, two tools (DESIGN §2) -------------------------------------------------------
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
# What nnU-Net 2.x writes, and nnui never does: a folder holding any of these is nnU-Net's.
NNUNET_FILE_PATTERNS = (
    "*.pkl",
    "*.pth",
    "training_log_*.txt",
    "progress.png",
    "debug.json",
    "nnUNet*Plans*.json",
    "dataset_fingerprint.json",
)


# The nnU-Net engine (DESIGN §4): nnU-Net finds nnui's trainer classes in this folder.
NNUNET_EXT_DIR = Path(__file__).resolve().parent / "nnunet_ext"
NNUNET_EXT_ENV = "nnUNet_extTrainer"
NNUI_NNUNET_TRAINER = "nnUNetTrainer_nnui"  # nnU-Net's trainer + nnui's stop and events
NNUNET_WRAP_SUFFIX = "_nnui"  # `<AnyTrainer>_nnui` wraps any trainer nnU-Net can find


def plans_file_name(plans_name: str) -> str:
    """nnui's plans file for a plans identifier: `nnuiPlans.json` (0.1's is `plans.json`)."""
    return LEGACY_PLANS_FILE if plans_name == LEGACY_PLANS else f"{plans_name}.json"


def is_legacy_identifier(trainer: str, plans: str) -> bool:
    return trainer == LEGACY_TRAINER or plans == LEGACY_PLANS


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


class Kind:
    """Event kinds of schema v1. Readers ignore kinds they do not know.

    Field notes (the trainer writes them so): `epoch` in events is the 0-based index of
    the epoch concerned (-1 in stop events before any epoch was trained); status.json's
    `epoch` counts completed epochs (0..num_epochs). `checkpoint_saved` names the
    checkpoint in `checkpoint` ("latest" | "best" | "final"), since `kind` is the event's.
    Dice values that are undefined (class absent from prediction and reference) are null.
    Every line is strict JSON: any NaN/inf is written as null; `epoch_ended` then carries
    `nan_loss: true` when its train or val loss was not finite. `dice_per_class` is a list
    indexed by foreground class (entry 0 = label 1) in `epoch_ended` and
    `validation_finished` alike.
    """

    RUN_STARTED = "run_started"
    TOPOLOGY = "topology"
    EPOCH_ENDED = "epoch_ended"
    CHECKPOINT_SAVED = "checkpoint_saved"
    STOP_REQUESTED = "stop_requested"
    STOPPED = "stopped"
    VALIDATION_STARTED = "validation_started"
    VALIDATION_FINISHED = "validation_finished"
    FINISHED = "finished"
    FAILED = "failed"


ALL_KINDS = frozenset(v for k, v in vars(Kind).items() if k.isupper())


class State:
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FINISHED = "finished"
    FAILED = "failed"


TERMINAL_STATES = frozenset({State.STOPPED, State.FINISHED, State.FAILED})


def encode_event(kind: str, t: float | None = None, **fields: Any) -> str:
    """One event as one JSON line (with its newline), ready for a single write()."""
    record = {"v": SCHEMA_VERSION, "t": time.time() if t is None else t, "kind": kind}
    record.update(fields)
    # Strict JSON: NaN/inf (a diverged loss, an undefined Dice) are written as null.
    return json.dumps(_finite_json(record), separators=(",", ":"), allow_nan=False) + "\n"


def _finite_json(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_json(v) for v in value]
    return value


def decode_event(line: str | bytes) -> dict[str, Any] | None:
    """A parsed event, or None for a line that is not one (blank, torn or malformed)."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return None
    return record


@dataclass
class Status:
    """status.json: the latest state of one run in one small file."""

    state: str
    epoch: int = 0
    num_epochs: int = 0
    pids: list[int] = field(default_factory=list)
    last_checkpoint: str | None = None
    message: str | None = None
    updated_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Status:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def read_status(run_dir: Path) -> Status | None:
    try:
        return Status.from_dict(json.loads((run_dir / STATUS_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a whole file so readers see the old or the new content, never a mix.

    tmp in the same folder, fsync, os.replace, then fsync of the folder so the rename
    itself survives a crash (best effort: some file systems refuse a directory fsync).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    try:
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


def atomic_write_text(path: Path, text: str) -> None:
    """atomic_write_bytes for text (UTF-8)."""
    atomic_write_bytes(path, text.encode("utf-8"))


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
