"""When does nnui's training step learn the small lesion, fed by which batch source?

    python bench/lesion_onset.py --work /tmp/acc6 --source nnui|nnunet [--seed 0]
        [--fold 1] [--epochs 30] [--iterations 20] [--ds nearest|nearest-exact]
        [--network nnui|nnunet] [--loss nnui|nnunet]

Bisects the lesion-onset gap of bench/accuracy.py (nnU-Net learns label 2 around epoch
11-13, nnui at 20-29 or never) with everything but the batches held fixed: nnui's
network (torch seed = --seed), DeepSupervisionLoss, SGD (0.01, 0.99 Nesterov, 3e-5),
poly LR over --epochs, grad-norm clip 12, fp32 on one CPU thread (--init-seed
separates the weights' seed from the batches'), on a work folder that
bench/accuracy.py prepared (same data, plan and split for both sides). The training
batches come from
- nnui: nnui's PatchLoader with its augmentation (seed --seed, no worker threads);
- nnunet: nnU-Net 2.8.1's own loader + get_training_transforms, run in its venv by
  bench/nnunet_batches.py (global generators seeded with --seed), cached as .npy.
--ds picks the interpolation of the deep-supervision targets (nnui: nearest, nnU-Net:
nearest-exact). --network nnunet / --loss nnunet put nnU-Net 2.8.1's own PlainConvUNet (its
plan, its initialisation) / DC_and_CE_loss in its DeepSupervisionWrapper in place of nnui's;
they import nnunetv2, so run this script with the work folder's venv python
(WORK/venv/bin/python; nnui's trainer imports there too). Metric, per epoch: Dice of each
label over fixed validation patches (8 batches of the validation cases, nnui's sampling, no
augmentation, seed 999), i.e. a pseudo Dice with 8x the patches of the trainers' own. A run
stops two epochs after the lesion's Dice first reaches 0.5 (the onset) or at --epochs. One
JSON line per epoch and a summary line go to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.data.dataset import PreprocessedCases  # noqa: E402
from trainer.data.loader import PatchLoader  # noqa: E402
from trainer.network import loss as loss_module  # noqa: E402
from trainer.network.build import build_network  # noqa: E402
from trainer.planning.plans import load_plans  # noqa: E402
from trainer.planning.splits import fold_cases, load_or_create_splits  # noqa: E402
from trainer.training.loop import poly_lr  # noqa: E402

DATASET_ID, DATASET = 900, "Dataset900_NnuiDemo"
VAL_BATCHES, VAL_SEED = 8, 999


def nnunet_batches(work: Path, fold: int, seed: int, count: int, configuration: str):
    """nnU-Net's training batches (data, seg) as tensors, generated once per seed."""
    out = work / "nnunet_batches" / f"{configuration}_fold{fold}_seed{seed}_n{count}"
    if not (out / "seg.npy").is_file():
        env = dict(
            os.environ,
            nnUNet_raw=str(work / "raw"),
            nnUNet_preprocessed=str(work / "nnunet_preprocessed"),
            nnUNet_results=str(work / "nnunet_results"),
        )
        script = REPO / "bench" / "nnunet_batches.py"
        argv = [str(work / "venv" / "bin" / "python"), str(script), str(DATASET_ID),
                configuration, str(fold), str(seed), str(count), str(out)]  # fmt: skip
        subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    data = torch.from_numpy(np.load(out / "data.npy"))
    seg = torch.from_numpy(np.load(out / "seg.npy").astype(np.int64)).clamp_min(0).to(torch.uint8)
    return ((data[k], seg[k]) for k in range(data.shape[0]))


def downsample_exact(target: torch.Tensor, shape) -> torch.Tensor:
    """nnU-Net's deep-supervision target rule: nearest-exact."""
    if tuple(target.shape[2:]) == tuple(shape):
        return target
    out = F.interpolate(target.float(), size=tuple(shape), mode="nearest-exact")
    return out.to(target.dtype)


def nnunet_network(work: Path, configuration: str, num_inputs: int, num_classes: int):
    """nnU-Net 2.8.1's own network and initialisation for its plan (needs its venv)."""
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    plans = PlansManager(str(work / "nnunet_preprocessed" / DATASET / "nnUNetPlans.json"))
    cm = plans.get_configuration(configuration)
    return get_network_from_plans(
        cm.network_arch_class_name, cm.network_arch_init_kwargs,
        cm.network_arch_init_kwargs_req_import, num_inputs, num_classes, deep_supervision=True,
    )  # fmt: skip


def nnunet_loss(num_outputs: int, batch_dice: bool):
    """nnU-Net 2.8.1's DC_and_CE_loss in its DeepSupervisionWrapper (its _build_loss), the
    targets cut to each output with nearest-exact as its DownsampleSegForDSTransform."""
    from nnunetv2.training.loss.compound_losses import DC_and_CE_loss
    from nnunetv2.training.loss.deep_supervision import DeepSupervisionWrapper
    from nnunetv2.training.loss.dice import MemoryEfficientSoftDiceLoss

    dice_kwargs = {"batch_dice": batch_dice, "smooth": 1e-5, "do_bg": False, "ddp": False}
    inner = DC_and_CE_loss(dice_kwargs, {}, weight_ce=1, weight_dice=1,
                           dice_class=MemoryEfficientSoftDiceLoss)  # fmt: skip
    weights = np.array([1 / 2**i for i in range(num_outputs)])
    weights[-1] = 0
    wrapped = DeepSupervisionWrapper(inner, weights / weights.sum())

    def loss(outputs, target):
        targets = [downsample_exact(target, o.shape[2:]) for o in outputs]
        return wrapped(outputs, targets)

    return loss


def dice_per_label(model, val, num_classes: int) -> list[float]:
    model.eval()
    k = num_classes - 1
    tp, fp, fn = np.zeros(k), np.zeros(k), np.zeros(k)
    with torch.no_grad():
        for data, seg in val:
            out = model(data)
            pred = (out[0] if isinstance(out, (list, tuple)) else out).argmax(1)
            lab = seg[:, 0].long()
            for c in range(1, k + 1):
                p, g = pred == c, lab == c
                tp[c - 1] += (p & g).sum().item()
                fp[c - 1] += (p & ~g).sum().item()
                fn[c - 1] += (~p & g).sum().item()
    model.train()
    return [round(2 * a / max(1.0, 2 * a + b + c), 4) for a, b, c in zip(tp, fp, fn, strict=True)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/acc6")
    p.add_argument("--source", default="nnui", choices=("nnui", "nnunet"))
    p.add_argument("--seed", type=int, default=0, help="batch stream (and init unless --init-seed)")
    p.add_argument("--init-seed", type=int, default=None, help="torch seed of the weights")
    p.add_argument("--fold", type=int, default=1)
    p.add_argument("--configuration", default="2d")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--ds", default="nearest", choices=("nearest", "nearest-exact"))
    p.add_argument("--threads", type=int, default=1)
    for part, theirs in (("network", "PlainConvUNet + init"), ("loss", "DC_and_CE + DS wrapper")):
        p.add_argument(f"--{part}", default="nnui", choices=("nnui", "nnunet"),
                       help=f"nnunet: nnU-Net's {theirs} (run with its venv's python)")  # fmt: skip
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.ds == "nearest-exact":
        loss_module.downsample_target = downsample_exact
    work = Path(a.work)
    dataset_dir = work / "nnui_preprocessed" / DATASET
    plans = load_plans(dataset_dir, "nnuiPlans")
    cplan = plans.configuration(a.configuration)
    cases = PreprocessedCases(dataset_dir / cplan.data_identifier)
    splits = load_or_create_splits(dataset_dir, cases.case_ids, write=False)
    train_ids, val_ids = fold_cases(splits, str(a.fold), cases.case_ids)
    patch, batch = tuple(cplan.patch_size), int(cplan.batch_size)
    mask = tuple(cplan.use_mask_for_norm)
    cpu = torch.device("cpu")
    with PatchLoader(cases, val_ids, patch, batch, 0.33, VAL_SEED, 0, cpu, augment=False,
                     num_workers=0, stream="val", mask_channels=mask) as vl:  # fmt: skip
        val = [
            (b.data.clone(), b.target.clone()) for b, _ in zip(vl, range(VAL_BATCHES), strict=False)
        ]
    total = a.epochs * a.iterations
    if a.source == "nnunet":
        batches = nnunet_batches(work, a.fold, a.seed, total, a.configuration)
        loader = None
    else:
        loader = PatchLoader(cases, train_ids, patch, batch, 0.33, a.seed, 0, cpu, augment=True,
                             num_workers=0, mask_channels=mask)  # fmt: skip
        batches = ((b.data, b.target) for b in loader)
    init_seed = a.seed if a.init_seed is None else a.init_seed
    torch.manual_seed(init_seed)
    if a.network == "nnunet":
        net = nnunet_network(work, a.configuration, plans.num_input_channels, plans.num_classes)
    else:
        net = build_network(cplan.network, plans.num_input_channels, plans.num_classes,
                            cplan.ndim, recompute_norm=False)  # fmt: skip
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.99, weight_decay=3e-5,
                          nesterov=True)  # fmt: skip
    num_outputs = cplan.network.num_stages - 1
    if a.loss == "nnunet":
        loss_fn = nnunet_loss(num_outputs, cplan.batch_dice)
    else:
        loss_fn = loss_module.DeepSupervisionLoss(num_outputs, batch_dice=cplan.batch_dice)
    onset: dict[str, int | None] = {str(c): None for c in range(1, plans.num_classes)}
    curve = []
    started = time.process_time()
    net.train()
    for epoch in range(a.epochs):
        for g in opt.param_groups:
            g["lr"] = poly_lr(0.01, epoch, a.epochs)
        train_loss = 0.0
        for _ in range(a.iterations):
            data, seg = next(batches)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(data), seg.clamp_min(0))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 12.0)
            opt.step()
            train_loss += loss.item()
        dice = dice_per_label(net, val, plans.num_classes)
        curve.append(dice)
        for c, d in enumerate(dice, start=1):
            if onset[str(c)] is None and d >= 0.5:
                onset[str(c)] = epoch
        print(json.dumps({"epoch": epoch, "loss": round(train_loss / a.iterations, 4),
                          "dice": dice, "cpu_s": round(time.process_time() - started, 1)}),
              flush=True)  # fmt: skip
        last = onset[str(plans.num_classes - 1)]
        if last is not None and epoch >= last + 2:
            break
    if loader is not None:
        loader.close()
    summary = {"source": a.source, "network": a.network, "loss": a.loss, "ds": a.ds,
               "seed": a.seed, "init_seed": init_seed,
               "fold": a.fold,
               "onset": onset, "epochs_run": len(curve), "curve_lesion": [c[-1] for c in curve],
               "cpu_s": round(time.process_time() - started, 1)}  # fmt: skip
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
