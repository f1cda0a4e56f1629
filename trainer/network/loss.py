"""Dice + cross-entropy with deep supervision (nnU-Net v2 defaults).

Soft Dice: softmax probabilities vs one-hot target, background excluded, smooth 1e-5.
As nnU-Net's plans decide per configuration: 2d sums tp/fp/fn over the batch and all voxels
("batch dice"; under DDP the sums are all-reduced with a differentiable SUM so every rank
sees, and differentiates, the global Dice), 3d scores each sample alone and averages
(under DDP each rank's mean carries the rank's batch share, as the cross-entropy does).
Deep supervision weights: 1/2^i per output, the lowest resolution gets 0, normalised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

Reducer = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def deep_supervision_weights(num_outputs: int) -> list[float]:
    weights = [1 / 2**i for i in range(num_outputs)]
    if num_outputs > 1:
        weights[-1] = 0.0
    total = sum(weights)
    return [w / total for w in weights]


def downsample_target(target: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Nearest-neighbour resize of an integer label map: only existing labels survive.
    nearest-exact (input voxel floor((i + 0.5) * scale)) as nnU-Net's deep-supervision
    targets: plain nearest (floor(i * scale)) shifts every target by half a voxel."""
    if tuple(target.shape[2:]) == tuple(shape):
        return target
    return F.interpolate(target.float(), size=tuple(shape), mode="nearest-exact").to(target.dtype)


class SoftDiceLoss(nn.Module):
    def __init__(
        self, smooth: float = 1e-5, reduce_fn: Reducer = _identity, batch_dice: bool = True
    ) -> None:
        super().__init__()
        self.smooth = smooth
        self.reduce_fn = reduce_fn
        self.batch_dice = batch_dice

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits.float(), dim=1)[:, 1:]
        labels = target[:, 0].long()
        onehot = torch.zeros_like(probs)
        # One-hot for foreground classes only: label c -> channel c-1; background scatters nowhere.
        fg = labels > 0
        index = (labels - 1).clamp(min=0).unsqueeze(1)
        onehot.scatter_(1, index, fg.unsqueeze(1).to(onehot.dtype))
        axes = [*([0] if self.batch_dice else []), *range(2, probs.ndim)]
        intersect = (probs * onehot).sum(axes)  # (C,) batch dice, else (b, C)
        sum_pred = probs.sum(axes)
        sum_gt = onehot.sum(axes)
        if self.batch_dice:
            stacked = self.reduce_fn(torch.stack((intersect, sum_pred, sum_gt)))
            intersect, sum_pred, sum_gt = stacked[0], stacked[1], stacked[2]
        dice = (2 * intersect + self.smooth) / (sum_pred + sum_gt + self.smooth).clamp(min=1e-8)
        return -dice.mean()


class DiceCELoss(nn.Module):
    """weight_ce: under DDP with uneven batch shares, trainer.training.batch.loss_weight
    (b_r W / G), so DDP's gradient mean equals the single-process mean over the global
    batch. Batch Dice needs no factor (its sums are global already); per-sample Dice is a mean
    over the rank's samples like the cross-entropy and takes the same factor."""

    def __init__(
        self,
        reduce_fn: Reducer = _identity,
        weight_ce: float = 1.0,
        weight_dice: float = 1.0,
        batch_dice: bool = True,
    ):
        super().__init__()
        self.dice = SoftDiceLoss(reduce_fn=reduce_fn, batch_dice=batch_dice)
        self.weight_ce = weight_ce
        self.weight_dice = weight_dice if batch_dice else weight_dice * weight_ce

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits.float(), target[:, 0].long())
        return self.weight_ce * ce + self.weight_dice * self.dice(logits, target)


class DeepSupervisionLoss(nn.Module):
    """Weighted sum of DiceCE over the decoder outputs (highest resolution first)."""

    def __init__(
        self,
        num_outputs: int,
        reduce_fn: Reducer = _identity,
        weight_ce: float = 1.0,
        batch_dice: bool = True,
    ) -> None:
        super().__init__()
        self.weights = deep_supervision_weights(num_outputs)
        self.loss: nn.Module = DiceCELoss(
            reduce_fn=reduce_fn, weight_ce=weight_ce, batch_dice=batch_dice
        )

    def forward(
        self, outputs: Sequence[torch.Tensor] | torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        if isinstance(outputs, torch.Tensor):
            return self.loss(outputs, target)
        total = outputs[0].new_zeros((), dtype=torch.float32)
        for weight, output in zip(self.weights, outputs, strict=True):
            if weight == 0:
                # Keeps the head in the graph with a zero gradient: DDP requires every
                # parameter to take part in the loss (no find_unused_parameters needed).
                total = total + 0.0 * output.float().sum()
                continue
            total = total + weight * self.loss(output, downsample_target(target, output.shape[2:]))
        return total
