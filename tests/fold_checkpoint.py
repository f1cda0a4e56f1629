"""A trained fold's checkpoint_final without training: a seeded network stored as training
stores it (tests of nnui-predict and of prediction jobs share it)."""

from __future__ import annotations

from pathlib import Path

from trainer.schema.tree import DEFAULT_PLANS, checkpoint_file, run_dir


def write_checkpoint(demo, results: Path, configuration: str, fold: str, seed: int,
                     identity: dict | None = None) -> Path:  # fmt: skip
    """checkpoint_final of a seeded (untrained) network, as training would store it."""
    import torch

    from trainer.checkpoint import store
    from trainer.network.build import build_network
    from trainer.planning.plans import load_plans

    plans = load_plans(demo.preprocessed / demo.dataset_name)
    cplan = plans.configuration(configuration)
    torch.manual_seed(seed)
    model = build_network(cplan.network, plans.num_input_channels, plans.num_classes, cplan.ndim)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run = run_dir(results, demo.dataset_name, configuration, fold)
    run.mkdir(parents=True, exist_ok=True)
    expected = {
        "dataset_name": demo.dataset_name, "configuration": configuration,
        "plans_name": DEFAULT_PLANS, "plans_identity": plans.identity_of(configuration),
    }  # fmt: skip
    metadata = {"kind": "final", "epoch_next": 1, "identity": {**expected, **(identity or {})}}
    path = run / checkpoint_file("final")
    store.save(path, model, optimizer, None, metadata)
    return path
