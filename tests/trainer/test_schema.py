"""The run-folder contract: events round-trip, torn lines are ignored, status is atomic."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from trainer.schema.atomic import atomic_write_bytes, atomic_write_text
from trainer.schema.events import (
    ALL_KINDS,
    OPTIONAL_KEYS,
    REQUIRED_KEYS,
    SCHEMA_VERSION,
    Kind,
    decode_event,
    encode_event,
    validate_event,
)
from trainer.schema.status import (
    ACTIVE_STATES,
    ENDED_STATES,
    TERMINAL_STATES,
    State,
    Status,
    read_status,
)
from trainer.schema.tree import EVENTS_FILE, STATUS_FILE
from trainer.training.events import RunRecorder

RANK = {"global_rank": 0, "local_rank": 0, "host": "h", "pid": 4242, "device": "cuda:0",
        "batch_size": 2, "oversample_foreground_percent": 0.33,
        "sigusr1_handler": True}  # fmt: skip
# One complete record per kind, with every key the trainer writes (docs/contract.md).
EXAMPLES: dict[Kind, dict] = {
    Kind.RUN_STARTED: dict(
        dataset="Dataset004_Demo",
        configuration="3d_fullres",
        fold="0",
        num_epochs=10,
        iterations_per_epoch=250,
        world_size=1,
        launcher="single",
        host="h",
        argv=["nnui-train"],
    ),
    Kind.TOPOLOGY: dict(ranks=[RANK]),
    Kind.EPOCH_ENDED: dict(
        epoch=3,
        train_loss=0.5,
        val_loss=None,
        dice_per_class=[0.5, None],
        mean_fg_dice=0.5,
        ema_fg_dice=0.4,
        lr=0.01,
        epoch_time_s=2.0,
        iterations_per_s=125.0,
        data_wait_s=0.1,
        nan_loss=True,
    ),
    Kind.CHECKPOINT_SAVED: dict(checkpoint="latest", path="/r/c", epoch=3, write_time_s=1),
    Kind.STOP_REQUESTED: dict(epoch=-1, ranks=[0, 1]),
    Kind.STOP_HEARD: dict(epoch=3),
    Kind.STOPPED: dict(epoch=3, reason="SIGUSR1"),
    Kind.VALIDATION_STARTED: dict(epoch=9, num_cases=2),
    Kind.VALIDATION_FINISHED: dict(mean_fg_dice=0.7, dice_per_class=[0.7], num_cases=2),
    Kind.VALIDATION_CASE: dict(index=1, num_cases=2),
    Kind.FINISHED: dict(epoch=9),
    Kind.FAILED: dict(message="boom", traceback="Traceback ...", epoch=None),
    Kind.PREDICTION_STARTED: dict(
        num_cases=5,
        num_skipped=1,
        part_id=1,
        num_parts=2,
        folds=["0", "1"],
        dataset="Dataset004_Demo",
        configuration="2d",
        checkpoint="final",
        output="/o",
        device="cpu",
        host="h",
        argv=["nnui-predict"],
    ),
    Kind.CASE_PREDICTED: dict(case="c1", index=1, num_cases=5, seconds=0.5, shape=[20, 40, 41]),
    Kind.TRAIN_LOSS_RUNNING: dict(epoch=2, iteration=125, num_iterations=250, loss=0.61),
}


def test_every_kind_has_its_rules_and_an_example() -> None:
    assert set(REQUIRED_KEYS) == set(OPTIONAL_KEYS) == set(Kind)
    assert set(EXAMPLES) == ALL_KINDS


@pytest.mark.parametrize("kind", sorted(ALL_KINDS))
def test_every_kind_round_trips(kind: Kind) -> None:
    line = encode_event(kind, t=1.5, **EXAMPLES[kind])
    assert line.endswith("\n") and line.count("\n") == 1
    record = decode_event(line)
    assert record == {"v": SCHEMA_VERSION, "t": 1.5, "kind": kind, **EXAMPLES[kind]}
    assert validate_event(record) is None


@pytest.mark.parametrize(
    ("kind", "key"),
    [(k, key) for k in sorted(Kind) for key in sorted(REQUIRED_KEYS[k])],
)
def test_a_missing_required_key_is_named(kind: Kind, key: str) -> None:
    record = {"v": 1, "t": 1.0, "kind": kind, **EXAMPLES[kind]}
    del record[key]
    assert validate_event(record) == f"{kind}: {key!r} is missing"


WRONG_VALUES = [
    (Kind.EPOCH_ENDED, "epoch", None), (Kind.EPOCH_ENDED, "epoch", "abc"),
    (Kind.EPOCH_ENDED, "epoch", math.inf), (Kind.EPOCH_ENDED, "epoch", True),
    (Kind.EPOCH_ENDED, "epoch", -1), (Kind.EPOCH_ENDED, "epoch", 2**40),
    (Kind.EPOCH_ENDED, "epoch", 1.0), (Kind.EPOCH_ENDED, "lr", math.nan),
    (Kind.EPOCH_ENDED, "dice_per_class", [0.5, "x"]),
    (Kind.EPOCH_ENDED, "nan_loss", 0),
    (Kind.TOPOLOGY, "ranks", "all"), (Kind.TOPOLOGY, "ranks", []),
    (Kind.TOPOLOGY, "ranks", [{**RANK, "pid": -1}]),
    (Kind.TOPOLOGY, "ranks", [{**RANK, "pid": 0}]),
    (Kind.TOPOLOGY, "ranks", [{**RANK, "pid": True}]),
    (Kind.TOPOLOGY, "ranks", [{**RANK, "pid": "12"}]),
    (Kind.TOPOLOGY, "ranks", [RANK, {"global_rank": 1}]),
    (Kind.TOPOLOGY, "ranks", [{**RANK, "host": 3}]),
    (Kind.RUN_STARTED, "num_epochs", "10"), (Kind.RUN_STARTED, "world_size", 0),
    (Kind.CHECKPOINT_SAVED, "checkpoint", "newest"),
    (Kind.STOP_REQUESTED, "ranks", "all"), (Kind.FAILED, "message", None),
    (Kind.PREDICTION_STARTED, "num_cases", -1),
    (Kind.PREDICTION_STARTED, "num_parts", 0),
    (Kind.PREDICTION_STARTED, "folds", [0]),
    (Kind.CASE_PREDICTED, "seconds", math.nan),
    (Kind.CASE_PREDICTED, "shape", [3, -1]), (Kind.CASE_PREDICTED, "case", 7),
    (Kind.STOPPED, "num_done", -2),
    (Kind.TRAIN_LOSS_RUNNING, "iteration", 0),
    (Kind.TRAIN_LOSS_RUNNING, "loss", "0.5"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "key", "value"), WRONG_VALUES)
def test_a_wrong_type_is_refused_with_its_reason(kind: Kind, key: str, value) -> None:
    record = {"v": 1, "t": 1.0, "kind": kind, **EXAMPLES[kind], key: value}
    reason = validate_event(record)
    assert reason is not None and reason.startswith(f"{kind}: {key!r} must be")


@pytest.mark.parametrize(
    "record",
    [[1, 2], "x", None, {"t": 1}, {"kind": "finished"}, {"t": "later", "kind": "finished"},
     {"t": True, "kind": "finished"}, {"t": math.inf, "kind": "x"}, {"t": 1, "kind": 3},
     {"t": 1, "kind": "finished", "v": "1"}, {"t": 1, "kind": "finished"},
     {"t": 1, "kind": "finished", "v": 0}],
)  # fmt: skip
def test_every_record_needs_a_version_a_time_and_a_kind(record) -> None:
    assert validate_event(record) is not None


def test_unknown_kinds_and_keys_are_valid() -> None:
    assert validate_event({"v": 1, "t": 1, "kind": "running_loss", "loss": "x"}) is None
    assert validate_event({"v": 1, "t": 1, "kind": "finished", "future": [None]}) is None


def test_kinds_and_states_are_enums_that_read_as_their_strings() -> None:
    assert Kind.TOPOLOGY == "topology" and f"{Kind.TOPOLOGY}" == "topology"
    assert Kind("epoch_ended") is Kind.EPOCH_ENDED
    assert json.dumps([State.LOST]) == '["lost"]' and str(State.QUEUED) == "queued"
    assert "running" in ACTIVE_STATES and "lost" in ENDED_STATES
    assert TERMINAL_STATES < ENDED_STATES


def test_status_round_trip_and_unknown_keys(tmp_path: Path) -> None:
    status = Status(state=State.RUNNING, epoch=4, num_epochs=10, pids=[1, 2])
    atomic_write_text(tmp_path / STATUS_FILE, status.to_json())
    assert read_status(tmp_path) == status
    data = json.loads(status.to_json()) | {"future_field": 1}
    assert Status.from_dict(data) == status


def test_recorder_writes_events_and_status_only_when_enabled(tmp_path: Path) -> None:
    main, other = tmp_path / "main", tmp_path / "other"
    for folder, enabled in ((main, True), (other, False)):
        with RunRecorder(folder, enabled=enabled, num_epochs=5) as recorder:
            recorder.event(Kind.EPOCH_ENDED, epoch=0, mean_fg_dice=math.nan)
            recorder.status(State.RUNNING, epoch=1)
            recorder.failed("boom", "Traceback ...")
    lines = (main / EVENTS_FILE).read_text().splitlines()
    kinds = [decode_event(line)["kind"] for line in lines]
    assert kinds == [Kind.EPOCH_ENDED, Kind.FAILED]
    assert read_status(main).state == State.FAILED
    assert not other.exists()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_events_are_strict_json_with_non_finite_values_as_null(value: float) -> None:
    line = encode_event(
        Kind.EPOCH_ENDED, t=1.0, train_loss=value, dice_per_class=[value, 0.5],
        nested={"x": value},
    )  # fmt: skip

    def refuse(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    record = json.loads(line, parse_constant=refuse)
    assert record["train_loss"] is None
    assert record["dice_per_class"] == [None, 0.5] and record["nested"] == {"x": None}


def test_atomic_write_bytes_replaces_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    atomic_write_bytes(path, b"old")
    atomic_write_bytes(path, b"\x00new")
    atomic_write_text(tmp_path / "t.txt", "é")
    assert path.read_bytes() == b"\x00new" and (tmp_path / "t.txt").read_text() == "é"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob.bin", "t.txt"]
