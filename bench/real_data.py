"""Synthetic cases at real sizes for the --real benchmarks (bench/loader.py, bench/predict.py).

MR-like: four co-registered channels (FLAIR/T1/T1c/T2-like contrasts) of a BraTS-sized head
(155 x 240 x 240 at 1 mm, zero outside an ellipsoidal brain, so nonzero cropping and masked
normalisation apply as on BraTS) with a three-label tumour (core 1, oedema 2, enhancing 3).
CT-like: one int16 HU channel of 300 x 512 x 512 voxels (0.8 x 0.8 x 1.0 mm): air, an
elliptic body with soft tissue, organs and bone. Pure functions of (seed, index); the
writers put them in nnU-Net's raw layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

MR_SHAPE = (155, 240, 240)
MR_LABELS = {"background": 0, "core": 1, "oedema": 2, "enhancing": 3}
# per channel: brain, tumour core, oedema, enhancing (arbitrary MR units)
MR_CONTRASTS = (
    (400.0, 300.0, 700.0, 500.0),
    (500.0, 350.0, 450.0, 550.0),
    (450.0, 300.0, 420.0, 900.0),
    (350.0, 600.0, 650.0, 500.0),
)
CT_SHAPE = (300, 512, 512)
CT_SPACING = (1.0, 0.8, 0.8)


def _grid(shape: tuple[int, ...]) -> list[np.ndarray]:
    """Open grids of each axis in [-1, 1]."""
    return list(np.ogrid[tuple(slice(-1.0, 1.0, complex(0, n)) for n in shape)])


def smooth_noise(rng: np.random.Generator, shape: tuple[int, ...], cells: int) -> np.ndarray:
    """Smooth float32 noise (about `cells` blobs per axis) in roughly [-1, 1]."""
    from scipy.ndimage import zoom

    coarse = rng.standard_normal(tuple(max(2, cells) for _ in shape)).astype(np.float32)
    factors = [n / c for n, c in zip(shape, coarse.shape, strict=True)]
    field = zoom(coarse, factors, order=1)
    out = np.zeros(shape, np.float32)
    view = tuple(slice(0, min(a, b)) for a, b in zip(shape, field.shape, strict=True))
    out[view] = field[view]
    return out


def mr_like_case(seed: int, index: int, shape: tuple[int, ...] = MR_SHAPE):
    """(image (4, *shape) float32, label uint8 of shape, spacing zyx) of one case."""
    rng = np.random.default_rng([seed, index])
    z, y, x = _grid(shape)
    radii = rng.uniform(0.82, 0.92, 3)
    brain = (z / radii[0]) ** 2 + (y / radii[1]) ** 2 + (x / radii[2]) ** 2 <= 1.0
    centre = rng.uniform(-0.35, 0.35, 3)
    r = float(rng.uniform(0.12, 0.25))
    dist = np.sqrt((z - centre[0]) ** 2 + (y - centre[1]) ** 2 + (x - centre[2]) ** 2)
    label = np.zeros(shape, np.uint8)
    label[dist <= r] = 2
    label[dist <= 0.6 * r] = 3
    label[dist <= 0.4 * r] = 1
    label[~brain] = 0
    texture = smooth_noise(rng, shape, 12)
    image = np.zeros((4, *shape), np.float32)
    for c, levels in enumerate(MR_CONTRASTS):
        lut = np.asarray(levels, np.float32)
        base = lut[np.minimum(label, 3)]  # 0 -> brain, 1..3 -> tumour parts
        channel = base * (1.0 + 0.15 * texture) + rng.normal(0, 20.0, shape).astype(np.float32)
        image[c] = np.where(brain, np.maximum(channel, 1.0), 0.0)
    return image, label, (1.0, 1.0, 1.0)


def ct_like_case(seed: int, shape: tuple[int, ...] = CT_SHAPE):
    """(image int16 HU of shape, spacing zyx): air, body, three organs, a spine."""
    rng = np.random.default_rng([seed, 7])
    z, y, x = _grid(shape)
    body = (y / 0.7) ** 2 + (x / 0.9) ** 2 <= 1.0
    hu = np.full(shape, -1000.0, np.float32)
    hu[np.broadcast_to(body, shape)] = 40.0
    for cy, cx, rad, value in (
        (-0.1, -0.35, 0.3, 60.0),
        (-0.1, 0.4, 0.2, 30.0),
        (0.3, 0.0, 0.15, 90.0),
    ):
        organ = ((y - cy) / rad) ** 2 + ((x - cx) / rad) ** 2 + (z / 0.8) ** 2 <= 1.0
        hu[organ] = value
    spine = ((y - 0.5) / 0.08) ** 2 + (x / 0.08) ** 2 <= 1.0
    hu[np.broadcast_to(spine, shape)] = 700.0
    hu += 25.0 * smooth_noise(rng, shape, 8) + rng.normal(0, 15.0, shape).astype(np.float32)
    return np.clip(hu, -1024, 3000).astype(np.int16), CT_SPACING


def write_mr_dataset(raw_root: Path, name: str, num_cases: int, seed: int = 0) -> Path:
    """nnU-Net raw layout: imagesTr CASE_000c.nii.gz x 4, labelsTr, dataset.json."""
    from trainer.data.image_io import write_nifti

    folder = raw_root / name
    (folder / "imagesTr").mkdir(parents=True, exist_ok=True)
    (folder / "labelsTr").mkdir(parents=True, exist_ok=True)
    for i in range(num_cases):
        image, label, spacing = mr_like_case(seed, i)
        case = f"mr_{i:03d}"
        for c in range(image.shape[0]):
            write_nifti(folder / "imagesTr" / f"{case}_{c:04d}.nii.gz", image[c], spacing)
        write_nifti(folder / "labelsTr" / f"{case}.nii.gz", label, spacing)
    meta = {
        "channel_names": {"0": "FLAIR", "1": "T1", "2": "T1c", "3": "T2"},
        "labels": MR_LABELS,
        "numTraining": num_cases,
        "file_ending": ".nii.gz",
        "name": name,
    }
    (folder / "dataset.json").write_text(json.dumps(meta, indent=1))
    return folder
