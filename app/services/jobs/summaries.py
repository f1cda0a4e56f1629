"""The summary cache: what nnui read of each run's events.jsonl, kept across its starts.

A lab's box holds years of finished runs, each with a megabyte of events; reading them all
again at every start of the board or `nnui status` cost seconds per hundred runs. This
cache holds, per job (and per run folder scanned for runs that ended unseen), the compact
state the rows need and the byte offset it was read to, with the events file's identity
(device, inode, size, mtime, ctime). An unchanged file is then not opened at all, a grown
one is read from the offset on, and a truncated or replaced one again from its start.

`events.jsonl` stays the source of truth: the cache is disposable. It lives in nnui's own
state folder (`$NNUI_STATE_DIR/cache/`), never in a run folder; a missing, damaged or
foreign cache file is ignored and written anew, and deleting it only costs time.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path
from typing import Any

from trainer.schema.atomic import atomic_write_text

CACHE_DIR = "cache"
CACHE_FILE = "run-summaries.json"
CACHE_VERSION = 1
SAVE_EVERY_S = 60.0  # a long-lived reader (the TUI) writes its changes at most this often
FORGET_AFTER_S = 30 * 24 * 3600  # an entry no reader used for this long is dropped
MAX_CACHE_BYTES = 256 << 20  # a larger file is not a cache this code wrote


class SummaryCache:
    """Entries by key, loaded on first use, saved when changed (save_if_due)."""

    def __init__(self, state_dir: Path | None) -> None:
        self.path = Path(state_dir) / CACHE_DIR / CACHE_FILE if state_dir is not None else None
        self._entries: dict[str, Any] | None = None
        self._dirty = False
        self._saved_at: float | None = None
        # A short command's last changes (the runs it found after its first save) too.
        atexit.register(self.save_if_due, 0.0)

    def _loaded(self) -> dict[str, Any]:
        if self._entries is None:
            self._entries = _read(self.path) if self.path is not None else {}
        return self._entries

    def get(self, key: str) -> dict[str, Any] | None:
        entry = self._loaded().get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("data"), dict):
            return None
        entry["used"] = time.time()
        return entry["data"]

    def put(self, key: str, data: dict[str, Any] | None) -> None:
        entries = self._loaded()
        if data is None:
            self._dirty |= entries.pop(key, None) is not None
            return
        held = entries.get(key)
        if not isinstance(held, dict) or held.get("data") != data:
            entries[key] = {"used": time.time(), "data": data}
            self._dirty = True

    def save_if_due(self, every_s: float = SAVE_EVERY_S) -> None:
        """Write the changes: at once the first time, then at most every `every_s` seconds.
        A failure (read-only state folder, full disk) only means the next start reads more."""
        now = time.time()
        if self.path is None or not self._dirty:
            return
        if self._saved_at is not None and now - self._saved_at < every_s:
            return
        entries = self._loaded()
        for key in [k for k, e in entries.items() if not _recent(e, now)]:
            del entries[key]
        try:
            self.path.parent.mkdir(exist_ok=True)  # never the state folder itself
            text = json.dumps({"version": CACHE_VERSION, "entries": entries}, separators=(",", ":"))
            atomic_write_text(self.path, text)
        except (OSError, ValueError):
            pass
        self._dirty, self._saved_at = False, now


def _recent(entry: Any, now: float) -> bool:
    used = entry.get("used") if isinstance(entry, dict) else None
    return isinstance(used, (int, float)) and now - used < FORGET_AFTER_S


def _read(path: Path) -> dict[str, Any]:
    """The entries of the cache file; {} when it is missing, damaged or of another version."""
    try:
        if os.stat(path).st_size > MAX_CACHE_BYTES:
            return {}
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def job_key(job_id: str, run_dir: str, created_at: float, ended_at: float | None) -> str:
    """A job's entry: a record that changed what the filter of its events depends on (its
    creation, its end) names another entry."""
    return f"job\0{job_id}\0{run_dir}\0{created_at!r}\0{ended_at!r}"


def folder_key(run_dir: str) -> str:
    return f"folder\0{run_dir}"
