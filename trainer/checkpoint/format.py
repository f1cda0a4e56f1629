"""The checkpoint file format, checked with the standard library only (no torch).

A checkpoint is a safetensors file: u64 header length, a JSON header (dtype, shape and
data offsets per tensor, plus `__metadata__`), then the tensor bytes. nnui's metadata is
one JSON string under `nnui`; `nnui_sha256` is the sha256 of that string, and inside it
`tensor_sha256` maps every tensor to [dtype, shape, sha256 of its bytes]. Together they
cover every byte of the file: a flipped bit anywhere fails a check here.

Files written before the checksums existed (no `tensor_sha256`) are accepted with a
warning: their structure is still checked, and the loader refuses non-finite tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

log = logging.getLogger("trainer.checkpoint.store")

FORMAT = "nnui-checkpoint-v1"
META_KEY = "nnui"
META_SHA_KEY = "nnui_sha256"
TENSOR_SHA_KEY = "tensor_sha256"
# safetensors refuses larger headers too; it also keeps a garbage length from a huge read.
MAX_HEADER_BYTES = 100 * 1024 * 1024
DIGEST_CHUNK_BYTES = 16 * 1024 * 1024
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "C64": 8,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E4M3FNUZ": 1, "F8_E5M2": 1, "F8_E5M2FNUZ": 1,
}  # fmt: skip

ReadAt = Callable[[int, int], bytes | memoryview]  # (offset, length) -> bytes


class CheckpointError(ValueError):
    """A file that is not a complete, intact nnui checkpoint (message: one line)."""


@dataclass(frozen=True)
class Header:
    """The parsed header of a checkpoint file."""

    name: str
    data_start: int  # file offset of the first tensor byte
    tensors: dict[str, dict[str, Any]]  # name -> {"dtype", "shape", "data_offsets"}
    metadata: dict[str, Any]  # nnui's metadata (format, epoch_next, ...)

    @property
    def has_checksums(self) -> bool:
        return TENSOR_SHA_KEY in self.metadata


def regular_file_size(path: Path) -> int:
    """Size of a regular file; a directory, FIFO or device in its place is a CheckpointError
    (opening a FIFO would block forever)."""
    try:
        info = os.stat(path)
    except OSError as error:
        raise CheckpointError(f"{path.name}: {error.strerror or error}") from error
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path.name}: not a regular file")
    return info.st_size


def parse_header(name: str, size: int, read_at: ReadAt) -> Header:
    """Header, tensor table and nnui metadata of a file of `size` bytes; no tensor bytes read."""
    if size < 8:
        raise CheckpointError(f"{name}: too short ({size} bytes)")
    (header_len,) = struct.unpack("<Q", bytes(read_at(0, 8)))
    if header_len > min(size - 8, MAX_HEADER_BYTES):
        raise CheckpointError(f"{name}: header length {header_len} does not fit the file")
    header = _decode_header(name, bytes(read_at(8, header_len)))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data_len = check_tensor_table(name, tensors)
    if 8 + header_len + data_len != size:
        raise CheckpointError(
            f"{name}: truncated or extended ({size} bytes, expected {8 + header_len + data_len})"
        )
    metadata = _decode_metadata(name, header.get("__metadata__"))
    return Header(name, 8 + header_len, tensors, metadata)


def _loads(name: str, text: str | bytes, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:  # RecursionError: absurdly nested JSON
        raise CheckpointError(f"{name}: unreadable {what} ({str(error)[:80]})") from None


def _decode_header(name: str, raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{name}: header is not UTF-8") from None
    # safetensors pads with spaces only; anything else there is damage, not padding.
    if not text.startswith("{") or not text.rstrip(" ").endswith("}"):
        raise CheckpointError(f"{name}: header is not a JSON object")
    header = _loads(name, text, "header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{name}: header is not a JSON object")
    return header


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_span(offsets: list) -> bool:
    return len(offsets) == 2 and all(map(_is_count, offsets)) and offsets[0] <= offsets[1]


def check_tensor_table(name: str, tensors: dict[str, Any]) -> int:
    """Every entry well formed, sizes consistent, the data contiguous; returns its length."""
    spans = []
    for key, entry in tensors.items():
        if not isinstance(entry, dict):
            raise CheckpointError(f"{name}: malformed tensor table entry {key[:60]!r}")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_BYTES or not isinstance(shape, list):
            raise CheckpointError(f"{name}: tensor {key[:60]!r} has a bad dtype or shape")
        if not all(_is_count(n) for n in shape):
            raise CheckpointError(f"{name}: tensor {key[:60]!r} has a bad shape")
        if not isinstance(offsets, list) or not _is_span(offsets):
            raise CheckpointError(f"{name}: tensor {key[:60]!r} has bad data offsets")
        numel = 1
        for n in shape:
            numel *= n
        if offsets[1] - offsets[0] != numel * DTYPE_BYTES[dtype]:
            raise CheckpointError(f"{name}: tensor {key[:60]!r} size does not match its shape")
        spans.append((offsets[0], offsets[1]))
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise CheckpointError(f"{name}: tensor data overlaps or leaves gaps")
        end = stop
    return end


def _decode_metadata(name: str, raw: object) -> dict[str, Any]:
    if not isinstance(raw, dict) or not isinstance(raw.get(META_KEY), str):
        raise CheckpointError(f"{name}: no nnui metadata")
    unknown = set(raw) - {META_KEY, META_SHA_KEY}
    if unknown or not all(isinstance(v, str) for v in raw.values()):
        raise CheckpointError(f"{name}: unexpected metadata {sorted(unknown)[:3]}")
    text = raw[META_KEY]
    sha = raw.get(META_SHA_KEY)
    if sha is not None and hashlib.sha256(text.encode("utf-8")).hexdigest() != sha:
        raise CheckpointError(f"{name}: metadata checksum mismatch (damaged file)")
    metadata = _loads(name, text, "nnui metadata")
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{name}: nnui metadata is not an object")
    if TENSOR_SHA_KEY in metadata and META_SHA_KEY not in raw:
        raise CheckpointError(f"{name}: metadata checksum missing (damaged file)")
    check_metadata(name, metadata)
    return metadata


def check_metadata(name: str, metadata: dict[str, Any]) -> None:
    """Fields whose damage would crash or mislead a resume, checked before any use."""
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{name}: not an {FORMAT} file")
    epoch_next = metadata.get("epoch_next")
    if not _is_count(epoch_next):
        raise CheckpointError(f"{name}: epoch_next {str(epoch_next)[:40]!r} is not an epoch")
    config = metadata.get("config", {})
    num_epochs = config.get("num_epochs") if isinstance(config, dict) else None
    if not isinstance(config, dict) or (num_epochs is not None and not _is_count(num_epochs)):
        raise CheckpointError(f"{name}: malformed config")
    if num_epochs is not None and epoch_next > num_epochs:
        raise CheckpointError(
            f"{name}: epoch {epoch_next} is beyond its own schedule of {num_epochs} epochs"
        )
    for key in ("ema_fg_dice", "best_ema"):  # the loop computes with them
        value = metadata.get(key)
        finite = _is_number(value) and abs(value) <= sys.float_info.max  # no NaN, inf, 10**400
        if value is not None and not finite:
            raise CheckpointError(f"{name}: {key} {str(value)[:40]!r} is not a number")
    history = metadata.get("history", {})
    if not isinstance(history, dict) or not all(
        isinstance(v, list) and len(v) == epoch_next for v in history.values()
    ):
        raise CheckpointError(f"{name}: history does not match epoch {epoch_next}")
    _check_sections(name, metadata)


def _check_sections(name: str, metadata: dict[str, Any]) -> None:
    optimizer, rng = metadata.get("optimizer"), metadata.get("rng")
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict):
        raise CheckpointError(f"{name}: malformed optimizer state")
    groups = optimizer.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"{name}: malformed optimizer param_groups")
    if not isinstance(metadata.get("scaler", {}), dict):
        raise CheckpointError(f"{name}: malformed scaler state")
    if not isinstance(rng, dict):
        raise CheckpointError(f"{name}: malformed RNG state")
    sums = metadata.get(TENSOR_SHA_KEY, {})
    if not isinstance(sums, dict):
        raise CheckpointError(f"{name}: malformed tensor checksums")


def expected_digests(header: Header) -> dict[str, str] | None:
    """name -> stored sha256 after checking the table against the header (None: an older
    file without checksums)."""
    if not header.has_checksums:
        return None
    sums = header.metadata[TENSOR_SHA_KEY]
    if set(sums) != set(header.tensors):
        extra = sorted(set(sums) ^ set(header.tensors))[:3]
        raise CheckpointError(f"{header.name}: tensors differ from their checksums ({extra})")
    digests = {}
    for key, entry in header.tensors.items():
        expected = sums[key]
        ok = isinstance(expected, list) and len(expected) == 3 and isinstance(expected[2], str)
        if not ok or expected[:2] != [entry["dtype"], entry["shape"]]:
            raise CheckpointError(f"{header.name}: tensor {key[:60]!r} dtype/shape changed")
        digests[key] = expected[2]
    return digests


def check_tensor_bytes(header: Header, read_at: ReadAt) -> None:
    """Every tensor's bytes against its stored sha256 (and its dtype and shape)."""
    digests = expected_digests(header)
    for key, expected in (digests or {}).items():
        begin, end = header.tensors[key]["data_offsets"]
        if digest_range(read_at, header.data_start + begin, end - begin) != expected:
            raise CheckpointError(f"{header.name}: checksum mismatch in {key[:60]!r}")


def digest_range(read_at: ReadAt, start: int, length: int) -> str:
    digest = hashlib.sha256()
    done = 0
    while done < length:
        step = min(DIGEST_CHUNK_BYTES, length - done)
        digest.update(read_at(start + done, step))
        done += step
    return digest.hexdigest()


def file_reader(handle: Any, name: str) -> ReadAt:
    def read_at(offset: int, length: int) -> bytes:
        handle.seek(offset)
        data = handle.read(length)
        if len(data) != length:  # the file shrank under us
            raise CheckpointError(f"{name}: file changed while it was read")
        return data

    return read_at


def verify_file(path: Path) -> Header:
    """Header, metadata and every tensor byte of a file (streamed, stdlib only)."""
    path = Path(path)
    size = regular_file_size(path)
    try:
        with open(path, "rb") as handle:
            read_at = file_reader(handle, path.name)
            header = parse_header(path.name, size, read_at)
            check_tensor_bytes(header, read_at)
    except OSError as error:
        raise CheckpointError(f"{path.name}: {error.strerror or error}") from error
    warn_unchecked(path, header)
    return header


_warned_unchecked: set[str] = set()


def warn_unchecked(path: Path, header: Header) -> None:
    if not header.has_checksums and str(path) not in _warned_unchecked:
        _warned_unchecked.add(str(path))
        log.warning(
            "%s has no checksums (written by an older nnui): its bytes are not verified",
            path.name,
        )
