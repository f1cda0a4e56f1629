"""The input folder of a prediction: `CASE_CCCC<ending>` files, one per channel.

Everything here reads headers only, so every mistake (an empty folder, a missing or extra
channel, an unreadable file, channels of different shapes) is found before anything is
written. Each is an `InputError` with a one-line message.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainer.data.image_io import (
    MULTI_CHANNEL_ENDINGS,
    SUPPORTED_ENDINGS,
    ImageReadError,
    check_spacing_file,
    file_ending,
    image_header,
)


class InputError(ValueError):
    """A user mistake in the inputs of a command (one line; the CLI exits 2)."""


@dataclass(frozen=True)
class InputCase:
    case_id: str
    image_files: tuple[Path, ...]  # CASE_0000.., in order (an RGB file holds 3 channels)
    ending: str  # of channel 0: the output is written in the same format
    num_channels: int = 0  # the files hold (an RGB file 3, a 4D file its volumes); 0: one each


_CHANNEL_FILE = re.compile(r"^(?P<case>.+)_(?P<channel>\d{4})$")


def _split_name(name: str) -> tuple[str, int, str] | None:
    """`case_0001.nii.gz` -> ('case', 1, '.nii.gz'); None for other files."""
    ending = file_ending(Path(name))
    if ending.lower() in SUPPORTED_ENDINGS:
        match = _CHANNEL_FILE.match(name[: -len(ending)])
        if match:
            return match["case"], int(match["channel"]), ending
    return None


def list_input_cases(in_dir: Path, num_channels: int) -> list[InputCase]:
    """Cases of `in_dir`, sorted by id, each with exactly channels 0..num_channels-1."""
    in_dir = Path(in_dir)
    if not in_dir.is_dir():
        raise InputError(f"input folder {in_dir} does not exist")
    found: dict[str, dict[int, Path]] = {}
    for entry in sorted(os.scandir(in_dir), key=lambda e: e.name):
        parsed = _split_name(entry.name) if entry.is_file() else None
        if parsed is not None:
            case_id, channel, _ = parsed
            found.setdefault(case_id, {})[channel] = Path(entry.path)
    if not found:
        endings = ", ".join(SUPPORTED_ENDINGS)
        raise InputError(f"{in_dir} holds no images named CASE_0000<ending> ({endings})")
    return [_input_case(in_dir, case_id, found[case_id], num_channels) for case_id in sorted(found)]


def _input_case(in_dir: Path, case_id: str, channels: dict[int, Path],
                num_channels: int) -> InputCase:  # fmt: skip
    """The case's files holding exactly the model's channels: one per file (names only),
    or, with fewer files than channels, counted from the headers where a file may hold
    several (an RGB image is three, a 4D image its volumes)."""
    files = tuple(channels[c] for c in sorted(channels))
    split = _split_name(files[0].name)
    assert split is not None  # the channels were found by splitting their names
    ending = split[2]
    expected = list(range(num_channels))
    missing = [c for c in expected if c not in channels]
    extra = sorted(set(channels) - set(expected))
    held = ""
    if (
        missing
        and ending.lower() in MULTI_CHANNEL_ENDINGS
        and not extra
        and missing[0] == len(files)
    ):
        try:
            found = sum(image_header(path)[0] for path in files)
        except ImageReadError as exc:  # the missing file is named, and why it was not counted
            found, held = 0, f"; {exc}"
        if found == num_channels:
            return InputCase(case_id, files, ending, num_channels)
        held = held or f"; the files hold {found}"
    if missing:
        names = ", ".join(f"{case_id}_{c:04d}" for c in missing)
        raise InputError(
            f"case {case_id}: channel file {names} is missing in {in_dir} (the model "
            f"takes {num_channels} channel(s){held})"
        )
    if extra:
        raise InputError(
            f"case {case_id} has {len(channels)} channel files but the model takes "
            f"{num_channels} (extra: {', '.join(f'{c:04d}' for c in extra)})"
        )
    return InputCase(case_id, files, ending, len(files))


def check_headers(cases: list[InputCase]) -> None:
    """Every file readable as an image holding the channels the listing counted, and all
    files of a case of one shape."""
    for case in cases:
        try:
            headers = [image_header(path) for path in case.image_files]
            check_spacing_file(case.image_files[0])
        except ImageReadError as exc:
            raise InputError(str(exc)) from None
        found = sum(channels for channels, _ in headers)
        if found != (case.num_channels or len(case.image_files)):
            raise InputError(
                f"case {case.case_id}: its image files hold {found} channel(s) but the model "
                f"takes {case.num_channels or len(case.image_files)}"
            )
        shapes = [shape for _, shape in headers]
        for path, shape in zip(case.image_files, shapes, strict=True):
            if shape != shapes[0]:
                raise InputError(
                    f"{path}: shape {list(shape)} differs from channel 0's {list(shapes[0])}"
                )


def select_part(cases: list, num_parts: int, part_id: int) -> list:
    """Part `part_id` of `num_parts`: every case belongs to exactly one part."""
    if num_parts < 1:
        raise InputError(f"-num_parts must be >= 1, got {num_parts}")
    if not 0 <= part_id < num_parts:
        raise InputError(f"-part_id must be within 0-{num_parts - 1}, got {part_id}")
    return cases[part_id::num_parts]
