"""The one module that touches blosc2: chunk/block layout, atomic writes, patch reads.

Layout rule: chunks are at most one patch per axis, so a patch read overlaps at most 2
chunks per axis, and blocks (blosc2's unit of decompression inside a chunk) are kept
around 32 KiB so a read decompresses little more than the patch itself.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import blosc2
import numpy as np

from trainer.schema.atomic import atomic_tmp_path

BLOCK_TARGET_BYTES = 32 * 1024


def choose_layout(
    shape: tuple[int, ...], patch_size: tuple[int, ...], itemsize: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(chunks, blocks) for a (C, Z, Y, X) array read in patches of patch_size.

    A 2D patch (Y, X) is read one slice at a time, so its chunks are one slice deep.
    """
    spatial = tuple(shape[1:])
    patch3 = (1, *patch_size) if len(patch_size) == 2 else tuple(patch_size)
    chunk = [1] + [max(1, min(n, p)) for n, p in zip(spatial, patch3, strict=True)]
    block = list(chunk)
    while np.prod(block) * itemsize > BLOCK_TARGET_BYTES:
        axis = int(np.argmax(block))
        if block[axis] == 1:
            break
        block[axis] = (block[axis] + 1) // 2
    return tuple(chunk), tuple(block)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_array(path: Path, array: np.ndarray, patch_size: tuple[int, ...], **cparams) -> None:
    """Write to a temporary name in the same folder, fsync, then rename (never half a file).

    Without the fsync a power loss shortly after the rename can leave a complete-looking
    name with empty or partial contents on ext4/xfs. Cost measured on the 2-core dev VM
    (ext4, default demo, -np 1), all fsyncs on vs off: +10-30 % (11.6-12.6 s vs
    9.5-10.5 s), far from doubling it, so every file is synced.
    """
    chunks, blocks = choose_layout(array.shape, patch_size, array.dtype.itemsize)
    params = {"codec": blosc2.Codec.LZ4, "clevel": 5, "nthreads": 1}
    params.update(cparams)
    # blosc2 writes to a path, not from bytes: schema.atomic_write_bytes's steps by hand,
    # under its tmp name.
    tmp = atomic_tmp_path(path)
    try:
        written = blosc2.asarray(
            np.ascontiguousarray(array),
            urlpath=str(tmp),
            mode="w",
            chunks=chunks,
            blocks=blocks,
            cparams=params,
        )
        del written  # closes blosc2's handle before the data is flushed to disk
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:  # e.g. a full disk: no half file left
        tmp.unlink(missing_ok=True)
        raise


def open_array(path: Path) -> blosc2.NDArray:
    """Open read-only with one decompression thread (loader threads run in parallel),
    memory-mapped: a read then decompresses straight from the page cache instead of a
    read() per chunk, which halved a read's CPU (DRIVE 2d image 3.9 -> 2.0 ms, 3D MR case
    111 -> 66 ms). A file replaced later (an atomic rename) stays mapped as it was."""
    return blosc2.open(str(path), mode="r", mmap_mode="r", dparams={"nthreads": 1})


class OpenArrays:
    """Arrays opened by open_array, kept per thread (a blosc2 handle is not shared across
    threads), the least recently used dropped past `limit`: each holds a memory map, and
    thousands of cases times several loader threads would near the kernel's limit on
    mappings per process."""

    def __init__(self, limit: int = 512) -> None:
        self.limit = limit
        self._local = threading.local()

    def get(self, path: Path) -> blosc2.NDArray:
        """The opened array at path (FileNotFoundError when it is not there)."""
        cache: OrderedDict[str, blosc2.NDArray] | None = getattr(self._local, "arrays", None)
        if cache is None:
            cache = self._local.arrays = OrderedDict()
        key = str(path)
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        array = cache[key] = open_array(Path(path))
        if len(cache) > self.limit:
            cache.popitem(last=False)
        return array


def read_padded(
    array, lower: tuple[int, ...], size: tuple[int, ...], fill: float = 0
) -> np.ndarray:
    """The box [lower, lower + size) of the trailing axes, zero-padded where it leaves the array.

    Only the part inside the array is sliced from blosc2, so only the chunks and blocks
    it overlaps are decompressed.
    """
    ndim = len(lower)
    lead = tuple(array.shape[: array.ndim - ndim])
    spatial = tuple(array.shape[array.ndim - ndim :])
    src, dst = [], []
    for lo, n, full in zip(lower, size, spatial, strict=True):
        start, stop = max(lo, 0), min(lo + n, full)
        if stop <= start:
            return np.full(lead + tuple(size), fill, dtype=array.dtype)
        src.append(slice(start, stop))
        dst.append(slice(start - lo, stop - lo))
    keep = (slice(None),) * len(lead)
    inside = array[keep + tuple(src)]
    if all(s.stop - s.start == n for s, n in zip(dst, size, strict=True)):
        return np.ascontiguousarray(inside)
    out = np.full(lead + tuple(size), fill, dtype=array.dtype)
    out[keep + tuple(dst)] = inside
    return out


class ReadBuffers:
    """Reusable read buffers, one per slot name, for one thread: a batch read into fresh
    arrays makes the kernel zero-fill every page again (allocations this large are mmap'd
    and returned on free), which cost a 3D batch as much CPU as the reading itself."""

    def __init__(self) -> None:
        self._flat: dict[str, np.ndarray] = {}

    def take(self, slot: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A C-contiguous (shape, dtype) array: slot's memory, overwritten by the next take."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        flat = self._flat.get(slot)
        if flat is None or flat.nbytes < nbytes:
            flat = self._flat[slot] = np.empty(nbytes, dtype=np.uint8)
        return flat[:nbytes].view(dtype).reshape(shape)


def _read_into(array, key: tuple[slice, ...], out: np.ndarray) -> None:
    """array[key] into out (C-contiguous, the key's shape) without an intermediate array."""
    if isinstance(array, blosc2.NDArray):
        pairs = [s.indices(n)[:2] for s, n in zip(key, array.shape, strict=True)]
        starts, stops = zip(*pairs, strict=True)
        array.get_slice_numpy(out, (starts, stops))
    else:
        out[...] = array[key]


def read_inside(
    array, lower: tuple[int, ...], size: tuple[int, ...], buffers: ReadBuffers, slot: str
) -> tuple[np.ndarray, tuple[int, ...]]:
    """The part of the box [lower, lower + size) of the trailing axes that lies inside the
    array, read straight into buffers' slot (C-contiguous, the leading axes kept), and
    where it starts in the box. No padding is written: whoever uses it knows the rest is
    the zero fill. A box that misses the array gives one zero voxel at its start."""
    ndim = len(lower)
    lead = tuple(array.shape[: array.ndim - ndim])
    src = []
    for lo, n, full in zip(lower, size, array.shape[array.ndim - ndim :], strict=True):
        start, stop = max(lo, 0), min(lo + n, full)
        if stop <= start:
            empty = buffers.take(slot, lead + (1,) * ndim, array.dtype)
            empty.fill(0)
            return empty, (0,) * ndim
        src.append(slice(start, stop))
    out = buffers.take(slot, lead + tuple(s.stop - s.start for s in src), array.dtype)
    _read_into(array, (slice(None),) * len(lead) + tuple(src), out)
    return out, tuple(s.start - lo for s, lo in zip(src, lower, strict=True))
