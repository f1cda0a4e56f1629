"""The run-folder contract: events round-trip, torn lines are ignored, status is atomic."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from trainer import schema
from trainer.events import RunRecorder


@pytest.mark.parametrize("kind", sorted(schema.ALL_KINDS))
def test_every_kind_round_trips(kind: str) -> None:
    line = schema.encode_event(kind, t=1.5, epoch=3, dice_per_class=[0.5, None])
    assert line.endswith("\n") and line.count("\n") == 1
    record = schema.decode_event(line)
    assert record == {
        "v": schema.SCHEMA_VERSION,
        "t": 1.5,
        "kind": kind,
        "epoch": 3,
        "dice_per_class": [0.5, None],
    }


@pytest.mark.parametrize("line", ["", "{", '{"kind": 3}', "[1, 2]", '{"v":1,"t":1,"kind":"epo'])
def test_torn_or_foreign_lines_decode_to_none(line: str) -> None:
    assert schema.decode_event(line) is None


def test_status_round_trip_and_unknown_keys(tmp_path: Path) -> None:
    status = schema.Status(state=schema.State.RUNNING, epoch=4, num_epochs=10, pids=[1, 2])
    schema.atomic_write_text(tmp_path / schema.STATUS_FILE, status.to_json())
    assert schema.read_status(tmp_path) == status
    data = json.loads(status.to_json()) | {"future_field": 1}
    assert schema.Status.from_dict(data) == status


def test_recorder_writes_events_and_status_only_when_enabled(tmp_path: Path) -> None:
    main, other = tmp_path / "main", tmp_path / "other"
    for folder, enabled in ((main, True), (other, False)):
        with RunRecorder(folder, enabled=enabled, num_epochs=5) as recorder:
            recorder.event(schema.Kind.EPOCH_ENDED, epoch=0, mean_fg_dice=math.nan)
            recorder.status(schema.State.RUNNING, epoch=1)
            recorder.failed("boom", "Traceback ...")
    lines = (main / schema.EVENTS_FILE).read_text().splitlines()
    kinds = [schema.decode_event(line)["kind"] for line in lines]
    assert kinds == [schema.Kind.EPOCH_ENDED, schema.Kind.FAILED]
    assert schema.read_status(main).state == schema.State.FAILED
    assert not other.exists()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_events_are_strict_json_with_non_finite_values_as_null(value: float) -> None:
    line = schema.encode_event(
        schema.Kind.EPOCH_ENDED, t=1.0, train_loss=value, dice_per_class=[value, 0.5],
        nested={"x": value},
    )  # fmt: skip

    def refuse(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    record = json.loads(line, parse_constant=refuse)
    assert record["train_loss"] is None
    assert record["dice_per_class"] == [None, 0.5] and record["nested"] == {"x": None}


def test_atomic_write_bytes_replaces_whole_file(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    schema.atomic_write_bytes(path, b"old")
    schema.atomic_write_bytes(path, b"\x00new")
    schema.atomic_write_text(tmp_path / "t.txt", "é")
    assert path.read_bytes() == b"\x00new" and (tmp_path / "t.txt").read_text() == "é"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blob.bin", "t.txt"]
