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

FG_SAMPLES_PER_CASE = 10_000

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaseFingerprint:
    case_id: str
    spacing: tuple[float, float, float]
    shape_before_crop: tuple[int, int, int]
    shape_after_crop: tuple[int, int, int]
    fg_samples: list[list[float]]  # per channel


def foreground_samples(image: np.ndarray, seg: np.ndarray) -> list[list[float]]:
    """FG_SAMPLES_PER_CASE foreground intensities per channel drawn with replacement, so
    every case with foreground weighs the same in the dataset's statistics however small
    its foreground (nnU-Net's rule, and its generator: RandomState(1234) per case)."""
    foreground = seg > 0
    rs = np.random.RandomState(1234)
    samples = []
    for channel in image:
        values = channel[foreground]
        if values.size:
            values = rs.choice(values, FG_SAMPLES_PER_CASE, replace=True)
        samples.append(values.astype(np.float64).tolist())
    return samples


def fingerprint_case(
    case: RawCase, labels: dict[str, int], fallback_spacing: tuple[float, ...] | None
) -> CaseFingerprint:
    """Top-level (picklable) so process pools can run it."""
    image, seg, spacing = load_raw_case(case, labels, fallback_spacing)
    bbox = nonzero_bbox(image)
    image_c, seg_c = crop(image, bbox), crop(seg, bbox)
    samples = foreground_samples(image_c, seg_c)
    return CaseFingerprint(
        case.case_id,
        spacing,
        cast("tuple[int, int, int]", tuple(int(n) for n in image.shape[1:])),
        cast("tuple[int, int, int]", tuple(int(n) for n in image_c.shape[1:])),
        samples,
    )


def intensity_properties(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        nan = float("nan")
        return dict.fromkeys(
            ("mean", "median", "std", "min", "max", "percentile_00_5", "percentile_99_5"), nan
        )
    return {
        "mean": float(values.mean()),
        "median": float(np.median(values)),
        "std": float(values.std()),
        "min": float(values.min()),
        "max": float(values.max()),
        "percentile_00_5": float(np.percentile(values, 0.5)),
        "percentile_99_5": float(np.percentile(values, 99.5)),
    }


def summarize(cases: list[CaseFingerprint], num_channels: int) -> dict:
    """The dataset_fingerprint.json content (nnU-Net v2 key names where they exist)."""
    before = np.array([c.shape_before_crop for c in cases], dtype=np.float64)
    after = np.array([c.shape_after_crop for c in cases], dtype=np.float64)
    relative = np.prod(after, axis=1) / np.prod(before, axis=1)
    per_channel = {}
    for ch in range(num_channels):
        values = np.concatenate([np.asarray(c.fg_samples[ch]) for c in cases])
        per_channel[str(ch)] = intensity_properties(values)
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
    items = [(case, raw.labels, raw.fallback_spacing) for case in raw.cases]
    total = len(items)
    started = time.perf_counter()

    def done(i: int, fp) -> None:
        if per_case:
            progress(f"[check {i + 1}/{total}] {fp.case_id} shape {list(fp.shape_before_crop)} ok")

    cases = run_all(fingerprint_case, items, num_processes, done)
    if not per_case:
        progress(f"[check] {total} cases read and checked in {time.perf_counter() - started:.1f} s")
    return summarize(cases, raw.num_channels)
