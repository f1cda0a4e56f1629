"""The losses of region-based training and of the ignore label (nnU-Net 2.8.1's rules).

Regions: one sigmoid per region, binary cross-entropy plus soft Dice over every region
(there is no background channel to leave out). Ignore label: its voxels are masked out of
both terms, so they give no loss and no gradient; a batch without annotated voxels gives
a zero cross-entropy (not NaN). Targets arrive as label maps, as for plain labels: each
deep-supervision output gets the label map resized by trainer.network.loss.downsample_target
and turned into region masks there (trainer.data.labels.region_masks), which equals resizing
the masks (nearest neighbour).
Plain labels without an ignore label keep trainer.network.loss.DeepSupervisionLoss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.data.labels import LabelSpec, region_masks
from trainer.network.loss import (
    DeepSupervisionLoss,
    Reducer,
)

SMOOTH = 1e-5


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def soft_dice(
    probs: torch.Tensor, onehot: torch.Tensor, batch_dice: bool, reduce_fn: Reducer
) -> torch.Tensor:
    """-mean Dice over channels (masked voxels already zero in both)."""
    axes = [*([0] if batch_dice else []), *range(2, probs.ndim)]
    intersect = (probs * onehot).sum(axes)
    sum_pred = probs.sum(axes)
    sum_gt = onehot.sum(axes)
    if batch_dice:
        stacked = reduce_fn(torch.stack((intersect, sum_pred, sum_gt)))
        intersect, sum_pred, sum_gt = stacked[0], stacked[1], stacked[2]
    dice = (2 * intersect + SMOOTH) / (sum_pred + sum_gt + SMOOTH).clamp(min=1e-8)
    return -dice.mean()


class LabelAwareDiceLoss(nn.Module):
    """Dice + cross-entropy on one output: sigmoid/BCE for regions, softmax/CE for labels;
    voxels of the ignore label masked out of both."""

    def __init__(self, spec: LabelSpec, reduce_fn: Reducer = _identity, weight_ce: float = 1.0,
                 weight_dice: float = 1.0, batch_dice: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.regions = [k if isinstance(k, tuple) else (k,) for k in spec.foreground_keys]
        self.has_regions = spec.has_regions
        self.ignore = spec.ignore_label
        self.reduce_fn = reduce_fn
        self.batch_dice = batch_dice
        self.weight_ce = weight_ce
        # As trainer.network.loss.DiceCELoss: per-sample Dice is a per-rank mean like the CE.
        self.weight_dice = weight_dice if batch_dice else weight_dice * weight_ce

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        labels = target[:, 0].long()
        mask = None if self.ignore is None else (labels != self.ignore).unsqueeze(1)
        if self.has_regions:
            onehot = region_masks(labels, self.regions)
            probs = torch.sigmoid(logits)
            ce = F.binary_cross_entropy_with_logits(logits, onehot, reduction="none")
        else:
            labels = labels if mask is None else torch.where(mask[:, 0], labels, 0)
            onehot = F.one_hot(labels, logits.shape[1]).movedim(-1, 1).float()[:, 1:]
            probs = torch.softmax(logits, 1)[:, 1:]
            ce = F.cross_entropy(logits, labels, reduction="none").unsqueeze(1)
        if mask is None:
            ce_value = ce.mean()
        else:
            weight = mask.float()
            probs, onehot = probs * weight, onehot * weight
            # Summed over regions, per annotated voxel (nnU-Net's masked BCE); a batch with no
            # annotated voxel gives zero, not NaN (nnU-Net skips its CE then).
            ce_value = (ce * weight).sum() / weight.sum().clamp(min=1e-8)
        dice = soft_dice(probs, onehot, self.batch_dice, self.reduce_fn)
        return self.weight_ce * ce_value + self.weight_dice * dice


class LabelAwareDeepSupervisionLoss(DeepSupervisionLoss):
    """trainer.network.loss.DeepSupervisionLoss's weighting around LabelAwareDiceLoss."""

    def __init__(self, spec: LabelSpec, num_outputs: int, reduce_fn: Reducer = _identity,
                 weight_ce: float = 1.0, batch_dice: bool = True) -> None:  # fmt: skip
        super().__init__(num_outputs, reduce_fn, weight_ce, batch_dice)
        self.loss = LabelAwareDiceLoss(spec, reduce_fn, weight_ce, batch_dice=batch_dice)


def make_loss(spec: LabelSpec, num_outputs: int, reduce_fn: Reducer, weight_ce: float,
              batch_dice: bool) -> nn.Module:  # fmt: skip
    """The training loss for these labels: plain labels keep nnui's DeepSupervisionLoss."""
    if not spec.has_regions and spec.ignore_label is None:
        return DeepSupervisionLoss(num_outputs, reduce_fn, weight_ce, batch_dice)
    return LabelAwareDeepSupervisionLoss(spec, num_outputs, reduce_fn, weight_ce, batch_dice)


@torch.no_grad()
def validation_counts(
    top: torch.Tensor, target: torch.Tensor, spec: LabelSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tp, fp, fn (one per scored class or region) of one validation batch, as nnU-Net's
    pseudo-Dice counts them: regions thresholded at sigmoid 0.5, labels by argmax; voxels
    of the ignore label left out."""
    labels = target[:, 0].long()
    keep = None if spec.ignore_label is None else (labels != spec.ignore_label).unsqueeze(1)
    if spec.has_regions:
        regions = [k if isinstance(k, tuple) else (k,) for k in spec.foreground_keys]
        pred = top.float() > 0  # sigmoid > 0.5
        gt = region_masks(labels, regions).bool()
    else:
        classes = torch.arange(1, top.shape[1], device=top.device)
        classes = classes.view(1, -1, *[1] * (labels.ndim - 1))
        pred = top.argmax(1, keepdim=True) == classes
        gt = labels.unsqueeze(1) == classes
    if keep is not None:
        pred, gt = pred & keep, gt & keep
    axes = [0, *range(2, pred.ndim)]
    tp = (pred & gt).sum(axes)
    return tp, (pred & ~gt).sum(axes), (~pred & gt).sum(axes)
