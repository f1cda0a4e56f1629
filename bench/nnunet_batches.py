"""Training batches from the real nnU-Net v2 (2.8.1) data side, written as .npy (runs in
nnU-Net's venv; bench/lesion_onset.py trains nnui's network on them).

    nnUNet_preprocessed=... nnUNet_results=... VENV/bin/python bench/nnunet_batches.py \
        DATASET CONFIG FOLD SEED NUM_BATCHES OUT_DIR

nnU-Net's own trainer builds its loader and training transforms (get_dataloaders, with
nnUNet_n_proc_DA=0: a single-threaded augmenter in this process); numpy's, python's and
torch's global generators are seeded with SEED first, which makes the stream reproducible.
Writes OUT_DIR/data.npy (N, b, C, *patch) float32 and OUT_DIR/seg.npy (N, b, 1, *patch)
int16: the full-resolution target (deep-supervision targets are left to the consumer).
"""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch


def main() -> int:
    dataset, configuration, fold, seed, count, out = sys.argv[1:7]
    os.environ["nnUNet_n_proc_DA"] = "0"  # noqa: SIM112 - nnU-Net's own name
    torch.set_num_threads(1)
    from nnunetv2.run.run_training import get_trainer_from_args

    trainer = get_trainer_from_args(
        dataset, configuration, int(fold), "nnUNetTrainer_nnuiBench", device=torch.device("cpu")
    )
    trainer.initialize()
    random.seed(int(seed))
    np.random.seed(int(seed))
    torch.manual_seed(int(seed))
    train, _ = trainer.get_dataloaders()
    datas, segs = [], []
    for _ in range(int(count)):
        batch = next(train)
        target = batch["target"][0] if isinstance(batch["target"], list) else batch["target"]
        datas.append(batch["data"].numpy().astype(np.float32))
        segs.append(target.numpy().astype(np.int16))
    os.makedirs(out, exist_ok=True)
    np.save(os.path.join(out, "data.npy"), np.stack(datas))
    np.save(os.path.join(out, "seg.npy"), np.stack(segs))
    print("wrote", out, np.stack(datas).shape)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
