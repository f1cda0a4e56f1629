"""The spatial half of augmentation: resampling a batch at per-sample affine grids.

Images bilinear; segmentations by linear interpolation of each label's indicator and an
argmax, with nnU-Net's -1 label ("outside the body") optionally as a label of its own
(batchgeneratorsv2's SpatialTransform); centre crops for samples that do not move.
"""

from __future__ import annotations

import math
from types import EllipsisType

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


def _resample_labels(
    seg: torch.Tensor, grid: torch.Tensor, outside: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """seg (b, 1, *in) integer sampled at grid: each foreground label's indicator linearly
    interpolated, background's score 1 - their sum, argmax (the lowest label on ties).
    nnU-Net's segmentation mode: thin structures keep their shape under rotation instead
    of nearest's jagged steps. `outside` (b, 1, *in) bool, nnU-Net's -1 label, is a label
    of its own that the fill belongs to, first in the argmax (ties go to it); returns
    where it won (None without it). Without it the fill counts as background."""
    # Labels present: a bincount of the (small, non-negative) label values is ~10x faster
    # on CPU than torch.unique's sort.
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """spatial_transform, and with masked channels (use_mask_for_norm) where the outside
    label (outside_body) won (see _resample_labels); None without.

    The input is first cut to the voxels the grid can touch: the labels' indicators, their
    resampling and the outside mask then cost what is sampled, not the whole read (the
    read is sized for the largest rotation and zoom). With read_size (the read's size)
    different from the input's, the input is that cut already (a reader fetched only it)."""
    full = tuple(read_size) if read_size is not None else tuple(data.shape[2:])
    out = tuple(out_size) if out_size is not None else full
    ndim = len(full)
    box = touched_box(matrices, full, out)
    if tuple(data.shape[2:]) == full:
        keep = (slice(None), slice(None), *box)
        data, seg = data[keep], seg[keep]
    elif tuple(data.shape[2:]) != tuple(b.stop - b.start for b in box):
        raise ValueError(f"input {tuple(data.shape[2:])} is neither the read nor its cut")
    outside = outside_body(data, seg, masked) if masked else None
    spatial = tuple(data.shape[2:])
    # the full input's centre, in voxels from the cut's centre
    shift = [n / 2 - b.start - k / 2 for n, b, k in zip(full, box, spatial, strict=True)]
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
    return (data, *_resample_labels(seg, grid, outside))


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
