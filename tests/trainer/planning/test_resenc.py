"""Residual-encoder presets: plans for 2d and 3d, the network's shapes, and the same network
and memory estimate as nnU-Net's ResidualEncoderUNet (dynamic_network_architectures, which
the nnU-Net extra installs; those tests skip without it)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.network.build import build_network
from trainer.planning.plans import RESIDUAL_ENCODER, plans_content, plans_from_dict
from trainer.planning.resenc import PRESETS, plan_patch_and_batch, plan_preset, resenc_network
from trainer.planning.topology import feature_map_voxels, topology

# (spacing, patch, input channels, classes)
PLANS = [
    ((1.0, 1.0, 1.0), (64, 64, 64), 1, 3),
    ((2.5, 0.8, 0.8), (20, 80, 64), 2, 4),
    ((3.0, 0.7, 0.7), (12, 64, 48), 1, 2),
    ((0.8, 0.8), (128, 96), 1, 3),
    ((1.0, 1.0), (64, 48), 3, 5),
]


def _dna_net(net, in_channels: int, num_classes: int, deep_supervision: bool = True):
    unet = pytest.importorskip(
        "dynamic_network_architectures.architectures.unet",
        reason="the nnunet extra installs dynamic_network_architectures",
    )
    ndim = len(net.strides[0])
    conv = torch.nn.Conv3d if ndim == 3 else torch.nn.Conv2d
    norm = torch.nn.InstanceNorm3d if ndim == 3 else torch.nn.InstanceNorm2d
    return unet.ResidualEncoderUNet(
        input_channels=in_channels, n_stages=net.num_stages,
        features_per_stage=net.features_per_stage, conv_op=conv, kernel_sizes=net.kernel_sizes,
        strides=net.strides, n_blocks_per_stage=net.n_conv_per_stage_encoder,
        num_classes=num_classes, n_conv_per_stage_decoder=net.n_conv_per_stage_decoder,
        conv_bias=True, norm_op=norm, norm_op_kwargs={"eps": 1e-5, "affine": True},
        nonlin=torch.nn.LeakyReLU, nonlin_kwargs={"inplace": True},
        deep_supervision=deep_supervision,
    )  # fmt: skip


def _num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(("spacing", "patch", "in_channels", "num_classes"), PLANS)
def test_network_equals_nnunets_residual_encoder_unet(spacing, patch, in_channels, num_classes):
    top = topology(spacing, patch)
    net = resenc_network(top)
    ours = build_network(net, in_channels, num_classes, len(spacing))
    theirs = _dna_net(net, in_channels, num_classes)
    assert _num_params(ours) == _num_params(theirs)
    shapes = sorted(tuple(p.shape) for p in ours.parameters())
    assert shapes == sorted(tuple(p.shape) for p in theirs.parameters())
    # The memory estimate is nnU-Net's (its network without deep supervision).
    plain = _dna_net(net, in_channels, num_classes, deep_supervision=False)
    expected = int(plain.compute_conv_feature_map_size(top.patch_size))
    assert feature_map_voxels(net, top.patch_size, num_classes) == expected


@pytest.mark.parametrize(("ndim", "patch"), [(3, (16, 32, 32)), (2, (32, 48))])
def test_forward_shapes_deep_supervision_and_initial_blocks(ndim, patch):
    spacing = (1.0,) * ndim
    net = resenc_network(topology(spacing, patch))
    assert net.architecture == RESIDUAL_ENCODER
    assert net.n_conv_per_stage_encoder == (1, 3, 4, 6, 6, 6, 6)[: net.num_stages]
    torch.manual_seed(0)
    model = build_network(net, 1, 3, ndim)
    outputs = model(torch.randn(2, 1, *patch))
    assert len(outputs) == net.num_stages - 1
    size = list(patch)
    for out, stride in zip(outputs, net.strides, strict=False):
        size = [s // st for s, st in zip(size, stride, strict=True)]
        assert tuple(out.shape) == (2, 3, *size)
    # every residual block starts as its skip: the norm before the sum is zero
    blocks = [m for m in model.modules() if type(m).__name__ == "ResidualBlock"]
    assert len(blocks) == sum(net.n_conv_per_stage_encoder)
    assert all(not b.conv2[1].weight.any() for b in blocks)
    model.deep_supervision = False
    assert tuple(model(torch.randn(1, 1, *patch)).shape) == (1, 3, *patch)


def _fingerprint(shapes, spacings) -> dict:
    return {
        "spacings": spacings,
        "shapes_after_crop": shapes,
        "median_relative_size_after_cropping": 1.0,
        "foreground_intensity_properties_per_channel": {"0": {"mean": 0.0}},
    }


DATASET_JSON = {"channel_names": {"0": "MRI"}, "labels": {"background": 0, "a": 1, "b": 2}}


def test_presets_plan_2d_and_3d_with_memory_targets_and_dataset_cap():
    """Larger presets: the same or a larger patch and batch; every estimate fits its
    reference; the batch never covers more voxels than the dataset; data is the default's."""
    shapes = [[160, 320, 320]] * 30
    spacings = [[1.0, 0.8, 0.8]] * 30
    previous = {}
    for planner in ("nnUNetPlannerResEncM", "nnUNetPlannerResEncL", "nnUNetPlannerResEncXL"):
        plans = plan_preset(_fingerprint(shapes, spacings), {**DATASET_JSON, "numTraining": 30},
                            "Dataset001_X", planner)  # fmt: skip
        assert plans.plans_name == PRESETS[planner][0]
        spec = PRESETS[planner][1]
        assert set(plans.configurations) == {"2d", "3d_fullres"}
        for name, c in plans.configurations.items():
            assert c.data_identifier == f"nnuiPlans_{name}"
            assert c.network.architecture == RESIDUAL_ENCODER
            assert c.network.n_conv_per_stage_decoder == (1,) * (c.network.num_stages - 1)
            estimate = feature_map_voxels(c.network, c.patch_size, 3)
            assert estimate <= spec.reference(c.ndim, spec.reference_gb)
            divisor = c.network.pooling_divisor
            assert all(p % d == 0 for p, d in zip(c.patch_size, divisor, strict=True))
            if name in previous:
                old = previous[name]
                old_voxels = math.prod(old.patch_size) * old.batch_size
                assert math.prod(c.patch_size) * c.batch_size >= old_voxels
            previous[name] = c
        # round trip through the plans file keeps the architecture and the block counts
        again = plans_from_dict(plans_content(plans))
        assert again.configurations == plans.configurations and again.identity == plans.identity


def test_small_dataset_caps_the_batch_at_its_voxels():
    top, batch = plan_patch_and_batch("nnUNetPlannerResEncXL", (1.0, 1.0, 1.0),
                                      (24.0, 40.0, 40.0), 3, 3 * 24 * 40 * 40)  # fmt: skip
    assert top.patch_size == (24, 40, 40)
    assert batch == 3  # the headroom alone would give far more


def test_anisotropic_topology_convolves_in_plane_first():
    top = topology((3.0, 0.7, 0.7), (20, 192, 160))
    assert top.kernel_sizes[0] == (1, 3, 3)
    assert top.strides[1] == (1, 2, 2)
    assert top.kernel_sizes[-1] == (3, 3, 3)
    assert all(p % d == 0 for p, d in zip(top.patch_size, top.divisor, strict=True))


_DNA_NAMES = [  # dynamic_network_architectures' parameter names -> nnui's
    (r"^encoder\.stem\.convs\.0\.conv\.", "stem.0."),
    (r"^encoder\.stem\.convs\.0\.norm\.", "stem.1."),
    (r"^encoder\.stages\.(\d+)\.blocks\.(\d+)\.(conv[12])\.conv\.", r"encoder.\1.\2.\3.0."),
    (r"^encoder\.stages\.(\d+)\.blocks\.(\d+)\.(conv[12])\.norm\.", r"encoder.\1.\2.\3.1."),
    (r"^encoder\.stages\.(\d+)\.blocks\.(\d+)\.skip\.(\d+)\.conv\.", r"encoder.\1.\2.skip.\3."),
    (r"^decoder\.stages\.(\d+)\.convs\.(\d+)\.conv\.", r"decoder.\1.\2.0."),
    (r"^decoder\.stages\.(\d+)\.convs\.(\d+)\.norm\.", r"decoder.\1.\2.1."),
    (r"^decoder\.transpconvs\.(\d+)\.", r"upsample.\1."),
    (r"^decoder\.seg_layers\.(\d+)\.", r"heads.\1."),
]


def _our_name(name: str) -> str:
    import re

    skip_norm = re.match(r"^encoder\.stages\.(\d+)\.blocks\.(\d+)\.skip\.(\d+)\.norm\.(.+)$", name)
    if skip_norm:  # nnui's skip is flat: [pool,] conv, norm
        s, b, i, rest = skip_norm.groups()
        return f"encoder.{s}.{b}.skip.{int(i) + 1}.{rest}"
    for pattern, repl in _DNA_NAMES:
        if re.match(pattern, name):
            return re.sub(pattern, repl, name)
    raise AssertionError(f"unmapped parameter {name}")


@pytest.mark.parametrize(
    ("spacing", "patch"), [((2.5, 0.8, 0.8), (8, 32, 32)), ((1.0, 1.0), (32, 32))]
)
def test_same_weights_give_nnunets_outputs(spacing, patch):
    """Functionally the same network: nnU-Net's weights loaded into nnui's give its outputs."""
    top = topology(spacing, patch)
    net = resenc_network(top)
    torch.manual_seed(0)
    theirs = _dna_net(net, 1, 3).eval()
    ours = build_network(net, 1, 3, len(spacing)).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.1)  # nonzero everywhere, the zero-initialised norms too
        mapped = {_our_name(n): p for n, p in theirs.named_parameters()}
        assert set(mapped) == {n for n, _ in ours.named_parameters()}
        ours.load_state_dict(mapped, strict=True)
        x = torch.randn(2, 1, *top.patch_size)
        for a, b in zip(ours(x), theirs(x), strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
