"""Write an nnU-Net v2 model folder with an untrained checkpoint (runs in nnU-Net's venv).

    python bench/nnunet_random_checkpoint.py DATASET CONFIGURATION FOLD [NNUI_CHECKPOINT]

bench/predict.py times `nnUNetv2_predict`, whose cost does not depend on the values of the
weights, only on the network. Instead of training, this builds nnU-Net's own trainer for
the dataset's plans (nnUNet_preprocessed / nnUNet_results from the environment), lets it
choose its test-time mirroring axes as training would, and saves its freshly initialised
network in the layout nnU-Net's trainer writes (`fold_F/checkpoint_final.pth`, plus the
folder's `plans.json` and `dataset.json`). It prints the parameter count and mirror axes.
With NNUI_CHECKPOINT (an nnui `checkpoint_*.safetensors` of the same plan's plain U-Net)
the checkpoint holds those trained weights instead (bench/nnunet_weights.py maps the names),
so both predictors run the same model and their segmentations can be compared.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer
from nnunetv2.utilities.label_handling.label_handling import determine_num_input_channels


def main() -> int:
    dataset, configuration, fold = sys.argv[1], sys.argv[2], int(sys.argv[3])
    nnui_checkpoint = sys.argv[4] if len(sys.argv) > 4 else None
    pre = Path(os.environ["nnUNet_preprocessed"]) / dataset  # noqa: SIM112 - nnU-Net's name
    plans = json.loads((pre / "nnUNetPlans.json").read_text())
    dataset_json = json.loads((pre / "dataset.json").read_text())
    plans["continue_training"] = False  # nnUNetv2_train's run_training adds this key
    trainer = nnUNetTrainer(plans, configuration, fold, dataset_json, device=torch.device("cpu"))
    # Sets trainer.inference_allowed_mirroring_axes, which its checkpoints record.
    trainer.configure_rotation_dummyDA_mirroring_and_inital_patch_size()
    network = nnUNetTrainer.build_network_architecture(
        trainer.plans_manager,
        trainer.configuration_manager,
        determine_num_input_channels(
            trainer.plans_manager, trainer.configuration_manager, dataset_json
        ),
        trainer.label_manager.num_segmentation_heads,
        enable_deep_supervision=False,
    )
    if nnui_checkpoint:
        network.load_state_dict(nnui_weights(nnui_checkpoint, network), strict=True)
    model_dir = Path(trainer.output_folder_base)
    fold_dir = model_dir / f"fold_{fold}"
    fold_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(pre / "nnUNetPlans.json", model_dir / "plans.json")
    shutil.copyfile(pre / "dataset.json", model_dir / "dataset.json")
    checkpoint = {
        "network_weights": network.state_dict(),
        "optimizer_state": None,
        "grad_scaler_state": None,
        "logging": {},
        "_best_ema": None,
        "current_epoch": 0,
        "init_args": trainer.my_init_kwargs,
        "trainer_name": "nnUNetTrainer",
        "inference_allowed_mirroring_axes": trainer.inference_allowed_mirroring_axes,
    }
    torch.save(checkpoint, fold_dir / "checkpoint_final.pth")
    parameters = sum(p.numel() for p in network.parameters())
    axes = trainer.inference_allowed_mirroring_axes
    print(json.dumps({"parameters": parameters, "mirror_axes": list(axes or ())}))
    return 0


def nnui_weights(path: str, network: torch.nn.Module) -> dict:
    from nnunet_weights import to_nnunet
    from safetensors.torch import load_file

    tensors = load_file(path)
    model = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    return to_nnunet(model, list(network.state_dict()))


if __name__ == "__main__":
    raise SystemExit(main())
