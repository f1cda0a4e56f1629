"""A raw nnU-Net dataset on disk: listing its cases and the integrity checks.

Every user mistake is a `DataError` whose message is one line naming the file; the CLIs
turn it into `error: ...` and exit 2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.image_io import (
    MULTI_CHANNEL_ENDINGS,
    SPACING_RTOL,
    SUPPORTED_ENDINGS,
    ImageReadError,
    check_file_ending,
    check_reader_override,
    file_ending,
    image_header,
    read_case,
    read_image,
)
from trainer.data.labels import (
    LabelError,
    check_consecutive,
    from_dataset_json,
    label_values_for_checks,
)


class DataError(ValueError):
    """A problem with the user's data; the message is one line."""


@dataclass(frozen=True)
class RawCase:
    case_id: str
    image_files: tuple[Path, ...]  # CASE_0000.., in order (an RGB file holds 3 channels)
    label_file: Path


@dataclass(frozen=True)
class RawDataset:
    name: str
    folder: Path
    dataset_json: dict
    cases: tuple[RawCase, ...]

    @property
    def num_channels(self) -> int:
        return len(self.dataset_json["channel_names"])

    @property
    def labels(self) -> dict[str, int]:
        """name -> value of every value a label file may hold (regions: one per value)."""
        return label_values_for_checks(from_dataset_json(self.dataset_json))

    @property
    def fallback_spacing(self) -> tuple[float, ...] | None:
        spacing = self.dataset_json.get("spacing")
        return tuple(float(s) for s in spacing) if spacing else None


def _read_dataset_json(folder: Path) -> dict:
    path = folder / "dataset.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} is not valid JSON: {exc}") from None
    for key in ("channel_names", "labels", "file_ending"):
        if key not in data:
            raise DataError(f"{path} has no {key!r} entry")
    try:
        check_file_ending(data["file_ending"])
        check_reader_override(data.get("overwrite_image_reader_writer"))
    except ImageReadError as exc:
        raise DataError(f"{path}: {exc}") from None
    try:  # ints, regions (lists) with regions_class_order, the ignore label: trainer.data.labels
        check_consecutive(from_dataset_json(data))  # nnU-Net's integrity check
    except LabelError as exc:
        raise DataError(f"{path}: {exc}") from None
    return data


def _refuse_other_endings(folder: Path, ending: str) -> None:
    """An image of another format beside the dataset's: nnU-Net would skip it silently."""
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        other = file_ending(path)
        if other.lower() in SUPPORTED_ENDINGS and other != ending and path.is_file():
            raise DataError(
                f"{path} is a {other} file but dataset.json's file_ending is {ending!r}: "
                "one format per dataset (convert or move it)"
            )


def _list_images(images_dir: Path, ending: str) -> dict[str, dict[int, Path]]:
    images: dict[str, dict[int, Path]] = {}
    for path in sorted(images_dir.glob(f"*{ending}")) if images_dir.is_dir() else []:
        stem = path.name[: -len(ending)]
        case_id, _, channel = stem.rpartition("_")
        if not case_id or len(channel) != 4 or not channel.isdigit():
            raise DataError(f"{path}: image names must be CASE_CCCC{ending} (e.g. case_0000)")
        images.setdefault(case_id, {})[int(channel)] = path
    return images


def _case_files(case_id: str, channels: dict[int, Path], num_channels: int,
                ending: str) -> tuple[Path, ...]:  # fmt: skip
    """The case's image files, in order, holding exactly the declared channels (an RGB
    image is three; counted from the headers where a file may hold several)."""
    files = tuple(channels[c] for c in sorted(channels))
    multi = ending.lower() in MULTI_CHANNEL_ENDINGS
    if sorted(channels) == list(range(len(channels))) and multi:
        try:
            found = sum(image_header(path)[0] for path in files)
        except ImageReadError as exc:
            raise DataError(str(exc)) from None
        if found == num_channels:
            return files
        raise DataError(
            f"case {case_id}: its image files hold {found} channel(s) but dataset.json "
            f"declares {num_channels} channel(s)"
        )
    if sorted(channels) != list(range(num_channels)):
        found_names = ", ".join(f"{c:04d}" for c in sorted(channels))
        raise DataError(
            f"case {case_id} has channels [{found_names}] but dataset.json declares "
            f"{num_channels} channel(s)"
        )
    return files


def open_raw_dataset(folder: Path) -> RawDataset:
    """List the cases and check the structure (pairs, channel counts); reads no voxels
    (headers only where one file may hold several channels)."""
    dataset_json = _read_dataset_json(folder)
    ending = dataset_json["file_ending"]
    num_channels = len(dataset_json["channel_names"])
    images_dir, labels_dir = folder / "imagesTr", folder / "labelsTr"
    for subfolder in (images_dir, labels_dir):
        _refuse_other_endings(subfolder, ending)
    images = _list_images(images_dir, ending)
    labels = {
        p.name[: -len(ending)]: p
        for p in (sorted(labels_dir.glob(f"*{ending}")) if labels_dir.is_dir() else [])
    }
    if not images and not labels:
        raise DataError(f"dataset {folder.name} is empty: no *{ending} files in {images_dir}")
    for case_id in sorted(set(labels) - set(images)):
        raise DataError(f"label {labels[case_id]} has no image {case_id}_0000{ending}")
    cases = []
    for case_id in sorted(images):
        if case_id not in labels:
            raise DataError(f"image of case {case_id} has no label {labels_dir / case_id}{ending}")
        files = _case_files(case_id, images[case_id], num_channels, ending)
        cases.append(RawCase(case_id, files, labels[case_id]))
    num_training = dataset_json.get("numTraining")
    if isinstance(num_training, int) and num_training != len(cases):
        raise DataError(
            f"{folder / 'dataset.json'} says numTraining {num_training} "
            f"but found {len(cases)} cases"
        )
    return RawDataset(folder.name, folder, dataset_json, tuple(cases))


def load_raw_case(
    case: RawCase, labels: dict[str, int], fallback_spacing: tuple[float, ...] | None = None
) -> tuple[np.ndarray, np.ndarray, tuple[float, float, float]]:
    """(image (C, Z, Y, X) float32, seg (Z, Y, X) uint8, spacing zyx) after the content checks."""
    try:
        image, spacing = read_case(case.image_files, fallback_spacing)
        seg, seg_spacing = read_image(case.label_file, fallback_spacing)
    except ImageReadError as exc:
        raise DataError(str(exc)) from None
    shape = image.shape[1:]
    if seg.shape != shape:
        raise DataError(f"{case.label_file}: label shape {seg.shape} != image shape {shape}")
    if not np.allclose(seg_spacing, spacing, rtol=SPACING_RTOL):
        raise DataError(
            f"{case.label_file}: label spacing {seg_spacing} != image spacing {spacing}"
        )
    values = np.unique(seg)
    declared = set(labels.values())
    if not np.all(np.mod(values, 1) == 0) or not set(values.astype(int).tolist()) <= declared:
        unknown = sorted(set(values.tolist()) - declared)
        raise DataError(
            f"{case.label_file}: label values {unknown} are not declared in dataset.json "
            f"(declared: {sorted(declared)})"
        )
    return image, seg.astype(np.uint8), spacing
