"""U-Net topology and memory estimate by nnU-Net 2.8.1's rules (both planners share them).

- topology: pool an axis while its feature map stays >= 8 voxels (>= 4 after the pool),
  and only the axes whose spacing is within 2x the finest poolable one; a single axis
  alone is pooled only while it is >= 12 voxels; kernel 3 on an axis once its spacing is
  within 2x the finest, 1 before; the bottleneck convolves every axis; the patch is padded
  up to the product of the strides;
- memory: the number of voxels of every conv output on one patch (what nnU-Net's
  `compute_conv_feature_map_size` counts for its plain and residual-encoder U-Nets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer.planning.plans import RESIDUAL_ENCODER, NetworkPlan

MIN_FEATURE_MAP = 4


@dataclass(frozen=True)
class Topology:
    strides: tuple[tuple[int, ...], ...]
    kernel_sizes: tuple[tuple[int, ...], ...]
    patch_size: tuple[int, ...]  # padded to `divisor`
    divisor: tuple[int, ...]


def pad_to_divisor(shape, divisor) -> tuple[int, ...]:
    """The next multiple of `divisor` per axis (a multiple stays); float sizes allowed."""
    out = []
    for size, d in zip(shape, divisor, strict=True):
        padded = size + d - size % d
        out.append(int(padded - d if size % d == 0 else padded))
    return tuple(out)


def topology(spacing, patch_size) -> Topology:
    """Strides, kernels and the padded patch for a (possibly float) patch size."""
    ndim = len(spacing)
    current_spacing, size = [float(s) for s in spacing], [float(p) for p in patch_size]
    strides, kernels = [(1,) * ndim], []
    num_pool, kernel = [0] * ndim, [1] * ndim
    while True:
        axes = [a for a in range(ndim) if size[a] >= 2 * MIN_FEATURE_MAP]
        if not axes:
            break
        finest = min(current_spacing[a] for a in axes)
        axes = [a for a in axes if current_spacing[a] / finest < 2]
        # One axis alone is pooled only while it stays >= 3 * the minimum afterwards.
        if not axes or (len(axes) == 1 and size[axes[0]] < 3 * MIN_FEATURE_MAP):
            break
        overall_finest = min(current_spacing)
        kernel = [
            3 if k == 3 or s / overall_finest < 2 else 1
            for k, s in zip(kernel, current_spacing, strict=True)
        ]
        for a in axes:
            num_pool[a] += 1
            current_spacing[a] *= 2
            size[a] = math.ceil(size[a] / 2)
        strides.append(tuple(2 if a in axes else 1 for a in range(ndim)))
        kernels.append(tuple(kernel))
    kernels.append((3,) * ndim)  # the bottleneck always convolves every axis
    divisor = tuple(2**n for n in num_pool)
    return Topology(tuple(strides), tuple(kernels), pad_to_divisor(patch_size, divisor), divisor)


def _stage_sizes(net: NetworkPlan, patch_size) -> list[list[int]]:
    sizes, size = [], [int(p) for p in patch_size]
    for stride in net.strides:
        size = [n // s for n, s in zip(size, stride, strict=True)]
        sizes.append(size)
    return sizes


def _decoder_voxels(net: NetworkPlan, sizes: list[list[int]], num_classes: int) -> int:
    """Per decoder stage: the transposed conv, its convs, the segmentation head at the end
    (deep supervision off, as the planner builds the network)."""
    total = 0
    for d in range(net.num_stages - 1):
        level = net.num_stages - 2 - d  # the encoder stage this decoder stage refines to
        voxels = math.prod(sizes[level])
        total += net.features_per_stage[level] * voxels * (net.n_conv_per_stage_decoder[d] + 1)
    return total + num_classes * math.prod(sizes[0])


def feature_map_voxels(net: NetworkPlan, patch_size, num_classes: int) -> int:
    """nnU-Net's memory estimate of one patch through `net` (plain or residual encoder)."""
    sizes = _stage_sizes(net, patch_size)
    features = net.features_per_stage
    if net.architecture != RESIDUAL_ENCODER:
        encoder = sum(
            n * f * math.prod(s)
            for n, f, s in zip(net.n_conv_per_stage_encoder, features, sizes, strict=True)
        )
        return encoder + _decoder_voxels(net, sizes, num_classes)
    # Residual encoder: stem, two convs per block, the 1x1 projection of a block that
    # changes the shape or the width.
    before = [int(p) for p in patch_size]
    total, in_features = features[0] * math.prod(before), features[0]
    for s, after in enumerate(sizes):
        voxels = features[s] * math.prod(after)
        total += 2 * voxels * net.n_conv_per_stage_encoder[s]
        if in_features != features[s] or after != before:
            total += voxels
        in_features, before = features[s], after
    return total + _decoder_voxels(net, sizes, num_classes)
