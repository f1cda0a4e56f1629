"""Augmentation against nnU-Net 2.8.1 / batchgeneratorsv2: which patches get "dummy 2D"
augmentation, what it does to the slices, and per-channel intensity draws whose
distributions match nnU-Net's (fixed seeds and enough draws: deterministic, no flakes)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainer.data.augment import AugmentConfig, augment_batch, channel_factors, read_size
from trainer.data.intensity_ops import gaussian_blur
from trainer.data.loader import default_augment_config

trainer_module = pytest.importorskip("nnunetv2.training.nnUNetTrainer.nnUNetTrainer")
contrast = pytest.importorskip("batchgeneratorsv2.transforms.intensity.contrast")
brightness = pytest.importorskip("batchgeneratorsv2.transforms.intensity.brightness")
gamma_module = pytest.importorskip("batchgeneratorsv2.transforms.intensity.gamma")
stats = pytest.importorskip("scipy.stats")

NUM_DRAWS = 20_000


def _nnunet_rotation_rule(patch):
    fake = SimpleNamespace(
        configuration_manager=SimpleNamespace(patch_size=list(patch)),
        print_to_log_file=lambda *a, **k: None,
    )
    method = trainer_module.nnUNetTrainer.configure_rotation_dummyDA_mirroring_and_inital_patch_size
    rotation, dummy_2d, initial, _ = method(fake)
    return rotation, dummy_2d, tuple(int(n) for n in initial)


@pytest.mark.parametrize(
    "patch",
    [
        (8, 64, 64),
        (20, 64, 64),
        (22, 64, 64),
        (64, 64, 64),
        (32, 160, 128),
        (48, 192, 160),
        (64, 64),
        (32, 64),
    ],
)
def test_dummy_2d_rule_rotation_and_read_size_are_nnunets(patch):
    rotation, dummy_2d, initial = _nnunet_rotation_rule(patch)
    config = default_augment_config(patch)
    assert config.in_plane_only == dummy_2d
    assert config.rotation_deg == pytest.approx(math.degrees(rotation[1]))
    assert read_size(patch, config) == initial


def test_dummy_2d_scales_in_plane_only_and_keeps_every_slice():
    """Slice k holds only (a fraction of, at the fill) its own value k + 10 and label: no
    neighbouring slice is interpolated in and no slice is replaced by fill."""
    depth, side = 8, 40
    values = torch.arange(depth, dtype=torch.float32) + 10
    data = values.view(1, 1, depth, 1, 1).expand(16, 1, depth, side, side).contiguous()
    seg = (torch.arange(depth) % 2 + 1).to(torch.uint8).view(1, 1, depth, 1, 1)
    seg = seg.expand(16, 1, depth, side, side).contiguous()
    off = dict.fromkeys(
        (
            "p_rotation",
            "p_mirror",
            "p_noise",
            "p_blur",
            "p_brightness",
            "p_contrast",
            "p_low_res",
            "p_gamma_inverted",
            "p_gamma",
        ),
        0.0,
    )
    config = AugmentConfig(**off, p_scale=1.0, in_plane_only=True, rotation_deg=180)
    out, labels = augment_batch(
        data, seg, torch.Generator().manual_seed(0), config, None, (8, 32, 32)
    )
    for k in range(depth):
        assert out[:, 0, k].max() == pytest.approx(k + 10)
        assert (out[:, 0, k] <= k + 10 + 1e-4).all() and (out[:, 0, k] >= 0).all()
        assert set(labels[:, 0, k].unique().tolist()) <= {0, k % 2 + 1}
        assert (labels[:, 0, k, 16, 16] == k % 2 + 1).all()  # the centre is never fill


def _nnunet_draws(transform, key):
    torch.manual_seed(0)
    np.random.seed(0)
    image = torch.zeros((2, 1, 1, 1))
    return np.array([transform.get_parameters(image=image)[key].tolist() for _ in range(NUM_DRAWS)])


def _our_draws(name):
    pc = torch.rand(
        NUM_DRAWS, 2, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    config = AugmentConfig()
    return np.array([channel_factors(rows, config)[name] for rows in pc.tolist()])


NNUNET = {
    "brightness": lambda: brightness.MultiplicativeBrightnessTransform(
        contrast.BGContrast((0.75, 1.25)), synchronize_channels=False, p_per_channel=1
    ),
    "contrast": lambda: contrast.ContrastTransform(
        contrast.BGContrast((0.75, 1.25)),
        preserve_range=True,
        synchronize_channels=False,
        p_per_channel=1,
    ),
    "gamma": lambda: gamma_module.GammaTransform(
        contrast.BGContrast((0.7, 1.5)),
        p_invert_image=0,
        synchronize_channels=False,
        p_per_channel=1,
        p_retain_stats=1,
    ),
    "gamma_inverted": lambda: gamma_module.GammaTransform(
        contrast.BGContrast((0.7, 1.5)),
        p_invert_image=1,
        synchronize_channels=False,
        p_per_channel=1,
        p_retain_stats=1,
    ),
}
KEYS = {
    "brightness": "multipliers",
    "contrast": "multipliers",
    "gamma": "gamma",
    "gamma_inverted": "gamma",
}


@pytest.mark.parametrize("name", sorted(NNUNET))
def test_intensity_factors_are_drawn_per_channel_from_nnunets_distribution(name):
    theirs = _nnunet_draws(NNUNET[name](), KEYS[name])
    ours = _our_draws(name)
    for c in range(2):
        # two-sample KS at 20,000 draws: a real difference of 0.03 in the CDF fails
        assert stats.ks_2samp(ours[:, c], theirs[:, c]).statistic < 0.02
    # independent per channel on both sides (a shared draw has correlation 1)
    assert abs(np.corrcoef(theirs.T)[0, 1]) < 0.05
    assert abs(np.corrcoef(ours.T)[0, 1]) < 0.05


def test_brightness_contrast_gamma_differ_between_identical_channels():
    """End to end: two identical channels come out different (one draw per channel)."""
    base = torch.linspace(-1, 1, 6 * 8 * 8).view(1, 1, 6, 8, 8)
    data = base.expand(4, 2, 6, 8, 8).contiguous()
    seg = torch.zeros((4, 1, 6, 8, 8), dtype=torch.uint8)
    off = dict.fromkeys(
        (
            "p_rotation",
            "p_scale",
            "p_mirror",
            "p_noise",
            "p_blur",
            "p_brightness",
            "p_contrast",
            "p_low_res",
            "p_gamma_inverted",
            "p_gamma",
        ),
        0.0,
    )
    for gate in ("p_brightness", "p_contrast", "p_gamma", "p_gamma_inverted"):
        config = AugmentConfig(**{**off, gate: 1.0})
        out, _ = augment_batch(data, seg, torch.Generator().manual_seed(3), config)
        assert all(not torch.allclose(out[i, 0], out[i, 1]) for i in range(4)), gate


blur_module = pytest.importorskip("batchgeneratorsv2.transforms.noise.gaussian_blur")


@pytest.mark.parametrize("sigmas", [(0.5, 0.5, 0.5), (0.62, 0.81, 1.0), (1.0, 0.7, 0.55)])
def test_blur_is_batchgenerators_kernel_and_reflect_padding(sigmas):
    x = torch.randn((9, 12, 10), generator=torch.Generator().manual_seed(0))
    theirs = x[None]
    for axis, sigma in enumerate(sigmas):
        theirs = blur_module.blur_dimension(theirs, sigma, axis)
    torch.testing.assert_close(gaussian_blur(x, list(sigmas)), theirs[0], atol=1e-5, rtol=0)


spatial_module = pytest.importorskip("batchgeneratorsv2.transforms.spatial.spatial")
masking_module = pytest.importorskip("batchgeneratorsv2.transforms.utils.nnunet_masking")


@pytest.mark.parametrize("scale", [0.75, 1.0, 1.3])
def test_outside_the_body_is_masked_as_nnunets_minus_one_label(scale):
    """A use_mask_for_norm channel through scaling and masking: nnU-Net stores -1 outside
    the body, pads with -1 and resamples it as a label of its own; nnui's image and labels
    come out the same (before: 3.6 % of the voxels masked differently at scale 1.3)."""
    shape = (30, 60, 60)
    z, y, x = torch.meshgrid(*[torch.arange(n) for n in shape], indexing="ij")
    body = (((z - 15) / 13.3) ** 2 + ((y - 30) / 25.2) ** 2 + ((x - 30) / 21.7) ** 2) < 1
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    image = torch.where(body, noise * 0.5 + 1.0, torch.zeros(()))
    seg = torch.zeros(shape, dtype=torch.int16)
    seg[(((z - 15) / 6) ** 2 + ((y - 26) / 9) ** 2 + ((x - 33) / 8) ** 2) < 1] = 1
    stored = torch.where(body | (seg > 0), seg, torch.full_like(seg, -1))
    patch = (24, 48, 48)
    spatial = spatial_module.SpatialTransform(
        patch, 0, False, p_scaling=1, scaling=(scale, scale),
        p_synchronize_scaling_across_axes=1, border_mode_seg="constant", padding_value_seg=-1,
    )  # fmt: skip
    theirs = spatial(image=image[None].clone(), segmentation=stored[None].clone())
    theirs = masking_module.MaskImageTransform([0])(**theirs)
    off = {k: 0.0 for k in AugmentConfig().__dict__ if k.startswith("p_")}
    config = AugmentConfig(
        **{**off, "p_scale": 1.0}, scale_range=(scale, scale), mask_channels=(True,)
    )
    generator = torch.Generator().manual_seed(1)
    seg8 = seg.to(torch.uint8)[None, None]
    ours, labels = augment_batch(image[None, None], seg8, generator, config, patch_size=patch)
    torch.testing.assert_close(ours[0], theirs["image"], atol=1e-4, rtol=0)
    assert torch.equal(labels[0, 0].long(), theirs["segmentation"][0].clamp_min(0).long())
