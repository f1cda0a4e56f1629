"""Plain convolutional U-Net for 2d and 3d (the nnU-Net v2 default architecture family).

Per stage: (conv -> instance norm (affine) -> LeakyReLU 0.01) x n; the first conv of an
encoder stage carries the stride (downsampling). Decoder: transposed conv (kernel = stride)
upsampling, concatenation with the skip, convs, and a 1x1 segmentation head per decoder
stage for deep supervision. Outputs are ordered highest resolution first.

Memory: autograd would keep two full-size tensors per conv block (the conv output for the
norm's backward, the activation for the next conv's backward) plus every decoder concat.
With `recompute_norm` (nnui-train's default on CPU) the training forward is cut at the
conv outputs instead: each piece is norm -> activation -> conv, run under selective
checkpointing that keeps the conv's output and recomputes the cheap norm and activation
during backward. One tensor per block is kept and no concat: less than half the
activation memory, the same math (gradients equal up to float rounding), 6-11 % more
time on CPU (bench/history.md). Evaluation and recompute_norm=False run the plain forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from trainer.network.norm import InstanceNorm3d, instance_norm_on_base

# Typed as builders: both take an int or a per-axis tuple for sizes and strides.
CONV: dict[int, Callable[..., nn.Module]] = {2: nn.Conv2d, 3: nn.Conv3d}
TRANSPOSED_CONV: dict[int, Callable[..., nn.Module]] = {
    2: nn.ConvTranspose2d,
    3: nn.ConvTranspose3d,
}
NORM = {2: nn.InstanceNorm2d, 3: InstanceNorm3d}  # 3d: a channels_last inference path


def as_tuple(value: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    return (value,) * ndim if isinstance(value, int) else tuple(int(v) for v in value)


NEGATIVE_SLOPE = 0.01


class ConvBlock(nn.Sequential):
    def __init__(
        self, ndim: int, in_ch: int, out_ch: int, kernel: Sequence[int], stride: Sequence[int]
    ):
        padding = tuple(k // 2 for k in kernel)
        super().__init__(
            CONV[ndim](in_ch, out_ch, tuple(kernel), tuple(stride), padding, bias=True),
            NORM[ndim](out_ch, eps=1e-5, affine=True),
            nn.LeakyReLU(NEGATIVE_SLOPE, inplace=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_act(self.conv(x))

    def conv(self, x: torch.Tensor) -> torch.Tensor:
        return self[0](x)

    def norm_act(self, z: torch.Tensor) -> torch.Tensor:
        """Norm and activation of this block's conv output z (z itself is left intact).
        In place saves a full-size buffer; torch.compile wants checkpointed regions
        without in-place ops."""
        inplace = not torch.compiler.is_compiling()
        norm = self[1]
        plain = not isinstance(norm, nn.modules.instancenorm._InstanceNorm)
        if plain or norm.track_running_stats or not torch.is_grad_enabled():
            # GroupNorm and the like; and inference, where no autograd is there to wrap and
            # the norm module keeps a channels_last input in its layout (trainer.network.norm).
            return F.leaky_relu(norm(z), NEGATIVE_SLOPE, inplace=inplace)
        return instance_norm_on_base(
            cast(nn.modules.instancenorm._InstanceNorm, norm),
            z,
            lambda t: F.leaky_relu(t, NEGATIVE_SLOPE, inplace=inplace),
        )


def _selective(keep: int | None) -> Callable[[], tuple]:
    """Checkpoint contexts that keep the output of a piece's keep-th conv (1-based; None:
    none) and recompute every other op in backward."""

    def contexts() -> tuple:
        calls = {False: 0, True: 0}  # forward and recompute count their convs apart

        def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
            if op is torch.ops.aten.convolution.default:
                calls[ctx.is_recompute] += 1
                if calls[ctx.is_recompute] == keep:
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return contexts


_KEEP_FIRST, _KEEP_SECOND, _KEEP_NONE = _selective(1), _selective(2), _selective(None)


def _stage(
    ndim: int, in_ch: int, out_ch: int, kernel: Sequence[int], stride: Sequence[int], n: int
) -> nn.Sequential:
    blocks = [ConvBlock(ndim, in_ch, out_ch, kernel, stride)]
    blocks += [ConvBlock(ndim, out_ch, out_ch, kernel, (1,) * ndim) for _ in range(n - 1)]
    return nn.Sequential(*blocks)


def _check_unet_arguments(
    ndim: int,
    features_per_stage: Sequence[int],
    kernel_sizes: Sequence,
    strides: Sequence,
    n_conv_per_stage_encoder: Sequence[int],
    n_conv_per_stage_decoder: Sequence[int],
) -> None:
    if ndim not in (2, 3):
        raise ValueError(f"ndim must be 2 or 3, got {ndim}")
    num_stages = len(features_per_stage)
    if not (len(kernel_sizes) == len(strides) == len(n_conv_per_stage_encoder) == num_stages):
        raise ValueError(
            "kernel_sizes, strides and n_conv_per_stage_encoder need one entry per stage"
        )
    if len(n_conv_per_stage_decoder) != num_stages - 1:
        raise ValueError("n_conv_per_stage_decoder needs num_stages - 1 entries")


def _encoder(
    ndim: int,
    in_channels: int,
    features_per_stage: Sequence[int],
    kernels: list[tuple[int, ...]],
    strides: list[tuple[int, ...]],
    n_conv_per_stage: Sequence[int],
) -> nn.ModuleList:
    encoder = nn.ModuleList()
    channels = in_channels
    for s, features in enumerate(features_per_stage):
        encoder.append(
            _stage(ndim, channels, features, kernels[s], strides[s], n_conv_per_stage[s])
        )
        channels = features
    return encoder


def build_decoder(
    ndim: int,
    num_classes: int,
    features_per_stage: Sequence[int],
    kernels: list[tuple[int, ...]],
    strides: list[tuple[int, ...]],
    convs_per_level: Sequence[int],
) -> tuple[nn.ModuleList, nn.ModuleList, nn.ModuleList]:
    """(upsample, decoder, heads) of both U-Nets; level d (0: the deepest) refines to the
    resolution of encoder stage num_stages - 2 - d with convs_per_level[d] conv blocks.
    Built interleaved per level, in this order, because module construction draws from the
    global RNG: same seed, same initial weights."""
    upsample, decoder, heads = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
    num_stages = len(features_per_stage)
    for d in range(num_stages - 1):
        skip = num_stages - 2 - d
        below, features = features_per_stage[skip + 1], features_per_stage[skip]
        up_stride = strides[skip + 1]
        upsample.append(TRANSPOSED_CONV[ndim](below, features, up_stride, up_stride, bias=True))
        decoder.append(
            _stage(ndim, 2 * features, features, kernels[skip], (1,) * ndim, convs_per_level[d])
        )
        heads.append(CONV[ndim](features, num_classes, 1, 1, 0, bias=True))
    return upsample, decoder, heads


def plain_forward(
    x: torch.Tensor,
    encoder: nn.ModuleList,
    upsample: nn.ModuleList,
    decoder: nn.ModuleList,
    heads: nn.ModuleList,
    deep_supervision: bool,
) -> list[torch.Tensor]:
    """Encoder stages, then per decoder level: upsample, concatenate the skip, convs, and its
    head (every level's under deep supervision, else the last one's). Deepest first."""
    skips = []
    for stage in encoder:
        x = stage(x)
        skips.append(x)
    x = skips.pop()
    outputs = []
    for d, (up, stage) in enumerate(zip(upsample, decoder, strict=True)):
        x = stage(torch.cat((up(x), skips[-1 - d]), dim=1))
        if deep_supervision or d == len(decoder) - 1:
            outputs.append(heads[d](x))
    return outputs


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
        recompute_norm: bool = True,
    ) -> None:
        super().__init__()
        _check_unet_arguments(
            ndim,
            features_per_stage,
            kernel_sizes,
            strides,
            n_conv_per_stage_encoder,
            n_conv_per_stage_decoder,
        )
        kernels = [as_tuple(k, ndim) for k in kernel_sizes]
        stride_list = [as_tuple(s, ndim) for s in strides]
        self.deep_supervision = deep_supervision
        self.recompute_norm = recompute_norm
        self.encoder = _encoder(
            ndim, in_channels, features_per_stage, kernels, stride_list, n_conv_per_stage_encoder
        )
        # n_conv_per_stage_decoder is indexed by the encoder stage a level refines to.
        num_levels = len(features_per_stage) - 1
        per_level = [n_conv_per_stage_decoder[num_levels - 1 - d] for d in range(num_levels)]
        self.upsample, self.decoder, self.heads = build_decoder(
            ndim, num_classes, features_per_stage, kernels, stride_list, per_level
        )
        self.apply(init_weights)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor] | torch.Tensor:
        if self.recompute_norm and torch.is_grad_enabled():
            outputs = self._recomputing_forward(x)
        else:
            outputs = self._plain_forward(x)
        outputs.reverse()  # highest resolution first
        return outputs if self.deep_supervision else outputs[0]

    def _plain_forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return plain_forward(x, self.encoder, self.upsample, self.decoder, self.heads,
                             self.deep_supervision)  # fmt: skip

    @staticmethod
    def _piece(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor, keep=_KEEP_FIRST):
        return checkpoint(fn, *inputs, use_reentrant=False, context_fn=keep)

    def _recomputing_forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The same network as a chain of kept conv outputs z: each piece applies the norm
        and activation of the block that produced its input, then a conv. Two pieces also
        recompute cheap convs at full resolution, where the backward peak is: the first
        conv (one input channel), and the top decoder's upsampling and concat conv, the
        latter split into its two halves so that neither the concat nor its gradient ever
        exists."""
        stages = [cast(nn.Sequential, stage) for stage in self.encoder]
        blocks = [cast(ConvBlock, block) for stage in stages for block in stage]
        stage_ends = {sum(len(st) for st in stages[: s + 1]) - 1 for s in range(len(stages))}
        merged_first = len(stages[0]) >= 2  # else z of block 0 is a skip and is kept
        skips: list[tuple[ConvBlock, torch.Tensor]] = []
        z, owner = x, None  # owner: the block whose conv produced z
        for i, block in enumerate(blocks):
            if owner is None:
                if not merged_first:
                    z = block.conv(z)
            elif i == 1 and merged_first:
                z = self._piece(lambda t, o=owner, b=block: b.conv(o.norm_act(o.conv(t))), z,
                                keep=_KEEP_SECOND)  # fmt: skip
            else:
                z = self._piece(lambda t, o=owner, b=block: b.conv(o.norm_act(t)), z)
            owner = block
            if i in stage_ends:
                skips.append((owner, z))
        skips.pop()
        outputs = []
        top = len(self.decoder) - 1
        for d, (up, stage) in enumerate(zip(self.upsample, self.decoder, strict=True)):
            skip_owner, skip_z = skips[-1 - d]
            stage = cast(nn.Sequential, stage)
            first = cast(ConvBlock, stage[0])
            if d == top:

                def merge(t, s, o=owner, u=up, so=skip_owner, conv=first[0]):
                    low = u(o.norm_act(t))
                    c = low.shape[1]
                    part = conv._conv_forward(low, conv.weight[:, :c], None)
                    return part + conv._conv_forward(so.norm_act(s), conv.weight[:, c:], conv.bias)

                z = self._piece(merge, z, skip_z, keep=_KEEP_NONE)
            else:
                z = self._piece(lambda t, o=owner, u=up: u(o.norm_act(t)), z)
                z = self._piece(
                    lambda t, s, so=skip_owner, b=first: b.conv(torch.cat((t, so.norm_act(s)), 1)),
                    z, skip_z,
                )  # fmt: skip
            owner = first
            for block in [cast(ConvBlock, b) for b in list(stage)[1:]]:
                z = self._piece(lambda t, o=owner, b=block: b.conv(o.norm_act(t)), z)
                owner = block
            if self.deep_supervision or d == top:
                outputs.append(self._piece(lambda t, o=owner, h=self.heads[d]: h(o.norm_act(t)), z))
        return outputs


def init_weights(module: nn.Module) -> None:
    # He initialisation for LeakyReLU(0.01), zero biases.
    if isinstance(module, (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        nn.init.kaiming_normal_(module.weight, a=1e-2)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
