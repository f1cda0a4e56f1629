"""The files-and-signals contract between the trainer and the app (docs/contract.md).

Standard library only: this is the one trainer module `app/` may import, so importing it
must stay cheap (no torch, no numpy).
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, BinaryIO

SCHEMA_VERSION = 1

# Run-folder file names.
EVENTS_FILE = "events.jsonl"
STATUS_FILE = "status.json"
CONFIG_FILE = "config.json"
CONSOLE_FILE = "console.log"
VALIDATION_DIR = "validation"
SUMMARY_FILE = "summary.json"
OWNER_LOCK_FILE = (
    "owner.lock"  # held by the trainer that writes the fold (trainer.training.fold_lock)
)
CHECKPOINT_KINDS = ("latest", "best", "final")
FOLDS = ("0", "1", "2", "3", "4", "all")
# The image files the trainer reads (trainer.data.image_io.SUPPORTED_ENDINGS, tested equal),
# for the app's up-front check of a prediction's input folder.
IMAGE_ENDINGS = (".nii.gz", ".nii", ".nrrd", ".mha", ".mhd", ".gipl", ".png", ".bmp", ".tif",
                 ".tiff", ".npy", ".npz")  # fmt: skip

# ---- one tree, two tools (docs/nnunet.md) -------------------------------------------------------
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
NNUNET_EXT_DIR = Path(__file__).resolve().parent / "nnunet_ext"
NNUNET_EXT_ENV = "nnUNet_extTrainer"
NNUI_NNUNET_TRAINER = "nnUNetTrainer_nnui"  # nnU-Net's trainer + nnui's stop and events
NNUNET_WRAP_SUFFIX = "_nnui"  # `<AnyTrainer>_nnui` wraps any trainer nnU-Net can find


def with_nnunet_ext_dir(current: str | None) -> str:
    """A `nnUNet_extTrainer` value with nnui's folder first, the user's folders kept."""
    folders = [p for p in (current or "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys([str(NNUNET_EXT_DIR), *folders]))


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


class _StrEnum(str, Enum):
    """A str that is also an enum member: JSON, ==, hashing and f-strings see the value."""

    __str__ = str.__str__

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)


class Kind(_StrEnum):
    """Event kinds of schema v1. Readers ignore kinds they do not know.

    Field notes (the trainer writes them so): `epoch` in events is the 0-based index of
    the epoch concerned (-1 in stop events before any epoch was trained); status.json's
    `epoch` counts completed epochs (0..num_epochs). `checkpoint_saved` names the
    checkpoint in `checkpoint` ("latest" | "best" | "final"), since `kind` is the event's.
    Dice values that are undefined (class absent from prediction and reference) are null.
    Every line is strict JSON: any NaN/inf is written as null; `epoch_ended` then carries
    `nan_loss: true` when its train or val loss was not finite. `dice_per_class` is a list
    indexed by foreground class (entry 0 = label 1) in `epoch_ended` and
    `validation_finished` alike. The keys each kind must carry, and the types of the keys
    it may carry, are REQUIRED_KEYS and OPTIONAL_KEYS below.
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
    # A prediction (nnui-predict --events FILE): it writes `topology`, `stop_requested`,
    # `stopped`, `finished` and `failed` as a training does, and these two of its own.
    PREDICTION_STARTED = "prediction_started"
    CASE_PREDICTED = "case_predicted"
    # Additive in v1: the mean training loss of the steps since the previous point, a few
    # times per epoch (rank 0's own batch share; `iteration` counts steps done this epoch).
    TRAIN_LOSS_RUNNING = "train_loss_running"
    # Additive in v1: final validation progress, once per round of cases on rank 0
    # (`index` = cases of every rank done so far, 1-based; `num_cases` = all of them).
    VALIDATION_CASE = "validation_case"
    # Additive in v1: rank 0 saw SIGUSR1 at its next training step (the stop itself is agreed
    # at the epoch's end: `stop_requested`), so the board shows it at once, not an epoch later.
    STOP_HEARD = "stop_heard"


# The kinds that begin a job's own run in its events file.
START_KINDS = frozenset({Kind.RUN_STARTED, Kind.PREDICTION_STARTED})
ALL_KINDS = frozenset(Kind)


class State(_StrEnum):
    """The one list of job states. The trainer writes the first six in status.json; the
    app derives the last three for a job (waiting for an earlier one; gone without an end;
    ended by `nnui kill`)."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FINISHED = "finished"
    FAILED = "failed"
    QUEUED = "queued"
    LOST = "lost"
    KILLED = "killed"
    VALIDATING = "validating"  # derived by the app: the final validation runs


TERMINAL_STATES = frozenset({State.STOPPED, State.FINISHED, State.FAILED})
ENDED_STATES = TERMINAL_STATES | {State.LOST, State.KILLED}  # nothing runs any more
ACTIVE_STATES = frozenset(
    {State.STARTING, State.QUEUED, State.RUNNING, State.STOPPING, State.VALIDATING}
)
# Named groups, so no caller spells a state as a string or a tuple of its own.
RUNNING_STATES = frozenset({State.RUNNING, State.VALIDATING})  # at work: counted running, ETA
WAITING_STATES = frozenset({State.QUEUED, State.STARTING})  # launched, not at work yet
WORKING_STATES = RUNNING_STATES | {State.STARTING}  # its trainer runs and was not told to stop
LIVE_STATES = ACTIVE_STATES - {State.QUEUED}  # its processes exist
FAILED_STATES = frozenset({State.FAILED, State.LOST})  # ended without finishing or a stop


# ---- what a valid event is (checked by every reader; a record that fails is skipped) ------

MAX_INT = 2**31 - 1  # counts, epochs and pids beyond this are data errors, not values


@dataclass(frozen=True)
class Check:
    """One rule for one value: `what` completes "must be ..." in the reason."""

    what: str
    ok: Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    # bool is an int subclass in Python, but `true` is never a count in JSON.
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_INT


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    # The bound first: it compares a huge int exactly, where isfinite would overflow.
    return abs(value) <= 1e300 and math.isfinite(value)


def _is_metric(value: Any) -> bool:
    return value is None or _is_number(value)


COUNT = Check("a non-negative integer", lambda v: _is_int(v) and v >= 0)
POSITIVE = Check("a positive integer", lambda v: _is_int(v) and v > 0)
EPOCH_INDEX = Check("an integer >= -1", lambda v: _is_int(v) and v >= -1)
EPOCH_OR_NULL = Check("an integer >= -1 or null", lambda v: v is None or EPOCH_INDEX.ok(v))
PID = Check("a positive integer pid", lambda v: _is_int(v) and v > 0)
NUMBER = Check("a finite number", _is_number)
METRIC = Check("a finite number or null", _is_metric)
TEXT = Check("a string", lambda v: isinstance(v, str))
FLAG = Check("true or false", lambda v: isinstance(v, bool))
FOLD = Check("a fold (string or integer)", lambda v: isinstance(v, str) or COUNT.ok(v))


def _list_of(items: str, item_ok: Callable[[Any], bool]) -> Check:
    return Check(f"a list of {items}", lambda v: isinstance(v, list) and all(map(item_ok, v)))


TEXTS = _list_of("strings", TEXT.ok)
METRICS = _list_of("finite numbers or nulls", _is_metric)
RANK_INDICES = _list_of("non-negative integers", COUNT.ok)
CHECKPOINT = Check(f"one of {', '.join(CHECKPOINT_KINDS)}", lambda v: v in CHECKPOINT_KINDS)

# One entry of topology.ranks: the pid is what a stop is sent to, so it must be real.
RANK_REQUIRED: dict[str, Check] = {"pid": PID}
RANK_OPTIONAL: dict[str, Check] = {
    "global_rank": COUNT, "local_rank": COUNT, "host": TEXT, "device": TEXT,
    "batch_size": COUNT, "oversample_foreground_percent": NUMBER, "sigusr1_handler": FLAG,
}  # fmt: skip


def _valid_ranks(value: Any) -> bool:
    if not isinstance(value, list) or not value:
        return False
    return all(
        isinstance(entry, dict) and check_fields(entry, RANK_REQUIRED, RANK_OPTIONAL) is None
        for entry in value
    )


RANKS = Check("a non-empty list of rank objects, each with a positive integer pid", _valid_ranks)

COMMON_REQUIRED: dict[str, Check] = {"t": NUMBER, "kind": TEXT}
COMMON_OPTIONAL: dict[str, Check] = {"v": POSITIVE}
# Required: the keys without which a reader could not use the record at all.
REQUIRED_KEYS: dict[Kind, dict[str, Check]] = {
    Kind.RUN_STARTED: {"num_epochs": COUNT},
    Kind.TOPOLOGY: {"ranks": RANKS},
    Kind.EPOCH_ENDED: {"epoch": COUNT},
    Kind.CHECKPOINT_SAVED: {"checkpoint": CHECKPOINT},
    Kind.STOP_REQUESTED: {},
    Kind.STOP_HEARD: {"epoch": COUNT},
    Kind.STOPPED: {},
    Kind.VALIDATION_STARTED: {},
    Kind.VALIDATION_FINISHED: {},
    Kind.FINISHED: {},
    Kind.FAILED: {},
    Kind.PREDICTION_STARTED: {"num_cases": COUNT},
    Kind.CASE_PREDICTED: {"case": TEXT},
    Kind.TRAIN_LOSS_RUNNING: {"epoch": COUNT, "iteration": POSITIVE, "loss": METRIC},
    Kind.VALIDATION_CASE: {"index": POSITIVE, "num_cases": POSITIVE},
}
_EPOCH_METRICS = ("train_loss", "val_loss", "mean_fg_dice", "ema_fg_dice", "lr",
                  "epoch_time_s", "iterations_per_s", "data_wait_s", "data_wait_share")  # fmt: skip
# Optional: checked when present (the trainer writes them all; other writers may not).
OPTIONAL_KEYS: dict[Kind, dict[str, Check]] = {
    Kind.RUN_STARTED: {
        "dataset": TEXT,
        "configuration": TEXT,
        "fold": FOLD,
        "iterations_per_epoch": COUNT,
        "world_size": POSITIVE,
        "launcher": TEXT,
        "host": TEXT,
        "argv": TEXTS,
        "class_names": TEXTS,  # of dice_per_class's entries: labels, or regions
    },
    Kind.TOPOLOGY: {},
    Kind.EPOCH_ENDED: {
        **dict.fromkeys(_EPOCH_METRICS, METRIC),
        "dice_per_class": METRICS,
        "nan_loss": FLAG,
    },
    Kind.CHECKPOINT_SAVED: {"path": TEXT, "epoch": EPOCH_INDEX, "write_time_s": NUMBER},
    Kind.STOP_REQUESTED: {"epoch": EPOCH_INDEX, "ranks": RANK_INDICES, "num_done": COUNT},
    Kind.STOP_HEARD: {},
    Kind.STOPPED: {"epoch": EPOCH_INDEX, "reason": TEXT, "num_done": COUNT, "num_cases": COUNT},
    Kind.VALIDATION_STARTED: {"epoch": EPOCH_INDEX, "num_cases": COUNT},
    Kind.VALIDATION_FINISHED: {
        "mean_fg_dice": METRIC,
        "dice_per_class": METRICS,
        "class_names": TEXTS,
        "num_cases": COUNT,
    },
    Kind.FINISHED: {"epoch": EPOCH_INDEX, "num_done": COUNT, "num_cases": COUNT},
    Kind.FAILED: {"message": TEXT, "traceback": TEXT, "epoch": EPOCH_OR_NULL},
    # num_cases: this part's cases still to predict; num_skipped: done already
    # (--continue_prediction); part_id of num_parts; folds averaged; output folder.
    Kind.PREDICTION_STARTED: {
        "num_skipped": COUNT,
        "part_id": COUNT,
        "num_parts": POSITIVE,
        "folds": TEXTS,
        "dataset": TEXT,
        "configuration": TEXT,
        "checkpoint": CHECKPOINT,
        "output": TEXT,
        "device": TEXT,
        "host": TEXT,
        "argv": TEXTS,
    },
    # index: 1-based within this run; seconds: wall time of the case; shape: the input's.
    Kind.CASE_PREDICTED: {
        "index": POSITIVE,
        "num_cases": COUNT,
        "seconds": NUMBER,
        "shape": _list_of("non-negative integers", COUNT.ok),
    },
    Kind.TRAIN_LOSS_RUNNING: {"num_iterations": POSITIVE},
    Kind.VALIDATION_CASE: {},
}


def _shown(value: Any) -> str:
    """The offending value, short, for the reason (never raises: it runs on garbage)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def check_fields(
    record: dict[str, Any], required: dict[str, Check], optional: dict[str, Check]
) -> str | None:
    """Why `record` breaks the rules (missing key, wrong type), or None when it keeps them."""
    for key in required:
        if key not in record:
            return f"{key!r} is missing"
    for key, value in record.items():
        check = required.get(key) or optional.get(key)
        if check is not None and not check.ok(value):
            return f"{key!r} must be {check.what}, got {_shown(value)}"
    return None


def validate_event(record: Any) -> str | None:
    """None for a usable event, else the reason (one line). Unknown kinds are valid (v1 is
    additive): readers ignore them, but their `t` and `kind` must still be sound."""
    if not isinstance(record, dict):
        return f"not a JSON object ({type(record).__name__})"
    problem = check_fields(record, COMMON_REQUIRED, COMMON_OPTIONAL)
    if problem is not None:
        return problem
    try:
        kind = Kind(record["kind"])
    except ValueError:
        return None
    problem = check_fields(record, REQUIRED_KEYS[kind], OPTIONAL_KEYS[kind])
    return None if problem is None else f"{kind}: {problem}"


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
    """A parsed and valid event, or None for a line that is not one (see parse_event)."""
    return parse_event(line)[0]


def parse_event(line: str | bytes) -> tuple[dict[str, Any] | None, str | None]:
    """(record, None) for a valid event line, else (None, why): blank, torn, not JSON,
    not UTF-8, nested too deep, or breaking the keys and types of its kind."""
    try:
        record = json.loads(line)
    except RecursionError:
        return None, "not JSON (nested too deep)"
    except ValueError as error:  # also UnicodeDecodeError, and ints beyond the digit limit
        return None, f"not JSON ({str(error)[:60]})"
    problem = validate_event(record)
    return (None, problem) if problem is not None else (record, None)


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


# ---- command lines: flags are spelled out (argparse's prefix matching is off everywhere) --


def with_close_flag(message: str, known_flags: Iterable[str]) -> str:
    """argparse's "unrecognized arguments: --epoch 3" plus the flag the user likely meant.

    Every nnui parser sets allow_abbrev=False (a prefix such as --epoch silently meaning
    --epochs is a trap when flags are passed through to a trainer); this names the match.
    """
    if not message.startswith("unrecognized arguments:"):
        return message
    known = list(known_flags)
    for word in message.split(":", 1)[1].split():
        flag = word.split("=", 1)[0]
        if flag.startswith("-"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                return f"{message} (did you mean {close[0]}?)"
    return message


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
