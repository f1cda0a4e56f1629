"""Command-line flags are spelled out everywhere (argparse's prefix matching is off): the
one-line hint for a flag the user nearly spelled. Standard library only."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# ---- command lines: flags are spelled out (argparse's prefix matching is off everywhere) --


def with_close_flag(message: str, known_flags: Iterable[str]) -> str:
    """argparse's "unrecognized arguments: --epoch 3" plus the flag the user likely meant.

    Every nnui parser sets allow_abbrev=False (a prefix such as --epoch silently meaning
    --epochs is a trap when flags are passed through to a trainer); this names the match.
    """
    if not message.startswith("unrecognized arguments:"):
        return message
    known = list(known_flags)
    for word in message.split(":", 1)[1].split():
        flag = word.split("=", 1)[0]
        if flag.startswith("-"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                return f"{message} (did you mean {close[0]}?)"
    return message
