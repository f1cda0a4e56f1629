"""`python -m trainer.nnunet_engine DATASET CONFIGURATION FOLD [nnUNetv2_train flags] [nnui flags]`

How nnui starts the real nnU-Net (docs/nnunet.md): exactly nnU-Net's own `nnUNetv2_train`
entry with the arguments it is given, after four things nnU-Net's console script cannot do:
- SIGUSR1 is caught from the first instruction (a stop during start-up is kept, not fatal);
- nnui's schedule flags (`--epochs`, `--iterations-per-epoch`, `--val-iterations`,
  `--save-every`, which nnUNetv2_train does not know) become the environment the extension
  trainer reads, and trainer/nnunet_ext is put on `nnUNet_extTrainer`;
- a cascade fold (3d_cascade_fullres) whose previous stage's segmentations are missing is
  refused in one line naming the lowres folds to train first (nnU-Net itself would start
  and die in a data-loading worker with a traceback);
- nnU-Net's `-tr` search imports its Primus trainers (timm -> torchvision): a torchvision
  built for CUDA does not import beside a CPU torch, which would end every search for a
  trainer outside nnU-Net's top-level module. Then torchvision is imported without its
  meta-kernel registrations (nnU-Net's networks never call torchvision's operators).
"""

from trainer import stop

stop.install_at_start()  # before anything slow

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from trainer.cli import usage_error  # noqa: E402
from trainer.schema.exits import EXIT_OK  # noqa: E402
from trainer.schema.nnunet import NNUNET_EXT_ENV, NNUNET_WRAP_SUFFIX, with_nnunet_ext_dir  # noqa: E402
from trainer.schema.tree import ROOT_ENVS  # noqa: E402

SCHEDULE_FLAGS = {
    "--epochs": "NNUI_EPOCHS",
    "--iterations-per-epoch": "NNUI_ITERATIONS_PER_EPOCH",
    "--val-iterations": "NNUI_VAL_ITERATIONS",
    "--save-every": "NNUI_SAVE_EVERY",
}


class UsageError(ValueError):
    pass


def split_schedule_flags(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(nnUNetv2_train's arguments, environment for nnui's schedule flags)."""
    rest: list[str] = []
    env: dict[str, str] = {}
    words = iter(argv)
    for word in words:
        flag, equals, value = word.partition("=")
        if flag not in SCHEDULE_FLAGS:
            rest.append(word)
            continue
        if not equals:
            value = next(words, "")
        if not value.isdigit() or int(value) < 1:
            raise UsageError(f"{flag} needs a whole number >= 1, got {value!r}")
        env[SCHEDULE_FLAGS[flag]] = str(int(value))
    return rest, env


class _QuietParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)  # no usage text: nnU-Net's own parser prints its own


def _cascade_fold(rest: list[str]) -> tuple | None:
    """(dataset folder, plans name, configuration block, configuration, fold, trainer
    folder name) of a cascade fold of nnUNetv2_train's arguments; None for anything else
    or what nnU-Net refuses itself."""
    import json
    from pathlib import Path

    from trainer.planning.plans import resolve_inheritance
    from trainer.schema.tree import DatasetNotFound, find_dataset

    parser = _QuietParser(add_help=False)
    for name in ("dataset", "configuration", "fold"):
        parser.add_argument(name)
    parser.add_argument("-tr")
    parser.add_argument("-p")
    try:
        args, _ = parser.parse_known_args(rest)
    except UsageError:
        return None  # nnU-Net's own parser says what is wrong
    preprocessed = os.environ.get(ROOT_ENVS["preprocessed"])
    if not preprocessed or not os.environ.get(ROOT_ENVS["results"]):
        return None
    plans_name = args.p or "nnUNetPlans"
    try:
        dataset_dir = Path(preprocessed) / find_dataset(Path(preprocessed), args.dataset)
        plans = json.loads((dataset_dir / f"{plans_name}.json").read_text())
        block = resolve_inheritance(plans["configurations"])[args.configuration]
    except (DatasetNotFound, OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(block, dict) or not block.get("previous_stage"):
        return None
    trainer = (args.tr or "nnUNetTrainer").removesuffix(NNUNET_WRAP_SUFFIX)
    return dataset_dir, plans_name, block, args.configuration, args.fold, trainer


def cascade_problem(rest: list[str]) -> str | None:
    """One line when these arguments train a cascade fold whose previous stage has not
    written the segmentations of the fold's cases (nnU-Net reads them from
    results/D/<tr>__<p>__<previous stage>/predicted_next_stage/<configuration>/); None
    otherwise, also when the arguments are wrong in a way nnU-Net reports itself."""
    found = _cascade_fold(rest)
    if found is None:
        return None
    dataset_dir, plans_name, block, configuration, fold, trainer = found
    from pathlib import Path
    from types import SimpleNamespace

    from trainer.data.cascade import NEXT_STAGE_DIR, CascadeError, check_inputs
    from trainer.planning.splits import SplitsError, fold_cases, load_or_create_splits

    data_dir = dataset_dir / str(block.get("data_identifier", ""))
    try:
        names = os.listdir(data_dir)
    except OSError:
        return None  # not preprocessed: nnU-Net says so
    stems = {n.rsplit(".", 1)[0] for n in names if n.endswith((".b2nd", ".npz"))}
    case_ids = sorted(c for c in stems if not c.endswith("_seg"))
    try:  # nnU-Net's own folds (an absent splits file: the ones it will write)
        splits = load_or_create_splits(dataset_dir, case_ids, write=False)
        train, val = fold_cases(splits, fold, case_ids)
    except (SplitsError, ValueError):
        return None
    stage = str(block["previous_stage"])
    folder = Path(os.environ[ROOT_ENVS["results"]]) / dataset_dir.name
    folder = folder / f"{trainer}__{plans_name}__{stage}" / NEXT_STAGE_DIR / configuration
    cplan = SimpleNamespace(name=configuration, previous_stage=stage)
    try:
        check_inputs(folder, sorted({*train, *val}), splits, cplan, (".b2nd", ".npz", ".npy"))
    except CascadeError as error:
        return str(error)
    return None


def let_trainer_search_pass() -> None:
    try:
        import torchvision
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
        import types

        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        stand_in = types.ModuleType("torchvision._meta_registrations")
        sys.modules["torchvision._meta_registrations"] = stand_in
        import torchvision  # noqa: F401

        print(
            "nnui: torchvision does not match this torch (CUDA build beside a CPU torch); "
            "imported without its operator registrations for nnU-Net's trainer search",
            flush=True,
        )
    except ImportError:
        pass  # no torchvision: nnU-Net's own search says what is missing


def main(argv: list[str] | None = None) -> int:
    try:
        rest, env = split_schedule_flags(list(sys.argv[1:] if argv is None else argv))
    except UsageError as error:
        return usage_error(error)
    problem = cascade_problem(rest)
    if problem is not None:
        return usage_error(problem)
    os.environ.update(env)
    os.environ[NNUNET_EXT_ENV] = with_nnunet_ext_dir(os.environ.get(NNUNET_EXT_ENV))
    try:
        from nnunetv2.run.run_training import run_training_entry
    except ImportError:
        return usage_error("nnunetv2 is not installed here (pip install 'nnui[nnunet]')")
    let_trainer_search_pass()
    sys.argv = ["nnUNetv2_train", *rest]
    run_training_entry()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
