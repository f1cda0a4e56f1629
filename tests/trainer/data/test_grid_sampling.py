"""The segmentation half of the spatial transform: labels resampled as nnU-Net does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.data.augment import _rotation_matrices
from trainer.data.grid_sampling import affine_grid, centre_into, resample_labels, spatial_transform


def _rotation(angles: list[float], ndim: int) -> torch.Tensor:
    """A rotation about each axis in turn (one angle in 2D), float64: augmentation's own."""
    drawn = torch.tensor([angles[: 1 if ndim == 2 else 3]], dtype=torch.float64)
    return _rotation_matrices(drawn, ndim)[0]


def _grid(matrix: torch.Tensor, spatial: tuple[int, ...], out: tuple[int, ...]) -> torch.Tensor:
    """Normalised sampling grid of a voxel-space map about the centres."""
    half_in = torch.tensor([n / 2 for n in spatial], dtype=torch.float64)
    half_out = torch.tensor([n / 2 for n in out], dtype=torch.float64)
    m = matrix / half_in[:, None] * half_out[None, :]
    flip = list(range(len(spatial)))[::-1]
    return affine_grid(m[flip][:, flip][None].float(), out)


def _reference(
    seg: torch.Tensor, grid: torch.Tensor, outside: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The definition, literally: every code's indicator (the outside label -1 first, then
    background, then each label) sampled bilinearly with the zero fill counted for the
    outside label (with one) or background, and the first maximum wins."""
    codes = seg.to(torch.int64)
    if outside is not None:
        codes = codes.masked_fill(outside, -1)
    fill_code = -1 if outside is not None else 0
    values = sorted({fill_code, 0, *codes.unique().tolist()})
    scores = []
    for v in values:
        # the fill is 1 for its code: sample indicator - 1, add 1 back
        shift = 1.0 if v == fill_code else 0.0
        indicator = (codes == v).float() - shift
        scores.append(
            F.grid_sample(indicator, grid, mode="bilinear", padding_mode="zeros",
                          align_corners=False) + shift
        )  # fmt: skip
    winner = torch.tensor(values)[torch.cat(scores, 1).argmax(1, keepdim=True)]
    won = (winner == -1) if outside is not None else None
    return winner.clamp_min(0).to(seg.dtype), won


def _labels(ndim: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """Blobs of labels 1-3 and one-voxel-thin lines of label 4 (vessels)."""
    coarse = torch.rand((1, 1) + (5,) * ndim, generator=generator)
    mode = "trilinear" if ndim == 3 else "bilinear"
    field = F.interpolate(coarse, size=(n,) * ndim, mode=mode, align_corners=False)
    seg = (field * 4).clamp(0, 3.99).to(torch.uint8)
    seg[(0, 0, *[slice(None)] * (ndim - 1), n // 3)] = 4
    seg[(0, 0, n // 2)] = 4
    return seg


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("with_outside", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_labels_are_the_argmax_of_every_labels_interpolated_indicator(ndim, with_outside, seed):
    """Rotated and zoomed (in, and out so far the fill is reached): the same labels as
    grid_sample of every indicator and an argmax, and the outside label where it won."""
    g = torch.Generator().manual_seed(seed)
    n, out = (40, (32, 32, 32)) if ndim == 3 else (80, (64, 64))
    seg = _labels(ndim, n, g)
    outside = None
    if with_outside:
        # the air around a body: background beyond a sphere, and stray voxels in it
        centre = [torch.arange(n, dtype=torch.float64) - n / 2 + 0.5] * ndim
        radius2 = sum(c.view([-1 if k == a else 1 for k in range(ndim)]) ** 2
                      for a, c in enumerate(centre))  # fmt: skip
        air = (radius2 > (0.35 * n) ** 2)[None, None]
        seg[air] = 0
        outside = air | (torch.rand(seg.shape, generator=g) < 0.002) & (seg == 0)
    for zoom in (0.75, 1.0, 1.4):
        angles = ((torch.rand(3, generator=g) * 2 - 1) * 0.8).tolist()
        grid = _grid(_rotation(angles, ndim) * zoom, (n,) * ndim, out)
        labels, won = resample_labels(seg, grid, outside)
        expected, expected_won = _reference(seg, grid, outside)
        assert labels.dtype == seg.dtype and labels.shape == (1, 1, *out)
        assert torch.equal(labels, expected)
        if with_outside:
            assert won is not None and expected_won is not None
            assert torch.equal(won, expected_won) and bool(won.any())
        else:
            assert won is None
        assert set(labels.unique().tolist()) <= {0, 1, 2, 3, 4}
        assert bool((labels == 4).any())  # the thin lines survive the rotation


def test_an_unmoved_grid_gives_back_the_labels():
    g = torch.Generator().manual_seed(3)
    seg = _labels(3, 24, g)
    outside = (seg == 0) & (torch.rand(seg.shape, generator=g) < 0.5)
    labels, won = resample_labels(seg, _grid(torch.eye(3, dtype=torch.float64), (24,) * 3,
                                             (24,) * 3), outside)  # fmt: skip
    assert torch.equal(labels, seg) and won is not None and torch.equal(won, outside)


@pytest.mark.parametrize("ndim", [2, 3])
def test_mirroring_by_the_map_or_the_crop_is_an_exact_reversal(ndim):
    """Augmentation mirrors where it costs nothing: a rotated sample by its map's column
    negated, an unmoved one in the centre crop's copy. Both must be the reversed patch,
    bit for bit (labels and image), as a flip after the transform would give."""
    g = torch.Generator().manual_seed(5)
    n, out = (30, (16, 20, 18)) if ndim == 3 else (60, (40, 36))
    data = torch.randn((1, 2, *(n,) * ndim), generator=g)
    seg = _labels(ndim, n, g)
    matrix = _rotation([0.3, -0.5, 0.2], ndim) * 0.9
    plain_data, plain_seg = spatial_transform(data, seg, matrix[None], out)
    for axes in ([0], [ndim - 1], list(range(ndim))):
        mirrored = matrix.clone()
        mirrored[:, axes] = -mirrored[:, axes]
        d, s = spatial_transform(data, seg, mirrored[None], out)
        dims = [2 + a for a in axes]
        assert torch.equal(d, plain_data.flip(dims)) and torch.equal(s, plain_seg.flip(dims))
        # the centre crop of a part (the rest of the read is the fill), copied reversed
        read = (n + 4,) * ndim
        first = read[0] // 2 - out[0] // 2 + 2  # the part misses the patch's first 2 rows
        part, start = data[0, :, first:], (first,) + (0,) * (ndim - 1)
        crop = torch.empty((2, *out))
        centre_into(crop, part, start, read)
        flipped = torch.empty((2, *out))
        centre_into(flipped, part, start, read, axes)
        assert torch.equal(flipped, crop.flip([1 + a for a in axes]))
        assert float(crop.abs().sum()) > 0 and bool((crop == 0).any())  # data and fill
