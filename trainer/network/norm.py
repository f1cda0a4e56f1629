"""Instance norm with a channels_last_3d path for CPU inference (both U-Nets use it).

CPU inference runs the 3D networks in channels_last_3d: oneDNN's convolutions then skip
the per-conv reorders between NCDHW and its blocked layout, and the full-resolution convs
of the bench's 64x80x80 network took ~40 % less CPU (bench/history.md). F.instance_norm
would undo that: it makes its input contiguous (a full copy back to NCDHW) and then runs
4x slower than on NCDHW. For one sample without autograd this class computes the same
statistics with var_mean over the spatial axes (a (voxels, C) view of channels_last
memory; as accurate as F.instance_norm, float32 vs float64 error ~1e-5) and applies them
with batch_norm's inference kernel, which keeps channels_last and fuses scale and shift.
batch_norm's own training statistics are not used: they accumulate channels_last sums
serially (10x the error). Everything else, training included, is nn.InstanceNorm3d.

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
        voxels = z[0].permute(1, 2, 3, 0).reshape(-1, z.shape[1])  # a view: (D*H*W, C)
        var, mean = torch.var_mean(voxels, dim=0, correction=0)
        # Under bf16 autocast z is bf16: batch_norm takes it with float32 statistics and
        # affine parameters (its mixed-dtype kernel), not with bf16 ones.
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
