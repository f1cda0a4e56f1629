"""Incremental reading of growing files by byte offset (events.jsonl, console.log).

Each poll reads only the bytes appended since the last one and parses complete lines
only; a torn last line waits for its newline. A line that still does not parse once its
newline came is counted as invalid, and a complete record glued to its end (a writer died
mid-line, the next one appended) is still read. A file that shrank or was replaced (new
inode) is read again from the start and `.reset` says so. A missing file means "waiting".
Memory stays bounded however long the run: records and lines live in deques.
"""

from __future__ import annotations

import os
import re
import stat as stat_module
from collections import deque
from pathlib import Path
from typing import Any, BinaryIO

from trainer.schema.events import parse_event

READ_LIMIT_BYTES = 16 << 20  # per poll; `.more` says the file has more to read
TEXT_BACKLOG_BYTES = 256 << 10  # a text tail opened on a big file starts this far from the end
MAX_PARTIAL_BYTES = 1 << 20  # a "line" longer than this without a newline is cut
MAX_INVALID_SAMPLES = 20
MAX_SAMPLE_BYTES = 200
MAX_RESYNC_TRIES = 32  # candidate record starts tried in one torn line
_RECORD_START = re.compile(rb'\{\s*"v"\s*:')


class ByteTail:
    """Shared offset bookkeeping: returns the new complete lines (bytes) on each call."""

    def __init__(self, path: Path, backlog_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.backlog_bytes = backlog_bytes
        self.more = False
        self.offset = 0
        self.exists = False
        self.reset = False
        self._inode: tuple[int, int] | None = None
        self._partial = b""
        # (device, inode, size, mtime, ctime) of the file when it was last read to its end: a
        # poll that finds it unchanged costs one stat() (the board polls every job's files
        # every second, and most of them are idle), not an open, two fstats and a close.
        self._read_to_end: tuple[int, ...] | None = None

    def _new_lines(self) -> list[bytes]:
        self.reset = False
        self.more = False
        if self._read_to_end is not None and _identity(self.path) == self._read_to_end:
            return []
        self._read_to_end = None
        handle = _open_regular(self.path)
        if handle is None:  # missing, a directory, a pipe, no permission: nothing to read
            if self.exists:
                self._restart()
            self.exists = False
            return []
        with handle:
            stat = os.fstat(handle.fileno())
            inode = (stat.st_dev, stat.st_ino)
            if self._inode is not None and (inode != self._inode or stat.st_size < self.offset):
                self._restart()
            skip_torn_start = False
            backlog = self.backlog_bytes
            if self._inode is None and backlog is not None and stat.st_size - self.offset > backlog:
                self.offset = stat.st_size - backlog
                skip_torn_start = True
            self._inode = inode
            self.exists = True
            if stat.st_size == self.offset:
                self._read_to_end = _key(stat)
                return []
            handle.seek(self.offset)
            data = handle.read(min(stat.st_size - self.offset, READ_LIMIT_BYTES))
        self.offset += len(data)
        self.more = self.offset < stat.st_size
        if not self.more:
            self._read_to_end = _key(stat)
        if skip_torn_start:
            data = data.split(b"\n", 1)[1] if b"\n" in data else b""
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_PARTIAL_BYTES:
            lines.append(self._partial)
            self._partial = b""
        return lines

    def position(self) -> dict[str, Any] | None:
        """Where this reader stands, to resume in another process (resume()); None when it
        did not read the file to its end (nothing to resume from)."""
        if self._read_to_end is None or self._inode is None:
            return None
        # A torn last line is read again from its start.
        return {"offset": self.offset - len(self._partial), "file": list(self._read_to_end)}

    def resume(self, position: dict[str, Any]) -> None:
        """Continue from a position(): an unchanged file costs one stat(), a grown one is read
        from the offset on, a truncated or replaced one again from its start."""
        key = tuple(int(v) for v in position["file"])
        offset = int(position["offset"])
        if len(key) != 5 or not 0 <= offset <= key[2]:
            raise ValueError("not a position")
        self.offset, self._inode, self.exists = offset, (key[0], key[1]), True
        self._partial = b""
        self._read_to_end = key if offset == key[2] else None

    def _restart(self) -> None:
        self.offset = 0
        self._partial = b""
        self._inode = None
        self._read_to_end = None
        self.reset = True


def _key(stat: os.stat_result) -> tuple[int, ...]:
    # A replaced, truncated, appended-to or rewritten file differs in one of these (ctime
    # also moves on a change of permissions, which can make it unreadable).
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def _identity(path: Path) -> tuple[int, ...] | None:
    """_key of a regular file; None: missing or something else in its place."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return _key(stat) if stat_module.S_ISREG(stat.st_mode) else None


def _open_regular(path: Path) -> BinaryIO | None:
    """The file opened for reading, or None when it is not a readable regular file (a FIFO
    in its place must not block the reader: O_NONBLOCK, then the type is checked)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    if not stat_module.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


class JsonlTail(ByteTail):
    """The one reader of events.jsonl: only valid records come out (schema.parse_event);
    every line that is not one is skipped and counted in `num_invalid`, with its reason."""

    def __init__(self, path: Path, max_records: int = 20000) -> None:
        super().__init__(path)
        self.records: deque[dict[str, Any]] = deque(maxlen=max_records)
        self.num_invalid = 0
        self.invalid_samples: deque[str] = deque(maxlen=MAX_INVALID_SAMPLES)

    def poll(self) -> list[dict[str, Any]]:
        """New valid records since the last poll (also appended to `.records`)."""
        lines = self._new_lines()
        if self.reset:
            self.records.clear()
            self.num_invalid = 0
            self.invalid_samples.clear()
        new = []
        for raw in lines:
            if not raw.strip():
                continue
            record, reason = parse_event(raw)
            if record is None:
                self._count_invalid(raw, reason or "invalid")
                # A writer that died mid-line left a torn line that the next writer's first
                # record was appended to: resync on that record rather than lose it.
                record = _record_after_torn_line(raw)
            if record is not None:
                new.append(record)
        self.records.extend(new)
        return new

    def _count_invalid(self, raw: bytes, reason: str) -> None:
        self.num_invalid += 1
        line = raw[:MAX_SAMPLE_BYTES].decode(errors="replace")
        self.invalid_samples.append(f"{reason}: {line}")

    @property
    def last_invalid_reason(self) -> str | None:
        return self.invalid_samples[-1] if self.invalid_samples else None


def _record_after_torn_line(raw: bytes) -> dict[str, Any] | None:
    """The valid event that ends `raw` after a torn start, if there is one.

    Every record is one JSON object, so the only suffix that parses whole is a complete
    record. Candidates are tried at each `{` (those opening `{"v"`, how encode_event starts
    a record, first), a bounded number of them: a long garbage line costs little.
    """
    likely = [m.start() for m in _RECORD_START.finditer(raw, 1)]
    starts = dict.fromkeys(likely[:MAX_RESYNC_TRIES] + _object_starts(raw))
    for start in list(starts)[:MAX_RESYNC_TRIES]:
        record, _ = parse_event(raw[start:])
        if record is not None:
            return record
    return None


def _object_starts(raw: bytes) -> list[int]:
    found: list[int] = []
    index = raw.find(b"{", 1)
    while index != -1 and len(found) < MAX_RESYNC_TRIES:
        found.append(index)
        index = raw.find(b"{", index + 1)
    return found


class TextTail(ByteTail):
    def __init__(self, path: Path, max_lines: int = 500) -> None:
        super().__init__(path, backlog_bytes=TEXT_BACKLOG_BYTES)
        self.lines: deque[str] = deque(maxlen=max_lines)

    def poll(self) -> bool:
        """Read what was appended; True when `.lines` changed."""
        new = self._new_lines()
        if self.reset:
            self.lines.clear()
        for raw in new:
            self.lines.append(raw.decode(errors="replace").rstrip("\r"))
        return bool(new) or self.reset

    @property
    def partial(self) -> str:
        """The torn last line (no newline yet), e.g. a progress bar."""
        return self._partial.decode(errors="replace")
