"""What the inference CLIs share: one-line argument errors (exit 2)."""

from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + error
        sys.stderr.write(f"error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def one_line(error: BaseException) -> str:
    """The message of an error on one line (nibabel's messages span several)."""
    return " ".join(str(error).split())
