"""Where patches come from: per-batch seeds, the forced-foreground rule, patch boxes.

Pure numpy, so the same batch k is planned identically in any process and after resume.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

STREAM_IDS = {"train": 0, "val": 1}


def batch_seed(seed: int, rank: int, stream: str, iteration: int) -> np.random.SeedSequence:
    """Batch k of (seed, rank, stream) depends only on these four numbers."""
    if stream not in STREAM_IDS:
        raise ValueError(f"stream must be one of {sorted(STREAM_IDS)}, got {stream!r}")
    return np.random.SeedSequence([int(seed), int(rank), STREAM_IDS[stream], int(iteration)])


def forced_slots(batch_size: int, share: float) -> list[bool]:
    """Slot j is forced to foreground iff j >= round(b * (1 - p)) (docs/fidelity.md)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"oversample share must be within [0, 1], got {share}")
    first_forced = round(batch_size * (1.0 - share))
    return [j >= first_forced for j in range(batch_size)]


@dataclass(frozen=True)
class PatchBox:
    case_id: str
    lower: tuple[int, int, int]  # (z, y, x) of the box corner; may be negative (padding)
    size: tuple[int, int, int]  # 2D patches read a box one slice deep
    forced: bool


def _lower_bound(
    rng: np.random.Generator, n: int, read: int, final: int, centre: int | None
) -> int:
    """nnU-Net's box rule along one axis (image length n, box `read`, network patch `final`).

    The box may reach into padding by the margin the spatial transform needs (read - final,
    or more where the image is shorter than the box), half of it on each side, the odd
    voxel on the low side; a random box takes any corner in that range. A box around a
    centre voxel puts the voxel at read // 2 and is clipped at the low end only: near the
    high edge the patch runs into padding rather than pushing the voxel off centre, so a
    forced patch always has its foreground at (or, near the low edge, before) the middle.
    """
    need = max(read - final, read - n)
    lo = (-need) // 2
    hi = n + need // 2 + need % 2 - read
    if centre is None:
        return int(rng.integers(lo, hi + 1))
    return max(lo, centre - read // 2)


@dataclass(frozen=True)
class LocationRule:
    """Which stored locations a patch centres on when the labels are not plain
    (trainer.data.labels): `groups` per class or region the class_locations keys whose union
    holds its voxels; `annotated`: the key of every annotated voxel (an ignore-label
    dataset), where the non-forced patches centre so none lies in unannotated space only."""

    groups: tuple[tuple[str, ...], ...]
    annotated: str | None = None


def _pick(rng: np.random.Generator, locations: Sequence) -> Sequence[int]:
    return locations[int(rng.integers(len(locations)))]


def _centre(
    rng: np.random.Generator, locations: dict, forced: bool, rule: LocationRule | None
) -> Sequence[int] | None:
    """The voxel a patch centres on, or None for a uniformly random box."""
    if rule is None:
        if not forced:
            return None
        present = sorted((k for k, v in locations.items() if len(v) and k.isdigit()), key=int)
        return _pick(rng, locations[present[int(rng.integers(len(present)))]]) if present else None
    if not forced:
        annotated = locations.get(rule.annotated, []) if rule.annotated else []
        return _pick(rng, annotated) if len(annotated) else None
    eligible = [g for g in rule.groups if any(len(locations.get(k, [])) for k in g)]
    if not eligible:
        return None
    group = eligible[int(rng.integers(len(eligible)))]
    return _pick(rng, [voxel for key in group for voxel in locations.get(key, [])])


def plan_batch(
    rng: np.random.Generator,
    case_ids: Sequence[str],
    batch_size: int,
    share: float,
    patch_size: tuple[int, ...],
    properties: Callable[[str], dict],
    read_size: tuple[int, ...] | None = None,
    rule: LocationRule | None = None,
) -> list[PatchBox]:
    """Boxes for one batch. A forced slot centres on a random stored location of a random
    foreground class (or region, `rule`) present in the case; a case without foreground
    falls back to uniform. Boxes are `read_size` (default patch_size): the larger region a
    rotation or scaling of the patch_size network patch draws on
    (trainer.data.augment.read_size)."""
    boxes = []
    read = tuple(read_size) if read_size is not None else tuple(patch_size)
    size3 = (1, *read) if len(read) == 2 else read
    for forced in forced_slots(batch_size, share):
        case_id = case_ids[int(rng.integers(len(case_ids)))]
        props = properties(case_id)
        shape = props["shape_after_resampling"]
        centre = _centre(rng, props["class_locations"], forced, rule)
        # stored locations are int32 arrays (rows), so `centre or ...` would be ambiguous
        origin = (0, 0, 0) if centre is None else centre
        if len(patch_size) == 2:
            z = int(centre[0]) if centre is not None else int(rng.integers(shape[0]))
            yx = [
                _lower_bound(rng, n, r, p, None if centre is None else int(c))
                for n, r, p, c in zip(shape[1:], read, patch_size, origin[1:], strict=True)
            ]
            lower = (z, *yx)
        else:
            lower = tuple(
                _lower_bound(rng, n, r, p, None if centre is None else int(c))
                for n, r, p, c in zip(shape, read, patch_size, origin, strict=True)
            )
        boxes.append(
            PatchBox(
                case_id,
                cast("tuple[int, int, int]", lower),
                cast("tuple[int, int, int]", size3),
                forced,
            )
        )
    return boxes
