"""Generated raw datasets for bench/accuracy.py --raw (issue #32: beyond one isotropic channel).

    python bench/accuracy_data.py --out ROOT [--cases 20] [--shape-scale 0.5]

Both start from the demo's anatomy (trainer/demo.py: body, organ = label 1, small lesion
inside it = label 2, bias field, noise) and change what the demo cannot show:
- Dataset910_NnuiMultiChannel: two channels of one 1 mm isotropic case. Channel 0 is the
  demo image (organ bright, lesion brighter); channel 1 another contrast with its own bias,
  noise and intensity range (organ darker than tissue, lesion bright, values x10), so both
  channels carry information and per-channel normalisation and augmentation matter.
- Dataset911_NnuiAniso: one channel, thick slices: the demo volume keeps every 3rd slice and
  is stored at 4.5-5.5 mm slice spacing and 0.7-0.9 mm in-plane (ratio > 3: nnU-Net's
  anisotropic rules for resampling and in-plane augmentation apply).
Deterministic: the same arguments write the same files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.data.image_io import write_nifti  # noqa: E402
from trainer.demo import LABELS, make_case  # noqa: E402

MULTI_CHANNEL = "Dataset910_NnuiMultiChannel"
ANISO = "Dataset911_NnuiAniso"
SEED = 0


def second_contrast(image: np.ndarray, label: np.ndarray, index: int) -> np.ndarray:
    """Another contrast of the same anatomy: organ below tissue, lesion far above, x10."""
    rng = np.random.default_rng([SEED, index, 1])
    body = image > 0
    out = np.where(body, 1200.0, 0.0).astype(np.float32)
    out[label == 1] = 800.0 + rng.uniform(-80, 80)
    out[label == 2] = 2000.0 + rng.uniform(-150, 150)
    z, y, x = np.meshgrid(
        *[np.linspace(-1, 1, n, dtype=np.float32) for n in image.shape], indexing="ij"
    )
    coeffs = rng.uniform(-0.2, 0.2, size=3)
    out *= (1.0 + coeffs[0] * z + coeffs[1] * y + coeffs[2] * x).astype(np.float32)
    out += rng.normal(0.0, 120.0, size=image.shape).astype(np.float32)
    out = np.maximum(out, 1.0)
    out[~body] = 0.0
    return out


def _write(folder: Path, name: str, channels: dict[str, str], cases: list) -> Path:
    dataset = folder / name
    (dataset / "imagesTr").mkdir(parents=True, exist_ok=True)
    (dataset / "labelsTr").mkdir(parents=True, exist_ok=True)
    for case_id, images, label, spacing in cases:
        for c, image in enumerate(images):
            write_nifti(dataset / "imagesTr" / f"{case_id}_{c:04d}.nii.gz", image, spacing)
        write_nifti(dataset / "labelsTr" / f"{case_id}.nii.gz", label, spacing)
    meta = {
        "name": name.split("_", 1)[1],
        "channel_names": channels,
        "labels": dict(LABELS),
        "numTraining": len(cases),
        "file_ending": ".nii.gz",
    }
    (dataset / "dataset.json").write_text(json.dumps(meta, indent=2) + "\n")
    return dataset


def make_multi_channel(root: Path, cases: int, shape_scale: float) -> Path:
    rows = []
    for i in range(cases):
        image, label, _ = make_case(SEED, i, shape_scale)
        rows.append((f"mc_{i:03d}", [image, second_contrast(image, label, i)], label, (1.0,) * 3))
    return _write(root, MULTI_CHANNEL, {"0": "T1", "1": "T2"}, rows)


def make_aniso(root: Path, cases: int, shape_scale: float) -> Path:
    rows = []
    for i in range(cases):
        image, label, _ = make_case(SEED, 1000 + i, shape_scale)
        rng = np.random.default_rng([SEED, i, 2])
        inplane = float(rng.uniform(0.7, 0.9))
        spacing = (float(rng.uniform(4.5, 5.5)), inplane, inplane)
        rows.append((f"an_{i:03d}", [image[::3].copy()], label[::3].copy(), spacing))
    return _write(root, ANISO, {"0": "CT"}, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="raw root to write the two datasets into")
    p.add_argument("--cases", type=int, default=20)
    p.add_argument("--shape-scale", type=float, default=0.5)
    ns = p.parse_args(argv)
    if ns.cases < 5 or not 0.1 <= ns.shape_scale <= 2.0:
        print("error: need --cases >= 5 and --shape-scale in [0.1, 2]", file=sys.stderr)
        return 2
    root = Path(ns.out)
    for make in (make_multi_channel, make_aniso):
        print(make(root, ns.cases, ns.shape_scale))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
