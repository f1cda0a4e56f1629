"""`python -m trainer.flag_check ENGINE DATASET CONFIGURATION FOLD [flags]`: parse a job's
trainer flags exactly as the job will, then exit — 0 when they parse, 2 and one line
(`error: ...`) when a flag is unknown or a value bad. nnui runs it before a launch (the app
never imports the trainer), so a typo is refused on the board instead of becoming a job that
dies at start. Stdlib only, no torch: it answers in well under a second.

ENGINE nnui: nnui-train's own parser. ENGINE nnunet: nnui's schedule flags as the nnU-Net
entry reads them, the rest against nnUNetv2_train's flags (its names and types, restated
here because importing nnU-Net pulls in torch).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from trainer.cli import usage_error
from trainer.schema.exits import EXIT_OK


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise SystemExit(usage_error(message))


def nnunet_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nnUNetv2_train", add_help=False)
    for name in ("dataset_name_or_id", "configuration", "fold"):
        p.add_argument(name)
    for flag in ("-tr", "-p", "-pretrained_weights", "-device"):
        p.add_argument(flag)
    p.add_argument("-num_gpus", type=int)
    for flag in ("--npz", "--c", "--val", "--val_best", "--disable_checkpointing",
                 "--use_compressed"):  # fmt: skip
        p.add_argument(flag, action="store_true")
    return p


def check(engine: str, args: list[str]) -> None:
    if engine == "nnunet":
        from trainer.nnunet_engine import UsageError, split_schedule_flags

        try:
            rest, _ = split_schedule_flags(args)
        except UsageError as error:
            _Parser().error(str(error))
        nnunet_parser().parse_args(rest)
        return
    from trainer.training.train_args import build_parser

    build_parser().parse_args(args)


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if not words:
        return usage_error("give ENGINE DATASET CONFIGURATION FOLD [flags]")
    check(words[0], words[1:])
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
