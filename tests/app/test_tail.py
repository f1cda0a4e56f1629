"""Tailing by byte offset: partial lines, truncation, replaced files, missing files, malformed
lines, bounded memory."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from app.services.tail import JsonlTail, TextTail
from trainer.schema.events import encode_event


def append(path: Path, text: str | bytes) -> None:
    with open(path, "ab") as handle:
        handle.write(text.encode() if isinstance(text, str) else text)


def epoch(n: int) -> str:
    return encode_event("epoch_ended", t=float(n), epoch=n)


def test_missing_file_is_waiting_then_read(tmp_path: Path) -> None:
    tail = JsonlTail(tmp_path / "events.jsonl")
    assert tail.poll() == [] and not tail.exists
    append(tail.path, epoch(0))
    assert [r["epoch"] for r in tail.poll()] == [0] and tail.exists


def test_only_new_records_each_poll(tmp_path: Path) -> None:
    tail = JsonlTail(tmp_path / "events.jsonl")
    append(tail.path, epoch(0) + epoch(1))
    assert [r["epoch"] for r in tail.poll()] == [0, 1]
    assert tail.poll() == []
    append(tail.path, epoch(2))
    assert [r["epoch"] for r in tail.poll()] == [2]
    assert [r["epoch"] for r in tail.records] == [0, 1, 2]


def test_partial_last_line_waits_for_its_newline(tmp_path: Path) -> None:
    tail = JsonlTail(tmp_path / "events.jsonl")
    line = epoch(5)
    append(tail.path, line[:10])
    assert tail.poll() == [] and tail.num_invalid == 0
    append(tail.path, line[10:-1])
    assert tail.poll() == []
    append(tail.path, "\n")
    assert [r["epoch"] for r in tail.poll()] == [5] and tail.num_invalid == 0


def test_truncation_restarts_from_zero(tmp_path: Path) -> None:
    tail = JsonlTail(tmp_path / "events.jsonl")
    append(tail.path, epoch(0) + epoch(1))
    tail.poll()
    with open(tail.path, "wb") as handle:
        handle.write(epoch(9).encode())
    assert [r["epoch"] for r in tail.poll()] == [9] and tail.reset
    assert [r["epoch"] for r in tail.records] == [9]
    assert tail.poll() == [] and not tail.reset


def test_replaced_file_is_detected_by_inode(tmp_path: Path) -> None:
    tail = JsonlTail(tmp_path / "events.jsonl")
    append(tail.path, epoch(0) + epoch(1))
    tail.poll()
    replacement = tmp_path / "new.jsonl"
    append(replacement, epoch(7) + epoch(8) + epoch(9))  # longer: size alone would not tell
    os.replace(replacement, tail.path)
    assert [r["epoch"] for r in tail.poll()] == [7, 8, 9] and tail.reset


def test_file_removed_then_recreated(tmp_path: Path) -> None:
    tail = JsonlTail(tmp_path / "events.jsonl")
    append(tail.path, epoch(0))
    tail.poll()
    tail.path.unlink()
    assert tail.poll() == [] and not tail.exists
    append(tail.path, epoch(3))
    assert [r["epoch"] for r in tail.poll()] == [3]


def test_malformed_lines_are_counted_and_kept_bounded(tmp_path: Path) -> None:
    tail = JsonlTail(tmp_path / "events.jsonl")
    garbage = "".join(f"garbage {i}\n" for i in range(50))
    append(tail.path, epoch(0) + garbage + '{"no_kind": 1}\n' + "\n" + epoch(1))
    assert [r["epoch"] for r in tail.poll()] == [0, 1]
    assert tail.num_invalid == 51
    assert len(tail.invalid_samples) == 20
    assert tail.invalid_samples[-1] == """'t' is missing: {"no_kind": 1}"""


def test_invalid_utf8_is_malformed_not_fatal(tmp_path: Path) -> None:
    tail = JsonlTail(tmp_path / "events.jsonl")
    append(tail.path, b"\xff\xfe\n" + epoch(0).encode())
    assert [r["epoch"] for r in tail.poll()] == [0] and tail.num_invalid == 1


def test_memory_is_bounded_however_long_the_run(tmp_path: Path) -> None:
    tail = JsonlTail(tmp_path / "events.jsonl", max_records=100)
    for chunk in range(10):
        append(tail.path, "".join(epoch(chunk * 1000 + i) for i in range(1000)))
        tail.poll()
    assert len(tail.records) == 100 and tail.records[-1]["epoch"] == 9999


def test_text_tail_keeps_last_lines_and_partial(tmp_path: Path) -> None:
    tail = TextTail(tmp_path / "console.log", max_lines=3)
    assert tail.poll() is False
    append(tail.path, "a\nb\r\nc\nd\npartial")
    assert tail.poll() is True
    assert list(tail.lines) == ["b", "c", "d"] and tail.partial == "partial"
    assert tail.poll() is False
    append(tail.path, " done\n")
    assert tail.poll() and list(tail.lines) == ["c", "d", "partial done"]


def test_text_tail_on_a_huge_file_reads_only_its_end(tmp_path: Path) -> None:
    path = tmp_path / "console.log"
    append(path, "".join(f"line {i}\n" for i in range(200_000)))  # ~2.3 MB
    tail = TextTail(path, max_lines=5)
    tail.poll()
    assert list(tail.lines)[-1] == "line 199999" and tail.offset == path.stat().st_size
    assert all(line.startswith("line ") for line in tail.lines)


def test_a_torn_line_does_not_swallow_the_next_record(tmp_path: Path) -> None:
    """A writer died mid-line; the next one appended a whole record right after the tear."""
    tail = JsonlTail(tmp_path / "events.jsonl")
    topology = encode_event("topology", t=2.0, ranks=[{"global_rank": 0, "pid": 4242}])
    append(tail.path, epoch(0) + epoch(1)[:25])
    assert [r["epoch"] for r in tail.poll()] == [0]  # the torn line waits for its newline
    append(tail.path, topology + epoch(2))
    records = tail.poll()
    assert [r["kind"] for r in records] == ["topology", "epoch_ended"]
    assert records[0]["ranks"][0]["pid"] == 4242 and tail.num_invalid == 1


def test_a_torn_line_read_in_one_go_is_counted_and_the_record_after_it_read(
    tmp_path: Path,
) -> None:
    tail = JsonlTail(tmp_path / "events.jsonl")
    torn = '{"v":1,"t":3.0,"kind":"topology","ranks":[{"pid":7,"global_rank":0}'
    append(tail.path, torn + epoch(4) + "garbage, then {not json}\n" + epoch(5))
    assert [r["epoch"] for r in tail.poll()] == [4, 5]
    assert tail.num_invalid == 2


BAD_RECORDS = [
    ('{"v":1,"t":1,"kind":"epoch_ended","epoch":null}', "'epoch' must be"),
    ('{"v":1,"t":1,"kind":"epoch_ended","epoch":"abc"}', "'epoch' must be"),
    ('{"v":1,"t":1,"kind":"epoch_ended","epoch":1e400}', "'epoch' must be"),
    ('{"v":1,"t":1,"kind":"epoch_ended","epoch":true}', "'epoch' must be"),
    ('{"v":1,"t":1,"kind":"epoch_ended","epoch":1,"train_loss":"low"}', "'train_loss'"),
    ('{"v":1,"t":1,"kind":"topology","ranks":[{"pid":-1}]}', "'ranks' must be"),
    ('{"v":1,"t":1,"kind":"topology","ranks":[{"pid":0}]}', "'ranks' must be"),
    ('{"v":1,"t":1,"kind":"topology","ranks":"all"}', "'ranks' must be"),
    ('{"v":1,"t":"later","kind":"finished"}', "'t' must be a finite number"),
    ('{"v":1,"t":NaN,"kind":"finished"}', "'t' must be a finite number"),
    ('{"v":1,"t":1,"kind":"run_started"}', "'num_epochs' is missing"),
    ("[" * 100_000, "nested too deep"),
    ("1" * 5000, "not JSON"),
]  # fmt: skip


@pytest.mark.parametrize(("line", "reason"), BAD_RECORDS, ids=[r[1] for r in BAD_RECORDS])
def test_an_invalid_record_costs_only_itself(tmp_path: Path, line: str, reason: str) -> None:
    tail = JsonlTail(tmp_path / "events.jsonl")
    append(tail.path, epoch(0) + line + "\n" + epoch(1))
    assert [r["epoch"] for r in tail.poll()] == [0, 1]
    assert tail.num_invalid == 1 and reason in tail.last_invalid_reason


def test_unknown_kinds_are_valid_and_passed_on(tmp_path: Path) -> None:
    tail = JsonlTail(tmp_path / "events.jsonl")
    append(tail.path, encode_event("running_loss", t=1.0, loss=0.3))
    assert [r["kind"] for r in tail.poll()] == ["running_loss"] and tail.num_invalid == 0


@pytest.mark.parametrize("what", ["directory", "fifo", "parent is a file"])
def test_something_else_in_place_of_the_file_reads_as_missing(tmp_path: Path, what: str) -> None:
    path = tmp_path / "events.jsonl"
    if what == "directory":
        path.mkdir()
    elif what == "fifo":
        os.mkfifo(path)  # opening it for reading must not block the reader
    else:
        path.write_text("x")
        path = path / "events.jsonl"
    tail = JsonlTail(path)
    results: list[list] = []
    reader = threading.Thread(target=lambda: results.append(tail.poll()), daemon=True)
    reader.start()
    reader.join(timeout=30)  # a safety net only: a blocked open would hang the suite
    assert results == [[]] and not tail.exists and tail.num_invalid == 0


def _count_opens(monkeypatch) -> list[Path]:
    from app.services import tail as tail_module

    opened: list[Path] = []
    real = tail_module._open_regular

    def counting(path: Path):
        opened.append(path)
        return real(path)

    monkeypatch.setattr(tail_module, "_open_regular", counting)
    return opened


def test_an_unchanged_file_is_not_opened_again(tmp_path: Path, monkeypatch) -> None:
    """An idle job's files cost one stat per poll; an append, a rewrite in place, a
    replacement of the same size and a truncation are each read at the next poll."""
    opened = _count_opens(monkeypatch)
    tail = JsonlTail(tmp_path / "events.jsonl")
    append(tail.path, epoch(0))
    assert [r["epoch"] for r in tail.poll()] == [0]
    for _ in range(3):
        assert tail.poll() == []
    assert len(opened) == 1  # only the first poll opened it
    append(tail.path, epoch(1))
    assert [r["epoch"] for r in tail.poll()] == [1] and len(opened) == 2
    other = tmp_path / "other.jsonl"
    other.write_text(epoch(0) + epoch(7))  # same size as the file it replaces
    assert other.stat().st_size == tail.path.stat().st_size
    os.replace(other, tail.path)
    assert [r["epoch"] for r in tail.poll()] == [0, 7] and tail.reset
    tail.path.write_text(epoch(5))  # truncated and rewritten in place
    assert [r["epoch"] for r in tail.poll()] == [5] and tail.reset


def test_a_file_read_in_parts_is_not_taken_as_unchanged(tmp_path: Path, monkeypatch) -> None:
    """A poll that stopped at READ_LIMIT_BYTES leaves `.more`: the next poll reads on even
    though the file did not change in between."""
    from app.services import tail as tail_module

    monkeypatch.setattr(tail_module, "READ_LIMIT_BYTES", len(epoch(0)))
    tail = JsonlTail(tmp_path / "events.jsonl")
    append(tail.path, epoch(0) + epoch(1))
    assert [r["epoch"] for r in tail.poll()] == [0] and tail.more
    assert [r["epoch"] for r in tail.poll()] == [1] and not tail.more
    assert tail.poll() == []


def test_a_text_tail_reads_a_rewritten_console(tmp_path: Path) -> None:
    tail = TextTail(tmp_path / "console.log")
    append(tail.path, "one\ntwo\n")
    assert tail.poll() and list(tail.lines) == ["one", "two"]
    assert not tail.poll()
    tail.path.write_text("six\n")
    assert tail.poll() and list(tail.lines) == ["six"]
