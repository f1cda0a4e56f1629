"""Instance norm with a channels_last_3d path for CPU inference (both U-Nets use it).

CPU inference runs the 3D networks in channels_last_3d: oneDNN's convolutions then skip
the per-conv reorders between NCDHW and its blocked layout, and the full-resolution convs
of the bench's 64x80x80 network took ~40 % less CPU (bench/history.md). F.instance_norm
would undo that: it makes its input contiguous (a full copy back to NCDHW) and then runs
4x slower than on NCDHW. For one float32 sample without autograd this class computes the
same statistics with two passes of sums over the spatial axes (a (voxels, C) view of
channels_last memory; as accurate as F.instance_norm, float32 vs float64 error ~1e-5) and
applies them with batch_norm's inference kernel, which keeps channels_last and fuses scale
and shift. batch_norm's own training statistics serve only bf16/fp16 samples: they
accumulate channels_last sums serially (~1e-3 error in float32, under a bf16 output's
rounding). Everything else, training included, is nn.InstanceNorm3d.

Training goes through instance_norm_on_base: torch's instance norm returns a view of its
batch_norm output, and the in-place LeakyReLU that follows on that view makes autograd wrap
its backward in CopySlices (3 full-size copies and a fill per block, ~5 % of a 2d CPU step).
The same batch_norm call on the same reshaped input, returned as the base tensor, gives the
same bits without them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _channels_last_sample(z: torch.Tensor) -> bool:
    return (
        z.dim() == 5
        and z.shape[0] == 1
        and not z.is_contiguous()
        and z.is_contiguous(memory_format=torch.channels_last_3d)
    )


class InstanceNorm3d(nn.InstanceNorm3d):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or not _channels_last_sample(z):
            return super().forward(z)
        if z.dtype in (torch.bfloat16, torch.float16):
            # Under autocast (bf16 on AMX CPUs): batch_norm's own statistics of the one
            # sample, float32 affine parameters (its mixed-dtype kernel). Their serial
            # channels_last sums err ~1e-4, far under the bf16 output's rounding (max error
            # 2.3e-2 vs 6.0e-2 for var_mean's bf16 statistics), and they take a sixth of
            # var_mean's time, which was 45 % of a 96x160x160 window (bench/history.md).
            return F.batch_norm(z, None, None, self.weight, self.bias, True, 0.0, self.eps)
        voxels = z[0].permute(1, 2, 3, 0).reshape(-1, z.shape[1])  # a view: (D*H*W, C)
        # Two passes of plain sums: var_mean's reduction over this layout is 4x slower
        # (532 vs ~130 ms for 32 x 96x160x160); the centred second pass keeps its accuracy.
        count = voxels.shape[0]
        mean = voxels.sum(0) / count
        var = (voxels - mean).square_().sum(0) / count
        stats_dtype = self.weight.dtype if self.weight is not None else z.dtype
        var, mean = var.to(stats_dtype), mean.to(stats_dtype)
        return F.batch_norm(z, mean, var, self.weight, self.bias, False, 0.0, self.eps)


def instance_norm_on_base(
    norm: nn.modules.instancenorm._InstanceNorm,
    z: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """activation(norm(z)) for a norm without running statistics, the activation (in place
    or not) applied to the base tensor, then viewed in z's shape."""
    b = z.shape[0]
    flat = z.contiguous().view(1, b * z.shape[1], *z.shape[2:])
    weight, bias = (None, None) if not norm.affine else (norm.weight.repeat(b), norm.bias.repeat(b))
    out = torch.batch_norm(flat, weight, bias, None, None, True, norm.momentum or 0.0, norm.eps,
                           torch.backends.cudnn.enabled)  # fmt: skip
    return activation(out).view(z.shape)
