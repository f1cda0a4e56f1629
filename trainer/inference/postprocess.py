"""nnU-Net's postprocessing: keep only the largest connected component of chosen labels.

Components are fully connected (26 neighbours in 3d), as nnU-Net's (skimage's default).
A postprocessing file (written by nnui-find-best-configuration, read by nnui-predict and
nnui-ensemble with --postprocess) is JSON: {"largest_component_labels": [1, 2]}.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy import ndimage

from trainer.inference.cases import InputError

POSTPROCESSING_KEY = "largest_component_labels"


def keep_largest_component(segmentation: np.ndarray, labels: Sequence[int]) -> np.ndarray:
    """A copy where, for each label, voxels outside its largest component become 0."""
    out = segmentation.copy()
    structure = np.ones((3,) * segmentation.ndim, dtype=bool)
    for label in labels:
        components, count = ndimage.label(segmentation == label, structure)
        if count <= 1:
            continue
        sizes = np.bincount(components.ravel())
        sizes[0] = 0
        out[(components != 0) & (components != int(sizes.argmax()))] = 0
    return out


def read_postprocessing(path: Path) -> list[int]:
    try:
        labels = json.loads(Path(path).read_text())[POSTPROCESSING_KEY]
        return [int(v) for v in labels]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--postprocess {path}: not a postprocessing file ({exc})") from None
