"""PatchLoader: an infinite, resumable stream of augmented batches on the training device.

Patch reading runs ahead in background workers (threads by default: blosc2 and numpy
release the GIL and, measured on 2 cores, threads beat processes; see bench/loader.py)
with at most `prefetch` batches in flight. Augmentation runs batched on the training
device (augment_on="device"): for a GPU in the consuming thread, for the CPU inside the
loader threads; augment_on="cpu" keeps it in the loader threads for a GPU too and moves
finished batches (nnU-Net's way). Loader threads augment with one intra-op thread each
(two OpenMP threads cost twice the CPU for these small ops, and the training step keeps
its own threads). Loader threads are named `nnui-loader` for the
OS (`top -H`, bench/). Batch k depends only on (seed, rank, stream, k), so a loader
started at start_iteration=k continues the exact stream of one that ran from 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

import numpy as np
import torch

from trainer.data.augment import AugmentConfig, augment_batch, read_size, sample_windows
from trainer.data.blosc_io import ReadBuffers
from trainer.data.dataset import PreprocessedCases
from trainer.data.patches import (
    BatchSpec,
    init_worker,
    load_patches,
    load_patches_in_worker,
    load_samples,
    worker_cases,
)
from trainer.data.sampling import STREAM_IDS, LocationRule, forced_slots

ANISO_THRESHOLD = 3.0
LOADER_THREAD_NAME = b"nnui-loader"


def _init_loader_thread(augments: bool) -> None:
    """Name the OS thread (Linux) and keep its torch ops on one intra-op thread."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the name is cosmetic
        ctypes.CDLL(None).prctl(15, LOADER_THREAD_NAME, 0, 0, 0)  # PR_SET_NAME
    if augments:
        # Per thread: the main thread keeps the count it initialised before this starts.
        torch.set_num_threads(1)


@dataclass
class Batch:
    data: torch.Tensor  # (b, C, *patch) float32 on the training device
    target: torch.Tensor  # (b, 1, *patch) uint8 on the training device
    iteration: int


def augment_seed(seed: int, rank: int, stream: str, iteration: int) -> int:
    """Seed of the augmentation generators of batch k (independent of the sampling seed)."""
    words = [int(seed), int(rank), STREAM_IDS[stream], int(iteration), 1]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0] >> 1)


def _check_arguments(
    cases: PreprocessedCases,
    case_ids: list[str],
    patch_size: tuple[int, ...],
    batch_size: int,
    oversample_share: float,
    stream: str,
    worker_mode: str,
    augment_on: str,
) -> None:
    """ValueError (or the cases' missing-file error) before any worker starts."""
    if not case_ids:
        raise ValueError("PatchLoader needs at least one case id")
    missing = sorted(set(case_ids) - set(cases.case_ids))
    if missing:
        raise ValueError(f"cases not in {cases.folder}: {missing[:5]}")
    gone = sorted(set(case_ids) & set(cases.missing_case_ids()))
    if gone:  # a deleted file: fail now with the fix, not later in a worker thread
        raise cases.missing_error(gone)
    if len(patch_size) not in (2, 3):
        raise ValueError(f"patch_size must have 2 or 3 entries, got {patch_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if worker_mode not in ("thread", "process"):
        raise ValueError(f"worker_mode must be 'thread' or 'process', got {worker_mode!r}")
    if augment_on not in ("device", "cpu"):
        raise ValueError(f"augment_on must be 'device' or 'cpu', got {augment_on!r}")
    forced_slots(batch_size, oversample_share)  # validates the share
    if stream not in STREAM_IDS:
        raise ValueError(f"stream must be one of {sorted(STREAM_IDS)}, got {stream!r}")


def default_augment_config(
    patch_size: tuple[int, ...], mask_channels: tuple[bool, ...] = ()
) -> AugmentConfig:
    # nnU-Net's rule for "dummy 2D" augmentation: the patch, not the spacing, decides (a
    # patch much thinner along axis 0 than its widest side)
    aniso = len(patch_size) == 3 and max(patch_size) / patch_size[0] > ANISO_THRESHOLD
    # nnU-Net's ranges: 2D patches and in-plane-only 3D rotate freely, except elongated 2D
    # patches (longest side > 1.5 x the shortest: 15 degrees); other 3D up to 30 degrees.
    if len(patch_size) == 2:
        degrees = 15.0 if max(patch_size) / min(patch_size) > 1.5 else 180.0
    else:
        degrees = 180.0 if aniso else 30.0
    return AugmentConfig(
        rotation_deg=degrees, in_plane_only=aniso, mask_channels=tuple(mask_channels)
    )


def _start_workers(
    cases: PreprocessedCases, num_workers: int, worker_mode: str, augment_in_worker: bool
) -> Executor | None:
    """The background readers: None (read in __next__), threads, or processes."""
    if num_workers > 0 and worker_mode == "thread":
        torch.get_num_threads()  # settles this thread's own count before workers start
        return ThreadPoolExecutor(
            num_workers,
            thread_name_prefix="nnui-loader",
            initializer=_init_loader_thread,
            initargs=(augment_in_worker,),
        )
    if num_workers > 0:
        # fork (Linux): the child starts with the parent's harmless flag handler and
        # init_worker ignores SIGUSR1 before anything else; spawn would leave a window
        # with the default (fatal) action while the child imports.
        method = "fork" if sys.platform.startswith("linux") else "spawn"
        return ProcessPoolExecutor(
            num_workers,
            mp_context=get_context(method),
            initializer=init_worker,
            initargs=(str(cases.folder),),
        )
    return None


@dataclass
class Parts:
    """What an augmented batch is made from (patches.load_samples): per sample the part
    of its read that augmentation touches and the image holds, and where it starts."""

    images: list[np.ndarray]
    segs: list[np.ndarray]
    starts: list[tuple[int, ...]]


def augment_generator(spec: BatchSpec, iteration: int) -> torch.Generator:
    """The generator of batch `iteration`'s augmentation draws (and of its windows)."""
    generator = torch.Generator()
    generator.manual_seed(augment_seed(spec.seed, spec.rank, spec.stream, iteration))
    return generator


def read_parts(
    cases: PreprocessedCases,
    spec: BatchSpec,
    config: AugmentConfig,
    iteration: int,
    buffers: ReadBuffers | None = None,
) -> Parts:
    """Batch `iteration`'s parts: only the windows its augmentation draws touch, only what
    of them lies inside the image (into `buffers`, else arrays of their own). The same
    wherever it runs, so every worker mode and device augments the same voxels."""
    read = spec.read_size or spec.patch_size
    windows = sample_windows(
        augment_generator(spec, iteration), spec.batch_size, config, read, spec.patch_size
    )
    images, segs, starts = load_samples(
        cases, spec, iteration, windows, buffers if buffers is not None else ReadBuffers()
    )
    return Parts(images, segs, starts)


def read_parts_in_worker(spec: BatchSpec, config: AugmentConfig, iteration: int) -> Parts:
    return read_parts(worker_cases(), spec, config, iteration)


def _augment_placement(
    augment: bool, device: torch.device, augment_on: str, num_workers: int, worker_mode: str
) -> tuple[torch.device, bool, bool]:
    """(where the consumer augments the parts worker processes read: the training device,
    or the CPU before the batch moves there; whether loader threads augment; whether the
    reading thread augments, loader thread or inline: its reads then go into that thread's
    reused buffers)."""
    cpu_augment = augment and (device.type == "cpu" or augment_on == "cpu")
    in_threads = cpu_augment and num_workers > 0 and worker_mode == "thread"
    in_load = cpu_augment and (num_workers == 0 or worker_mode == "thread")
    return (torch.device("cpu") if cpu_augment else device), in_threads, in_load


class PatchLoader:
    def __init__(
        self,
        cases: PreprocessedCases,
        case_ids: list[str],
        patch_size: tuple[int, ...],
        batch_size: int,
        oversample_share: float,
        seed: int,
        rank: int,
        device: torch.device,
        augment: bool,
        start_iteration: int = 0,
        num_workers: int = 2,
        prefetch: int = 2,
        stream: str = "train",
        worker_mode: str = "thread",
        augment_config: AugmentConfig | None = None,
        mask_channels: tuple[bool, ...] = (),  # the plans' use_mask_for_norm
        rule: LocationRule | None = None,  # regions / ignore label (trainer.data.labels)
        augment_on: str = "device",  # or "cpu": in the loader threads, also for a GPU
    ):
        _check_arguments(
            cases, case_ids, patch_size, batch_size, oversample_share, stream, worker_mode,
            augment_on,
        )  # fmt: skip
        self.cases = cases
        if augment_config is None:
            augment_config = default_augment_config(tuple(patch_size), mask_channels)
        self.augment_config = augment_config
        # Augmented streams read a larger box and cut the patch out of its centre after the
        # rotation / scaling (nnU-Net's way): rotated corners hold image, not fill.
        read = read_size(tuple(patch_size), augment_config) if augment else None
        self.spec = BatchSpec(
            tuple(sorted(case_ids)),
            tuple(int(p) for p in patch_size),
            int(batch_size),
            float(oversample_share),
            int(seed),
            int(rank),
            stream,
            read,
            rule,
        )
        self.device = torch.device(device)
        self.augment = augment
        self.prefetch = max(1, int(prefetch))
        self._next_submit = int(start_iteration)
        self._iteration = int(start_iteration)
        self._pending: deque[tuple[int, Future | None]] = deque()
        self._augment_device, self._augment_in_worker, self._augment_in_load = _augment_placement(
            augment, self.device, augment_on, num_workers, worker_mode
        )
        self._local = threading.local()
        self._executor: Executor | None = _start_workers(
            cases, num_workers, worker_mode, self._augment_in_worker
        )
        self._closed = False
        self.wait_s = 0.0  # time __next__ spent blocked on a batch (data starving the step)

    @property
    def iteration(self) -> int:
        """Index of the next batch __next__ returns."""
        return self._iteration

    def _submit(self, iteration: int) -> Future | None:
        if self._executor is None:
            return None
        if isinstance(self._executor, ProcessPoolExecutor):
            if self.augment:
                return self._executor.submit(
                    read_parts_in_worker, self.spec, self.augment_config, iteration
                )
            return self._executor.submit(load_patches_in_worker, self.spec, iteration)
        return self._executor.submit(self._load, iteration)

    def _load(self, iteration: int):
        """Batch `iteration` as far as this thread takes it: augmented (CPU augmentation),
        the parts to augment on the device, or the un-augmented patches (numpy)."""
        if not self.augment:
            data, seg, _ = load_patches(self.cases, self.spec, iteration)
            return data, seg
        if not self._augment_in_load:  # the consumer holds them: arrays of their own
            return read_parts(self.cases, self.spec, self.augment_config, iteration)
        buffers = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = ReadBuffers()
        parts = read_parts(self.cases, self.spec, self.augment_config, iteration, buffers)
        return self._augmented(parts, iteration)

    def _augmented(self, parts: Parts, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        return augment_batch(
            [torch.from_numpy(x).to(self._augment_device) for x in parts.images],
            [torch.from_numpy(y).to(self._augment_device) for y in parts.segs],
            augment_generator(spec, iteration),
            self.augment_config,
            patch_size=spec.patch_size,
            read_size=spec.read_size or spec.patch_size,
            starts=parts.starts,
        )

    def __iter__(self) -> PatchLoader:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise RuntimeError("PatchLoader is closed")
        while len(self._pending) < self.prefetch:
            self._pending.append((self._next_submit, self._submit(self._next_submit)))
            self._next_submit += 1
        iteration, future = self._pending.popleft()
        started = time.perf_counter()
        loaded = future.result() if future is not None else self._load(iteration)
        self.wait_s += time.perf_counter() - started
        if self._augment_in_load:
            data, seg = loaded
        elif self.augment:  # from the parts read, where augmentation runs
            data, seg = self._augmented(loaded, iteration)
        else:
            data, seg = (torch.from_numpy(a) for a in loaded)
        if data.device != self.device:  # CPU batches for a GPU
            if self.device.type == "cuda":
                data, seg = data.pin_memory(), seg.pin_memory()
            data = data.to(self.device, non_blocking=True)
            seg = seg.to(self.device, non_blocking=True)
        self._iteration = iteration + 1
        return Batch(data, seg, iteration)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> PatchLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()
