"""The pure helpers of the --real benchmarks (bench/loader.py, bench/loader_sides.py,
bench/predict_real.py, bench/real_data.py): run order, figures, generated cases, window
counts. Nothing here times anything or reads ../shared."""

from __future__ import annotations

import cProfile
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import loader
import loader_sides
import predict_real
import real_data


def _run(side: str, block: int, batches: int, cpu_s: float, rss_mib: int) -> dict:
    return {"side": side, "block": block, "batches": batches, "batch_size": 2, "cpu_s": cpu_s,
            "wall_s": 2 * cpu_s, "peak_rss_bytes": rss_mib * 2**20,
            "peak_pss_bytes": rss_mib * 2**19}  # fmt: skip


def test_block_order_alternates_the_sides():
    assert loader.block_order(2) == [(0, "nnU-Net"), (0, "nnui"), (1, "nnU-Net"), (1, "nnui")]


def test_summarize_blocks_pools_samples_over_cpu_and_pairs_blocks():
    runs = [
        _run("nnU-Net", 0, 10, 20.0, 1000),
        _run("nnui", 0, 10, 10.0, 500),
        _run("nnU-Net", 1, 10, 10.0, 1200),
        _run("nnui", 1, 10, 10.0, 400),
    ]
    s = loader.summarize_blocks(runs)
    assert s["nnU-Net"]["samples_per_core"] == pytest.approx(40 / 30)
    assert s["nnui"]["samples_per_core"] == pytest.approx(2.0)
    assert s["ratio"] == pytest.approx(2.0 / (40 / 30))
    assert s["block_ratios"] == pytest.approx([2.0, 1.0])
    assert s["nnui"]["peak_rss_mib"] == 500 and s["nnU-Net"]["peak_rss_mib"] == 1200
    assert s["peak_rss_ratio"] == pytest.approx(500 / 1200)
    assert s["nnui"]["samples_per_s_wall"] == pytest.approx(1.0)


def test_samples_per_core_of_a_run_without_cpu_is_nan():
    assert math.isnan(loader.samples_per_core(_run("nnui", 0, 3, 0.0, 1)))


def test_mr_like_case_has_four_channels_zero_outside_the_brain_and_tumour_labels():
    image, label, spacing = real_data.mr_like_case(0, 1, shape=(40, 48, 44))
    assert image.shape == (4, 40, 48, 44) and image.dtype == np.float32
    assert label.shape == (40, 48, 44) and label.dtype == np.uint8
    assert set(np.unique(label)) <= {0, 1, 2, 3} and (label > 0).any()
    outside = image.sum(axis=0) == 0
    assert outside.any() and (image[:, ~outside] > 0).all()
    assert (label[outside] == 0).all()
    assert spacing == (1.0, 1.0, 1.0)
    again, _, _ = real_data.mr_like_case(0, 1, shape=(40, 48, 44))
    assert np.array_equal(image, again)


def test_ct_like_case_is_int16_hu_with_air_body_and_bone():
    hu, spacing = real_data.ct_like_case(0, shape=(12, 64, 64))
    assert hu.dtype == np.int16 and hu.shape == (12, 64, 64)
    assert hu.min() <= -900 and hu.max() >= 500
    assert spacing == real_data.CT_SPACING


def test_logits_from_image_argmax_follows_the_anatomy():
    hu = np.full((8, 32, 32), -1000, np.int16)
    hu[:, 4:28, 4:28] = 60
    hu[:, 14:18, 14:18] = 900
    labels = predict_real.logits_from_image(hu).argmax(axis=0)
    assert labels[4, 0, 0] == 0 and labels[4, 8, 8] == 1 and labels[4, 16, 16] == 2


@pytest.mark.parametrize(
    ("shape", "patch"),
    [((291, 525, 525), (128, 128, 128)), ((100, 40, 300), (64, 64, 96)), ((5, 7), (9, 9))],
)
def test_window_count_is_nnunets_sliding_window_rule(shape, patch):
    from nnunetv2.inference.sliding_window_prediction import compute_steps_for_sliding_window

    steps = compute_steps_for_sliding_window(
        [max(s, p) for s, p in zip(shape, patch, strict=True)], patch, 0.5
    )
    assert predict_real.window_count(shape, patch) == math.prod(len(s) for s in steps)


def test_top_functions_ranks_by_own_time_with_shares():
    def busy():
        return sum(i * i for i in range(20000))

    prof = cProfile.Profile()
    prof.enable()
    busy()
    prof.disable()
    rows = loader_sides.top_functions(prof, 3)
    assert len(rows) <= 3 and rows
    assert all(0 <= r["share"] <= 1 for r in rows)
    assert [r["tottime_s"] for r in rows] == sorted((r["tottime_s"] for r in rows), reverse=True)
