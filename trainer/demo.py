"""`nnui-demo-data`: a deterministic synthetic 3D MRI-like segmentation task in raw format.

Each case: an ellipsoidal body (zero outside it), an organ-like blob inside it (label 1)
and a small lesion inside the organ (label 2), a smooth multiplicative bias field and
Gaussian noise. Shapes and anisotropic spacings vary per case, like a real MRI cohort.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from trainer.cli import OneLineParser, usage_error
from trainer.data.image_io import write_nifti
from trainer.schema.exits import EXIT_OK
from trainer.schema.tree import resolve_roots

DEMO_DATASET = "Dataset900_NnuiDemo"
DEFAULT_NUM_CASES = 20
DEFAULT_NUM_TEST_CASES = 4  # held out in imagesTs/labelsTs: predict -> evaluate end to end
LABELS = {"background": 0, "organ": 1, "lesion": 2}

log = logging.getLogger(__name__)


def _case_geometry(rng: np.random.Generator, shape_scale: float):
    base = (rng.integers(40, 81), rng.integers(60, 111), rng.integers(60, 111))
    shape = tuple(max(8, round(s * shape_scale)) for s in base)
    inplane_mm = float(rng.uniform(0.7, 0.9))
    spacing_zyx = (float(rng.uniform(2.0, 3.0)), inplane_mm, inplane_mm)
    return shape, spacing_zyx


def make_case(
    seed: int, index: int, shape_scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray, tuple[float, float, float]]:
    """(image float32 ZYX, label uint8 ZYX, spacing zyx mm) of case `index`; pure function."""
    rng = np.random.default_rng([seed, index])
    shape, spacing = _case_geometry(rng, shape_scale)
    # Normalised coordinates in [-1, 1] per axis: anatomy scales with the field of view.
    grids = np.meshgrid(
        *[np.linspace(-1.0, 1.0, n, dtype=np.float32) for n in shape], indexing="ij"
    )
    z, y, x = grids

    body_radii = (rng.uniform(0.85, 0.98), rng.uniform(0.7, 0.85), rng.uniform(0.7, 0.85))
    body = (z / body_radii[0]) ** 2 + (y / body_radii[1]) ** 2 + (x / body_radii[2]) ** 2 <= 1.0

    organ_center = rng.uniform(-0.2, 0.2, size=3)
    organ_radii = rng.uniform(0.32, 0.45, size=3)
    wobble = 0.12 * np.sin(3.0 * z + rng.uniform(0, 6)) * np.cos(2.0 * y + rng.uniform(0, 6))
    organ_r = sum(
        ((g - c) / r) ** 2 for g, c, r in zip(grids, organ_center, organ_radii, strict=True)
    )
    organ = (organ_r + wobble <= 1.0) & body

    # The lesion sits well inside the organ: offset at most 40 % of the organ radius.
    lesion_center = organ_center + rng.uniform(-0.4, 0.4, size=3) * organ_radii
    lesion_radius = rng.uniform(0.25, 0.4) * float(organ_radii.min())
    lesion_r = sum((g - c) ** 2 for g, c in zip(grids, lesion_center, strict=True))
    lesion = (lesion_r <= lesion_radius**2) & organ

    label = np.zeros(shape, dtype=np.uint8)
    label[organ] = 1
    label[lesion] = 2

    image = np.full(shape, 100.0, dtype=np.float32)
    image += 8.0 * np.sin(9.0 * x + rng.uniform(0, 6)) * np.sin(7.0 * y)  # tissue texture
    image[organ] = 165.0 + rng.uniform(-15, 15)
    image[lesion] = 235.0 + rng.uniform(-20, 20)
    coeffs = rng.uniform(-0.15, 0.15, size=4)
    bias = 1.0 + coeffs[0] * z + coeffs[1] * y + coeffs[2] * x + coeffs[3] * y * x
    image *= bias.astype(np.float32)
    image += rng.normal(0.0, 9.0, size=shape).astype(np.float32)
    image = np.maximum(image, 1.0)  # keep the body strictly non-zero: zero means "outside"
    image[~body] = 0.0
    return image.astype(np.float32), label, spacing


def make_demo_dataset(
    out_root: Path,
    num_cases: int = DEFAULT_NUM_CASES,
    seed: int = 0,
    shape_scale: float = 1.0,
    num_test_cases: int = 0,
) -> Path:
    """Write Dataset900_NnuiDemo under out_root (raw format); returns the dataset folder.

    Training cases are demo_000.. in imagesTr/labelsTr; the num_test_cases held-out cases
    continue the numbering (other anatomy, never trained on) in imagesTs/labelsTs.
    """
    if num_cases < 1:
        raise ValueError("num_cases must be >= 1; set --cases to a positive number")
    if num_test_cases < 0:
        raise ValueError("num_test_cases must be >= 0; set --test-cases to 0 or more")
    dataset_dir = Path(out_root) / DEMO_DATASET
    splits = [("Tr", range(num_cases))]
    if num_test_cases:
        splits.append(("Ts", range(num_cases, num_cases + num_test_cases)))
    for suffix, indices in splits:
        (dataset_dir / f"images{suffix}").mkdir(parents=True, exist_ok=True)
        (dataset_dir / f"labels{suffix}").mkdir(parents=True, exist_ok=True)
        for index in indices:
            case_id = f"demo_{index:03d}"
            image, label, spacing = make_case(seed, index, shape_scale)
            write_nifti(dataset_dir / f"images{suffix}" / f"{case_id}_0000.nii.gz", image, spacing)
            write_nifti(dataset_dir / f"labels{suffix}" / f"{case_id}.nii.gz", label, spacing)
            log.info("wrote %s shape %s spacing %s", case_id, image.shape, spacing)
    dataset_json = {
        "name": "NnuiDemo",
        "description": f"synthetic MRI-like demo, {num_cases} cases, seed {seed}",
        "channel_names": {"0": "MRI"},
        "labels": dict(LABELS),
        "numTraining": num_cases,
        "file_ending": ".nii.gz",
    }
    (dataset_dir / "dataset.json").write_text(json.dumps(dataset_json, indent=2) + "\n")
    return dataset_dir


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="nnui-demo-data", description="Write a small synthetic 3D segmentation dataset."
    )
    parser.add_argument("--cases", type=int, default=DEFAULT_NUM_CASES, help="number of cases")
    parser.add_argument(
        "--out", default=None, help="raw root (default: $nnUNet_raw or ./nnui_data/raw)"
    )
    parser.add_argument(
        "--test-cases",
        type=int,
        default=DEFAULT_NUM_TEST_CASES,
        help=f"held-out cases in imagesTs/labelsTs (default {DEFAULT_NUM_TEST_CASES})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape-scale", type=float, default=1.0, help="scale case shapes (tests)")
    args = parser.parse_args(argv)
    if args.cases < 1:
        return usage_error("--cases must be >= 1")
    if args.test_cases < 0:
        return usage_error("--test-cases must be >= 0")
    if not 0.05 <= args.shape_scale <= 4.0:
        return usage_error("--shape-scale must be within 0.05-4")
    out_root = resolve_roots(raw=args.out).raw
    dataset_dir = make_demo_dataset(
        out_root, args.cases, args.seed, args.shape_scale, args.test_cases
    )
    print(f"wrote {args.cases} training and {args.test_cases} test cases to {dataset_dir}")
    print(f"next: nnui-preprocess 900 -pl nnuiCPUPlanner --raw {out_root}  (CPU-sized plans)")
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
