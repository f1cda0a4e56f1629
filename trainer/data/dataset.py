"""One preprocessed configuration folder: CASE.b2nd, CASE_seg.b2nd, CASE.json per case.

A case counts once its CASE.json exists: preprocessing writes it after both arrays.
The cases that *should* be there come from the plans file next to the folder (the
configuration's `case_ids`, written last by nnui-preprocess) or, for plans written before
that list existed, from nnui's fingerprint; a deleted file is then an error that
says how to fix it, not a case silently left out of training.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trainer import legacy
from trainer.data.blosc_io import OpenArrays
from trainer.data.raw import DataError
from trainer.schema.tree import FINGERPRINT_FILE

CASE_FILES = ("{}.b2nd", "{}_seg.b2nd", "{}.json")


class MissingCaseError(DataError):
    """A case listed at preprocessing time whose files are gone (message is one line)."""


def expected_case_ids(folder: Path) -> list[str] | None:
    """The case ids preprocessing wrote into `folder`, or None when nothing records them."""
    folder = Path(folder)
    for plans_path in sorted(folder.parent.glob("*.json")):
        try:
            data = json.loads(plans_path.read_text())
        except (OSError, ValueError):
            continue
        configurations = data.get("configurations") if isinstance(data, dict) else None
        if not isinstance(configurations, dict):
            continue
        for block in configurations.values():
            if (
                isinstance(block, dict)
                and block.get("data_identifier") == folder.name
                and "case_ids" in block
            ):
                return sorted(str(c) for c in block["case_ids"])
    for name in (FINGERPRINT_FILE, *legacy.FINGERPRINT_FILES):
        try:  # plans from before `case_ids`: nnui's fingerprint lists every raw case
            fingerprint = json.loads((folder.parent / name).read_text())
            return sorted(str(c) for c in fingerprint["case_ids"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


class PreprocessedCases:
    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise FileNotFoundError(
                f"{self.folder} does not exist; run nnui-preprocess for this configuration"
            )
        expected = expected_case_ids(self.folder)
        # Every expected case, present or not (so splits and folds stay what they were);
        # without a record, the complete cases found on disk.
        self.case_ids: list[str] = expected if expected is not None else self._present()
        if not self.case_ids:
            raise FileNotFoundError(f"{self.folder} holds no preprocessed cases")
        self._properties: dict[str, dict] = {}
        # blosc2 handles are opened once per thread: loader threads read concurrently.
        self._arrays = OpenArrays()

    def _present(self) -> list[str]:
        return sorted(p.stem for p in self.folder.glob("*.json") if self._is_whole(p.stem))

    def _is_whole(self, case_id: str) -> bool:
        return all((self.folder / name.format(case_id)).is_file() for name in CASE_FILES)

    def missing_case_ids(self) -> list[str]:
        """Expected cases with a file missing now (checked on every call)."""
        return [c for c in self.case_ids if not self._is_whole(c)]

    def missing_error(self, case_ids: list[str]) -> MissingCaseError:
        shown = ", ".join(case_ids[:5]) + (" ..." if len(case_ids) > 5 else "")
        dataset = self.folder.parent.name
        return MissingCaseError(
            f"{len(case_ids)} preprocessed case(s) missing from {self.folder} ({shown}); "
            f"rerun nnui-preprocess {dataset}"
        )

    def check_complete(self) -> None:
        """MissingCaseError when any expected case has a file missing."""
        missing = self.missing_case_ids()
        if missing:
            raise self.missing_error(missing)

    def _check(self, case_id: str) -> None:
        if case_id not in self._properties and case_id not in self.case_ids:
            raise KeyError(f"case {case_id!r} is not in {self.folder}")

    def _handle(self, case_id: str, name: str):
        try:
            return self._arrays.get(self.folder / name)
        except FileNotFoundError:
            raise self.missing_error([case_id]) from None

    def load_image(self, case_id: str):
        """(C, Z, Y, X) float32 blosc2 array; slicing it decompresses only what it touches."""
        self._check(case_id)
        return self._handle(case_id, f"{case_id}.b2nd")

    def load_seg(self, case_id: str):
        """(1, Z, Y, X) uint8 blosc2 array."""
        self._check(case_id)
        return self._handle(case_id, f"{case_id}_seg.b2nd")

    def properties(self, case_id: str) -> dict:
        self._check(case_id)
        if case_id not in self._properties:
            path = self.folder / f"{case_id}.json"
            if not path.is_file():
                raise self.missing_error([case_id])
            props = json.loads(path.read_text())
            # int32 arrays: nnU-Net's >= 10,000 locations per class as nested Python lists
            # would hold ~1.5 MB per class and case in every loader
            props["class_locations"] = {
                k: np.asarray(v, dtype=np.int32).reshape(-1, 3)
                for k, v in props.get("class_locations", {}).items()
            }
            self._properties[case_id] = props
        return self._properties[case_id]

    def load_case(self, case_id: str) -> tuple[np.ndarray, np.ndarray, dict]:
        """Whole arrays in memory (final validation)."""
        return self.load_image(case_id)[...], self.load_seg(case_id)[...], self.properties(case_id)

    def __len__(self) -> int:
        return len(self.case_ids)
