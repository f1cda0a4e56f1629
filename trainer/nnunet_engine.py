"""`python -m trainer.nnunet_engine DATASET CONFIGURATION FOLD [nnUNetv2_train flags] [nnui flags]`

How nnui starts the real nnU-Net (DESIGN §4): exactly nnU-Net's own `nnUNetv2_train`
entry with the arguments it is given, after three things nnU-Net's console script cannot do:
- SIGUSR1 is caught from the first instruction (a stop during start-up is kept, not fatal);
- nnui's schedule flags (`--epochs`, `--iterations-per-epoch`, `--val-iterations`,
  `--save-every`, which nnUNetv2_train does not know) become the environment the extension
  trainer reads, and trainer/nnunet_ext is put on `nnUNet_extTrainer`;
- nnU-Net's `-tr` search imports its Primus trainers (timm -> torchvision): a torchvision
  built for CUDA does not import beside a CPU torch, which would end every search for a
  trainer outside nnU-Net's top-level module. Then torchvision is imported without its
  meta-kernel registrations (nnU-Net's networks never call torchvision's operators).
"""

from trainer import stop

stop.install_at_start()  # before anything slow

import os  # noqa: E402
import sys  # noqa: E402

from trainer.schema import NNUNET_EXT_ENV, with_nnunet_ext_dir  # noqa: E402

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
        sys.stderr.write(f"error: {error}\n")
        return 2
    os.environ.update(env)
    os.environ[NNUNET_EXT_ENV] = with_nnunet_ext_dir(os.environ.get(NNUNET_EXT_ENV))
    try:
        from nnunetv2.run.run_training import run_training_entry
    except ImportError:
        sys.stderr.write("error: nnunetv2 is not installed here (pip install 'nnui[nnunet]')\n")
        return 2
    let_trainer_search_pass()
    sys.argv = ["nnUNetv2_train", *rest]
    run_training_entry()
    return 0


if __name__ == "__main__":
    sys.exit(main())
