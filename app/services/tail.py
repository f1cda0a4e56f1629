"""Incremental reading of growing files by byte offset (events.jsonl, console.log).

Each poll reads only the bytes appended since the last one and parses complete lines
only; a torn last line waits for its newline. A file that shrank or was replaced (new
inode) is read again from the start and `.reset` says so. A missing file means "waiting".
Memory stays bounded however long the run: records and lines live in deques.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Any

from trainer.schema import decode_event

READ_LIMIT_BYTES = 16 << 20  # per poll; `.more` says the file has more to read
TEXT_BACKLOG_BYTES = 256 << 10  # a text tail opened on a big file starts this far from the end
MAX_PARTIAL_BYTES = 1 << 20  # a "line" longer than this without a newline is cut
MAX_MALFORMED_SAMPLES = 20


class _ByteTail:
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

    def _new_lines(self) -> list[bytes]:
        self.reset = False
        self.more = False
        try:
            handle = open(self.path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
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
                return []
            handle.seek(self.offset)
            data = handle.read(min(stat.st_size - self.offset, READ_LIMIT_BYTES))
        self.offset += len(data)
        self.more = self.offset < stat.st_size
        if skip_torn_start:
            data = data.split(b"\n", 1)[1] if b"\n" in data else b""
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_PARTIAL_BYTES:
            lines.append(self._partial)
            self._partial = b""
        return lines

    def _restart(self) -> None:
        self.offset = 0
        self._partial = b""
        self._inode = None
        self.reset = True


class JsonlTail(_ByteTail):
    def __init__(self, path: Path, max_records: int = 20000) -> None:
        super().__init__(path)
        self.records: deque[dict[str, Any]] = deque(maxlen=max_records)
        self.malformed = 0
        self.malformed_samples: deque[str] = deque(maxlen=MAX_MALFORMED_SAMPLES)

    def poll(self) -> list[dict[str, Any]]:
        """New complete records since the last poll (also appended to `.records`)."""
        lines = self._new_lines()
        if self.reset:
            self.records.clear()
        new = []
        for raw in lines:
            if not raw.strip():
                continue
            record = decode_event(raw)
            if record is None:
                self.malformed += 1
                self.malformed_samples.append(raw[:500].decode(errors="replace"))
                continue
            new.append(record)
        self.records.extend(new)
        return new


class TextTail(_ByteTail):
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
