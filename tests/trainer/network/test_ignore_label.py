"""The ignore label (issue 29, item 2): its voxels give no loss and no gradient (Dice and
CE, labels and regions, with deep supervision), patches centre on annotated voxels, the
loss equals nnU-Net's DC_and_CE_loss with its ignore label, and the pseudo-Dice skips them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.data.labels import ANNOTATED_KEY, location_rule, parse_labels
from trainer.data.sampling import LocationRule, plan_batch
from trainer.network.label_loss import (
    LabelAwareDeepSupervisionLoss,
    LabelAwareDiceLoss,
    validation_counts,
)

LABELS = {"background": 0, "organ": 1, "lesion": 2, "ignore": 3}
REGIONS = {"background": 0, "whole": [1, 2], "lesion": [2], "ignore": 3}


def _batch(seed: int = 0, ignore: int = 3):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (2, 1, 8, 10, 12), generator=gen)
    labels[:, :, 2:5] = ignore  # a slab of unannotated voxels
    labels[0, 0, 0, 0, :4] = ignore
    return labels


@pytest.mark.parametrize("labels", [LABELS, REGIONS], ids=["labels", "regions"])
@pytest.mark.parametrize("batch_dice", [True, False])
def test_ignored_voxels_have_zero_gradient_and_do_not_change_the_loss(labels, batch_dice):
    spec = parse_labels(labels, [1, 2] if labels is REGIONS else None)
    loss_fn = LabelAwareDiceLoss(spec, batch_dice=batch_dice)
    target = _batch()
    ignored = (target == 3).expand(-1, spec.num_heads, -1, -1, -1)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn((2, spec.num_heads, 8, 10, 12), generator=gen, requires_grad=True)
    loss = loss_fn(logits, target)
    loss.backward()
    assert torch.all(logits.grad[ignored] == 0)
    assert torch.any(logits.grad[~ignored] != 0)
    # Anything under the ignored voxels: the very same loss and gradient elsewhere.
    other = logits.detach().clone()
    other[ignored] = torch.randn(int(ignored.sum()), generator=gen) * 50
    other.requires_grad_(True)
    loss_other = loss_fn(other, target)
    loss_other.backward()
    assert torch.equal(loss_other, loss)
    assert torch.equal(other.grad, logits.grad)


def test_deep_supervision_masks_every_output():
    spec = parse_labels(LABELS)
    loss_fn = LabelAwareDeepSupervisionLoss(spec, 3, batch_dice=False)
    target = _batch()
    gen = torch.Generator().manual_seed(2)
    shapes = [(8, 10, 12), (4, 5, 6), (2, 3, 3)]
    outputs = [torch.randn((2, 3, *s), generator=gen, requires_grad=True) for s in shapes]
    loss_fn(outputs, target).backward()
    top = (target == 3).expand(-1, 3, -1, -1, -1)
    assert torch.all(outputs[0].grad[top] == 0)
    half = (
        torch.nn.functional.interpolate(target.float(), size=shapes[1], mode="nearest-exact") == 3
    )
    assert torch.all(outputs[1].grad[half.expand(-1, 3, -1, -1, -1)] == 0)


@pytest.mark.parametrize("batch_dice", [True, False])
def test_label_loss_with_ignore_is_nnunets(batch_dice):
    from nnunetv2.training.loss.compound_losses import DC_and_CE_loss
    from nnunetv2.training.loss.dice import MemoryEfficientSoftDiceLoss

    spec = parse_labels(LABELS)
    target = _batch()
    logits = torch.randn((2, 3, 8, 10, 12), generator=torch.Generator().manual_seed(3))
    theirs = DC_and_CE_loss(
        {"batch_dice": batch_dice, "smooth": 1e-5, "do_bg": False, "ddp": False}, {},
        weight_ce=1, weight_dice=1, ignore_label=3, dice_class=MemoryEfficientSoftDiceLoss,
    )(logits, target)  # fmt: skip
    ours = LabelAwareDiceLoss(spec, batch_dice=batch_dice)(logits, target)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (ours, theirs)


def test_a_batch_without_annotation_gives_zero_ce_not_nan():
    spec = parse_labels(LABELS)
    target = torch.full((1, 1, 4, 4, 4), 3)
    loss = LabelAwareDiceLoss(spec)(torch.randn((1, 3, 4, 4, 4), requires_grad=True), target)
    assert torch.isfinite(loss)


def test_pseudo_dice_skips_ignored_voxels():
    spec = parse_labels(LABELS)
    target = torch.tensor([1, 1, 3, 3]).view(1, 1, 1, 1, 4)
    top = torch.zeros((1, 3, 1, 1, 4))
    top[:, 1] = 5.0  # organ predicted everywhere, the ignored voxels too
    tp, fp, fn = validation_counts(top, target, spec)
    assert tp.tolist() == [2, 0] and fp.tolist() == [0, 0] and fn.tolist() == [0, 0]


def test_patches_centre_on_annotated_voxels():
    """Every patch of an ignore-label dataset, forced or not, centres on an annotated voxel:
    none lies in unannotated space only."""
    spec = parse_labels(LABELS)
    rule = location_rule(spec)
    assert rule == LocationRule((("1",), ("2",)), ANNOTATED_KEY)
    annotated = [[z, 5, 5] for z in range(40, 44)]
    props = {
        "shape_after_resampling": [100, 12, 12],
        "class_locations": {"1": [[41, 5, 5]], "2": [], ANNOTATED_KEY: annotated},
    }
    rng = np.random.default_rng(0)
    for _ in range(20):
        boxes = plan_batch(rng, ["a"], 4, 0.5, (8, 8, 8), lambda _: props, rule=rule)
        for box in boxes:
            z0 = box.lower[0]
            assert z0 <= 43 and z0 + 8 > 40, box


def test_regions_sample_from_the_union_of_their_labels():
    spec = parse_labels({"background": 0, "whole": [1, 2], "core": [2]}, [1, 2])
    rule = location_rule(spec)
    assert rule == LocationRule((("1", "2"), ("2",)), None)
    props = {
        "shape_after_resampling": [100, 12, 12],
        "class_locations": {"1": [[10, 5, 5]], "2": []},  # core absent: only "whole" eligible
    }
    rng = np.random.default_rng(0)
    boxes = plan_batch(rng, ["a"], 4, 1.0, (8, 8, 8), lambda _: props, rule=rule)
    assert all(box.lower[0] == 6 for box in boxes)
