"""Fingerprint intensity samples and stored foreground locations against nnU-Net 2.8.1."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.planning.fingerprint import foreground_samples
from trainer.planning.preprocess import class_location_count, sample_class_locations

fingerprint = pytest.importorskip(
    "nnunetv2.experiment_planning.dataset_fingerprint.fingerprint_extractor"
)
preprocessor = pytest.importorskip("nnunetv2.preprocessing.preprocessors.default_preprocessor")


@pytest.mark.parametrize("num_foreground", [0, 7, 20_000])
def test_foreground_samples_are_nnunets_draw_with_replacement(num_foreground):
    rng = np.random.default_rng(0)
    image = rng.normal(size=(2, 40, 30, 30)).astype(np.float32)
    seg = np.zeros((40, 30, 30), np.uint8)
    seg.reshape(-1)[rng.choice(seg.size, num_foreground, replace=False)] = 1
    theirs, _ = fingerprint.DatasetFingerprintExtractor.collect_foreground_intensities(
        seg[None], image
    )
    ours = foreground_samples(image, seg, 10_000)
    for c in range(2):
        # a small foreground weighs as much as a large one: as many draws from every case
        assert ours[c].counts.sum() == (10_000 if num_foreground else 0)
        np.testing.assert_array_equal(ours[c].expanded(), np.sort(np.asarray(theirs[c])))


@pytest.mark.parametrize("num_voxels", [5, 9_999, 10_000, 10_001, 600_000, 2_000_000])
def test_class_location_count_is_nnunets(num_voxels):
    seg = np.zeros(num_voxels + 1, np.int8)[None, :, None, None]
    seg[0, :num_voxels] = 1
    theirs = preprocessor.DefaultPreprocessor._sample_foreground_locations(seg, [1])
    assert class_location_count(num_voxels) == len(theirs[1])


def test_stored_locations_are_voxels_of_their_class():
    seg = np.zeros((20, 40, 40), np.uint8)
    seg[2:18, 5:35, 5:35] = 1
    locations = sample_class_locations(seg, [1, 2], seed=0)
    assert len(locations["1"]) == 10_000 and locations["2"] == []
    assert all(seg[tuple(p)] == 1 for p in locations["1"])
    assert len({tuple(p) for p in locations["1"]}) == 10_000  # without replacement


def _write_raw(folder, channels: dict, cases: list, ct: bool) -> None:
    """Cases of very different foreground sizes: photo-like 3-channel integer intensities,
    or CT-like HU values (air -1024 outside a body, up to bone)."""
    import json

    from trainer.data.image_io import write_nifti

    (folder / "imagesTr").mkdir(parents=True)
    (folder / "labelsTr").mkdir()
    rng = np.random.default_rng(len(channels))
    for i, (shape, radius) in enumerate(cases):
        grid = np.meshgrid(*[np.linspace(-1, 1, n) for n in shape], indexing="ij")
        distance = np.sqrt(sum(g**2 for g, n in zip(grid, shape, strict=True) if n > 1))
        seg = (distance < radius).astype(np.uint8) + (distance < radius / 2)
        for c in range(len(channels)):
            if ct:
                image = np.where(distance < 0.9, rng.normal(40, 30, shape), -1024.0)
                image += 300 * (seg == 2) + 900 * (rng.random(shape) < 0.01)
                image = np.rint(image).astype(np.int16)
            else:
                image = rng.integers(0, 256, shape) * 0.3 + 150 * (seg > 0) - 20 * c
                image = np.clip(np.rint(image), 0, 255).astype(np.uint8)
            write_nifti(folder / "imagesTr" / f"c{i}_{c:04d}.nii.gz", image, (1.0, 1.0, 1.0))
        write_nifti(folder / "labelsTr" / f"c{i}.nii.gz", seg, (1.0, 1.0, 1.0))
    dataset_json = {"channel_names": channels, "labels": {"background": 0, "a": 1, "b": 2},
                    "numTraining": len(cases), "file_ending": ".nii.gz"}  # fmt: skip
    (folder / "dataset.json").write_text(json.dumps(dataset_json))


RGB_CASES = [((1, 60, 64), 0.7), ((1, 50, 70), 0.05), ((1, 64, 64), 0.4)]
CT_CASES = [((20, 40, 36), 0.6), ((16, 30, 30), 0.08), ((24, 36, 40), 0.3), ((18, 32, 30), 0.5)]


@pytest.mark.parametrize(
    ("channels", "cases", "ct"),
    [({"0": "R", "1": "G", "2": "B"}, RGB_CASES, False), ({"0": "CT"}, CT_CASES, True)],
    ids=["rgb", "ct"],
)
def test_dataset_intensity_properties_are_nnunets(tmp_path, monkeypatch, channels, cases, ct):
    """nnU-Net's own extractor (its run(), sampling total lowered alike on both sides so
    the test stays small) and nnui's fingerprint on the same files: every statistic."""
    import multiprocessing

    from trainer.data.raw import open_raw_dataset
    from trainer.planning import fingerprint as ours_module

    extractor = fingerprint.DatasetFingerprintExtractor
    name = "Dataset991_Intensities"
    raw, pre = tmp_path / "raw", tmp_path / "pre"
    _write_raw(raw / name, channels, cases, ct)
    monkeypatch.setattr(fingerprint, "nnUNet_raw", str(raw))
    monkeypatch.setattr(fingerprint, "nnUNet_preprocessed", str(pre))
    fork = multiprocessing.get_context("fork")
    monkeypatch.setattr(fingerprint.multiprocessing, "get_context", lambda method=None: fork)
    nnunet = extractor(name, num_processes=1)
    nnunet.show_progress_bar = False
    assert nnunet.num_foreground_voxels_for_intensitystats == ours_module.FG_SAMPLES_TOTAL
    total = 3_000_000
    nnunet.num_foreground_voxels_for_intensitystats = total
    monkeypatch.setattr(ours_module, "FG_SAMPLES_TOTAL", total)
    theirs = nnunet.run()["foreground_intensity_properties_per_channel"]
    mine = ours_module.fingerprint_dataset(open_raw_dataset(raw / name), 1, lambda _: None)
    mine = mine["foreground_intensity_properties_per_channel"]
    assert len(mine) == len(theirs) == len(channels)
    for c in range(len(channels)):
        for key in ("min", "max", "median", "percentile_00_5", "percentile_99_5"):
            assert mine[str(c)][key] == pytest.approx(theirs[c][key], rel=1e-6, abs=1e-4), key
        for key in ("mean", "std"):  # nnU-Net sums in float32
            assert mine[str(c)][key] == pytest.approx(theirs[c][key], rel=1e-5), key
