"""Reading one batch of patches (numpy), the CPU half of the loader.

Runs in loader threads or worker processes; the function is pure in its arguments, so
batch k is the same wherever and whenever it is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainer import stop
from trainer.data.blosc_io import ReadBuffers, read_inside, read_padded
from trainer.data.dataset import PreprocessedCases
from trainer.data.sampling import LocationRule, batch_seed, plan_batch


@dataclass(frozen=True)
class BatchSpec:
    """Everything that determines the patches of one batch (plain data: crosses processes)."""

    case_ids: tuple[str, ...]
    patch_size: tuple[int, ...]
    batch_size: int
    oversample_share: float
    seed: int
    rank: int
    stream: str
    # Boxes read for the spatial transform, which cuts patch_size out of them (None: read
    # patch_size itself, as for un-augmented streams).
    read_size: tuple[int, ...] | None = None
    # Regions / ignore label: where patches centre (None: per label, as plain labels).
    rule: LocationRule | None = None


def _boxes(cases: PreprocessedCases, spec: BatchSpec, iteration: int):
    rng = np.random.default_rng(batch_seed(spec.seed, spec.rank, spec.stream, iteration))
    return plan_batch(
        rng,
        spec.case_ids,
        spec.batch_size,
        spec.oversample_share,
        spec.patch_size,
        cases.properties,
        spec.read_size,
        spec.rule,
    )


def load_patches(cases: PreprocessedCases, spec: BatchSpec, iteration: int):
    """(data (b, C, *read) float32, seg (b, 1, *read) uint8, boxes) of batch `iteration`;
    read = spec.read_size or spec.patch_size."""
    boxes = _boxes(cases, spec, iteration)
    images, segs = [], []
    for box in boxes:
        image = read_padded(cases.load_image(box.case_id), box.lower, box.size, 0.0)
        seg = read_padded(cases.load_seg(box.case_id), box.lower, box.size, 0)
        if len(spec.patch_size) == 2:  # one slice deep -> (C, Y, X)
            image, seg = image[:, 0], seg[:, 0]
        images.append(image)
        segs.append(seg)
    return np.stack(images), np.stack(segs), boxes


def load_samples(
    cases: PreprocessedCases,
    spec: BatchSpec,
    iteration: int,
    windows: Sequence[tuple[slice, ...]],
    buffers: ReadBuffers,
):
    """load_patches' batch as per-sample parts in `buffers` (overwritten by the next call
    with them): of the window (slices of the read box's patch axes) given for sample i,
    what lies inside its image, (C, *part) image and (1, *part) seg, and where the part
    starts in the read box (patch axes); the rest of the read is the zero fill, never
    written. Augmentation tells the windows (augment.sample_windows): the centre patch of
    a sample it neither rotates nor scales, the box its rotation and zoom can touch
    otherwise; the rest is never read."""
    boxes = _boxes(cases, spec, iteration)
    two_d = len(spec.patch_size) == 2
    images, segs, starts = [], [], []
    for i, box in enumerate(boxes):
        window = (slice(0, 1), *windows[i]) if two_d else tuple(windows[i])
        lower = tuple(lo + w.start for lo, w in zip(box.lower, window, strict=True))
        size = tuple(w.stop - w.start for w in window)
        image, offset = read_inside(cases.load_image(box.case_id), lower, size, buffers,
                                    f"image{i}")  # fmt: skip
        seg, _ = read_inside(cases.load_seg(box.case_id), lower, size, buffers, f"seg{i}")
        start = tuple(w.start + o for w, o in zip(window, offset, strict=True))
        if two_d:  # one slice deep -> (C, Y, X)
            image, seg, start = image[:, 0], seg[:, 0], start[1:]
        images.append(image)
        segs.append(seg)
        starts.append(start)
    return images, segs, starts


# ---- worker-process side -------------------------------------------------------------

_WORKER_CASES: PreprocessedCases | None = None


def init_worker(folder: str) -> None:
    """Process-pool initializer: ignore the trainer's graceful-stop signal first thing."""
    stop.ignore()
    global _WORKER_CASES
    _WORKER_CASES = PreprocessedCases(folder)


def worker_cases() -> PreprocessedCases:
    """The cases of this worker process (init_worker)."""
    assert _WORKER_CASES is not None, "init_worker did not run"
    return _WORKER_CASES


def load_patches_in_worker(spec: BatchSpec, iteration: int):
    data, seg, _ = load_patches(worker_cases(), spec, iteration)
    return data, seg
