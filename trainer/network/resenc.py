"""Residual-encoder U-Net for 2d and 3d (nnU-Net's ResidualEncoderUNet, the ResEnc presets).

Built from network.unet's parts (convs, norms, decoder, forward, initialisation); its own
are the stem and the residual blocks. Encoder: a stem conv (stride 1), then per stage n
residual blocks (ResNet-D "basic" blocks): conv -> norm -> LeakyReLU -> conv -> norm, plus
the skip, then LeakyReLU. The first
block of a stage carries the stride; its skip average-pools by that stride and, when the
width changes, projects with a 1x1 conv (no bias) and a norm. Decoder: as the plain U-Net's
(transposed-conv upsampling, concatenation with the skip, convs, a 1x1 head per stage for
deep supervision), with one conv per stage in the presets. Same layers and parameter count
as dynamic_network_architectures' ResidualEncoderUNet for the same plan (a test checks it).

Initialisation: He for every conv, zero biases, and the last norm of every residual block
set to zero, so each block starts as its skip (a common choice for deep residual nets).
The whole training forward is kept by autograd (no recomputation: `--recompute-norm` is
for the plain U-Net).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from trainer.network.unet import (
    CONV,
    NEGATIVE_SLOPE,
    NORM,
    as_tuple,
    build_decoder,
    init_weights,
    plain_forward,
)


def _conv_norm(ndim: int, in_ch: int, out_ch: int, kernel: Sequence[int], stride: Sequence[int],
               act: bool = True, bias: bool = True) -> nn.Sequential:  # fmt: skip
    """conv -> norm (-> LeakyReLU): the residual blocks' pieces (the plain U-Net's ConvBlock
    always has the activation and a bias)."""
    layers = [
        CONV[ndim](in_ch, out_ch, tuple(kernel), tuple(stride), tuple(k // 2 for k in kernel),
                   bias=bias),
        NORM[ndim](out_ch, eps=1e-5, affine=True),
    ]  # fmt: skip
    if act:
        layers.append(nn.LeakyReLU(NEGATIVE_SLOPE, inplace=True))
    return nn.Sequential(*layers)


_POOL: dict[int, Callable[..., nn.Module]] = {2: nn.AvgPool2d, 3: nn.AvgPool3d}


class ResidualBlock(nn.Module):
    def __init__(
        self, ndim: int, in_ch: int, out_ch: int, kernel: Sequence[int], stride: Sequence[int]
    ):
        super().__init__()
        self.conv1 = _conv_norm(ndim, in_ch, out_ch, kernel, stride)
        self.conv2 = _conv_norm(ndim, out_ch, out_ch, kernel, (1,) * ndim, act=False)
        skip: list[nn.Module] = []
        if any(s != 1 for s in stride):
            skip.append(_POOL[ndim](tuple(stride), tuple(stride)))
        if in_ch != out_ch:
            skip += list(_conv_norm(ndim, in_ch, out_ch, (1,) * ndim, (1,) * ndim, False, False))
        self.skip = nn.Sequential(*skip)  # empty: the identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(self.conv1(x)) + self.skip(x)
        return F.leaky_relu(out, NEGATIVE_SLOPE, inplace=True)


def _residual_stage(
    ndim: int, in_ch: int, out_ch: int, kernel: Sequence[int], stride: Sequence[int], n: int
) -> nn.Sequential:
    blocks = [ResidualBlock(ndim, in_ch, out_ch, kernel, stride)]
    blocks += [ResidualBlock(ndim, out_ch, out_ch, kernel, (1,) * ndim) for _ in range(n - 1)]
    return nn.Sequential(*blocks)


class ResidualEncoderUNet(nn.Module):
    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        features_per_stage: Sequence[int],
        kernel_sizes: Sequence[Sequence[int] | int],
        strides: Sequence[Sequence[int] | int],
        n_blocks_per_stage: Sequence[int],
        n_conv_per_stage_decoder: Sequence[int],
        ndim: int,
        deep_supervision: bool = True,
    ) -> None:
        super().__init__()
        num_stages = len(features_per_stage)
        if ndim not in (2, 3) or not (
            len(kernel_sizes) == len(strides) == len(n_blocks_per_stage) == num_stages
            and len(n_conv_per_stage_decoder) == num_stages - 1
        ):
            raise ValueError("ndim 2 or 3; kernel_sizes, strides, n_blocks_per_stage per stage; "
                             "n_conv_per_stage_decoder per stage but the lowest")  # fmt: skip
        kernels = [as_tuple(k, ndim) for k in kernel_sizes]
        stride_list = [as_tuple(s, ndim) for s in strides]
        self.deep_supervision = deep_supervision
        self.stem = _conv_norm(ndim, in_channels, features_per_stage[0], kernels[0], (1,) * ndim)
        self.encoder = nn.ModuleList()
        channels = features_per_stage[0]
        for s, features in enumerate(features_per_stage):
            self.encoder.append(
                _residual_stage(
                    ndim, channels, features, kernels[s], stride_list[s], n_blocks_per_stage[s]
                )
            )
            channels = features
        self.upsample, self.decoder, self.heads = build_decoder(
            ndim, num_classes, features_per_stage, kernels, stride_list, n_conv_per_stage_decoder
        )
        self.apply(init_weights)
        for module in self.modules():
            if isinstance(module, ResidualBlock):
                norm = module.conv2[1]
                nn.init.zeros_(cast(torch.Tensor, norm.weight))
                nn.init.zeros_(cast(torch.Tensor, norm.bias))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor] | torch.Tensor:
        outputs = plain_forward(self.stem(x), self.encoder, self.upsample, self.decoder,
                                self.heads, self.deep_supervision)  # fmt: skip
        outputs.reverse()  # highest resolution first
        return outputs if self.deep_supervision else outputs[0]
