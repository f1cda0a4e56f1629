"""Plain convolutional U-Net for 2d and 3d (the nnU-Net v2 default architecture family).

Per stage: (conv -> instance norm (affine) -> LeakyReLU 0.01) x n; the first conv of an
encoder stage carries the stride (downsampling). Decoder: transposed conv (kernel = stride)
upsampling, concatenation with the skip, convs, and a 1x1 segmentation head per decoder
stage for deep supervision. Outputs are ordered highest resolution first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

_CONV = {2: nn.Conv2d, 3: nn.Conv3d}
_TRANSP = {2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
_NORM = {2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}


def _as_tuple(value: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    return (value,) * ndim if isinstance(value, int) else tuple(int(v) for v in value)


class ConvBlock(nn.Sequential):
    def __init__(
        self, ndim: int, in_ch: int, out_ch: int, kernel: Sequence[int], stride: Sequence[int]
    ):
        padding = tuple(k // 2 for k in kernel)
        super().__init__(
            _CONV[ndim](in_ch, out_ch, tuple(kernel), tuple(stride), padding, bias=True),
            _NORM[ndim](out_ch, eps=1e-5, affine=True),
            nn.LeakyReLU(0.01, inplace=True),
        )


def _stage(
    ndim: int, in_ch: int, out_ch: int, kernel: Sequence[int], stride: Sequence[int], n: int
) -> nn.Sequential:
    blocks = [ConvBlock(ndim, in_ch, out_ch, kernel, stride)]
    blocks += [ConvBlock(ndim, out_ch, out_ch, kernel, (1,) * ndim) for _ in range(n - 1)]
    return nn.Sequential(*blocks)


class PlainConvUNet(nn.Module):
    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        features_per_stage: Sequence[int],
        kernel_sizes: Sequence[Sequence[int] | int],
        strides: Sequence[Sequence[int] | int],
        n_conv_per_stage_encoder: Sequence[int],
        n_conv_per_stage_decoder: Sequence[int],
        ndim: int,
        deep_supervision: bool = True,
    ) -> None:
        super().__init__()
        if ndim not in (2, 3):
            raise ValueError(f"ndim must be 2 or 3, got {ndim}")
        num_stages = len(features_per_stage)
        if not (len(kernel_sizes) == len(strides) == len(n_conv_per_stage_encoder) == num_stages):
            raise ValueError(
                "kernel_sizes, strides and n_conv_per_stage_encoder need one entry per stage"
            )
        if len(n_conv_per_stage_decoder) != num_stages - 1:
            raise ValueError("n_conv_per_stage_decoder needs num_stages - 1 entries")
        kernels = [_as_tuple(k, ndim) for k in kernel_sizes]
        stride_list = [_as_tuple(s, ndim) for s in strides]
        self.deep_supervision = deep_supervision
        self.encoder = nn.ModuleList()
        channels = in_channels
        for s in range(num_stages):
            self.encoder.append(
                _stage(
                    ndim,
                    channels,
                    features_per_stage[s],
                    kernels[s],
                    stride_list[s],
                    n_conv_per_stage_encoder[s],
                )
            )
            channels = features_per_stage[s]
        self.upsample = nn.ModuleList()
        self.decoder = nn.ModuleList()
        self.heads = nn.ModuleList()
        # Decoder index d refines to the resolution of encoder stage num_stages - 2 - d.
        for d in range(num_stages - 1):
            skip = num_stages - 2 - d
            below = features_per_stage[skip + 1]
            self.upsample.append(
                _TRANSP[ndim](
                    below,
                    features_per_stage[skip],
                    stride_list[skip + 1],
                    stride_list[skip + 1],
                    bias=True,
                )
            )
            self.decoder.append(
                _stage(
                    ndim,
                    2 * features_per_stage[skip],
                    features_per_stage[skip],
                    kernels[skip],
                    (1,) * ndim,
                    n_conv_per_stage_decoder[skip],
                )
            )
            self.heads.append(
                _CONV[ndim](features_per_stage[skip], num_classes, 1, 1, 0, bias=True)
            )
        self.apply(_init_weights)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor] | torch.Tensor:
        skips = []
        for stage in self.encoder:
            x = stage(x)
            skips.append(x)
        x = skips.pop()
        outputs = []
        for d, (up, stage) in enumerate(zip(self.upsample, self.decoder, strict=True)):
            x = stage(torch.cat((up(x), skips[-1 - d]), dim=1))
            if self.deep_supervision or d == len(self.decoder) - 1:
                outputs.append(self.heads[d](x))
        outputs.reverse()  # highest resolution first
        return outputs if self.deep_supervision else outputs[0]


def _init_weights(module: nn.Module) -> None:
    # He initialisation for LeakyReLU(0.01), zero biases.
    if isinstance(module, (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        nn.init.kaiming_normal_(module.weight, a=1e-2)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def build_network(
    network_plan: object,
    in_channels: int,
    num_classes: int,
    ndim: int,
    deep_supervision: bool = True,
) -> PlainConvUNet:
    """From the data helper's NetworkPlan (features_per_stage, kernel_sizes, strides, n_conv_*)."""
    return PlainConvUNet(
        in_channels=in_channels,
        num_classes=num_classes,
        features_per_stage=list(network_plan.features_per_stage),
        kernel_sizes=list(network_plan.kernel_sizes),
        strides=list(network_plan.strides),
        n_conv_per_stage_encoder=list(network_plan.n_conv_per_stage_encoder),
        n_conv_per_stage_decoder=list(network_plan.n_conv_per_stage_decoder),
        ndim=ndim,
        deep_supervision=deep_supervision,
    )
