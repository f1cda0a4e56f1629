"""events.jsonl's records: the event kinds of schema v1, the keys and types each kind
carries, and the one encoder and the checking decoder every writer and reader uses
(docs/contract.md, "Events"). Standard library only."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.schema.status import TextEnum
from trainer.schema.tree import CHECKPOINT_KINDS

SCHEMA_VERSION = 1


class Kind(TextEnum):
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

# `v` (the schema version) is required: a line without it is not a record of this contract.
COMMON_REQUIRED: dict[str, Check] = {"t": NUMBER, "kind": TEXT, "v": POSITIVE}
COMMON_OPTIONAL: dict[str, Check] = {}
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
