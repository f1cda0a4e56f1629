"""Reading and dropping flags in a trainer's argument list, as argparse would see them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload


@overload
def flag_value(args: Sequence[str], flag: str, default: str) -> str: ...
@overload
def flag_value(args: Sequence[str], flag: str, default: None = None) -> str | None: ...
def flag_value(args: Sequence[str], flag: str, default: str | None = None) -> str | None:
    """The value of `flag V` or `flag=V` (the last one wins, as in argparse)."""
    value = default
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def without_flags(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    """`args` without the given flags and their values (`-p X` and `-p=X` alike)."""
    out: list[str] = []
    skip = False
    for word in args:
        if skip:
            skip = False
        elif word in flags:
            skip = True
        elif not any(word.startswith(f + "=") for f in flags):
            out.append(word)
    return out
