"""Dataset fingerprint: spacings, shapes after cropping, foreground intensity statistics.

Reading every case for the fingerprint also runs every integrity check (DataError), so
`nnui-preprocess --verify` is this pass without writing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from typing import cast

import numpy as np

from trainer.data.case_ops import crop, nonzero_bbox
from trainer.data.raw import RawCase, RawDataset, load_raw_case

# nnU-Net samples 10^8 foreground voxels per channel for the whole dataset, with replacement,
# the same number from every case (DatasetFingerprintExtractor.num_foreground_voxels_...).
FG_SAMPLES_TOTAL = 10**8
_DRAW_CHUNK = 1 << 22  # draws at a time: memory stays small, the random stream the same

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Drawn:
    """One channel's foreground samples held compactly: each distinct value (sorted) and
    how often it was drawn (nnU-Net keeps the 10^8 samples themselves)."""

    values: np.ndarray  # float32, sorted, unique
    counts: np.ndarray  # int64, > 0

    def expanded(self) -> np.ndarray:
        return np.repeat(self.values, self.counts)


@dataclass(frozen=True)
class CaseFingerprint:
    case_id: str
    spacing: tuple[float, float, float]
    shape_before_crop: tuple[int, int, int]
    shape_after_crop: tuple[int, int, int]
    fg_samples: list[Drawn]  # per channel


def samples_per_case(num_cases: int) -> int:
    return int(FG_SAMPLES_TOTAL // max(num_cases, 1))


def _compact(values: np.ndarray, counts: np.ndarray) -> Drawn:
    keep = counts > 0
    unique, inverse = np.unique(values[keep], return_inverse=True)
    summed = np.bincount(inverse.ravel(), weights=counts[keep], minlength=unique.size)
    return Drawn(unique.astype(np.float32), np.rint(summed).astype(np.int64))


def foreground_samples(image: np.ndarray, seg: np.ndarray, num_samples: int) -> list[Drawn]:
    """`num_samples` foreground intensities per channel drawn with replacement, so every
    case with foreground weighs the same in the dataset's statistics however small its
    foreground: nnU-Net's rule and its draws (RandomState(1234) per case, one stream over
    the channels), counted per voxel instead of stored."""
    foreground = seg > 0
    rs = np.random.RandomState(1234)
    samples = []
    for channel in image:
        values = channel[foreground].astype(np.float32)
        counts = np.zeros(values.size, np.int64)
        for start in range(0, num_samples if values.size else 0, _DRAW_CHUNK):
            size = min(_DRAW_CHUNK, num_samples - start)
            counts += np.bincount(rs.randint(0, values.size, size=size), minlength=values.size)
        samples.append(_compact(values, counts))
    return samples


def fingerprint_case(
    case: RawCase,
    labels: dict[str, int],
    fallback_spacing: tuple[float, ...] | None,
    num_samples: int,
) -> CaseFingerprint:
    """Top-level (picklable) so process pools can run it."""
    image, seg, spacing = load_raw_case(case, labels, fallback_spacing)
    bbox = nonzero_bbox(image)
    image_c, seg_c = crop(image, bbox), crop(seg, bbox)
    samples = foreground_samples(image_c, seg_c, num_samples)
    return CaseFingerprint(
        case.case_id,
        spacing,
        cast("tuple[int, int, int]", tuple(int(n) for n in image.shape[1:])),
        cast("tuple[int, int, int]", tuple(int(n) for n in image_c.shape[1:])),
        samples,
    )


def _percentile(drawn: Drawn, q: float) -> float:
    """np.percentile's linear rule on the expanded samples, from the counts."""
    ends = np.cumsum(drawn.counts)
    position = (int(ends[-1]) - 1) * q / 100
    low = int(np.floor(position))
    at = np.searchsorted(ends, [low, min(low + 1, int(ends[-1]) - 1)], side="right")
    a, b = (float(drawn.values[i]) for i in at)
    return a + (position - low) * (b - a)


def intensity_properties(drawn: Drawn) -> dict[str, float]:
    """nnU-Net's per-channel statistics of the pooled samples (float64 sums where it sums
    in float32: equal to about 1e-6 relative)."""
    if drawn.counts.sum() == 0:
        nan = float("nan")
        return dict.fromkeys(
            ("mean", "median", "std", "min", "max", "percentile_00_5", "percentile_99_5"), nan
        )
    values, weights = drawn.values.astype(np.float64), drawn.counts.astype(np.float64)
    mean = float(np.average(values, weights=weights))
    return {
        "mean": mean,
        "median": _percentile(drawn, 50.0),
        "std": float(np.sqrt(np.average((values - mean) ** 2, weights=weights))),
        "min": float(values[0]),
        "max": float(values[-1]),
        "percentile_00_5": _percentile(drawn, 0.5),
        "percentile_99_5": _percentile(drawn, 99.5),
    }


def pooled(drawn: list[Drawn]) -> Drawn:
    """The samples of several cases together (nnU-Net concatenates them)."""
    if not drawn:
        return Drawn(np.zeros(0, np.float32), np.zeros(0, np.int64))
    return _compact(np.concatenate([d.values for d in drawn]),
                    np.concatenate([d.counts for d in drawn]))  # fmt: skip


def summarize(cases: list[CaseFingerprint], num_channels: int) -> dict:
    """The dataset_fingerprint.json content (nnU-Net v2 key names where they exist)."""
    before = np.array([c.shape_before_crop for c in cases], dtype=np.float64)
    after = np.array([c.shape_after_crop for c in cases], dtype=np.float64)
    relative = np.prod(after, axis=1) / np.prod(before, axis=1)
    per_channel = {}
    for ch in range(num_channels):
        per_channel[str(ch)] = intensity_properties(pooled([c.fg_samples[ch] for c in cases]))
    return {
        "case_ids": [c.case_id for c in cases],
        "spacings": [list(c.spacing) for c in cases],
        "shapes_before_crop": [list(c.shape_before_crop) for c in cases],
        "shapes_after_crop": [list(c.shape_after_crop) for c in cases],
        "median_relative_size_after_cropping": float(np.median(relative)),
        "foreground_intensity_properties_per_channel": per_channel,
    }


def run_all(fn: Callable, items: list, num_processes: int, on_done: Callable) -> list:
    """fn over items, in worker processes when num_processes > 1; results in input order."""
    results: list = [None] * len(items)
    if num_processes <= 1 or len(items) <= 1:
        for i, item in enumerate(items):
            results[i] = fn(*item)
            on_done(i, results[i])
        return results
    num_done = 0
    # spawn: safe even when the caller already imported torch (fork + OpenMP threads is not).
    with ProcessPoolExecutor(num_processes, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(fn, *item): i for i, item in enumerate(items)}
        try:
            for future in as_completed(futures):
                i = futures[future]
                results[i] = future.result()
                on_done(num_done, results[i])  # progress counts completions, not positions
                num_done += 1
        except BaseException:
            # First error wins: do not wait for the remaining cases.
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return results


def fingerprint_dataset(
    raw: RawDataset,
    num_processes: int = 1,
    progress: Callable[[str], None] = log.info,
    per_case: bool = True,
) -> dict:
    """Read and check every case; DataError on the first problem."""
    num_samples = samples_per_case(len(raw.cases))
    items = [(case, raw.labels, raw.fallback_spacing, num_samples) for case in raw.cases]
    total = len(items)
    started = time.perf_counter()

    def done(i: int, fp) -> None:
        if per_case:
            progress(f"[check {i + 1}/{total}] {fp.case_id} shape {list(fp.shape_before_crop)} ok")

    cases = run_all(fingerprint_case, items, num_processes, done)
    if not per_case:
        progress(f"[check] {total} cases read and checked in {time.perf_counter() - started:.1f} s")
    return summarize(cases, raw.num_channels)
