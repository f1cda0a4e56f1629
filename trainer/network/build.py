"""The network of a plan: the plain U-Net (trainer.network.unet) or the residual-encoder one
of the ResEnc presets (trainer.network.resenc), both from the same building blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from trainer.network.resenc import ResidualEncoderUNet
from trainer.network.unet import PlainConvUNet

if TYPE_CHECKING:
    from trainer.planning.plans import NetworkPlan


def build_network(
    network_plan: NetworkPlan,
    in_channels: int,
    num_classes: int,
    ndim: int,
    deep_supervision: bool = True,
    recompute_norm: bool = True,
) -> nn.Module:
    """From a NetworkPlan (features_per_stage, kernel_sizes, strides, n_conv_*): the plain
    U-Net, or the residual-encoder one of the ResEnc presets (trainer.network.resenc)."""
    from trainer.planning.plans import RESIDUAL_ENCODER

    common: dict[str, Any] = {
        "in_channels": in_channels,
        "num_classes": num_classes,
        "features_per_stage": list(network_plan.features_per_stage),
        "kernel_sizes": list(network_plan.kernel_sizes),
        "strides": list(network_plan.strides),
        "n_conv_per_stage_decoder": list(network_plan.n_conv_per_stage_decoder),
        "ndim": ndim,
        "deep_supervision": deep_supervision,
    }
    encoder = list(network_plan.n_conv_per_stage_encoder)
    if getattr(network_plan, "architecture", None) == RESIDUAL_ENCODER:
        return ResidualEncoderUNet(**common, n_blocks_per_stage=encoder)
    return PlainConvUNet(**common, n_conv_per_stage_encoder=encoder, recompute_norm=recompute_norm)
