"""nnU-Net's postprocessing: keep only the largest connected component of chosen labels.

Components are fully connected (26 neighbours in 3d), as nnU-Net's (skimage's default).
A postprocessing file (written by nnui-find-best-configuration, read by nnui-predict and
nnui-ensemble with --postprocess) is JSON: {"largest_component_labels": [[1, 2], 1]}: steps
applied in order, each a label or a list of labels taken together as one mask (nnU-Net's
first candidate: all foreground as one component).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy import ndimage

from trainer.inference.cases import InputError

POSTPROCESSING_KEY = "largest_component_labels"


Step = int | tuple[int, ...]


def keep_largest_component(segmentation: np.ndarray, steps: Sequence[Step]) -> np.ndarray:
    """A copy where, step by step, the voxels of the step's label(s) outside their largest
    component become 0 (components tied for the largest all stay, as nnU-Net's)."""
    out = segmentation.copy()
    structure = np.ones((3,) * segmentation.ndim, dtype=bool)
    for step in steps:
        labels = [step] if isinstance(step, (int, np.integer)) else list(step)
        components, count = ndimage.label(np.isin(out, labels), structure)
        if count <= 1:
            continue
        sizes = np.bincount(components.ravel())
        sizes[0] = 0
        out[(components != 0) & (sizes[components] != sizes.max())] = 0
    return out


def _step(value: Any) -> Step:  # a JSON value
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return int(value)


def read_postprocessing(path: Path) -> list[Step]:
    try:
        steps = json.loads(Path(path).read_text())[POSTPROCESSING_KEY]
        return [_step(v) for v in steps]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--postprocess {path}: not a postprocessing file ({exc})") from None
