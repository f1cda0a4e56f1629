"""Tailing by byte offset: partial lines, truncation, replaced files, missing files, malformed
lines, bounded memory."""

from __future__ import annotations

import os
from pathlib import Path

from app.services.tail import JsonlTail, TextTail
from trainer.schema import encode_event


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
    assert tail.poll() == [] and tail.malformed == 0
    append(tail.path, line[10:-1])
    assert tail.poll() == []
    append(tail.path, "\n")
    assert [r["epoch"] for r in tail.poll()] == [5] and tail.malformed == 0


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
    assert tail.malformed == 51
    assert len(tail.malformed_samples) == 20 and tail.malformed_samples[-1] == '{"no_kind": 1}'


def test_invalid_utf8_is_malformed_not_fatal(tmp_path: Path) -> None:
    tail = JsonlTail(tmp_path / "events.jsonl")
    append(tail.path, b"\xff\xfe\n" + epoch(0).encode())
    assert [r["epoch"] for r in tail.poll()] == [0] and tail.malformed == 1


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
