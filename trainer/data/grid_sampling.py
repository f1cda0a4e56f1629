"""The spatial half of augmentation: resampling a batch at per-sample affine grids.

Images bilinear; segmentations by linear interpolation of each label's indicator and an
argmax, with nnU-Net's -1 label ("outside the body") optionally as a label of its own
(batchgeneratorsv2's SpatialTransform); centre crops for samples that do not move.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import EllipsisType

import numpy as np
import torch
import torch.nn.functional as F


def affine_grid(m: torch.Tensor, spatial: tuple[int, ...]) -> torch.Tensor:
    """F.affine_grid without translation, built by broadcasting 1D coordinates.

    Same result as affine_grid(align_corners=False), ~20x faster on CPU where
    affine_grid's batched matmul over a materialised base grid dominates the transform.
    Each output coordinate is one broadcast sum written straight into the grid.
    """
    ndim = len(spatial)
    coords = []  # normalised voxel centres per axis in (x, y, z) order
    for i, n in enumerate(reversed(spatial)):
        c = (torch.arange(n, device=m.device, dtype=m.dtype) * 2 + 1) / n - 1
        # exactly antisymmetric (the formula's rounding is not): an axis reversed by a
        # negated column of m then gives the very same grid values, reversed (mirroring)
        half = n // 2
        c[n - half :] = -c[:half].flip(0)
        shape = [1] * (ndim + 1)
        shape[ndim - i] = n
        coords.append(c.view(shape))
    grid = torch.empty((m.shape[0], *spatial, ndim), device=m.device, dtype=m.dtype)
    for row in range(ndim):
        terms = [m[:, row, col].view(-1, *([1] * ndim)) * coords[col] for col in range(ndim)]
        partial = terms[0]
        for term in terms[1:-1]:
            partial = partial + term
        torch.add(partial, terms[-1], out=grid[..., row])
    return grid


def _reaches_fill(grid: torch.Tensor, spatial: tuple[int, ...]) -> bool:
    """Whether bilinear sampling at grid (affine: its extremes lie at its corners) draws on
    the zero fill beyond the outermost voxel centres of an input of shape `spatial`."""
    corners = grid
    for axis in range(1, grid.ndim - 1):
        ends = torch.tensor([0, grid.shape[axis] - 1], device=grid.device)
        corners = corners.index_select(axis, ends)
    limits = torch.tensor(
        [1 - 1 / n for n in reversed(spatial)], dtype=grid.dtype, device=grid.device
    )
    return bool((corners.abs() > limits + 1e-6).any())


def _fill_share(grid: torch.Tensor, spatial: tuple[int, ...]) -> torch.Tensor:
    """(b, 1, *out) weight bilinear sampling at grid gives the zero fill: 1 minus the
    product over axes of the in-bounds weight, min(u + 1, n - u) clamped to [0, 1] at
    voxel coordinate u. Equals sampling an all-zero outside label, without a grid_sample."""
    inside: torch.Tensor | None = None
    for k, n in enumerate(reversed(spatial)):
        u = (grid[..., k] + 1) * (n / 2) - 0.5
        w = torch.minimum(u + 1, n - u).clamp_(0, 1)
        inside = w if inside is None else inside.mul_(w)
    assert inside is not None  # spatial has axes
    return (1 - inside).unsqueeze(1)


def resample_labels(
    seg: torch.Tensor, grid: torch.Tensor, outside: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """seg (b, 1, *in) integer sampled at grid as nnU-Net's segmentation mode does: each
    label's indicator linearly interpolated and the largest wins, so thin structures keep
    their shape under rotation instead of nearest's jagged steps. With `outside` (b, 1, *in)
    bool, nnU-Net's -1 label, that is a label of its own, and the zero fill beyond the input
    belongs to it (else to background). Ties go to the lowest label, the outside label
    first; returns the labels (the outside's as 0) and where the outside won (None without).

    Two ways to the same labels, each the cheaper one on CPU for its dimensionality (the
    tests hold them equal): 2D samples every indicator (grid_sample's 2D kernel is
    vectorised), 3D looks labels up per block of corners (its 3D kernel is not)."""
    if seg.ndim == 5:
        return _labels_by_blocks(seg, grid, outside)
    return _labels_by_indicators(seg, grid, outside)


def _labels_by_indicators(
    seg: torch.Tensor, grid: torch.Tensor, outside: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """resample_labels by grid_sample of each foreground label's indicator (background's
    score 1 - their sum; the outside's indicator sampled minus 1 and 1 added back, so the
    fill scores for it) and a running maximum."""
    # Labels present: for a binary seg its maximum says it (one vectorised pass); else a
    # bincount of the (small, non-negative) values, ~10x faster on CPU than torch.unique.
    top = int(seg.max()) if seg.numel() else 0
    if top <= 1:
        labels = [1] if top == 1 else []
    else:
        counts = torch.bincount(seg.reshape(-1).to(torch.int64 if seg.is_cuda else seg.dtype))
        labels = [int(v) for v in counts.nonzero().flatten().tolist() if v != 0]
    shape = (seg.shape[0], 1, *grid.shape[1:-1])
    # The outside label matters only where it is in the input or the fill is reached.
    spatial = tuple(seg.shape[2:])
    sample_outside = outside is not None and bool(outside.any())
    use_outside = sample_outside or (outside is not None and _reaches_fill(grid, spatial))
    won_outside = (
        None if outside is None else torch.zeros(shape, dtype=torch.bool, device=seg.device)
    )
    out = torch.zeros(shape, dtype=seg.dtype, device=seg.device)
    if not labels and not use_outside:
        return out, won_outside
    # the indicators written straight into one tensor (no per-label float copies to cat)
    first = 1 if sample_outside else 0
    channels = torch.empty(
        (seg.shape[0], first + len(labels), *spatial), dtype=grid.dtype, device=seg.device
    )
    if sample_outside:  # sampled as indicator - 1 and 1 added back: the fill scores 1
        assert outside is not None  # sample_outside says it is given
        channels[:, :1] = outside
        channels[:, :1] -= 1
    for k, v in enumerate(labels, start=first):
        channels[:, k : k + 1] = seg == v
    scores = (
        F.grid_sample(channels, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        if channels.shape[1]
        else torch.zeros((seg.shape[0], 0, *shape[2:]), dtype=grid.dtype, device=grid.device)
    )
    if sample_outside:
        scores[:, :1] += 1
    elif use_outside:  # only the fill is outside
        scores = torch.cat([_fill_share(grid, spatial), scores], dim=1)
    # A running maximum instead of argmax over the label axis: argmax across channels
    # cost 2/3 of a 3D batch's augmentation on CPU; strict > keeps the lowest label on ties.
    best = 1.0 - scores.sum(1, keepdim=True)  # background's score
    if use_outside:
        won_outside = scores[:, :1] >= best
        best = torch.maximum(best, scores[:, :1])
    for k, value in enumerate(labels, start=1 if use_outside else 0):
        score = scores[:, k : k + 1]
        wins = score > best
        out.masked_fill_(wins, value)
        if use_outside:
            assert won_outside is not None  # set above when use_outside
            won_outside &= ~wins
        best = torch.maximum(best, score)
    return out, won_outside


# Codes of the label map the segmentation is resampled from: the labels themselves (>= 0),
# nnU-Net's -1 label ("outside the body") as -1, MIXED for a 2^d block of differing codes.
OUTSIDE = -1
MIXED = -2
_PAD = 2  # fill voxels around the input: a block beyond it is all fill (see _block_codes)


def _codes(seg: torch.Tensor, outside: torch.Tensor | None) -> torch.Tensor:
    """(b, *(in + 4)) int16: seg's labels, OUTSIDE where `outside`, in a border of _PAD
    voxels of the fill (bilinear sampling's zero padding): the outside label with an outside
    mask, else background."""
    fill = OUTSIDE if outside is not None else 0
    spatial = seg.shape[2:]
    codes = torch.full(
        (seg.shape[0], *[n + 2 * _PAD for n in spatial]), fill, dtype=torch.int16,
        device=seg.device,
    )  # fmt: skip
    inner = codes[(slice(None), *[slice(_PAD, _PAD + n) for n in spatial])]
    inner.copy_(seg[:, 0])
    if outside is not None:
        inner.masked_fill_(outside[:, 0], OUTSIDE)
    return codes


def _block_codes(codes: torch.Tensor) -> torch.Tensor:
    """(b, *(n - 1)) the code shared by the 2^d voxels of each block codes[k:k+2, ...] (k
    per axis), MIXED where they differ: min and max over the block, axis by axis."""
    lo = hi = codes
    for axis in range(1, codes.ndim):
        n = codes.shape[axis] - 1
        lo = torch.minimum(lo.narrow(axis, 0, n), lo.narrow(axis, 1, n))
        hi = torch.maximum(hi.narrow(axis, 0, n), hi.narrow(axis, 1, n))
    return lo.masked_fill_(lo != hi, MIXED)


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


def _labels_by_blocks(
    seg: torch.Tensor, grid: torch.Tensor, outside: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """resample_labels without sampling every label at every voxel (the indicators'
    grid_sample cost a moved 3D sample more than its image): an output voxel whose 2^d
    interpolation corners hold one code takes it, looked up in the map of 2^d blocks; only
    voxels at a boundary (a few %) weigh their corners, with grid_sample's own arithmetic
    (its unnormalisation, corners and weights)."""
    b, spatial = seg.shape[0], tuple(seg.shape[2:])
    ndim = len(spatial)
    codes = _codes(seg, outside)
    blocks = _block_codes(codes).to(grid.dtype).unsqueeze(1)
    # Block k (per axis) covers voxels k - _PAD and k - _PAD + 1: the one a voxel coordinate
    # u falls in is floor(u) + _PAD, which nearest sampling at u + _PAD - 0.5 gives, i.e. at
    # the normalised grid scaled by n / (n + 2 _PAD - 1) per axis ('border': beyond the
    # edge blocks all is fill). Where u is within rounding of an integer nearest may take
    # the neighbouring block; that one holds the corner plane with all the weight, so a
    # single code there is still the answer.
    scale = torch.tensor(
        [n / (n + 2 * _PAD - 1) for n in reversed(spatial)], dtype=grid.dtype, device=grid.device
    )
    picked = F.grid_sample(
        blocks, grid * scale, mode="nearest", padding_mode="border", align_corners=False
    ).to(torch.int16)[:, 0]
    strides = _strides(tuple(codes.shape[1:]))
    for i in range(b):
        flat = picked[i].view(-1)
        mixed = (flat == MIXED).nonzero().squeeze(1)
        if len(mixed):
            points = grid[i].reshape(-1, ndim)[mixed]
            flat[mixed] = _weigh_corners(codes[i].reshape(-1), points, spatial, strides)
    won = (picked == OUTSIDE).unsqueeze(1) if outside is not None else None
    return picked.clamp_min_(0).to(seg.dtype).unsqueeze(1), won


def _weigh_corners(
    codes: torch.Tensor, points: torch.Tensor, spatial: tuple[int, ...], strides: list[int]
) -> torch.Tensor:
    """The winning code at M points (normalised grid coordinates, (M, ndim) in x, y, z
    order) of the padded code map `codes` (flat, its strides): each code's summed corner
    weights, the largest wins, ties to the lowest code (the order of the indicators in a
    first-maximum argmax)."""
    ndim = len(spatial)
    coords, floors = [], []
    base = None
    for axis, n in enumerate(spatial):
        # grid_sample's unnormalisation (align_corners=False): ((g + 1) n - 1) / 2
        coord = points[:, ndim - 1 - axis].add(1).mul_(n).sub_(1).div_(2)
        floor = coord.floor()
        coords.append(coord)
        floors.append(floor)
        step = floor.add(_PAD).to(torch.int64).mul_(strides[axis])
        base = step if base is None else base.add_(step)
    assert base is not None  # spatial has axes
    # per axis the weights of the low and the high corner, as grid_sample computes them
    low = [f + 1 - c for f, c in zip(floors, coords, strict=True)]
    high = [c - f for f, c in zip(floors, coords, strict=True)]
    corner_codes, corner_weights = [], []
    for corner in range(2**ndim):
        ups = [(corner >> (ndim - 1 - axis)) & 1 for axis in range(ndim)]
        offset = sum(u * s for u, s in zip(ups, strides, strict=True))
        corner_codes.append(codes.take(base + offset))
        # grid_sample multiplies the x factor first, then y, then z
        factors = [(high if u else low)[axis] for axis, u in enumerate(ups)][::-1]
        weight = factors[0]
        for factor in factors[1:]:
            weight = weight * factor
        corner_weights.append(weight)
    stacked, weights = torch.stack(corner_codes), torch.stack(corner_weights)
    best = winner = None
    # codes in ascending order (OUTSIDE, background, labels); one absent from these
    # corners scores 0 everywhere and never ends up the winner (some code scores > 0)
    for code in range(int(stacked.min()), int(stacked.max()) + 1):
        score = (weights * (stacked == code)).sum(0)
        if best is None or winner is None:
            best, winner = score, torch.full_like(stacked[0], code)
        else:
            winner.masked_fill_(score > best, code)
            best = torch.maximum(best, score)
    assert winner is not None  # every point has corners
    return winner


def spatial_transform(
    data: torch.Tensor,
    seg: torch.Tensor,
    matrices: torch.Tensor,
    out_size: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply per-sample voxel-space linear maps (b, d, d) (output -> input coordinates)
    about the centre: the output's centre lands on the input's centre, so out_size
    (default: the input's) smaller than the input cuts its middle."""
    data, seg, _ = spatial_with_outside(data, seg, matrices, out_size, None)
    return data, seg


def outside_body(data: torch.Tensor, seg: torch.Tensor, channels: list[int]) -> torch.Tensor:
    """(b, 1, *spatial) nnU-Net's -1 label: background where the masked channels are
    exactly 0 (preprocessing leaves them 0 outside the hole-filled body; reads pad with 0)."""
    outside = seg == 0
    for c in channels:
        outside &= data[:, c : c + 1] == 0
    return outside


def touched_box(
    matrices: torch.Tensor, spatial: tuple[int, ...], out: tuple[int, ...]
) -> tuple[slice, ...]:
    """The box of input voxels bilinear sampling can touch for output voxels mapped by
    `matrices` (b, d, d) about the centres (affine: its extremes are at the corners), as
    slices, clipped to the input."""
    offsets = matrices.abs() @ torch.tensor([o / 2 - 0.5 for o in out], dtype=matrices.dtype)
    reach = offsets.amax(0).tolist()  # (d,) largest offset from the input centre per axis
    box = []
    for n, r in zip(spatial, reach, strict=True):
        lo, hi = n / 2 - 0.5 - r, n / 2 - 0.5 + r
        box.append(slice(max(0, math.floor(lo)), min(n, math.floor(hi) + 2)))
    return tuple(box)


def spatial_with_outside(
    data: torch.Tensor,
    seg: torch.Tensor,
    matrices: torch.Tensor,
    out_size: tuple[int, ...] | None,
    masked: list[int] | None = None,
    read_size: tuple[int, ...] | None = None,
    start: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """spatial_transform, and with masked channels (use_mask_for_norm) where the outside
    label (outside_body) won (see resample_labels); None without.

    The input may be a part of the read (read_size) starting at `start` (a reader fetched
    only what lies inside the image); the rest of the read is the zero fill, as a padded
    read would hold it: image 0, background, the outside label with masked channels. It is
    cut to the voxels the grid can touch first: the outside mask and the labels then cost
    what is sampled, not the whole read (sized for the largest rotation and zoom)."""
    full = tuple(read_size) if read_size is not None else tuple(data.shape[2:])
    out = tuple(out_size) if out_size is not None else full
    ndim = len(full)
    data, seg, start = _cut(data, seg, start, touched_box(matrices, full, out))
    outside = outside_body(data, seg, masked) if masked else None
    spatial = tuple(data.shape[2:])
    # the full input's centre, in voxels from the cut's centre
    shift = [n / 2 - s - k / 2 for n, s, k in zip(full, start, spatial, strict=True)]
    # grid_sample's normalised coordinates are per-axis scaled and in (x, y, z) order:
    # input voxel offset M @ (output offset) + shift, each axis in its own half-length.
    half_in = torch.tensor([n / 2.0 for n in spatial], dtype=matrices.dtype)
    half_out = torch.tensor([n / 2.0 for n in out], dtype=matrices.dtype)
    m = matrices / half_in[None, :, None] * half_out[None, None, :]
    flip = list(range(ndim))[::-1]
    m = m[:, flip][:, :, flip]
    grid = affine_grid(m.to(device=data.device, dtype=data.dtype), out)
    for k, axis in enumerate(flip):
        if shift[axis] != 0:
            grid[..., k].add_(shift[axis] / half_in[axis].item())
    data = F.grid_sample(data, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return (data, *resample_labels(seg, grid, outside))


def _cut(
    data: torch.Tensor, seg: torch.Tensor, start: tuple[int, ...] | None, box: tuple[slice, ...]
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(data, seg) (b, C, *part) at `start` (None: 0) cut to the box, and where the cut
    starts; a part the box misses becomes one voxel of the fill."""
    begin = tuple(start) if start is not None else (0,) * len(box)
    spatial = tuple(data.shape[2:])
    lo = [max(b.start, s) for b, s in zip(box, begin, strict=True)]
    hi = [min(b.stop, s + k) for b, s, k in zip(box, begin, spatial, strict=True)]
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        one = (*data.shape[:2], *[1] * len(box))
        return data.new_zeros(one), seg.new_zeros((seg.shape[0], 1, *one[2:])), tuple(lo)
    keep = (slice(None), slice(None),
            *(slice(low - s, h - s) for low, h, s in zip(lo, hi, begin, strict=True)))  # fmt: skip
    return data[keep], seg[keep], tuple(lo)


def centre_into(
    out: torch.Tensor,
    part: torch.Tensor,
    start: tuple[int, ...],
    read: tuple[int, ...],
    flips: Sequence[int] = (),
) -> None:
    """Write into out (..., *patch) the centre patch of a read (read, nnU-Net's crop of a
    sample it does not rotate or scale: start floor(n / 2) - patch // 2) of which only
    `part` (..., *k) at `start` is given, the rest being the zero fill; reversed along the
    patch axes `flips` (mirroring) in the same copy."""
    ndim = len(read)
    patch = tuple(out.shape[-ndim:])
    corner = [n // 2 - p // 2 for n, p in zip(read, patch, strict=True)]
    lo = [max(c, s) for c, s in zip(corner, start, strict=True)]
    hi = [min(c + p, s + k) for c, p, s, k in zip(corner, patch, start, part.shape[-ndim:],
                                                    strict=True)]  # fmt: skip
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        out.zero_()
        return
    inner = []
    for axis, (low, h, c, p) in enumerate(zip(lo, hi, corner, patch, strict=True)):
        a, b = low - c, h - c
        inner.append(slice(p - b, p - a) if axis in flips else slice(a, b))
    for k, axis_slice in enumerate(inner):  # the fill around the part, slab by slab
        tail = (slice(None),) * (ndim - k - 1)
        below: tuple[EllipsisType | slice, ...] = (..., *inner[:k], slice(0, axis_slice.start))
        above: tuple[EllipsisType | slice, ...] = (..., *inner[:k], slice(axis_slice.stop, None))
        out[(*below, *tail)] = 0
        out[(*above, *tail)] = 0
    source = tuple(slice(low - s, h - s) for low, h, s in zip(lo, hi, start, strict=True))
    into: tuple[EllipsisType | slice, ...] = (..., *inner)
    taken: tuple[EllipsisType | slice, ...] = (..., *source)
    if not flips:
        out[into] = part[taken]
    elif out.device.type == "cpu":  # numpy copies through reversed strides in one pass
        axes = tuple(out.ndim - ndim + a for a in flips)
        np.copyto(out.numpy()[into], np.flip(part.numpy()[taken], axes))
    else:
        out[into] = part[taken].flip([part.ndim - ndim + a for a in flips])


def centre_crop(x: torch.Tensor, out_size: tuple[int, ...]) -> torch.Tensor:
    """x (..., *spatial) cut to out_size around floor(n / 2), nnU-Net's crop of a sample it
    does not rotate or scale (start floor(n / 2) - out // 2)."""
    ndim = len(out_size)
    starts = [n // 2 - o // 2 for n, o in zip(x.shape[-ndim:], out_size, strict=True)]
    index: tuple[EllipsisType | slice, ...] = (
        ...,
        *(slice(s, s + o) for s, o in zip(starts, out_size, strict=True)),
    )
    return x[index]
